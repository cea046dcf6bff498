"""``elmo bench`` times only engines that compute the model: each one's vectors are checked first.

Every engine (PyTorch eager, PyTorch sorted, onnxruntime, onnxruntime + token cache) embeds the same sentences and
is held to the export's bound against PyTorch float64 before the clock starts; an engine that computes something
else makes the benchmark refuse (exit 2, nothing written) instead of reporting the speed of a wrong answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import elmo.export.context_graph as context_graph
import elmo.export.onnx_export as onnx_export

from elmo.bench.run import ENGINES, TorchEngine
from elmo.cli import main
from elmo.runtime import TokenVectorCache


def _bench(model: Path, out: Path, *extra: str) -> int:
    argv = [
        "bench",
        "--model",
        str(model),
        "--shapes",
        "--batch-sizes",
        "1",
        "4",
        "--threads",
        "1",
        "--time-budget-s",
        "0",
        "--min-batches",
        "1",
        "--sentences",
        "24",
        "--name",
        "t",
        "--out",
        str(out),
        *extra,
    ]
    return main(argv)


def test_every_engine_is_checked_against_float64_before_it_is_timed(tiny_model_dir: Path, tmp_path: Path):
    assert _bench(tiny_model_dir, tmp_path) == 0
    (model,) = json.loads((tmp_path / "t.json").read_text())["models"]
    for row in model["rows"]:
        agreement = row["agreement"]
        assert agreement["reference"] == "PyTorch float64" and agreement["sentences"] == 16
        assert agreement["bound"] == onnx_export.FP32_BOUND.describe()
        assert set(agreement["max_abs_error"]) == set(ENGINES)
        # Each engine really ran the check (float32 is never exactly float64) and stayed within the bound.
        for engine, error in agreement["max_abs_error"].items():
            assert 0 < error <= agreement["case_bound"], engine
    assert "matched PyTorch float64 within the export bound" in (tmp_path / "t.md").read_text()


def test_an_fp16_graph_is_held_to_the_fp16_bound(tiny_model_dir: Path, tmp_path: Path):
    fp16 = shutil.copytree(tiny_model_dir, tmp_path / "fp16")  # the PyTorch engines need the checkpoint beside
    onnx_export.export_model(fp16, fp16=True, threads=1)
    assert _bench(fp16, tmp_path, "--batch-sizes", "4") == 0
    (model,) = json.loads((tmp_path / "t.json").read_text())["models"]
    (row,) = model["rows"]
    assert row["agreement"]["bound"] == onnx_export.FP16_BOUND.describe()
    # PyTorch stays at float32's error, onnxruntime shows fp16's: the check tells them apart and accepts both.
    errors = row["agreement"]["max_abs_error"]
    assert errors["torch eager"] < 1e-5 < errors["ort"] <= row["agreement"]["case_bound"]


def test_a_graph_that_computes_something_else_is_refused(tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys):
    # A real broken export: the clips dropped from the biLSTM graph, accepted by hand with `--max-error`. The
    # benchmark holds it to the rule for its dtype, not to that override: both onnxruntime engines are refused.
    broken = shutil.copytree(tiny_model_dir, tmp_path / "broken")
    with monkeypatch.context() as patch:
        patch.setattr(context_graph, "_clip", lambda g, x, limit: x)
        onnx_export.export_model(broken, threads=1, max_error=10.0)
    assert _bench(broken, tmp_path / "results") == 2
    err = capsys.readouterr().err
    assert "engines disagree with the model (PyTorch float64) beyond the export bound; not timing them" in err
    assert "over the bound: ort in batches of 1" in err and "over the bound: ort+cache in batches of 1" in err
    assert "over the bound: torch" not in err
    assert not (tmp_path / "results" / "t.json").exists()


def test_a_token_cache_that_confuses_tokens_is_refused(tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys):
    # A plausible cache bug: keys folded to lower case, so "The" is served the vector of "the". Only the cached
    # engine is wrong, and only once the cache is warm: the check must run on the warm cache to see it.
    lookup, store = TokenVectorCache.lookup, TokenVectorCache.store
    monkeypatch.setattr(TokenVectorCache, "lookup", lambda self, tokens: lookup(self, [t.lower() for t in tokens]))
    monkeypatch.setattr(
        TokenVectorCache, "store", lambda self, tokens, vectors: store(self, [t.lower() for t in tokens], vectors)
    )
    assert _bench(tiny_model_dir, tmp_path / "results") == 2
    err = capsys.readouterr().err
    assert "over the bound: ort+cache in batches of" in err and "over the bound: ort in" not in err
    assert not (tmp_path / "results" / "t.json").exists()


def test_the_sorted_torch_engine_returns_vectors_in_the_batch_order(tiny_model_dir: Path):
    # The sorted engine reorders the batch to cut it; what it returns must be in the caller's order again, so the
    # check compares each sentence with its own reference (and an empty sentence stays empty).
    batch = [["a", "much", "longer", "sentence", "here"], [], ["short"], ["mid", "size", "one"]]
    eager, sorted_engine = TorchEngine(tiny_model_dir), TorchEngine(tiny_model_dir, sort=True)
    for a, b, sentence in zip(eager(batch), sorted_engine(batch), batch):
        assert a.shape == b.shape == (3, len(sentence), 16)
        assert abs(a - b).max(initial=0.0) < 1e-5
