"""Hot swaps under load (issue 31): no failed request, every answer from exactly the version it names.

    .venv/bin/python -m bench.service.swap                        # 16 clients, 60 s, small-preset versions
    .venv/bin/python -m bench.service.swap --rss-model DIR        # and the RSS check with an exported model DIR

``elmo serve --model-root ROOT --poll-interval-s 0.2`` runs as a child process (127.0.0.1, free ports, gRPC and
HTTP). ``--clients`` clients (half gRPC ``Embed``, half HTTP: ``/v1/embed`` and ``/v1/embeddings`` in turn, base64)
send requests of two sentences back to back for ``--duration`` seconds while versions are published into ROOT:

    0                first third: no swap (v1 serves)
    D/3              v2 published (different weights)         -> a swap
    D/2              v2b published: a broken version (its graphs are garbage, its record says it passed)
                                                              -> refused, v2 keeps serving
    2D/3             v3 published                             -> a swap

Every answer must name its model and version (gRPC ``model_version``, the HTTP JSON field and ``X-Elmo-Model``),
and its vectors must equal, within ``--tolerance`` (1e-6), those an in-process elmo.runtime.Embedder of exactly
that version computes. A failed request (any error, a wrong or missing version, a vector off) counts as failed.
Latency: p50/p99 of the requests that started while a swap was under way (from its publication until the old
version was released, or the broken one refused; the admin API says when) beside p50/p99 of a window of the same
total length with no swap (the end of the first third).

``--rss-model DIR`` (an exported model, e.g. the ELMo-original shape: ``python -m elmo.export.random_model
--preset original``) then measures, on a fresh server: RSS before the model is loaded, after it is loaded and has
answered requests, and after it is unloaded (admin API) and released. The check: after within 10 % of before.

Writes swap.json and swap.md into ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.kit import serve
from bench.kit.load import ClosedLoop, Record
from bench.kit.results import RESULTS
from bench.kit.sample import rss_mib
from elmo.bench.figures import machine, percentiles_ms

ADMIN_TOKEN = "swap-bench-admin"
SENTENCES = [
    "The cat sat on the mat .",
    "Apple shares rose on Tuesday after the company reported strong iPhone sales .",
    "A short one .",
    "Researchers at the university published a study of language models and their embeddings .",
    "It rained all day in the valley , and the river rose over its banks by evening .",
    "naïve café emoji",
    "Stocks fell .",
    "The committee will meet again next week to decide on the budget for the coming year .",
    "She read the letter twice before she put it back in the drawer .",
    "Hello world !",
    "Bank of America raised its forecast for the second quarter .",
    "They walked home slowly through the park as the sun went down behind the hills .",
]


# -- models ------------------------------------------------------------------------------------------------------------
def model_versions(cache: Path, preset: str) -> list[Path]:
    """Three exported random models of ``preset`` (seeds 1, 2, 3), written once into ``cache`` and reused."""
    dirs = []
    for seed in (1, 2, 3):
        directory = cache / f"{preset}-seed{seed}"
        if not (directory / "onnx.json").is_file():
            from elmo.export.random_model import write_random_model

            print(f"exporting a random {preset} model (seed {seed}) into {directory} ...", flush=True)
            shutil.rmtree(directory, ignore_errors=True)
            write_random_model(directory, preset, seed=seed, export=True)
        dirs.append(directory)
    return dirs


def skip_checkpoint(_folder: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "model.safetensors"]


def publish(source: Path, root: Path, name: str = "default") -> int:
    from elmo.runtime.repository import publish_copy

    return publish_copy(source, root, name, ignore=skip_checkpoint).version  # type: ignore[return-value]


def publish_broken(source: Path, root: Path, name: str = "default") -> int:
    """A version that counts as complete (verification passed, weights at the recorded size) with garbage graphs."""
    from elmo.runtime.repository import publishing

    with publishing(root, name) as publication:
        shutil.copytree(source, publication.folder, ignore=skip_checkpoint, dirs_exist_ok=True)
        for graph in publication.folder.glob("*.onnx"):
            graph.write_bytes(b"not an onnx graph")
    return publication.version  # type: ignore[return-value]


def references(directory: Path) -> dict[str, np.ndarray]:
    """Per sentence, (n_layers, n_tokens, dim) float32 from an in-process runtime of this version."""
    from elmo.runtime import Embedder

    runtime = Embedder(directory)
    vectors = {text: runtime.embed_texts([text])[0] for text in SENTENCES}
    runtime.close()
    return vectors


# -- the server ----------------------------------------------------------------------------------------------------
@dataclass
class Server(serve.Server):
    """The swap bench's server: bench.kit.serve.Server and the admin API's calls."""

    def index(self) -> dict:
        status, _, body = http_call(self.http_port, "GET", "/admin/models", None, ADMIN_TOKEN)
        assert status == 200, body
        return {m["name"]: {v["version"]: v for v in m["versions"]} for m in json.loads(body)["models"]}

    def admin(self, action: str, name: str, version: int) -> dict:
        status, _, body = http_call(
            self.http_port, "POST", f"/admin/models/{name}/{action}", {"version": version}, ADMIN_TOKEN
        )
        if status != 200:
            raise SystemExit(f"admin {action} {name}@{version}: {status} {body[:500]!r}")
        return json.loads(body)

    def wait_state(self, name: str, version: int, states: tuple[str, ...], timeout: float = 300.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.index().get(name, {}).get(version)
            if entry is not None and entry["state"] in states:
                return time.monotonic()
            time.sleep(0.05)
        raise SystemExit(f"{name}@{version} did not reach {states} within {timeout:.0f} s; log {self.log_path}")


def start_server(root: Path, poll: float, threads: int | None, timeout: float = 300.0) -> Server:
    """``elmo serve --model-root ROOT --poll-interval-s POLL`` with the admin API, gRPC and HTTP, SERVING."""
    serve_args = ["--poll-interval-s", str(poll), "--admin-token", ADMIN_TOKEN]
    return serve.start_server(
        model_root=root, threads=threads, serve_args=serve_args, timeout=timeout, label="swap", kind=Server
    )


def http_call(port: int, method: str, path: str, body, token: str | None = None, conn=None):
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        if own:
            conn.close()


# -- the clients ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    started: float
    latency: float
    kind: str
    version: int
    error: str = ""


@dataclass
class Load:
    server: Server
    expected: dict[int, dict[str, np.ndarray]]  # server version -> sentence -> vectors
    tolerance: float
    closers: list = field(default_factory=list)  # each client's channel or connection, closed after the run

    def outcome(self, record: Record) -> Outcome:
        """A client call (bench.kit.load.ClosedLoop's record) as this bench counts it: a step returns (kind, version,
        error), an exception it did not expect is an error too."""
        if record.error is not None:
            error = f"{type(record.error).__name__}: {record.error}"
            return Outcome(record.started, record.seconds, "client", 0, error)
        return Outcome(record.started, record.seconds, *record.value)

    def close(self) -> None:
        for close in self.closers:
            close()

    def check(self, version: int, texts: list[str], got: list[np.ndarray], pooled: bool) -> str:
        if version not in self.expected:
            return f"answer names version {version}, which is not a published working version"
        worst = 0.0
        for text, vectors in zip(texts, got):
            want = self.expected[version][text]
            if pooled:
                want = want.astype(np.float64).mean(axis=(0, 1)).astype(np.float32)
            if want.shape != vectors.shape:
                return f"shape {vectors.shape}, version {version} gives {want.shape}"
            worst = max(worst, float(np.abs(want - vectors).max()))
        return "" if worst <= self.tolerance else f"vectors differ from version {version}'s by {worst:.3g}"

    def grpc_step(self, seed: int):
        """A gRPC client's call (one channel per client): (kind, version, error)."""
        import grpc

        from elmo.v1 import embedder_pb2 as pb
        from elmo.v1 import embedder_pb2_grpc as pb_grpc

        rng = random.Random(seed)
        channel = grpc.insecure_channel(self.server.grpc_target)
        self.closers.append(channel.close)
        stub = pb_grpc.EmbedderStub(channel)

        def step(turn: int) -> tuple[str, int, str]:
            texts = rng.sample(SENTENCES, 2)
            version, error = 0, ""
            try:
                response = stub.Embed(pb.EmbedRequest(inputs=[pb.Input(text=t) for t in texts]), timeout=60)
                version = int(response.model_version)
                got = [np.frombuffer(e.layers.data, "<f4").reshape(tuple(e.layers.shape)) for e in response.embeddings]
                error = self.check(version, texts, got, pooled=False)
            except grpc.RpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
            return "grpc", version, error

        return step

    def http_step(self, seed: int):
        """An HTTP client's call (one kept-alive connection per client, /v1/embeddings and /v1/embed in turn)."""
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=120)
        self.closers.append(lambda: conn.close())

        def step(turn: int) -> tuple[str, int, str]:
            nonlocal conn
            texts = rng.sample(SENTENCES, 2)
            pooled = turn % 2 == 1
            version, error = 0, ""
            try:
                if pooled:
                    body = {"input": texts, "encoding_format": "base64"}
                    status, headers, raw = http_call(0, "POST", "/v1/embeddings", body, conn=conn)
                else:
                    body = {"inputs": texts, "encoding": "base64"}
                    status, headers, raw = http_call(0, "POST", "/v1/embed", body, conn=conn)
                answer = json.loads(raw)
                if status != 200:
                    error = f"HTTP {status}: {answer}"
                else:
                    version = int(answer["model_version"])
                    if headers.get("X-Elmo-Model") != f"default@{version}":
                        error = f"X-Elmo-Model {headers.get('X-Elmo-Model')!r} but model_version {version}"
                    elif pooled:
                        got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in answer["data"]]
                        error = self.check(version, texts, got, pooled=True)
                    else:
                        got = [
                            np.frombuffer(base64.b64decode(e["layers"]["data"]), "<f4").reshape(e["layers"]["shape"])
                            for e in answer["embeddings"]
                        ]
                        error = self.check(version, texts, got, pooled=False)
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                error = f"{type(exc).__name__}: {exc}"
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=120)
            return "pooled" if pooled else "embed", version, error

        return step


