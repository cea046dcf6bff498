from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from elmo.errors import ModelFileError
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import (
    WEIGHTS_FILE,
    load_model,
    load_model_and_vocab,
    load_vocab,
    save_model,
)
from elmo.model.config import tiny
from elmo.text.chars import batch_to_char_ids

VOCAB = ["<S>", "</S>", "<UNK>", "the", "cat", "猫"]


def _model(seed: int = 0) -> BiLM:
    torch.manual_seed(seed)
    return BiLM(tiny(vocab_size=len(VOCAB))).eval()


def _outputs(model: BiLM) -> np.ndarray:
    ids = torch.from_numpy(batch_to_char_ids([["the", "cat"], ["猫"]])).long()
    with torch.no_grad():
        return model(ids)[0].numpy()


def test_round_trip_is_exact_in_float32(tmp_path):
    model = _model()
    save_model(model, tmp_path, VOCAB)
    loaded, vocab = load_model_and_vocab(tmp_path)
    assert vocab == VOCAB
    assert loaded.cfg == model.cfg
    np.testing.assert_array_equal(_outputs(loaded), _outputs(model))


def test_fp16_storage_halves_the_file_and_stays_close(tmp_path):
    model = _model()
    save_model(model, tmp_path / "f32", VOCAB)
    save_model(model, tmp_path / "f16", VOCAB, fp16=True)
    size32 = (tmp_path / "f32" / WEIGHTS_FILE).stat().st_size
    size16 = (tmp_path / "f16" / WEIGHTS_FILE).stat().st_size
    assert size16 < 0.6 * size32
    loaded = load_model(tmp_path / "f16")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    np.testing.assert_allclose(_outputs(loaded), _outputs(model), atol=5e-3)


def test_missing_weights_names_the_file(tmp_path):
    save_model(_model(), tmp_path, VOCAB)
    (tmp_path / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelFileError, match="model.safetensors"):
        load_model(tmp_path)


def test_corrupt_weights_names_the_file(tmp_path):
    save_model(_model(), tmp_path, VOCAB)
    (tmp_path / WEIGHTS_FILE).write_bytes(b"this is not safetensors at all")
    with pytest.raises(ModelFileError, match="model.safetensors"):
        load_model(tmp_path)


def test_missing_config_and_directory(tmp_path):
    with pytest.raises(ModelFileError, match="not found"):
        load_model(tmp_path / "nowhere")
    save_model(_model(), tmp_path, VOCAB)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelFileError, match="config.json"):
        load_model(tmp_path)


def test_config_that_disagrees_with_weights_names_the_tensor(tmp_path):
    save_model(_model(), tmp_path, VOCAB)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["cell_dim"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="shape"):
        load_model(tmp_path)


def test_vocab_size_mismatch(tmp_path):
    with pytest.raises(ModelFileError, match="vocab_size"):
        save_model(_model(), tmp_path, VOCAB[:-1])
    save_model(_model(), tmp_path, VOCAB)
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    with pytest.raises(ModelFileError, match="vocab.txt"):
        load_model_and_vocab(tmp_path)


def test_missing_vocab(tmp_path):
    with pytest.raises(ModelFileError, match="vocab.txt"):
        load_vocab(tmp_path)


def test_shipped_default_model_loads_and_reports_both_languages():
    from tests.conftest import REPO

    directory = REPO / "models" / "default"
    model, vocab = load_model_and_vocab(directory)
    assert model.cfg.vocab_size == len(vocab) and vocab[:3] == ["<S>", "</S>", "<UNK>"]
    metrics = json.loads((directory / "metrics.json").read_text())
    for lang in ("en", "zh"):
        for system in ("bilm", "kn3_baseline"):
            assert {"forward_ppl", "backward_ppl", "avg_ppl", "tokens"} <= set(metrics["test"][lang][system])
    assert sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) < 40 * 2**20
