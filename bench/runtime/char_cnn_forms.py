"""The char-CNN's convolutions in two forms, side by side on the runtime's own path (bench/notes/front-door.md).

    python -m bench.runtime.char_cnn_forms --preset small --threads 1 2
    python -m bench.runtime.char_cnn_forms --model models/default --threads 2

*conv*: the model's encoder as written, one ``Conv`` per filter width (encoder.onnx before this form replaced it).
*windows*: export.graphs.EncoderGraph, what encoder.onnx now holds: the same maths as one ``MatMul`` over windows of
the widest filter's width, a window that reads past its row pushed below every real one (its docstring says how).
Both are exported here from the model's weights, so that any model directory, old exports included, compares them.

Both forms run through the runtime's ``Embedder._encode`` (rows sorted by length, chunks cut to their longest token +
the widest filter) on the distinct tokens of the first ``--lines`` held-out lines, taking turns ``--repeat`` times,
best of each, for each ``--threads``. Reported: tokens/s of each, the largest difference between the forms, and
whether the windows form still gives cut and full rows the same vectors bit for bit. Writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.kit.models import prepare_model
from bench.kit.results import result_path
from bench.kit.texts import HANDBOOK, corpus_lines
from bench.runtime.cpu_profile import distinct_rows, full_rows
from elmo.bench.figures import machine


class ConvGraph(torch.nn.Module):
    """char_ids int64 (N, W) -> token vectors (N, P): the model's encoder as written, one ``Conv`` per width (what
    encoder.onnx held before the windows form)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.encoder

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(char_ids.unsqueeze(0)).squeeze(0)


def export_forms(model_dir: Path, out: Path) -> dict[str, Path]:
    """Both forms of ``model_dir``'s encoder as ONNX files in ``out``, named as encoder.onnx's input and output so
    that the runtime can run either in its place."""
    from elmo.export.graphs import EncoderGraph
    from elmo.export.onnx_export import _trace, load_bilm

    model = load_bilm(model_dir)
    example = torch.randint(1, 200, (3, model.cfg.token_width))
    paths = {}
    for form, graph in (("conv", ConvGraph(model)), ("windows", EncoderGraph(model))):
        proto = _trace(graph, (example,), out / "trace.onnx", {"char_ids": {0: "tokens", 1: "chars"}},
                       {"token_vectors": {0: "tokens"}})  # fmt: skip
        paths[form] = out / f"encoder_{form}.onnx"
        paths[form].write_bytes(proto.SerializeToString())
    return paths


def compare(model: Path, forms: dict[str, Path], rows: np.ndarray, threads: int, repeat: int) -> dict:
    """Both forms through ``Embedder._encode`` with ``threads`` intra-op threads, in turn: best seconds of each."""
    from elmo.runtime import CPU, Embedder
    from elmo.runtime.providers import open_session

    embedder = Embedder(model, providers=[CPU], intra_op_threads=threads)
    own = embedder.encoder
    sessions = {form: open_session(path, [CPU], threads) for form, path in forms.items()}
    best = dict.fromkeys(sessions, float("inf"))
    vectors = {}
    try:
        for _ in range(repeat):
            for form, session in sessions.items():
                embedder.encoder = session
                start = time.perf_counter()
                vectors[form] = embedder._encode(rows)
                best[form] = min(best[form], time.perf_counter() - start)
        embedder.encoder = sessions["windows"]
        with full_rows(embedder):
            untrimmed = embedder._encode(rows)
    finally:
        embedder.encoder = own
        embedder.close()
    return {
        "threads": threads,
        "seconds": best,
        "tokens_per_s": {form: len(rows) / seconds for form, seconds in best.items()},
        "windows_over_conv": best["conv"] / best["windows"],
        "max_abs_difference": float(np.abs(vectors["windows"] - vectors["conv"]).max()),
        "windows_cut_rows_bit_identical": bool(np.array_equal(untrimmed, vectors["windows"])),
    }


def render(result: dict) -> str:
    lines = [f"{result['model']}; {result['corpus']}; {result['distinct_tokens']} distinct tokens; best of "
             f"{result['repeat']}", "", "| threads | conv tokens/s | windows tokens/s | windows ÷ conv | max diff |"
             " cut = full rows |", "|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for run in result["runs"]:
        speed = run["tokens_per_s"]
        lines.append(f"| {run['threads']} | {speed['conv']:,.0f} | {speed['windows']:,.0f} | "
                     f"{run['windows_over_conv']:.2f}× | {run['max_abs_difference']:.1e} | "
                     f"{run['windows_cut_rows_bit_identical']} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: --preset's random model)")
    parser.add_argument("--preset", default="small", help="random-weights shape when no --model")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=result_path("char_cnn_forms.json"))
    args = parser.parse_args(argv)

    from elmo.runtime import CPU, Embedder
    from elmo.text.tokenize import tokenize

    model, described = prepare_model(args)
    lines, corpus = corpus_lines(args.lines, HANDBOOK if HANDBOOK.is_file() else None)
    embedder = Embedder(model, providers=[CPU], intra_op_threads=1)
    rows = distinct_rows(embedder, [tokenize(line).tokens for line in lines])
    embedder.close()
    with tempfile.TemporaryDirectory() as work:
        forms = export_forms(model, Path(work))
        runs = [compare(model, forms, rows, threads, args.repeat) for threads in args.threads]
    result = {"model": described, "corpus": corpus, "distinct_tokens": len(rows), "repeat": args.repeat,
              "runs": runs} | machine()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


if __name__ == "__main__":
    main()