def percentiles(latencies: list[float]) -> dict:
    figures = percentiles_ms(latencies, (50, 99))
    return {"requests": figures["n"], "p50_ms": figures.get("p50"), "p99_ms": figures.get("p99")}


# -- the runs ------------------------------------------------------------------------------------------------------
def run_swaps(args: argparse.Namespace, versions: list[Path]) -> dict:
    root = Path(tempfile.mkdtemp(prefix="swap-root-"))
    print("reference vectors from in-process runtimes ...", flush=True)
    refs = [references(d) for d in versions]
    expected = {publish(versions[0], root): refs[0]}
    server = start_server(root, args.poll_interval_s, args.threads)
    load = Load(server, expected, args.tolerance)
    half = args.clients // 2
    steps = [load.grpc_step(i) for i in range(half)] + [load.http_step(100 + i) for i in range(args.clients - half)]
    t0 = time.monotonic()
    loop = ClosedLoop(steps).start()
    events = []

    def at(fraction: float) -> None:
        time.sleep(max(0.0, t0 + fraction * args.duration - time.monotonic()))

    at(1 / 3)
    begun = time.monotonic()
    number = publish(versions[1], root)
    expected[number] = refs[1]
    server.wait_state("default", number, ("ready", "failed"))
    server.wait_state("default", number - 1, ("unloaded",))
    events.append({"event": f"swap v1 -> v2 (version {number})", "start": begun - t0, "end": time.monotonic() - t0})
    at(1 / 2)
    begun = time.monotonic()
    broken = publish_broken(versions[1], root)
    server.wait_state("default", broken, ("failed",))
    events.append(
        {"event": f"broken v2b offered (version {broken}), refused", "start": begun - t0, "end": time.monotonic() - t0}
    )
    at(2 / 3)
    begun = time.monotonic()
    number3 = publish(versions[2], root)
    expected[number3] = refs[2]
    server.wait_state("default", number3, ("ready", "failed"))
    server.wait_state("default", number, ("unloaded",))
    events.append({"event": f"swap v2 -> v3 (version {number3})", "start": begun - t0, "end": time.monotonic() - t0})
    at(1.0)
    records = loop.stop(120)
    load.close()
    index = server.index()["default"]
    code = server.stop()
    model_log = [line for line in server.log_path.read_text().splitlines() if "service.models" in line]
    shutil.rmtree(root, ignore_errors=True)

    outcomes = [load.outcome(record) for record in records]
    failed = [o for o in outcomes if o.error]
    swap_windows = [(e["start"], e["end"]) for e in events]
    in_swap = [o.latency for o in outcomes if any(a <= o.started - t0 < b for a, b in swap_windows)]
    swap_span = sum(b - a for a, b in swap_windows)
    quiet_end = events[0]["start"]
    quiet_start = max(3.0, quiet_end - swap_span)  # the clients' first 3 s (connections, caches) left out
    quiet = [o.latency for o in outcomes if quiet_start <= o.started - t0 < quiet_end]
    by_version: dict[int, int] = {}
    for o in outcomes:
        if not o.error:
            by_version[o.version] = by_version.get(o.version, 0) + 1
    return {
        "requests": len(outcomes),
        "failed": len(failed),
        "failures": sorted({o.error for o in failed})[:20],
        "answers_by_version": {str(k): v for k, v in sorted(by_version.items())},
        "requests_by_kind": {k: sum(1 for o in outcomes if o.kind == k) for k in ("grpc", "embed", "pooled")},
        "events": [{**e, "start": round(e["start"], 2), "end": round(e["end"], 2)} for e in events],
        "during_swaps": {**percentiles(in_swap), "seconds": round(swap_span, 2)},
        "without_swaps": {
            **percentiles(quiet),
            "seconds": round(quiet_end - quiet_start, 2),
            "window": [round(quiet_start, 2), round(quiet_end, 2)],
        },
        "final_versions": {str(v): entry["state"] for v, entry in index.items()},
        "server_exit_code": code,
        "server_model_log": model_log[-20:],
    }


