"""Where a lone sentence's time goes inside the batcher (issue 42): each step from ``Batcher.embed`` to the answer,
beside a bare ``run_in_executor`` round trip of the same shape.

    python -m bench.service.batcher_hops --model models/default --calls 300

A served model's batcher (service.models.registry.serve_model, this machine's default limits) embeds one
15-token sentence at a time, idle between calls; its steps are timed by wrapping the batcher's own methods:
``embed`` called -> batch formed -> the runtime call starts on the worker -> ends -> its answers are handed to
the callers on the event loop -> ``embed`` returns. Then a bare asyncio ``run_in_executor`` of a function that
spins as long as the runtime call took: its hop in and its hop back are what any thread hand-off costs on this
machine. Medians (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.kit.models import DEFAULT_MODEL
from elmo.bench.figures import machine

STEPS = ("embed called", "batch formed", "runtime starts", "runtime ends", "answered", "embed returns")
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank today .".split()


def traced_batcher(model_dir: Path, threads: int):
    """A served model whose batcher records when each step happens: (model, marks by step)."""
    from elmo.service.common.limits import Limits
    from elmo.service.models.registry import serve_model
    from elmo.service.telemetry.metrics import ServiceMetrics

    from elmo.runtime import Embedder

    limits, marks = Limits(), {step: [] for step in STEPS}
    runtime = Embedder(model_dir, intra_op_threads=threads, check_on_load=False)
    model = serve_model(runtime, model_dir, limits, ServiceMetrics().observer("m"), name="m")
    batcher = model.batcher
    embed_fn, form_batch, answer = batcher._embed_fn, batcher._form_batch, batcher._answer

    def runtime_call(sentences):
        marks["runtime starts"].append(time.perf_counter())
        try:
            return embed_fn(sentences)
        finally:
            marks["runtime ends"].append(time.perf_counter())

    def formed():
        batch = form_batch()
        if batch:
            marks["batch formed"].append(time.perf_counter())
        return batch

    def answering(run, outcome, error):
        marks["answered"].append(time.perf_counter())
        answer(run, outcome, error)

    batcher._embed_fn, batcher._form_batch, batcher._answer = runtime_call, formed, answering
    return model, marks


async def measure_batcher(args: argparse.Namespace) -> dict:
    model, marks = traced_batcher(args.model, args.threads)
    model.batcher.start()
    await model.warm_up()
    for step in marks.values():
        step.clear()
    try:
        for _ in range(args.calls):
            marks["embed called"].append(time.perf_counter())
            await model.batcher.embed([SENTENCE])
            marks["embed returns"].append(time.perf_counter())
            await asyncio.sleep(0.002)  # idle between calls, as a lone client leaves it
    finally:
        await model.batcher.close()
    return {f"{a} -> {b}": median_ms(marks[a], marks[b], args.warmup) for a, b in zip(STEPS, STEPS[1:])}


async def measure_bare_hop(args: argparse.Namespace, work_s: float) -> dict:
    pool, loop = ThreadPoolExecutor(1), asyncio.get_running_loop()
    called, started, ended, back = [], [], [], []

    def spin() -> None:
        started.append(time.perf_counter())
        while time.perf_counter() - started[-1] < work_s:
            pass
        ended.append(time.perf_counter())

    for _ in range(args.calls):
        called.append(time.perf_counter())
        await loop.run_in_executor(pool, spin)
        back.append(time.perf_counter())
        await asyncio.sleep(0.002)
    pool.shutdown()
    return {"hop in": median_ms(called, started, args.warmup), "hop back": median_ms(ended, back, args.warmup)}


def median_ms(earlier: list[float], later: list[float], skip: int) -> float:
    return round(1000 * statistics.median(b - a for a, b in list(zip(earlier, later))[skip:]), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.batcher_hops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50, help="calls left out of the medians")
    args = parser.parse_args(argv)
    if args.calls <= args.warmup:
        parser.error("--calls must be more than --warmup")
    steps = asyncio.run(measure_batcher(args))
    bare = asyncio.run(measure_bare_hop(args, steps["runtime starts -> runtime ends"] / 1000))
    overhead = round(sum(ms for step, ms in steps.items() if step != "runtime starts -> runtime ends"), 3)
    result = {"model": str(args.model), "steps_ms": steps, "batcher_overhead_ms": overhead, "bare_hop_ms": bare}
    print(json.dumps(result | machine(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
