"""What the served benches share (bench.noisy, bench.latency, bench.memory): a real ``elmo serve`` subprocess with
gRPC and HTTP on free loopback ports, this checkout or an older revision's (``--before REV``), realistic sentences,
percentiles, and where the results go.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import random
import re
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from elmo.bench.server_process import check_loopback, spawn_server, stop_server
from elmo.bench.worktree import REPO, describe, revision_tree

from elmo.runtime.host import host_facts

RESULTS = REPO / "bench" / "results"
DEFAULT_MODEL = REPO / "models" / "default"
HANDBOOK = REPO / "data" / "handbook" / "handbook.en.txt"  # `elmo data handbook`, when it has run
SENSES = REPO / "elmo" / "senses" / "en.tsv"  # shipped: hand-written English sentences


@dataclass
class Served:
    """One running ``elmo serve`` (stop it with :meth:`stop`)."""

    label: str  # "after" (this checkout) or "before" (the --before revision)
    proc: subprocess.Popen
    grpc_target: str
    http_url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def http_host_port(self) -> tuple[str, int]:
        host, _, port = self.http_url.split("//", 1)[1].rpartition(":")
        return host, int(port)

    def stop(self) -> int:
        return stop_server(self.proc)


def start_server(
    model: Path, threads: int | None, serve_args: Sequence[str] = (), tree: Path | None = None, label: str = "after"
) -> Served:
    """``elmo serve --host 127.0.0.1 --port 0 --http-port 0 --port-file F`` (of ``tree``'s code when given), SERVING."""
    proc, target, log_path = spawn_server(model, threads, ["--http-port", "0", *serve_args], tree=tree)
    lines = (log_path.parent / "port").read_text().split("\n")  # gRPC port, metrics port (empty), HTTP port
    http_url = f"http://127.0.0.1:{lines[2].strip()}"
    check_loopback(target)
    return Served(label, proc, target, http_url, log_path)


@contextlib.contextmanager
def code_trees(before: str | None, label: str = "after") -> Iterator[list[tuple[str, Path | None]]]:
    """[(label, None)] (this checkout), or with ``before`` [("before", worktree of REV), ("after", None)]: the
    benches alternate them within one run, so both see the same machine state."""
    if not before:
        yield [(label, None)]
        return
    with revision_tree(before, prefix="served-bench-before-") as old:
        yield [("before", old), ("after", None)]


def revision_info(before: str | None, label: str = "after") -> dict:
    """What each label's runs served: this checkout (its HEAD, and whether elmo/ or service/ have local changes),
    and the --before revision."""
    head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "elmo", "service"], capture_output=True, text=True
    )
    info = {
        label if not before else "after": f"working tree on {head.stdout.strip()}"
        + (" (modified)" if dirty.stdout.strip() else "")
    }
    if before:
        info["before"] = describe(before)
    return info


def machine(load_at_start: Sequence[float] | None = None) -> dict:
    """The machine, and its load average (1, 5, 15 min) now and, when given, at the bench's start: the benches run
    on shared machines, so read their figures with the load beside them."""
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
           "host": host_facts()}  # the CPU model and the flags that pick onnxruntime's kernels (elmo.runtime.host)
    if load_at_start is not None:
        out["load_average_at_start"] = [round(v, 2) for v in load_at_start]
    out["load_average_at_end"] = [round(v, 2) for v in os.getloadavg()]
    return out


# -- HTTP --------------------------------------------------------------------------------------------------------
class Http:
    """One kept-alive HTTP/1.1 connection that reconnects after an error or a ``Connection: close``."""

    def __init__(self, host: str, port: int, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[str, bytes]:
        """-> (status as a string, body); a transport failure is ('conn:<ExceptionName>', b'')."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            data = response.read()
            if response.will_close:
                self.close()
            return str(response.status), data
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return f"conn:{type(exc).__name__}", b""

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# -- text --------------------------------------------------------------------------------------------------------
def _source_sentences(text: Path | None) -> tuple[list[str], str]:
    if text is None and HANDBOOK.is_file():
        text = HANDBOOK
    if text is not None:
        paragraphs = [line.strip() for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
        found = [s.strip() for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if s.strip()]
        return found, str(text.relative_to(REPO) if text.is_relative_to(REPO) else text)
    rows = SENSES.read_text(encoding="utf-8").splitlines()[1:]
    found = [row.split("\t")[2].replace("[[", "").replace("]]", "") for row in rows if row.count("\t") == 2]
    return found, str(SENSES.relative_to(REPO))


def sentences(
    n: int, seed: int = 0, min_words: int = 15, max_words: int = 25, text: Path | None = None
) -> tuple[list[str], str]:
    """``n`` real English sentences of ``min_words``-``max_words`` words (deterministic): from ``text``, else the
    Debian handbook when `elmo data handbook` has run (data/handbook/handbook.en.txt), else the shipped word-sense
    sentences (elmo/senses/en.tsv; shorter ones joined in pairs to reach the range). Cycled when fewer exist."""
    found, source = _source_sentences(text)
    rng = random.Random(seed)
    fits = [s for s in found if min_words <= len(s.split()) <= max_words]
    shuffled = found[:]
    rng.shuffle(shuffled)
    for first, second in zip(shuffled[::2], shuffled[1::2]):  # two short ones make one of the right length
        joined = f"{first} {second}"
        if len(first.split()) < min_words and min_words <= len(joined.split()) <= max_words:
            fits.append(joined)
    if not fits:
        raise SystemExit(f"no sentence of {min_words}-{max_words} words in {source}")
    rng.shuffle(fits)
    picked = [fits[i % len(fits)] for i in range(n)]
    return picked, f"{source} ({len(set(picked))} distinct sentences of {min_words}-{max_words} words)"


# -- numbers -----------------------------------------------------------------------------------------------------
def percentiles_ms(seconds: Sequence[float], quantiles: Sequence[int] = (50, 90, 99)) -> dict:
    """{"n", "p50", ..., "max", "mean"} in milliseconds (empty but for n when there is nothing)."""
    if len(seconds) == 0:
        return {"n": 0}
    values = np.asarray(seconds, dtype=float) * 1000
    out = {"n": int(values.size)}
    out |= {f"p{q}": round(float(np.percentile(values, q)), 2) for q in quantiles}
    out |= {"max": round(float(values.max()), 2), "mean": round(float(values.mean()), 2)}
    return out


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


__all__ = [
    "DEFAULT_MODEL",
    "Http",
    "RESULTS",
    "Served",
    "code_trees",
    "fmt",
    "machine",
    "percentiles_ms",
    "revision_info",
    "sentences",
    "start_server",
    "write_json",
]


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """``python -m bench.MODULE``'s parser, with the module docstring as its help and the common ``--model``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default models/default)")
    return parser


def save_result(out: Path, result: dict, plot, no_plot: bool) -> None:
    """Write ``result`` as JSON to ``out`` and, unless ``no_plot``, ``plot(result, png)`` beside it; say where."""
    write_json(out, result)
    png = out.with_suffix(".png")
    if not no_plot:
        plot(result, png)
    print(f"\nwrote {out}" + ("" if no_plot else f" and {png}"))
