"""``elmo export --int8`` (export/quantize.py): int8 weights inside the recurrence, judged by cosine to float32."""

import json
import shutil
import subprocess
import sys

import elmo.export.onnx_export as onnx_export
import numpy as np
import onnx
import pytest
from elmo.export.quantize import (
    DEFAULT_SCHEME,
    INT8_MEAN_COSINE,
    SCHEMES,
    compare_cosine,
    count_ops,
    integer_weights,
    quantize_graph,
)
from onnx import numpy_helper

from elmo.cli import main
from elmo.errors import ModelFileError
from elmo.runtime import CPU, Embedder
from elmo.runtime.probe import COSINE, token_cosines

SENTENCES = [["The", "cat", "sat", "on", "the", "mat", "."], ["苹", "果", "很", "好", "吃"], ["a"], ["naïve", "😀"]]


@pytest.fixture(scope="module")
def int8_model(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8") / "model"
    onnx_export.export_model(tiny_model_dir, out, int8=True, threads=1, heldout=[["held", "out", "text"]])
    return out


def test_int8_export_quantizes_the_recurrence_inside_each_scan(int8_model):
    graph = onnx.load(str(int8_model / "context.onnx"))
    scans = [node for node in graph.graph.node if node.op_type == "Scan"]
    assert scans
    for scan in scans:  # the recurrent and projection matrices of every step: int8 inside the body
        body_ops = count_ops(scan.attribute[0].g)
        assert body_ops.get("MatMulInteger", 0) == 2 and "MatMul" not in body_ops, body_ops
        # u8 weights (export/quantize.py SCHEMES: u8 x s8 saturates on AVX2 without VNNI)
        assert any(t.data_type == onnx.TensorProto.UINT8 for t in scan.attribute[0].g.initializer)
    assert count_ops(graph.graph).get("Gemm", 0) == 0  # the hoisted input projections too
    assert count_ops(onnx.load(str(int8_model / "encoder.onnx")).graph).get("MatMulInteger", 0) == 0  # char-CNN


def test_int8_export_is_judged_by_cosine_and_records_it(int8_model):
    meta = json.loads((int8_model / "onnx.json").read_text())
    assert meta["dtype"] == "int8" and meta["quantization"]["scheme"] == DEFAULT_SCHEME == "u8u8"
    assert meta["quantization"]["weights"].startswith("uint8")
    verification = meta["verification"]
    assert verification["passed"] is True and verification["reference"] == "float32 graphs"
    assert min(verification["mean"]) >= INT8_MEAN_COSINE and verification["tokens"] > 1000
    assert "int8 vs float32 per-token cosine" in verification["summary"]


def test_int8_model_serves_like_any_model(int8_model, tiny_model_dir):
    int8 = Embedder(int8_model, providers=[CPU], intra_op_threads=1)
    float32 = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    got, expected = int8.embed_tokens(SENTENCES), float32.embed_tokens(SENTENCES)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == np.float32
        np.testing.assert_array_equal(g[0], e[0])  # layer 0 is the float32 char-CNN in both
        assert not np.array_equal(g[1:], e[1:])  # the biLSTM layers really run in int8
    report = compare_cosine(SENTENCES, int8.embed_tokens, float32.embed_tokens)
    assert report.passed and min(report.mean) >= INT8_MEAN_COSINE


def test_an_int8_export_also_writes_its_products_as_u8_x_s8(int8_model):
    meta = json.loads((int8_model / "onnx.json").read_text())
    assert meta["graphs"]["context_s8"] == "context_s8.onnx"
    unsigned, signed = (
        {t.name: numpy_helper.to_array(t) for t in integer_weights(onnx.load(str(int8_model / name)).graph)}
        for name in ("context.onnx", "context_s8.onnx")
    )
    assert unsigned.keys() == signed.keys() and len(unsigned) >= 8  # weights and zero points, both directions
    for name, weights in unsigned.items():
        assert weights.dtype == np.uint8 and signed[name].dtype == np.int8
        np.testing.assert_array_equal(signed[name].astype(np.int16), weights.astype(np.int16) - 128)


def test_the_runtime_multiplies_u8_x_s8_only_where_the_cpu_accumulates_in_int32(int8_model, tiny_model_dir):
    from elmo.runtime.host import int8_accumulates_in_int32

    auto = Embedder(int8_model, providers=[CPU], intra_op_threads=1)
    assert auto.int8_products == ("u8 x s8" if int8_accumulates_in_int32() else "u8 x u8")
    assert auto._paths["context"].name == ("context_s8.onnx" if int8_accumulates_in_int32() else "context.onnx")
    unsigned = Embedder(int8_model, providers=[CPU], intra_op_threads=1, signed_int8=False)
    assert unsigned.int8_products == "u8 x u8" and unsigned._paths["context"].name == "context.onnx"
    if int8_accumulates_in_int32():  # the same integer products: the same vectors, bit for bit
        signed = Embedder(int8_model, providers=[CPU], intra_op_threads=1, signed_int8=True)
        for got, expected in zip(signed.embed_tokens(SENTENCES), unsigned.embed_tokens(SENTENCES)):
            np.testing.assert_array_equal(got, expected)
    assert Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1).int8_products is None  # float32
    with pytest.raises(ModelFileError, match="signed_int8 was demanded but this export has no context_s8.onnx"):
        Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, signed_int8=True)


