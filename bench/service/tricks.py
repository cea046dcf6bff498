"""What each of the service's tricks is worth: today's code beside variants that each take one trick out, taking
turns in one run of bench.service.compiled_load, and the table of what that run found.

    python -m bench.service.compiled_load --models default tiny --rounds 3 --duration 4 --one-sentence-s 2 \\
        --variants nice=bench/notes/tricks/nice.patch --out bench/results/tricks.json
    python -m bench.service.tricks bench/results/tricks.json        # the table, as Markdown

A variant is ``NAME=REV``: a git revision, or a ``.patch`` file applied to this checkout's HEAD, served from a
worktree (bench.kit.revision): today's code with that one trick taken out. bench/notes/tricks/ holds each trick's
patch; those of the tricks since taken out apply to the code that still had them.
Every round measures each server under load (served ÷ in-process, gRPC and HTTP) and, with
``--one-sentence-s S``, one sentence at a time on one connection for S seconds each: gRPC (h2load, its per-request
log), HTTP (wrk), and HTTP again while h2load loads the same server over gRPC with 8-sentence requests (a short
request beside long ones). The table gives each row's median over the rounds and its range (min–max). A trick pays
on a row when the median of today and that of its variant differ, in the trick's favour, by more than the larger
of their two half-ranges: more than the bench's own spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.kit.revision import describe, revision_tree

TODAY = "today"
# (row, the round entry's key under a server's label, higher is better)
ROWS = (
    ("gRPC load: served ÷ in-process", "grpc", True),
    ("HTTP load: served ÷ in-process", "http", True),
    ("gRPC, 1 sentence: p50 ms", "one/grpc_p50_ms", False),
    ("HTTP, 1 sentence: p50 ms", "one/http_p50_ms", False),
    ("HTTP, 1 sentence beside a gRPC load: p50 ms", "one/http_beside_load_p50_ms", False),
)


def parse_variants(variants: list[str]) -> list[tuple[str, str]]:
    """``NAME=REV`` pairs, NAME neither empty nor today's label."""
    pairs = [tuple(item.split("=", 1)) for item in variants]
    if any(len(pair) != 2 or not all(pair) or pair[0] == TODAY for pair in pairs):
        raise SystemExit(f"--variants takes NAME=REV items (NAME not {TODAY!r}), got {variants}")
    return pairs  # type: ignore[return-value]


@contextmanager
def variant_trees(variants: list[str]) -> Iterator[list[tuple[str, Path | None]]]:
    """[(today, None), (NAME, worktree of REV), ...]: every tree removed afterwards."""
    with ExitStack() as stack:
        pairs = parse_variants(variants)
        trees = [(name, stack.enter_context(revision_tree(rev, prefix=f"trick-{name}-"))) for name, rev in pairs]
        yield [(TODAY, None), *trees]


def variant_info(variants: list[str]) -> dict[str, str]:
    return {name: describe(rev) for name, rev in parse_variants(variants)}


def h2load_p50(run_h2load, target: str, body: Path, seconds: int, work: Path) -> float:
    """The p50 (ms) of gRPC calls sent one after another on one connection for ``seconds``, from h2load's
    per-request log (its own report has no percentiles)."""
    log = work / "h2load.log"
    run_h2load(target, body, 1, seconds, ["--log-file", str(log)])
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()]
    if not rows or any(row[1] != "200" for row in rows):
        raise SystemExit(f"h2load: {sum(row[1] != '200' for row in rows)} of {len(rows)} one-sentence calls failed")
    return statistics.median(int(row[2]) for row in rows) / 1000


def one_sentence(loads, server, run_h2load, run_wrk) -> dict:
    """One sentence at a time: gRPC, HTTP, and HTTP beside a gRPC load of the loads' own requests (the generators'
    runs: bench.service.compiled_load's ``run_h2load`` and ``run_wrk``)."""
    seconds, work = loads.args.one_sentence_s, loads.work
    result = {
        "grpc_p50_ms": h2load_p50(run_h2load, server.grpc_target, work / "one.bin", seconds, work),
        "http_p50_ms": run_wrk(server.http_address, loads.one_http, 1, seconds, work)["latency_ms"]["p50"],
    }
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(run_h2load, server.grpc_target, work / "grpc.bin", loads.args.connections, seconds + 2)
        time.sleep(1)  # the load is on
        beside = run_wrk(server.http_address, loads.one_http, 1, seconds, work)
        load.result()  # every loading call answered
    return {**result, "http_beside_load_p50_ms": beside["latency_ms"]["p50"]}


def round_values(rounds: list[dict], label: str, key: str) -> list[float]:
    """One row's value in each round for one server: a load run's served ÷ in-process, or a one-sentence p50."""
    if key.startswith("one/"):
        return [r[f"{label}_one"][key[4:]] for r in rounds if f"{label}_one" in r]
    return [r[f"{label}_{key}"]["served_over_in_process"] for r in rounds if f"{label}_{key}" in r]


def judge(today: list[float], without: list[float], higher_is_better: bool) -> dict:
    """Medians and ranges of both sides; ``pays``: the medians differ in today's favour by more than the larger
    half-range (the bench's spread)."""
    gain = statistics.median(today) - statistics.median(without)
    spread = max(max(today) - min(today), max(without) - min(without)) / 2
    favour = gain if higher_is_better else -gain
    return {"today": today, "without": without, "gain": gain, "spread": spread, "pays": favour > spread}


def table(result: dict) -> dict:
    """Per model, variant and row: :func:`judge` of the run's rounds."""
    out: dict = {}
    for model, entry in result["models"].items():
        rounds = entry["rounds"]
        for name in result.get("variants", {}):
            for row, key, higher in ROWS:
                today, without = round_values(rounds, TODAY, key), round_values(rounds, name, key)
                if today and without:
                    out.setdefault(name, {}).setdefault(model, {})[row] = judge(today, without, higher)
    return out


def markdown(judged: dict) -> str:
    """Per model, a table: today's medians (range over the rounds), then each variant's, ``**bold**`` where the
    trick pays on that row."""

    def cell(values: list[float], pays: bool = False) -> str:
        text = f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"
        return f"**{text}**" if pays else text

    out = []
    models = list(dict.fromkeys(model for rows in judged.values() for model in rows))
    for model in models:
        variants = {name: rows[model] for name, rows in judged.items() if model in rows}
        names = list(next(iter(variants.values())))
        out += [f"{model}:", "", "| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        today = next(iter(variants.values()))
        out.append("| today | " + " | ".join(cell(today[row]["today"]) for row in names) + " |")
        for name, rows in variants.items():
            cells = [cell(rows[row]["without"], rows[row]["pays"]) for row in names]
            out.append(f"| without {name} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.service.tricks", description=__doc__)
    parser.add_argument("result", type=Path, help="a bench.service.compiled_load --variants result (JSON)")
    args = parser.parse_args(argv)
    print(markdown(table(json.loads(args.result.read_text()))))


if __name__ == "__main__":
    main()
