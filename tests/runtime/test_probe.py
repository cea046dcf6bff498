"""The load-time check (elmo.runtime.probe): the export's probe is run by every Embedder that loads the model and a
model whose answers on this host miss the export's bar is refused, with one line naming the CPU, figures and bar."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from elmo.export.onnx_export import initializers
from elmo.export.probe import PROBE_SENTENCES, write_probe
from elmo.export.verify import ErrorBound
from onnx import numpy_helper

from elmo.errors import ModelFileError
from elmo.model.checkpoint import load_model
from elmo.runtime import CPU, Embedder
from elmo.runtime.host import cpu_facts
from elmo.runtime.probe import COSINE, MAX_ABS, PROBE_FILE, Probe, judge, read_probe
from elmo.text.chars import load_char_scheme
from tests.conftest import REPO


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


def _meta(directory: Path) -> dict:
    return json.loads((directory / "onnx.json").read_text())


def _rewrite_probe_record(directory: Path, entry: dict) -> None:
    """onnx.json -> probe replaced by ``entry``: a consistent record (size, sha256), so only the numbers can tell."""
    meta = _meta(directory)
    meta["probe"] = {**entry, "at_export": meta["probe"].get("at_export")}
    (directory / "onnx.json").write_text(json.dumps(meta))


def probe_from_other_weights(directory: Path) -> None:
    """The probe the export would have written for the same model with one recurrent weight changed by 0.05."""
    model = load_model(directory).float().eval()
    with torch.no_grad():
        weight = dict(model.named_parameters())["forward_layers.0.state_linearity.weight"]
        weight[0, 0] += 0.05
    bound = ErrorBound(**{k: v for k, v in _meta(directory)["verification"]["bound"].items() if k != "rule"})
    _rewrite_probe_record(directory, write_probe(directory, model, load_char_scheme(directory), bound))


def edit_a_graph_after_export(directory: Path) -> None:
    """One inline weight of context.onnx (the CPU layout's biLSTM, inside a Scan body or not) negated in place; the
    shared weights file (whose sha256 onnx.json records) is left as it was."""
    path = directory / "context.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    tensors = initializers(graph.graph)  # Scan bodies included
    inline = [t for t in tensors if t.data_type == onnx.TensorProto.FLOAT and not t.external_data]
    target = max(inline, key=lambda t: numpy_helper.to_array(t).size)  # a bias or small matrix, not a scalar
    target.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(target), target.name))
    onnx.save(graph, str(path))


def test_every_export_stores_a_probe_that_passes_here(tiny_model_dir):
    meta = _meta(tiny_model_dir)
    probe = read_probe(tiny_model_dir, meta)
    assert probe.kind == MAX_ABS and probe.sentences == PROBE_SENTENCES
    assert probe.reference.shape == (3, sum(map(len, PROBE_SENTENCES)), 16)
    assert meta["probe"]["at_export"]["passed"] is True
    assert cpu_facts()["model"] in meta["probe"]["at_export"]["host"]
    result = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1).checked
    assert result is not None and result.passed and float(result.figures.split()[3]) <= probe.bar["max_abs_error"]


def test_the_genuine_model_logs_one_passing_line(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="elmo.runtime"):
        Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    lines = [r.getMessage() for r in caplog.records if "load-time check" in r.getMessage()]
    assert len(lines) == 1
    assert cpu_facts()["model"] in lines[0] and "passed: max abs error" in lines[0] and "bar: <=" in lines[0]


@pytest.mark.parametrize("tamper", [probe_from_other_weights, edit_a_graph_after_export])
def test_a_model_whose_probe_does_not_match_is_refused(model_copy, tamper):
    tamper(model_copy)
    with pytest.raises(ModelFileError) as refused:
        Embedder(model_copy, providers=[CPU], intra_op_threads=1)
    message = str(refused.value)
    assert "load-time check of" in message and "FAILED: max abs error" in message
    assert cpu_facts()["model"] in message and "bar: <=" in message and "not serving it" in message


def test_the_check_can_wait_for_the_warm_up(model_copy):
    edit_a_graph_after_export(model_copy)
    runtime = Embedder(model_copy, providers=[CPU], intra_op_threads=1, check_on_load=False)
    assert runtime.checked is None
    with pytest.raises(ModelFileError, match="FAILED"):
        runtime.warmup()


def test_an_export_without_a_probe_is_refused_with_the_fix(model_copy):
    meta = _meta(model_copy)
    del meta["probe"]
    (model_copy / "onnx.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFileError, match=r"no load-time probe .* re-run `elmo export --model"):
        Embedder(model_copy, providers=[CPU])


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: (d / PROBE_FILE).write_bytes(b"\0" * (d / PROBE_FILE).stat().st_size), "sha256 differs"),
        (lambda d: (d / PROBE_FILE).write_bytes(b"\0" * 8), "missing or not"),
        (lambda d: _rewrite_probe_record(d, {**_meta(d)["probe"], "file": "../outside.bin"}), "plain file name"),
        (lambda d: _rewrite_probe_record(d, {**_meta(d)["probe"], "shape": [3, 2, 16]}), "do not match"),
        (lambda d: _rewrite_probe_record(d, {**_meta(d)["probe"], "bytes": 10**12}), "declares"),
        (lambda d: _rewrite_probe_record(d, {"file": PROBE_FILE}), "malformed"),
        (lambda d: _rewrite_probe_record(d, {**_meta(d)["probe"], "bar": {"mean": 0.9}}), "needs finite max_abs_error"),
    ],
)
def test_a_damaged_probe_is_named_before_anything_runs(model_copy, edit, match):
    edit(model_copy)
    with pytest.raises(ModelFileError, match=match):
        Embedder(model_copy, providers=[CPU])


def _probe(kind: str, reference: np.ndarray, bar: dict) -> Probe:
    return Probe([["a", "b"], ["c"]], reference, kind, bar, "test")


def test_judging_by_max_abs_and_by_cosine():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(3, 3, 4)).astype(np.float32)
    exact = [reference[:, :2], reference[:, 2:]]
    near = [x + np.float32(1e-6) for x in exact]
    far = [x + np.float32(1e-3) for x in exact]
    bound = _probe(MAX_ABS, reference, {"max_abs_error": 1e-5})
    assert judge(bound, near).passed and not judge(bound, far).passed
    cosine = _probe(COSINE, reference, {"mean": 0.999, "min": 0.99})
    assert judge(cosine, [2 * x for x in exact]).passed  # a scale is no change of direction
    assert not judge(cosine, [exact[0], -exact[1]]).passed
    wrong_shape = judge(bound, [exact[0]])
    assert not wrong_shape.passed and "output shapes" in wrong_shape.figures


def test_serve_refuses_the_model_with_one_line_naming_cpu_figures_and_bar(model_copy):
    edit_a_graph_after_export(model_copy)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elmo.cli",
            "serve",
            "--model",
            str(model_copy),
            "--port",
            "0",
            "--http-port",
            "off",
            "--threads",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "load-time check" in line]
    assert len(lines) == 1, proc.stderr
    assert cpu_facts()["model"] in lines[0] and "FAILED: max abs error" in lines[0] and "bar: <=" in lines[0]
    assert "Traceback" not in proc.stderr


def test_the_probe_file_is_what_onnx_json_says(tiny_model_dir):
    entry = _meta(tiny_model_dir)["probe"]
    raw = (tiny_model_dir / entry["file"]).read_bytes()
    assert len(raw) == entry["bytes"] == int(np.prod(entry["shape"])) * 4
    assert hashlib.sha256(raw).hexdigest() == entry["sha256"]
