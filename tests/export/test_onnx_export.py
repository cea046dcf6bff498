import copy
import json
import shutil

import elmo.export.context_graph as context_graph
import elmo.export.onnx_export as onnx_export
import numpy as np
import pytest
import torch
from elmo.export.verify import (
    FLOAT32_SAMPLES,
    float32_error,
    max_abs_error,
    rounding_variants,
    torch_layers,
    verification_cases,
)

from elmo.bench.random_model import random_bilm, write_random_model
from elmo.cli import main
from elmo.errors import ModelFileError
from elmo.model.checkpoint import save_model
from elmo.runtime import CPU, Embedder
from elmo.runtime.modeldir import sha256_of


@pytest.fixture()
def unexported_model(tmp_path):
    return write_random_model(tmp_path / "model", "tiny", seed=1, scale=0.3, cell_clip=0.5, proj_clip=0.5)


def test_export_writes_a_verified_graph_and_its_metadata(tiny_model_dir):
    meta = json.loads((tiny_model_dir / "onnx.json").read_text())
    assert meta["verification"]["passed"] is True
    assert meta["verification"]["dtype"] == "float32"
    assert 0 < meta["verification"]["max_abs_error"] <= 1e-5
    assert meta["checkpoint_sha256"] == sha256_of(tiny_model_dir / "model.safetensors")
    assert (meta["n_layers"], meta["dim"], meta["projection_dim"], meta["cell_dim"]) == (3, 16, 8, 16)
    assert meta["char_scheme"]["max_chars"] == 50 and meta["opset"] == onnx_export.OPSET
    assert "BertPreTokenizer" in json.dumps(meta["tokenizer"])
    names = {case["name"] for case in meta["verification"]["cases"]}
    for path in ("model.onnx", "runtime (separate)", "runtime (fused)"):  # the single graph, both served paths
        assert {f"{path}: length {n}" for n in (1, 2, 7, 50, 200, 400)} <= names


def test_verification_cases_cover_what_the_export_must_survive():
    cases = dict(verification_cases())
    tokens = [t for sentences in cases.values() for sentence in sentences for t in sentence]
    assert any(len(t.encode()) > 50 for t in tokens)
    assert any("\u4e00" <= ch <= "\u9fff" for t in tokens for ch in t)  # CJK
    assert any(ord(ch) > 0xFFFF for t in tokens for ch in t)  # emoji (4-byte UTF-8)
    mixed = [len(s) for s in cases["mixed lengths 1/2/7/50/200"]]
    assert sorted(mixed) == [1, 2, 7, 50, 200]


def test_a_graph_without_clipping_fails_verification_and_replaces_nothing(tiny_model_dir, tmp_path, monkeypatch):
    # A semantic slip (here: the clips dropped from the hand-built recurrence) passes the ONNX checker; the
    # self-verification must catch it, and the earlier good export must stay in place.
    exported = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    monkeypatch.setattr(context_graph, "_clip", lambda g, x, limit: x)
    with pytest.raises(ModelFileError, match="model.onnx: verification against PyTorch failed"):
        onnx_export.export_model(exported)
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before