def run_rss(args: argparse.Namespace, small: Path) -> dict:
    """RSS before loading ``--rss-model``, with it loaded (after requests), and after unloading it."""
    from elmo.service.models.versions import model_file_bytes

    root = Path(tempfile.mkdtemp(prefix="swap-rss-"))
    publish(small, root, "default")
    server = start_server(root, 0.0, args.threads)
    pid = server.proc.pid
    try:
        http_call(server.http_port, "POST", "/v1/embed", {"inputs": SENTENCES[:4]})
        time.sleep(1.0)
        before = rss_mib(pid)
        print(f"copying {args.rss_model} into the repository ...", flush=True)
        big = publish(Path(args.rss_model), root, "big")
        started = time.monotonic()
        server.admin("load", "big", big)
        load_s = time.monotonic() - started
        for _ in range(args.rss_requests):
            status, _, body = http_call(
                server.http_port,
                "POST",
                "/v1/embed",
                {"inputs": SENTENCES, "model": f"big@{big}", "encoding": "base64"},
            )
            assert status == 200, body[:300]
        time.sleep(1.0)
        loaded = rss_mib(pid)
        server.admin("unload", "big", 0)
        server.wait_state("big", big, ("unloaded",))
        time.sleep(2.0)
        after = rss_mib(pid)
        files = model_file_bytes(root / "big" / str(big))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    assert before is not None and loaded is not None and after is not None
    return {
        "model": str(args.rss_model),
        "model_file_mib": round(files / 2**20, 1),
        "load_s": round(load_s, 2),
        "rss_before_mib": round(before, 1),
        "rss_loaded_mib": round(loaded, 1),
        "rss_after_unload_mib": round(after, 1),
        "after_vs_before": round((after - before) / before, 4),
        "within_10_percent": abs(after - before) <= 0.10 * before,
        "rss_per_model_file_byte": round((loaded - before) * 2**20 / files, 2),
    }


