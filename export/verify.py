"""Self-verification of an export: onnxruntime vs the PyTorch model on inputs the tracer never saw.

The ONNX checker proves nothing about semantics (a silently fixed token axis passes it), so every export runs
these cases: lengths 1, 2, 7, 50, 200 alone, mixed-length batches (padding and the backward direction), an
empty sentence beside a long one, a word over 50 bytes (char truncation), CJK and emoji (multi-byte UTF-8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from elmo.chars import batch_to_char_ids

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

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error for c in self.cases), default=float("nan"))

    @property
    def passed(self) -> bool:
        return not self.failures and bool(self.cases) and self.max_abs_error <= self.tolerance

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        text = (
            f"{verdict}: {len(self.cases)} cases, {self.dtype} max abs error {self.max_abs_error:.2e} "
            f"(tolerance {self.tolerance:.0e})"
        )
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
            "summary": self.summary(),
            "cases": [c.to_dict() for c in self.cases],
        }


def torch_layers(model: torch.nn.Module, char_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        layers, mask = model(torch.as_tensor(char_ids).long())
    return layers.float().numpy(), mask.numpy()


def compare(
    model: torch.nn.Module,
    run_graph: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
    cases: Sequence[tuple[str, Sentences]],
    tolerance: float,
    dtype: str,
) -> VerificationReport:
    """Run every case through ``run_graph`` (char_ids int64 (B, T, 50) -> (layers, mask)) and PyTorch."""
    report = VerificationReport(tolerance=tolerance, dtype=dtype)
    for name, sentences in cases:
        char_ids = batch_to_char_ids(sentences).astype(np.int64)
        expected, expected_mask = torch_layers(model, char_ids)
        try:
            got, got_mask = run_graph(char_ids)
        except Exception as exc:  # an onnxruntime failure is a verification failure, reported as such
            report.failures.append(f"{name}: onnxruntime raised {type(exc).__name__}: {exc}")
            continue
        if got.shape != expected.shape:
            report.failures.append(f"{name}: output shape {got.shape}, PyTorch gives {expected.shape}")
            continue
        if not np.array_equal(got_mask.astype(bool), expected_mask.astype(bool)):
            report.failures.append(f"{name}: mask differs")
        error = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
        if not np.isfinite(error):
            report.failures.append(f"{name}: non-finite output")
        report.cases.append(CaseResult(name, tuple(char_ids.shape), error))
    return report


def verify_onnx(model: torch.nn.Module, onnx_path: Path, tolerance: float, fp16: bool = False) -> VerificationReport:
    """Verify the single-graph export ``onnx_path`` on the CPU provider (the export machine has no GPU)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, torch.get_num_threads())
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])

    def run_graph(char_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        layers, mask = session.run(["layers", "mask"], {"char_ids": char_ids})
        return layers, mask

    return compare(model, run_graph, verification_cases(), tolerance, "float16" if fp16 else "float32")
