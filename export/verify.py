"""Self-verification of an export: onnxruntime vs the PyTorch model on inputs the tracer never saw.

The ONNX checker proves nothing about semantics (a silently fixed token axis passes it), so every export runs
these cases: lengths 1, 2, 7, 50, 200 alone, mixed-length batches (padding and the backward direction), an
empty sentence beside a long one, a word over 50 bytes (char truncation), CJK and emoji (multi-byte UTF-8).

The reference is the PyTorch model run in float64: the exact maths of the same weights. PyTorch's own float32
result is an approximation too (on a trained model whose token layer reaches |v| ~ 20 it was 1.1e-5 away from
float64 while onnxruntime was 7.6e-6 away), so the error is measured against float64; PyTorch float32's
distance from it is reported beside, for scale.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from elmo.chars import MAX_CHARS, batch_to_char_ids

Sentences = list[list[str]]


def _words(rng: np.random.Generator, count: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;'-"))
    return ["".join(rng.choice(letters, size=int(rng.integers(1, 12)))) for _ in range(count)]


def verification_cases(seed: int = 1234) -> list[tuple[str, Sentences]]:
    """(name, sentences) pairs; each entry is one batch."""
    rng = np.random.default_rng(seed)
    special = ["x" * 60, "naïve", "中文", "字", "😀", "👍🏽", "Ünïcödé" * 8, "<S>", "e"]
    cases: list[tuple[str, Sentences]] = [(f"length {n}", [_words(rng, n)]) for n in (1, 2, 7, 50, 200)]
    cases.append(("mixed lengths 1/2/7/50/200", [_words(rng, n) for n in (7, 200, 1, 50, 2)]))
    cases.append(("long word, CJK, emoji", [special, _words(rng, 3), ["中", "文", "字", "符", "😀", "。"]]))
    cases.append(("empty sentence beside others", [[], _words(rng, 5), ["a"]]))
    cases.append(("batch of 16 mixed", [_words(rng, int(n)) for n in rng.integers(1, 40, size=16)]))
    return cases


@dataclass
class CaseResult:
    name: str
    shape: tuple[int, ...]
    max_abs_error: float

    def to_dict(self) -> dict:
        return {"name": self.name, "char_ids_shape": list(self.shape), "max_abs_error": self.max_abs_error}


@dataclass
class VerificationReport:
    tolerance: float
    dtype: str
    cases: list[CaseResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    pytorch_float32_error: float | None = None  # PyTorch float32 vs the float64 reference, for scale

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error for c in self.cases), default=float("nan"))

    @property
    def passed(self) -> bool:
        return not self.failures and bool(self.cases) and self.max_abs_error <= self.tolerance

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        text = (
            f"{verdict}: {len(self.cases)} cases, {self.dtype} max abs error {self.max_abs_error:.2e} vs PyTorch "
            f"float64 (tolerance {self.tolerance:.0e})"
        )
        if self.pytorch_float32_error is not None:
            text += f"; PyTorch float32 itself: {self.pytorch_float32_error:.2e}"
        worst = [c.name for c in self.cases if c.max_abs_error > self.tolerance]
        if worst:
            text += f"; over tolerance: {', '.join(worst)}"
        if self.failures:
            text += f"; {'; '.join(self.failures)}"
        return text

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "dtype": self.dtype,
            "tolerance": self.tolerance,
            "max_abs_error": self.max_abs_error,
            "reference": "PyTorch float64",
            "pytorch_float32_max_abs_error": self.pytorch_float32_error,
            "summary": self.summary(),
            "cases": [c.to_dict() for c in self.cases],
        }


def torch_layers(model: torch.nn.Module, sentences: Sentences) -> list[np.ndarray]:
    """The PyTorch model's vectors, one (L+1, n, 2P) array per sentence, in the model's own precision."""
    with torch.no_grad():
        layers, _ = model(torch.as_tensor(batch_to_char_ids(sentences)).long())
    layers = layers.numpy()
    return [layers[i, :, : len(s)] for i, s in enumerate(sentences)]


def compare(
    expected_by_case: Sequence[list[np.ndarray]],
    embed: Callable[[Sentences], list[np.ndarray]],
    cases: Sequence[tuple[str, Sentences]],
    tolerance: float,
    dtype: str,
    label: str,
) -> VerificationReport:
    """Run every case through ``embed`` (sentences -> per sentence (L+1, n, 2P)) and compare with PyTorch's
    vectors for it (``expected_by_case``, from torch_layers)."""
    report = VerificationReport(tolerance=tolerance, dtype=dtype)
    for (name, sentences), expected in zip(cases, expected_by_case):
        name = f"{label}: {name}"
        try:
            got = embed(sentences)
        except Exception as exc:  # an onnxruntime failure is a verification failure, reported as such
            report.failures.append(f"{name}: raised {type(exc).__name__}: {exc}")
            continue
        shapes = [g.shape for g in got]
        if shapes != [e.shape for e in expected]:
            report.failures.append(f"{name}: output shapes {shapes}, PyTorch gives {[e.shape for e in expected]}")
            continue
        error = max((float(np.max(np.abs(g - e))) for g, e in zip(got, expected) if e.size), default=0.0)
        if not np.isfinite(error):
            report.failures.append(f"{name}: non-finite output")
        width = max((len(s) for s in sentences), default=0)
        report.cases.append(CaseResult(name, (len(sentences), width, MAX_CHARS), error))
    return report


def full_graph_embedder(session) -> Callable[[Sentences], list[np.ndarray]]:
    """model.onnx as a per-sentence embedder; its mask output and its zero padding are checked on the way."""

    def embed(sentences: Sentences) -> list[np.ndarray]:
        char_ids = batch_to_char_ids(sentences).astype(np.int64)
        layers, mask = session.run(["layers", "mask"], {"char_ids": char_ids})
        lengths = np.array([len(s) for s in sentences])
        if not np.array_equal(mask, np.arange(char_ids.shape[1])[None, :] < lengths[:, None]):
            raise ValueError("mask output differs from the sentence lengths")
        for i, n in enumerate(lengths):
            if np.any(layers[i, :, n:]):
                raise ValueError(f"sentence {i}: non-zero vectors past its end")
        return [layers[i, :, :n] for i, n in enumerate(lengths)]

    return embed


def verify_export(model: torch.nn.Module, directory: Path, tolerance: float, dtype: str, threads: int = 1):
    """Verify the graphs written in ``directory`` against ``model``: model.onnx alone, and the runtime's
    encoder + context path (elmo.runtime.Embedder, exactly what is served) with each context layout, all on
    the CPU provider."""
    import onnxruntime as ort

    from elmo.modeldir import ONNX_FILE
    from elmo.runtime import CPU, Embedder

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(directory / ONNX_FILE), options, providers=[CPU])
    cases = verification_cases()
    exact = copy.deepcopy(model).double()
    expected = [torch_layers(exact, sentences) for _, sentences in cases]
    del exact
    report = compare(expected, full_graph_embedder(session), cases, tolerance, dtype, ONNX_FILE)
    report.pytorch_float32_error = compare(
        expected, lambda s: torch_layers(model.float(), s), cases, tolerance, "float32", "PyTorch"
    ).max_abs_error
    for layout in ("separate", "fused"):
        runtime = Embedder(directory, providers=[CPU], intra_op_threads=threads, cache_size=64, context_layout=layout)
        part = compare(expected, runtime.embed_tokens, cases, tolerance, dtype, f"runtime ({layout})")
        report.cases += part.cases
        report.failures += part.failures
    return report
