"""Where CPU time goes in the runtime's two graphs, measured on real text (docs/explanation/runtime.md, issue 19).

    python -m bench.runtime.cpu_profile --preset small                      # ELMo-small shape, random weights
    python -m bench.runtime.cpu_profile --model models/default --threads 2

*char-CNN* (encoder.onnx): the distinct tokens of ``--lines`` handbook lines, full 50-id rows against rows cut to
their chunk's longest token + the widest filter (what the runtime sends: ``Embedder._encode``), alternating
``--repeat`` times, best of each; the two must agree bit for bit.

*biLSTM* (context.onnx): one batch the way the runtime cuts it (the length-sorted sentences around the median
length, under the 4,096-position budget, the batch's own table rows), onnxruntime's profiler on 1 thread, kernel
time per op summed over ``--runs`` runs and grouped: the hoisted input projections (outer ``Gemm``), the
per-step products inside the Scans (recurrent ``Gemm``, projection ``MatMul``), the per-step gathers of layer 0's
projection, and the element-wise rest. Beside it the same batch with one table row per position (what layer 0's
projection costs when it is computed per position, as model.onnx does and the runtime did before). Where the
export has it, the same batch through the batch job's graph too (context_in_step.onnx: each gate's product on
``[x_t, h]`` inside the step, which onnxruntime fuses with the gate's activation, ``FusedGemm``).

Writes JSON to ``--out`` (default bench/results/cpu_profile.json) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from bench.kit.models import prepare_model
from bench.kit.results import result_path
from bench.kit.revision import REPO
from bench.kit.texts import corpus_lines
from elmo.bench.figures import machine
from elmo.runtime.modeldir import CONTEXT_IN_STEP_FILE

HANDBOOK = REPO / "data" / "handbook" / "handbook.en.txt"


def distinct_rows(embedder, sentences: list[list[str]]) -> np.ndarray:
    """The char-id rows of the distinct tokens of ``sentences``, as the runtime builds them."""
    return np.stack([embedder.scheme.token_ids(t) for t in sorted({t for s in sentences for t in s})])


@contextlib.contextmanager
def full_rows(embedder) -> Iterator[None]:
    """Inside the block the runtime's char-CNN gets full rows (its trim window off)."""
    window = embedder._trim_window
    embedder._trim_window = None
    try:
        yield
    finally:
        embedder._trim_window = window


def char_cnn(embedder, sentences: list[list[str]], repeat: int) -> dict:
    """Full rows against cut rows on the distinct tokens: best seconds of each, tokens/s, bit-identical or not."""
    rows = distinct_rows(embedder, sentences)

    def full() -> np.ndarray:
        with full_rows(embedder):
            return embedder._encode(rows)

    def cut() -> np.ndarray:
        return embedder._encode(rows)

    best = {"full rows": float("inf"), "cut rows": float("inf")}
    for _ in range(repeat):
        for name, run in (("full rows", full), ("cut rows", cut)):
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return {
        "distinct_tokens": len(rows),
        "trim_window": embedder._trim_window,
        "seconds": best,
        "tokens_per_s": {name: len(rows) / seconds for name, seconds in best.items()},
        "bit_identical": bool(np.array_equal(full(), cut())),
    }


