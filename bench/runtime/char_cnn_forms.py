"""The char-CNN's convolutions in two forms, side by side on the runtime's own path (docs/runtime.md, "Sixth round").

    python -m bench.runtime.char_cnn_forms --preset small --threads 1 2
    python -m bench.runtime.char_cnn_forms --model models/default --threads 2

*conv*: the model's encoder.onnx, one ``Conv`` per filter width (what the runtime runs). *windows*: the same maths
as one ``MatMul`` over windows of the widest filter's width: every position's K char vectors side by side
(N, L, K·(d+1)) against the filters' weights stacked (K·(d+1), F), a filter narrower than K having zero weights for
the taps it lacks. The (d+1)-th column of a char vector is 1 past the end of the row and 0 inside it, with weight
-1e30 on the taps a filter uses: a filter's windows that run past the row (which its own ``Conv`` never computes)
are then far below every real window, and the max over positions is that of the ``Conv``. The bias is added after
the max (the same value: rounding is monotone), the highway and projection are the model's.

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
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from bench.kit.models import prepare_model
from bench.kit.results import result_path
from bench.kit.texts import HANDBOOK, corpus_lines
from elmo.bench.figures import machine

PAST_THE_ROW = -1e30  # a window's score for each tap past the row's end: below any real window, finite (no 0·inf)


class WindowGraph(torch.nn.Module):
    """char_ids int64 (N, W) -> token vectors float32 (N, P): the encoder with its convolutions as one MatMul."""

    def __init__(self, encoder: torch.nn.Module, filters: list[list[int]]) -> None:
        super().__init__()
        self.encoder = encoder
        self.width = max(width for width, _ in filters)  # K
        chars = encoder.char_embedding.weight.detach()  # (n_chars, d)
        n_chars, dim = chars.shape
        self.past_the_row = n_chars  # the id that pads a row's windows: its own table row, [0 .. 0, 1]
        table = torch.zeros(n_chars + 1, dim + 1)
        table[:n_chars, :dim] = chars
        table[n_chars, dim] = 1.0
        self.register_buffer("table", table)
        weights = torch.zeros(self.width, dim + 1, sum(count for _, count in filters))  # (K, d+1, F)
        column = 0
        for conv, (width, count) in zip(encoder.convs, filters):
            weights[:width, :dim, column : column + count] = conv.weight.detach().permute(2, 1, 0)  # (w, d, count)
            weights[:width, dim, column : column + count] = PAST_THE_ROW
            column += count
        self.register_buffer("weights", weights.reshape(-1, weights.shape[-1]))  # (K·(d+1), F)
        self.register_buffer("bias", torch.cat([conv.bias.detach() for conv in encoder.convs]))

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        encoder = self.encoder
        chars = char_ids if encoder.word_embedding is None else char_ids[:, : encoder.max_chars]
        rows, length = chars.shape
        padded = F.pad(chars, (0, self.width - 1), value=self.past_the_row)  # (N, L+K-1)
        taps = torch.arange(length).unsqueeze(1) + torch.arange(self.width).unsqueeze(0)  # (L, K)
        windows = self.table[padded[:, taps]].reshape(rows, length, -1)  # (N, L, K·(d+1))
        scores = torch.matmul(windows, self.weights)  # (N, L, F)
        features = encoder.highway(encoder.activation(scores.max(dim=1).values + self.bias))
        if encoder.word_embedding is not None:
            features = torch.cat([encoder.word_embedding(char_ids[:, encoder.max_chars]), features], dim=-1)
        return encoder.projection(features)


def export_windows(model_dir: Path, out: Path) -> Path:
    """The windows form of ``model_dir``'s encoder as an ONNX file in ``out`` (input and output named as
    encoder.onnx's, so the runtime can run it in its place)."""
    from elmo.export.onnx_export import _trace, load_bilm

    model = load_bilm(model_dir)
    graph = WindowGraph(model.encoder, model.cfg.filters)
    example = torch.randint(1, 200, (3, 20))
    path = out / "encoder_windows.onnx"
    with warnings.catch_warnings():  # the tracer's note that F.pad's reversed slice is not folded: it runs as is
        warnings.filterwarnings("ignore", message="Constant folding - Only steps=1", category=UserWarning)
        proto = _trace(graph, (example,), out / "trace.onnx", {"char_ids": {0: "tokens", 1: "chars"}},
                       {"token_vectors": {0: "tokens"}})  # fmt: skip
    path.write_bytes(proto.SerializeToString())
    return path


def distinct_rows(embedder, lines: list[str]) -> np.ndarray:
    """The char-id rows of the distinct tokens of ``lines``, as the runtime builds them."""
    from elmo.text.tokenize import tokenize

    tokens = sorted({token for line in lines for token in tokenize(line).tokens})
    return np.stack([embedder.scheme.token_ids(token) for token in tokens])


def compare(model: Path, windows: Path, rows: np.ndarray, threads: int, repeat: int) -> dict:
    """Both forms through ``Embedder._encode`` with ``threads`` intra-op threads, in turn: best seconds of each."""
    from elmo.runtime import CPU, Embedder
    from elmo.runtime.providers import open_session

    embedder = Embedder(model, providers=[CPU], intra_op_threads=threads)
    sessions = {"conv": embedder.encoder, "windows": open_session(windows, [CPU], threads)}
    best = dict.fromkeys(sessions, float("inf"))
    vectors = {}
    try:
        for _ in range(repeat):
            for form, session in sessions.items():
                embedder.encoder = session
                start = time.perf_counter()
                vectors[form] = embedder._encode(rows)
                best[form] = min(best[form], time.perf_counter() - start)
        trim_window = embedder._trim_window
        embedder._trim_window = None  # full rows
        full_rows = embedder._encode(rows)
        embedder._trim_window = trim_window
    finally:
        embedder.encoder = sessions["conv"]
        embedder.close()
    return {
        "threads": threads,
        "seconds": best,
        "tokens_per_s": {form: len(rows) / seconds for form, seconds in best.items()},
        "windows_over_conv": best["conv"] / best["windows"],
        "max_abs_difference": float(np.abs(vectors["windows"] - vectors["conv"]).max()),
        "windows_cut_rows_bit_identical": bool(trim_window is None or np.array_equal(full_rows, vectors["windows"])),
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

    model, described = prepare_model(args)
    lines, corpus = corpus_lines(args.lines, HANDBOOK if HANDBOOK.is_file() else None)
    embedder = Embedder(model, providers=[CPU], intra_op_threads=1)
    rows = distinct_rows(embedder, lines)
    embedder.close()
    with tempfile.TemporaryDirectory() as work:
        windows = export_windows(model, Path(work))
        runs = [compare(model, windows, rows, threads, args.repeat) for threads in args.threads]
    result = {"model": described, "corpus": corpus, "distinct_tokens": len(rows), "repeat": args.repeat,
              "runs": runs} | machine()  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


if __name__ == "__main__":
    main()
