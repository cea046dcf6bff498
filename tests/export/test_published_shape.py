"""A user's published-size weights through the whole CPU chain, as the README has them typed:
``import-allennlp → export → embed-file --tokenized --layers all``, on the ELMo-small shape (cell 1024, projection
128, 2048 char filters up to width 7, clips 3) with random weights at a trained model's recurrent scales
(elmo/bench/random_model.py: LSTM kernels N(0, 1.5/√fan_in), recurrent projection N(0, 2/√1024)). Over hundreds of
steps such an LSTM amplifies float32 rounding, so "exact" means: as close to the float64 truth as float32 gets.

The truth is the independent float64 NumPy reference (tests/numpy_reference.py, translated from the hdf5 layout by
tests/importers/test_allennlp.py's own translator); "what float32 gets" is PyTorch float32 on the same sentences,
the worst of five roundings of the weights (elmo.export.verify.float32_error).
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from elmo.export.onnx_export import FP32_BOUND
from elmo.export.verify import float32_error, rounding_variants

from elmo.bench.random_model import write_bilm_tf_files
from elmo.cli import main
from elmo.model.checkpoint import load_model
from tests.importers.test_allennlp import reference_config, reference_weights
from tests.numpy_reference import elmo_forward


def sentences() -> list[list[str]]:
    rng = np.random.default_rng(3)
    words = ["the", "bank", "river", "money", "苹果", "公司", "naïve", "😀", "x" * 60, ",", "."]
    return [
        ["The", "cat", "sat", "."],
        [str(w) for w in rng.choice(words, size=400)],  # longer than the export's own 200-token cases
        ["我", "买", "了", "一台", "苹果", "电脑", "。"],
        [str(w) for w in rng.choice(words, size=57)],
        ["a"],
    ]


@pytest.fixture(scope="module")
def small_chain(tmp_path_factory):
    """The three commands on random ELMo-small-shape bilm-tf files; -> (options, hdf5 datasets, model dir, out)."""
    work = tmp_path_factory.mktemp("published_small")
    options_path, weights_path = write_bilm_tf_files(work / "src", "small", seed=0)
    model = work / "model"
    text = work / "corpus.txt"
    text.write_text("".join(" ".join(s) + "\n" for s in sentences()))
    out = work / "out.hdf5"
    commands = [
        ["import-allennlp", "--options", str(options_path), "--weights", str(weights_path), "--out", str(model)],
        ["export", "--model", str(model), "--threads", "2"],
        ["embed-file", str(text), str(out), "--model", str(model), "--tokenized", "--layers", "all"],
    ]
    for command in commands:
        assert main(command) == 0, f"elmo {' '.join(command)} failed"
    options = json.loads(options_path.read_text())
    with h5py.File(weights_path, "r") as handle:
        datasets = {name: handle[name][()] for name in _dataset_names(handle)}
    return options, datasets, model, out


def _dataset_names(handle: h5py.File) -> list[str]:
    names: list[str] = []
    handle.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
    return names


def test_the_export_of_published_size_weights_is_verified_up_to_400_tokens(small_chain):
    _, _, model, _ = small_chain
    verification = json.loads((model / "onnx.json").read_text())["verification"]
    assert verification["passed"] and verification["dtype"] == "float32"
    long = [case for case in verification["cases"] if case["name"].endswith("length 400")]
    assert len(long) == 4  # model.onnx and the runtime's three layouts (separate, fused, in_step)
    assert all(case["max_abs_error"] <= case["bound"] for case in long)


def test_embed_file_output_is_as_close_to_float64_as_float32_gets(small_chain):
    options, datasets, model, out = small_chain
    weights, cfg = reference_weights(options, datasets), reference_config(options)
    variants = rounding_variants(load_model(model).eval())
    torch.set_num_threads(2)
    with h5py.File(out, "r") as handle:
        assert len(handle) == len(sentences()) + 1  # the lines + sentence_to_index
        for index, sentence in enumerate(sentences()):
            got = handle[str(index)][()]
            truth = elmo_forward(weights, sentence, cfg)  # float64, shares no code with the product
            assert got.shape == truth.shape == (3, len(sentence), 256)
            bound = FP32_BOUND.for_case(float32_error(variants, [sentence], [truth]), float(np.abs(truth).max()))
            error = float(np.abs(got - truth).max())
            assert error <= bound, f"line {index} ({len(sentence)} tokens): {error:.2e} > {bound:.2e}"