def _scaled_model(directory, names: tuple[str, ...], factor: float, **config):
    """The tiny random model with the parameters whose names contain one of ``names`` multiplied by ``factor``."""
    import torch

    model = random_bilm("tiny", 0, 0.3, **config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if any(part in name for part in names):
                parameter.mul_(factor)
    save_model(model, directory)
    return directory


@pytest.mark.parametrize(
    "names, factor, config, why",
    [
        (("char_embedding",), 1e6, {}, "is over 1e+04: the weights are not a model's"),
        (
            ("state_linearity.weight", "state_projection"),
            6.0,
            {"cell_clip": 0, "proj_clip": 0},
            "the weights amplify rounding, no float export can be exact",
        ),
    ],
    ids=["absurd-outputs", "chaotic-recurrence"],
)
def test_weights_no_float_export_can_match_are_refused_whatever_float32s_error(tmp_path, names, factor, config, why):
    """A bound relative to PyTorch float32's own error would pass anything when that error is itself huge (weights
    read from a host file once gave outputs of 1e27 and "passed")."""
    model_dir = _scaled_model(tmp_path / "model", names, factor, **config)
    with pytest.raises(ModelFileError, match="verification against PyTorch failed") as refused:
        onnx_export.export_model(model_dir, threads=1)
    assert why in str(refused.value)
    assert not (model_dir / "model.onnx").exists() and not (model_dir / "onnx.json").exists()


def test_a_graph_with_two_gates_swapped_fails_verification(tiny_model_dir, tmp_path, monkeypatch):
    # Input and forget gates exchanged in the hand-built recurrence: every shape and the checker stay happy.
    def swapped(w, cell):
        i, f, g, o = (w[..., k * cell : (k + 1) * cell] for k in range(4))
        return np.concatenate([f, i, o, g], axis=-1)

    monkeypatch.setattr(context_graph, "_reorder_gates", swapped)
    with pytest.raises(ModelFileError, match="over the bound: model.onnx: length 1 ") as failure:
        onnx_export.export_model(tiny_model_dir, tmp_path / "swapped")
    assert "runtime (separate)" in str(failure.value) and "runtime (fused)" in str(failure.value)
    assert not (tmp_path / "swapped" / "model.onnx").exists()


def test_each_case_is_judged_against_float32s_own_error_and_the_figures_are_recorded(tiny_model_dir):
    verification = json.loads((tiny_model_dir / "onnx.json").read_text())["verification"]
    bound = onnx_export.FP32_BOUND
    assert verification["bound"]["rule"] == bound.describe() and verification["bound"]["override"] is None
    for case in verification["cases"]:
        expected = max(bound.floor, bound.float32_factor * case["pytorch_float32_error"])
        expected = max(expected, bound.relative * case["output_scale"])
        assert case["bound"] == pytest.approx(expected)
        assert case["max_abs_error"] <= case["bound"] and case["output_scale"] > 0
    worst_float32 = max(case["pytorch_float32_error"] for case in verification["cases"])
    assert verification["pytorch_float32_max_abs_error"] == worst_float32


def test_float32s_error_is_the_worst_of_several_roundings_of_the_same_weights():
    model = random_bilm("tiny", seed=3, scale=0.5)
    variants = rounding_variants(model)
    assert len(variants) == 1 + FLOAT32_SAMPLES and variants[0] is model
    originals = [w.detach().clone() for w in model.parameters()]
    for variant in variants[1:]:
        moved = 0
        for original, weight in zip(originals, variant.parameters()):
            ulps = torch.abs(weight.detach() - original) / torch.finfo(torch.float32).eps
            assert bool(torch.all(ulps <= 2 * original.abs()))  # each weight moved by about one ulp, no more
            moved += int(torch.count_nonzero(weight.detach() != original))
        assert moved > 0.9 * sum(o.numel() for o in originals if o.count_nonzero())  # nearly every non-zero weight
    sentences = dict(verification_cases())["length 50"]
    expected = torch_layers(copy.deepcopy(model).double(), sentences)
    samples = [max_abs_error(torch_layers(v, sentences), expected) for v in variants]
    assert len(set(samples)) > 1  # different roundings land at different distances
    assert float32_error(variants, sentences, expected) == max(samples)


def test_the_user_can_set_the_bound(tiny_model_dir, tmp_path, capsys):
    # Tighter than float32 can reach: refused, naming the user's bound and the cases over it.
    out = tmp_path / "strict"
    args = ["export", "--model", str(tiny_model_dir), "--out", str(out), "--max-error", "1e-12"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "max abs error 1.0e-12 (set by the user)" in err and "over the bound" in err
    assert not (out / "model.onnx").exists()
    assert main(["export", "--model", str(tiny_model_dir), "--out", str(out), "--max-error", "1e-3"]) == 0
    verification = json.loads((out / "onnx.json").read_text())["verification"]
    assert verification["bound"]["override"] == 1e-3 and {c["bound"] for c in verification["cases"]} == {1e-3}
    assert main(["export", "--model", str(tiny_model_dir), "--max-error", "-1"]) == 2
    assert "--max-error must be a positive number" in capsys.readouterr().err


def test_fp16_export_reports_its_own_error(tiny_model_dir, tmp_path):
    out = tmp_path / "fp16"
    onnx_export.export_model(tiny_model_dir, out, fp16=True)
    meta = json.loads((out / "onnx.json").read_text())
    assert meta["dtype"] == "float16" and meta["verification"]["dtype"] == "float16"
    verification = meta["verification"]
    assert verification["bound"]["rule"] == "per case max(2e-03, 2e-03 x max |output|)"
    # Each case is judged by 4 fp16 unit roundoffs (2^-9) of max(1, its output scale), not a flat 0.1; the error is
    # really fp16's (far above float32's 1e-5) and stays within that bound (measured: about 2^-11 x the scale).
    for case in verification["cases"]:
        assert case["bound"] == pytest.approx(2.0**-9 * max(1.0, case["output_scale"]))
        assert 1e-5 < case["max_abs_error"] <= case["bound"]
    sentences = [["Half", "precision", "."], ["中", "文"]]
    half = Embedder(out, providers=[CPU]).embed_tokens(sentences)
    single = Embedder(tiny_model_dir, providers=[CPU]).embed_tokens(sentences)
    for a, b in zip(half, single):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=2.0**-9 * max(1.0, float(np.abs(b).max())))


def test_cli_exports_into_another_directory(unexported_model, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", "--model", str(unexported_model), "--out", str(out), "--threads", "1"]) == 0
    assert "verification: passed" in capsys.readouterr().out
    assert {"config.json", "model.onnx", "onnx.json"} <= {p.name for p in out.iterdir()}
    assert Embedder(out, providers=[CPU]).embed_tokens([["ok"]])[0].shape == (3, 1, 16)


def test_cli_names_a_missing_model_directory(tmp_path, capsys):
    assert main(["export", "--model", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("elmo export: error:") and "absent" in err


def test_a_checkpoint_stored_in_fp16_exports_half_the_bytes_exactly(tmp_path):
    # Weights that are exact float16 numbers go to model.onnx.data as float16 (widened when the graph loads).
    model = random_bilm("tiny", seed=2, scale=0.3, cell_clip=0.5, proj_clip=0.5)
    save_model(model, tmp_path / "half", fp16=True)
    save_model(model, tmp_path / "full")
    for name in ("half", "full"):
        onnx_export.export_model(tmp_path / name)
    sizes = {name: (tmp_path / name / "model.onnx.data").stat().st_size for name in ("half", "full")}
    assert sizes["half"] < 0.6 * sizes["full"]
    meta = json.loads((tmp_path / "half" / "onnx.json").read_text())
    assert meta["dtype"] == "float32" and meta["verification"]["max_abs_error"] <= 1e-5


def test_exported_files_are_readable_by_every_user_whatever_the_umask(unexported_model):
    """An export made by root under umask 077 is served by another user: its files are 0644, set explicitly."""
    import os
    import stat

    old = os.umask(0o077)
    try:
        onnx_export.export_model(unexported_model, threads=1)
    finally:
        os.umask(old)
    for name in (
        "model.onnx",
        "encoder.onnx",
        "context.onnx",
        "context_fused.onnx",
        "model.onnx.data",
        "probe.bin",
        "onnx.json",
    ):
        assert stat.S_IMODE((unexported_model / name).stat().st_mode) == 0o644, name