def typical_batch(embedder, sentences: list[list[str]]) -> dict:
    """The runtime's batch holding the median-length sentence, as the context graph's feeds."""
    table, rows = embedder._token_table(sentences)
    batches = embedder._batches([len(s) for s in sentences])
    median = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))[len(sentences) // 2]
    (indices,) = [b for b in batches if median in b]
    return embedder._feeds(table, [rows[i] for i in indices])


def one_row_per_position(feeds: dict) -> dict:
    """The same batch with every position its own table row."""
    tokens = feeds["table"][feeds["index"]]  # (B, S, P)
    b, s, p = tokens.shape
    return {"table": tokens.reshape(b * s, p), "index": np.arange(b * s).reshape(b, s), "lengths": feeds["lengths"]}


def context_profile(model: Path, feeds: dict, runs: int, graph: str = "context.onnx") -> dict:
    """onnxruntime's profiler on ``graph`` (a context graph of ``model``), 1 thread: ms per run per op group."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="elmo-profile-") as scratch:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "context")
        session = ort.InferenceSession(str(model / graph), options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)  # warm-up, not counted below
        walls = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, feeds)
            walls.append(time.perf_counter() - start)
        events = json.loads(Path(session.end_profiling()).read_text())
    groups: collections.Counter = collections.Counter()
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        groups[_group(event["name"], event["args"].get("op_name", "?"))] += event["dur"] / 1000
    groups.pop("Scan (whole loop)", None)  # its body's kernels are counted one by one
    per_run = {name: total / (runs + 1) for name, total in groups.most_common()}
    b, s = feeds["index"].shape
    return {
        "batch": [int(b), int(s)],
        "table_rows": int(len(feeds["table"])),
        "best_run_ms": min(walls) * 1000,
        "kernel_ms_per_run": per_run,
    }


def _group(node: str, op: str) -> str:
    inside = node.count("/") > 1  # Scan body nodes are named context/l<layer>d<direction>/...
    if op == "Scan":
        return "Scan (whole loop)"
    if op == "Gemm" and not inside:
        return "input projections (outer Gemm)"
    if op == "Gemm":
        return "recurrent products (Gemm in the Scans)"
    if op == "FusedGemm" and inside:  # the in-step graph: a gate's [x_t, h] product and its activation in one
        return "gate products with their activation (FusedGemm in the Scans)"
    if op == "MatMul" and inside:
        return "projection products (MatMul in the Scans)"
    if op == "Gather" and inside:
        return "layer 0 gathers (in the Scans)"
    return "element-wise and the rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: --preset's random model)")
    parser.add_argument("--preset", default="small", choices=["small", "original"])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--out", default=str(result_path("cpu_profile.json")))
    args = parser.parse_args()

    from elmo.runtime import Embedder
    from elmo.text.tokenize import tokenize

    model, described = prepare_model(args)
    texts, corpus = corpus_lines(args.lines, HANDBOOK if HANDBOOK.is_file() else None)
    sentences = [tokenize(text.strip()).tokens for text in texts]
    sentences = [s for s in sentences if s]
    embedder = Embedder(model, intra_op_threads=args.threads)
    embedder.warmup()
    result = {
        "model": described,
        "corpus": corpus,
        "threads": args.threads,
        "char_cnn": char_cnn(embedder, sentences, args.repeat),
    }
    feeds = typical_batch(embedder, sentences)
    result["context"] = context_profile(model, feeds, args.runs)
    result["context_one_row_per_position"] = context_profile(model, one_row_per_position(feeds), args.runs)
    if (model / CONTEXT_IN_STEP_FILE).is_file():  # the batch job's graph: the same feeds, the same batch
        result["context_in_step"] = context_profile(model, feeds, args.runs, CONTEXT_IN_STEP_FILE)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(render(result))


def render(result: dict) -> str:
    cnn, context = result["char_cnn"], result["context"]
    lines = [
        f"{result['model']}; {result['corpus']}; {result['threads']} threads",
        "",
        f"| char-CNN, {cnn['distinct_tokens']:,} distinct tokens | seconds (best) | tokens/s |",
        "|---|---:|---:|",
    ]
    for name, seconds in cnn["seconds"].items():
        lines.append(f"| {name} | {seconds:.2f} | {cnn['tokens_per_s'][name]:,.0f} |")
    lines.append(f"\nbit-identical: {cnn['bit_identical']} (trim window {cnn['trim_window']})\n")
    b, s = context["batch"]
    per_position = result.get("context_one_row_per_position", context)
    lines += [
        f"| context.onnx, {b} rows x {s} steps, 1 thread, ms per run | the batch's {context['table_rows']} "
        f"table rows | one row per position ({per_position['table_rows']}) |",
        "|---|---:|---:|",
        f"| whole run (best) | {context['best_run_ms']:.0f} | {per_position['best_run_ms']:.0f} |",
    ]
    for name, ms in context["kernel_ms_per_run"].items():
        lines.append(f"| {name} | {ms:.0f} | {per_position['kernel_ms_per_run'].get(name, 0.0):.0f} |")
    in_step = result.get("context_in_step")
    if in_step is not None:
        head = f"| {CONTEXT_IN_STEP_FILE} (the batch job's graph), the same batch, 1 thread | ms per run | share |"
        lines += ["", head, "|---|---:|---:|", f"| whole run (best) | {in_step['best_run_ms']:.0f} | |"]
        kernels = sum(in_step["kernel_ms_per_run"].values())
        for name, ms in in_step["kernel_ms_per_run"].items():
            lines.append(f"| {name} | {ms:.0f} | {100 * ms / kernels:.0f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
