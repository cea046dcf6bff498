"""The probe every export stores, so that each host that loads the model judges it again (elmo.runtime.probe).

A handful of sentences (English, Chinese, a long word, emoji; 56 tokens in four sentences of different lengths, so
padding and the backward direction are exercised) and their reference vectors, made from the PyTorch model the export
was judged against:

- float32 / fp16 exports: the float64 vectors, with the bar the export verification applies to a case (the bound
  of export/verify.py's ErrorBound for this very case: PyTorch float32's own error on it, the outputs' scale);
- int8 exports: PyTorch float32's vectors, with the int8 bars (export/quantize.py: per-token cosine mean and min).

The reference goes to probe.bin (float32 little-endian), the rest to onnx.json -> probe with the file's size and
sha256; the export then opens the staged folder with the runtime, which runs the check as on any host, and records
the figures it reached here (``at_export``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from elmo.export.quantize import INT8_MEAN_COSINE, INT8_MIN_COSINE
from elmo.export.verify import ErrorBound, Scheme, references, torch_layers

from elmo.runtime.host import host_summary
from elmo.runtime.probe import COSINE, MAX_ABS, PROBE_FILE, ProbeResult

PROBE_SENTENCES = [
    ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."],
    list("我今天吃了一个苹果，苹果公司发布了新手机。"),  # one token per character, as the tokenizer splits Chinese
    ["naïve", "😀", "x" * 60, "Ünïcödé", "2026"],
    [
        "Apple",
        "released",
        "a",
        "new",
        "phone",
        ";",
        "the",
        "apple",
        "I",
        "ate",
        "was",
        "sweet",
        ",",
        "and",
        "ELMo",
        "vectors",
        "tell",
        "them",
        "apart",
        ".",
    ],
]


def _write(
    directory: Path, sentences: list[list[str]], vectors: list[np.ndarray], kind: str, bar: dict, describes: str
) -> dict:
    """probe.bin from per-sentence (L+1, n, D) vectors; returns the onnx.json -> probe entry."""
    reference = np.concatenate([v.astype("<f4") for v in vectors], axis=1)
    raw = np.ascontiguousarray(reference).tobytes()
    (directory / PROBE_FILE).write_bytes(raw)
    return {
        "file": PROBE_FILE,
        "bytes": len(raw),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "shape": list(reference.shape),
        "sentences": sentences,
        "kind": kind,
        "reference": describes,
        "bar": bar,
    }


def write_probe(directory: Path, model: torch.nn.Module, scheme: Scheme, bound: ErrorBound | None) -> dict:
    """Write ``directory``/probe.bin; the onnx.json -> probe entry. ``bound``: a float32 / fp16 export's bound
    (export/verify.py), None for an int8 export (judged by cosine to float32)."""
    if bound is None:
        vectors = torch_layers(model.float(), PROBE_SENTENCES, scheme)
        bar = {"mean": INT8_MEAN_COSINE, "min": INT8_MIN_COSINE}
        return _write(directory, PROBE_SENTENCES, vectors, COSINE, bar, "float32 graphs (PyTorch float32)")
    (reference,) = references(model, [("probe", PROBE_SENTENCES)], scheme)
    bar = {"max_abs_error": bound.for_case(reference.float32_error, reference.output_scale), "rule": bound.describe()}
    return _write(directory, PROBE_SENTENCES, reference.expected, MAX_ABS, bar, "PyTorch float64")


def at_export(result: ProbeResult) -> dict:
    """What the check reached on the exporting machine, for onnx.json -> probe -> at_export."""
    return {"host": host_summary(), "passed": result.passed, "figures": result.figures}