def markdown(result: dict) -> str:
    swaps = result["swaps"]
    lines = [
        "# Hot swaps under load (bench/service/swap.py)",
        "",
        f"`{result['command']}`",
        "",
        f"{result['clients']} clients (gRPC Embed, HTTP /v1/embed and /v1/embeddings) for {result['duration_s']} s, "
        f"{result['preset']}-preset random models, poll interval {result['poll_interval_s']} s, "
        f"{result['machine']}.",
        "",
        f"- requests: {swaps['requests']} ({swaps['requests_by_kind']}), **failed: {swaps['failed']}**",
        f"- answers by version: {swaps['answers_by_version']} (each checked against that version's in-process "
        f"vectors, tolerance {result['tolerance']:g})",
        "",
        "| window | seconds | requests | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
    ]
    for label, key in (("during swaps", "during_swaps"), ("without swaps", "without_swaps")):
        w = swaps[key]
        lines.append(f"| {label} | {w['seconds']} | {w['requests']} | {w['p50_ms']} | {w['p99_ms']} |")
    lines += ["", "| event | from s | to s |", "|---|---|---|"]
    lines += [f"| {e['event']} | {e['start']} | {e['end']} |" for e in swaps["events"]]
    if swaps["failures"]:
        lines += ["", "Failures:", *[f"- {f}" for f in swaps["failures"]]]
    rss = result.get("rss")
    if rss:
        lines += [
            "",
            f"RSS with {rss['model']} ({rss['model_file_mib']} MiB of model files, loaded in {rss['load_s']} s):",
            "",
            "| before load | loaded (after requests) | after unload | after vs before |",
            "|---|---|---|---|",
            f"| {rss['rss_before_mib']} MiB | {rss['rss_loaded_mib']} MiB | {rss['rss_after_unload_mib']} MiB | "
            f"{rss['after_vs_before']:+.1%} ({'within' if rss['within_10_percent'] else 'NOT within'} 10 %) |",
            "",
            f"RSS added per byte of model files: {rss['rss_per_model_file_byte']} (--max-model-memory-bytes's factor).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.swap", description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    parser.add_argument("--clients", type=int, default=16, help="clients, half gRPC, half HTTP (default 16)")
    parser.add_argument("--preset", default="small", help="random model preset of the versions (default small)")
    parser.add_argument(
        "--models",
        type=Path,
        default=Path(tempfile.gettempdir()) / "elmo-swap-models",
        help="where the versions' models are exported once and reused",
    )
    parser.add_argument("--poll-interval-s", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=None, help="the server's --threads")
    parser.add_argument("--tolerance", type=float, default=1e-6)
    parser.add_argument("--rss-model", type=Path, default=None, help="an exported model dir for the RSS check")
    parser.add_argument("--rss-requests", type=int, default=5)
    parser.add_argument("--skip-swaps", action="store_true", help="only the RSS check")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    versions = model_versions(args.models, args.preset)
    result: dict = {
        "command": " ".join([".venv/bin/python -m bench.service.swap", *(argv if argv is not None else sys.argv[1:])]),
        "clients": args.clients,
        "duration_s": args.duration,
        "preset": args.preset,
        "poll_interval_s": args.poll_interval_s,
        "tolerance": args.tolerance,
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
    }
    if not args.skip_swaps:
        result["swaps"] = run_swaps(args, versions)
        swaps = result["swaps"]
        print(
            f"requests {swaps['requests']}, failed {swaps['failed']}; during swaps {swaps['during_swaps']}; "
            f"without {swaps['without_swaps']}",
            flush=True,
        )
    if args.rss_model is not None:
        result["rss"] = run_rss(args, versions[0])
        print(f"RSS: {result['rss']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "swap" if not args.skip_swaps else "swap_rss"
    result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.skip_swaps:
        (args.out / f"{name}.md").write_text(markdown(result))
    print(f"wrote {args.out / name}.json", flush=True)
    ok = (args.skip_swaps or result["swaps"]["failed"] == 0) and (
        "rss" not in result or result["rss"]["within_10_percent"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
