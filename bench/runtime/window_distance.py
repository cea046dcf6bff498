"""How far ``overflow: window`` vectors are from whole-sentence vectors, on real long text.

    python -m bench.runtime.window_distance --model models/default --text data/handbook/handbook.en.txt --tokens 5000

Consecutive paragraphs of TEXT are joined into documents of at least ``--tokens`` tokens (the service's tokenizer).
Each document is embedded once whole (one sequence, no limit) and once in windows of ``--window`` tokens for every
``--overlaps`` value, exactly as the service and the batch job cut and stitch them (elmo.text.overflow). Per layer:
the mean, 1st percentile and minimum of the per-token cosine similarity between the two, and the share of tokens at
or above 0.99; plus the extra tokens the windows cost. Layer 0 (the char-CNN) sees no context and is identical.
Prints a Markdown table and writes the JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from elmo.bench.figures import machine, percentiles
from elmo.text.overflow import embed_windowed, windowed
from elmo.text.tokenize import tokenize


def documents(path: Path, min_tokens: int, count: int) -> list[list[str]]:
    docs, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            current.extend(tokenize(line).tokens)
        if len(current) >= min_tokens:
            docs.append(current[:min_tokens])
            current = []
            if len(docs) == count:
                break
    return docs


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per token cosine of two (n_layers, n, dim) arrays -> (n_layers, n)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.sum(a * b, -1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def measure(model: Path, text: Path, tokens: int, count: int, window: int, overlaps: list[int], threads: int) -> dict:
    from elmo.runtime import Embedder

    runtime = Embedder(model, intra_op_threads=threads, max_tokens_per_sentence=max(tokens, window) + 1)
    docs = documents(text, tokens, count)
    if not docs:
        raise SystemExit(f"{text}: no document of {tokens} tokens")
    started = time.perf_counter()
    whole = [runtime.embed_tokens([doc])[0] for doc in docs]
    whole_s = time.perf_counter() - started
    rows = []
    for overlap in overlaps:
        started = time.perf_counter()
        stitched = embed_windowed(runtime.embed_tokens, docs, window, overlap)
        seconds = time.perf_counter() - started
        cos = np.concatenate([cosines(s, w) for s, w in zip(stitched, whole)], axis=1)  # (n_layers, all tokens)
        pieces = sum(len(p) for p in windowed(docs, window, overlap).pieces)
        row = {"overlap": overlap, "extra_tokens": round(pieces / sum(map(len, docs)) - 1, 3), "seconds": seconds}
        for layer in range(cos.shape[0]):
            figures = percentiles(cos[layer], (1,), digits=5)
            row[f"layer{layer}"] = {
                "mean": figures["mean"],
                "p1": figures["p1"],
                "min": round(float(cos[layer].min()), 5),
                "share_ge_0.99": round(float((cos[layer] >= 0.99).mean()), 4),
            }
        rows.append(row)
    return {
        "model": str(model),
        "text": str(text),
        "documents": len(docs),
        "tokens_per_document": tokens,
        "window": window,
        "whole_seconds": whole_s,
        "rows": rows,
    }


def table(result: dict) -> str:
    n_layers = sum(1 for key in result["rows"][0] if key.startswith("layer"))
    head = "| overlap | extra tokens | " + " | ".join(f"layer {i}: mean / p1 / min cos" for i in range(1, n_layers))
    lines = [head + " |", "|" + "---|" * (n_layers + 1)]
    for row in result["rows"]:
        cells = [
            f"{row[f'layer{i}']['mean']:.4f} / {row[f'layer{i}']['p1']:.4f} / {row[f'layer{i}']['min']:.4f}"
            for i in range(1, n_layers)
        ]
        lines.append(f"| {row['overlap']} | {100 * row['extra_tokens']:.0f} % | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.runtime.window_distance", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", type=Path, default=Path("models/default"))
    parser.add_argument("--text", type=Path, required=True, help="UTF-8 text, one paragraph per line")
    parser.add_argument("--tokens", type=int, default=5000, help="tokens per document (default 5000)")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--window", type=int, default=512, help="window size: the service's --max-sentence-tokens")
    parser.add_argument("--overlaps", type=int, nargs="+", default=[0, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args(argv)
    result = measure(args.model, args.text, args.tokens, args.documents, args.window, args.overlaps, args.threads)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
        args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