def flip_8bit_weights(graph: onnx.ModelProto) -> onnx.ModelProto:
    """Every 8-bit weight inside a Scan body mirrored (int8: negated; uint8: 255 - w, about its zero point): the
    graph runs, the shapes hold, only the cosine to float32 can tell."""
    for node in graph.graph.node:
        for attribute in node.attribute:
            if attribute.type != onnx.AttributeProto.GRAPH:
                continue
            for tensor in attribute.g.initializer:
                if tensor.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) and not tensor.external_data:
                    array = numpy_helper.to_array(tensor).astype(np.int16)
                    if tensor.data_type == onnx.TensorProto.INT8:
                        mirrored = np.clip(-array, -127, 127).astype(np.int8)
                    else:
                        mirrored = (255 - array).astype(np.uint8)
                    tensor.CopyFrom(numpy_helper.from_array(mirrored, tensor.name))
    return graph


def test_an_int8_export_writes_no_in_step_graph_and_removes_a_float_one(tiny_model_dir, tmp_path):
    # quantization cannot read the in-step graph's joined step weights; a float export's, left behind, would point
    # into the weight file the int8 export replaced
    exported = shutil.copytree(tiny_model_dir, tmp_path / "model")
    assert (exported / "context_in_step.onnx").is_file()
    onnx_export.export_model(exported, int8=True, threads=1)
    assert not (exported / "context_in_step.onnx").exists()
    assert "context_in_step" not in json.loads((exported / "onnx.json").read_text())["graphs"]
    assert Embedder(exported, providers=[CPU], intra_op_threads=1, wide_batches=True).context_layout == "separate"


def test_a_broken_int8_graph_fails_and_replaces_nothing(tiny_model_dir, tmp_path, monkeypatch):
    real = onnx_export.quantize_graph

    def flipped(graph, scheme):
        return flip_8bit_weights(real(graph, scheme))

    exported = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    monkeypatch.setattr(onnx_export, "quantize_graph", flipped)
    with pytest.raises(ModelFileError, match="verification against float32 failed: FAILED: int8 vs float32"):
        onnx_export.export_model(exported, int8=True, threads=1)
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before


def test_an_int8_export_stores_a_cosine_probe_and_an_edited_int8_graph_is_refused_at_load(int8_model, tmp_path):
    meta = json.loads((int8_model / "onnx.json").read_text())
    assert meta["probe"]["kind"] == COSINE and meta["probe"]["bar"] == {"mean": 0.999, "min": 0.99}
    assert meta["probe"]["at_export"]["passed"] is True
    genuine = Embedder(int8_model, providers=[CPU], intra_op_threads=1)
    assert genuine.checked.passed
    edited = shutil.copytree(int8_model, tmp_path / "edited")
    loaded = edited / genuine._paths["context"].name  # context_s8.onnx where this CPU accumulates in int32
    onnx.save(flip_8bit_weights(onnx.load(str(loaded), load_external_data=False)), str(loaded))
    with pytest.raises(ModelFileError, match=r"load-time check .* FAILED: per-token cosine .* bar: mean >= 0.999"):
        Embedder(edited, providers=[CPU], intra_op_threads=1)


