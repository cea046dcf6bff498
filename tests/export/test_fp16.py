"""The fp16 export's verification bound: derived from fp16's precision, tight enough to refuse a broken graph.

fp16 keeps 11 significant bits (unit roundoff 2^-11); a good fp16 graph lands about one unit of the outputs' scale
from the float64 reference, and FP16_BOUND allows four (export/onnx_export.py has the measured figures). A graph
with a semantic slip must be refused even when the slip is small next to the flat 0.1 used before.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import elmo.export.context_graph as context_graph
import elmo.export.onnx_export as onnx_export
import pytest

from elmo.errors import ModelFileError

FP16_UNIT_ROUNDOFF = 2.0**-11


def test_the_fp16_bound_is_four_unit_roundoffs_of_the_output_scale():
    bound = onnx_export.FP16_BOUND
    assert bound.override is None and bound.float32_factor == 0.0  # fp16's error owes nothing to float32's
    for scale in (0.0, 0.5, 1.0):  # the gates and tanh inside the recurrence live on [-1, 1]: scale at least 1
        assert bound.for_case(float32_error=1e-7, output_scale=scale) == pytest.approx(4 * FP16_UNIT_ROUNDOFF)
    for scale in (3.2, 20.0):  # the tiny test model's outputs, the shipped default model's token layer
        assert bound.for_case(float32_error=1e-7, output_scale=scale) == pytest.approx(4 * FP16_UNIT_ROUNDOFF * scale)


def test_a_trained_model_exports_to_fp16_within_the_bound(trained_tiny_lm: Path, tmp_path: Path):
    # Trained weights (not only random ones) must pass: the bound was derived on random and trained models alike.
    onnx_export.export_model(trained_tiny_lm, tmp_path / "fp16", fp16=True, threads=1)
    verification = json.loads((tmp_path / "fp16" / "onnx.json").read_text())["verification"]
    assert verification["passed"] and verification["dtype"] == "float16"
    for case in verification["cases"]:  # measured: up to 5.1e-4 x max(1, scale), a 3.9x margin to the bound
        assert case["bound"] == pytest.approx(4 * FP16_UNIT_ROUNDOFF * max(1.0, case["output_scale"]))
        assert case["max_abs_error"] <= case["bound"]


def _clip_scaled(factor: float) -> Callable:
    """A context-graph builder whose clips sit ``factor`` times their configured limit."""
    clip = context_graph._clip

    def scaled(g, x: str, limit: float) -> str:
        return clip(g, x, limit * factor)

    return scaled


@pytest.mark.parametrize(
    ("mutation", "why"),
    [
        (lambda g, x, limit: x, "clips dropped (misses by 0.12-0.61 on the tiny model)"),
        # 5 % off misses by 1.2e-2..3e-2, under the old flat 0.1 but 2.7x or more over 2^-9 x the output scale.
        (_clip_scaled(1.05), "clip limits 5 % too wide"),
    ],
    ids=["clips dropped", "clips 5 % wide"],
)
def test_a_broken_fp16_graph_fails_verification(tiny_model_dir: Path, tmp_path: Path, monkeypatch, mutation, why):
    monkeypatch.setattr(context_graph, "_clip", mutation)
    with pytest.raises(ModelFileError, match="verification against PyTorch failed") as failure:
        onnx_export.export_model(tiny_model_dir, tmp_path / "broken", fp16=True, threads=1)
    # Refused on every path and already on the shortest case, not only where long sentences add up the slip.
    for path in ("model.onnx", "runtime (separate)", "runtime (fused)"):
        assert f"{path}: length 1 " in str(failure.value), why
    assert not (tmp_path / "broken" / "model.onnx").exists()