# Exports the tiny model with both schemes in a process that sees an AVX2 CPU (bench/kit/isa.py), then loads the u8
# one there: what each verification and the load-time check say, as JSON.
ON_AVX2 = """
import json, sys
from pathlib import Path
import elmo.export.onnx_export as onnx_export
from elmo.errors import ModelFileError
from elmo.runtime import CPU, Embedder

source, out, verdicts = Path(sys.argv[1]), Path(sys.argv[2]), {}
for scheme in ("u8s8", "u8u8"):
    try:
        onnx_export.export_model(source, out / scheme, int8=True, threads=1, quantization=scheme)
        verdicts[scheme] = "passed"
    except ModelFileError as exc:
        verdicts[scheme] = str(exc)
embedder = Embedder(out / "u8u8", providers=[CPU], intra_op_threads=1)
verdicts["load"], verdicts["products"] = embedder.checked.line(embedder.model_dir), embedder.int8_products
print(json.dumps(verdicts))
"""


def test_u8_weights_pass_on_avx2_kernels_where_s8_weights_saturate(tiny_model_dir, tmp_path):
    """export/quantize.py's reason for u8 weights, on onnxruntime's AVX2 kernels (no VNNI) whatever this CPU has:
    u8 x s8 products saturate there and the s8 export fails its own gate; the u8 export passes it and its load-time
    check there, with its u8 x u8 graph. tests/test_bench_isa.py checks that the masked process really gets those
    kernels."""
    from bench.kit.isa import MaskUnavailable, avx2_env

    try:
        env = avx2_env()
    except MaskUnavailable as exc:
        pytest.skip(f"this machine cannot hide CPU features from a process: {exc}")
    run = subprocess.run(
        [sys.executable, "-c", ON_AVX2, str(tiny_model_dir), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = json.loads(run.stdout.splitlines()[-1])
    assert "verification against float32 failed: FAILED: int8 vs float32" in verdicts["u8s8"]
    assert verdicts["u8u8"] == "passed" and ": passed: per-token cosine" in verdicts["load"]
    assert "(no AVX-512, AVX-512 VNNI, AVX-VNNI, AMX-INT8" in verdicts["load"]  # the line names what it ran on
    assert verdicts["products"] == "u8 x u8"  # not context_s8.onnx, which would saturate here
    assert Embedder(tmp_path / "u8u8", providers=[CPU], intra_op_threads=1).checked.passed  # and here, unmasked


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_each_scheme_quantizes_to_its_weight_type(tiny_model_dir, scheme):
    from elmo.export.context_graph import build_context_graph

    from elmo.model.checkpoint import load_model

    model = load_model(tiny_model_dir).float()
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    graph = quantize_graph(build_context_graph(state, model.cfg), scheme)
    types = {
        t.data_type
        for node in graph.graph.node
        for a in node.attribute
        if a.type == onnx.AttributeProto.GRAPH
        for t in a.g.initializer
        if t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
    }
    assert types == {onnx.TensorProto.UINT8 if SCHEMES[scheme]["weight_type"] == "QUInt8" else onnx.TensorProto.INT8}


def test_token_cosines_per_layer():
    a = np.array([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [2.0, 0.0]]])  # (L+1=2, n=2, D=2)
    b = np.array([[[2.0, 0.0], [0.0, 0.0]], [[1.0, -1.0], [0.0, 3.0]]])
    np.testing.assert_allclose(token_cosines([a], [b]), [[1.0, 1.0], [0.0, 0.0]])  # zero vs zero counts as equal
    assert token_cosines([a, a[:, :0]], [b, b[:, :0]]).shape == (2, 2)  # empty sentences add nothing


@pytest.mark.parametrize(
    "argv, message",
    [(["--int8", "--fp16"], "--int8 goes with neither"), (["--heldout", "x.txt"], "--heldout goes with --int8")],
)
def test_int8_options_that_do_not_go_together_are_refused(tiny_model_dir, tmp_path, capsys, argv, message):
    assert main(["export", "--model", str(tiny_model_dir), "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
