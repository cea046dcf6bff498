"""Scalar mix: numpy apply (serving) vs the torch ScalarMix, the task store, the AllenNLP-style Elmo module."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from elmo.errors import DataError, InputError, ModelFileError
from elmo.mix.modules import (
    Elmo,
    FeatureData,
    ScalarMix,
    TaskModel,
    TrainConfig,
    normalize_per_sentence,
    one_hot_logits,
    pool_torch,
    predict,
    segment_pool,
    to_task,
    train_task_model,
)
from elmo.model.bilm import BiLM
from elmo.model.config import tiny
from elmo.runtime.tasks import (
    Task,
    TaskStore,
    UnknownTaskError,
    apply_task,
    list_tasks,
    mix_layers,
    normalize_layers,
    pool,
    save_task,
    softmax,
)

torch.set_num_threads(1)


def _sentences(rng: np.random.Generator, lengths=(5, 1, 3), n_layers=3, dim=8) -> list[np.ndarray]:
    return [
        rng.normal(size=(n_layers, n, dim)).astype(np.float32) * (1 + np.arange(n_layers))[:, None, None]
        for n in lengths
    ]


def _padded(sentences: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sentence (L, n, D) -> padded (B, L, T, D) filled with a junk value (so masking is exercised) + mask."""
    n_layers, dim, width = sentences[0].shape[0], sentences[0].shape[2], max(s.shape[1] for s in sentences)
    out = torch.full((len(sentences), n_layers, width, dim), 7.0)
    mask = torch.zeros(len(sentences), width, dtype=torch.bool)
    for b, s in enumerate(sentences):
        out[b, :, : s.shape[1]] = torch.from_numpy(s)
        mask[b, : s.shape[1]] = True
    return out, mask


# -- the formula -------------------------------------------------------------------------------------------------
def test_equal_weights_and_gamma_give_the_scaled_average():
    layers = _sentences(np.random.default_rng(0))[0]
    np.testing.assert_allclose(mix_layers(layers, [0.0, 0.0, 0.0], 2.0), 2.0 * layers.mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(softmax([1.0, 2.0, 3.0]).sum(), 1.0)
    np.testing.assert_allclose(mix_layers(layers, one_hot_logits(3, 2)), layers[2], atol=1e-6)


def test_numpy_layer_norm_is_per_layer_zero_mean_unit_variance():
    layers = _sentences(np.random.default_rng(1))[0] + 5.0
    normed = normalize_layers(layers)
    np.testing.assert_allclose(normed.mean(axis=(1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(normed.std(axis=(1, 2)), 1.0, atol=1e-4)
    assert normalize_layers(np.zeros((3, 0, 4), np.float32)).shape == (3, 0, 4)


def test_scalar_mix_initialisation_and_penalty():
    mix = ScalarMix(3, l2=0.001)
    assert torch.equal(mix.weights.data, torch.zeros(3)) and mix.gamma.item() == 1.0
    assert mix.normalized_weights() == pytest.approx([1 / 3] * 3)
    assert float(mix.penalty()) == 0.0
    with torch.no_grad():
        mix.weights.copy_(torch.tensor([1.0, -2.0, 3.0]))
    assert float(mix.penalty()) == pytest.approx(0.001 * 14.0)


@pytest.mark.parametrize("layer_norm", [False, True])
def test_torch_scalar_mix_on_a_padded_batch_equals_numpy_per_sentence(layer_norm):
    rng = np.random.default_rng(2)
    sentences = _sentences(rng)
    weights, gamma = [0.3, -1.2, 0.8], 1.7
    mix = ScalarMix(3, layer_norm=layer_norm, initial=weights, gamma=gamma)
    padded, mask = _padded(sentences)
    with torch.no_grad():
        out = mix(padded, mask).numpy()
    for b, s in enumerate(sentences):
        expected = mix_layers(s, weights, gamma, layer_norm)
        np.testing.assert_allclose(out[b, : s.shape[1]], expected, atol=1e-5)
        assert np.all(out[b, s.shape[1] :] == 0.0)  # padding is zero, not the junk value
    # A list of L tensors (AllenNLP's calling convention) gives the same thing.
    with torch.no_grad():
        listed = mix([padded[:, j] for j in range(3)], mask).numpy()
    np.testing.assert_allclose(listed, out, atol=1e-6)


def test_batch_scope_layer_norm_uses_all_unmasked_elements_of_the_batch():
    sentences = _sentences(np.random.default_rng(3))
    padded, mask = _padded(sentences)
    mix = ScalarMix(3, layer_norm=True, norm_scope="batch", initial=one_hot_logits(3, 1))
    with torch.no_grad():
        out = mix(padded, mask).numpy()
    flat = np.concatenate([s[1] for s in sentences])  # layer 1, every real token of the batch
    expected = (flat - flat.mean()) / np.sqrt(flat.var() + 1e-12)
    got = np.concatenate([out[b, : s.shape[1]] for b, s in enumerate(sentences)])
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_scalar_mix_learns_to_pick_the_informative_layer():
    """Layer 2 carries the signal, layers 0/1 are noise: the softmax weight of layer 2 must grow."""
    torch.manual_seed(0)
    x = torch.randn(64, 3, 6, 4)
    target = x[:, 2].sum(-1)
    mix = ScalarMix(3)
    optimizer = torch.optim.Adam(mix.parameters(), lr=0.05)
    for _ in range(150):
        loss = ((mix(x).sum(-1) - target) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert mix.normalized_weights()[2] > 0.9


def test_pooling_torch_matches_numpy():
    sentences = _sentences(np.random.default_rng(4))
    mixed = [mix_layers(s, [0.0, 0.0, 0.0]) for s in sentences]
    padded, mask = _padded([m[None] for m in mixed])
    for pooling in ("mean", "max", "mean+max"):
        got = pool_torch(padded[:, 0], mask, pooling).numpy()
        np.testing.assert_allclose(got, np.stack([pool(m, pooling) for m in mixed]), atol=1e-6)
    assert pool(np.zeros((0, 4), np.float32), "mean+max").shape == (8,)


# -- tasks on disk -----------------------------------------------------------------------------------------------
def _trained_task(tmp_path, kind: str, layer_norm: bool = True):
    """A TaskModel trained for a few steps on random features, stored under tmp_path; returns the raw features."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 6, size=20)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    layers = (rng.normal(size=(3, int(offsets[-1]), 8)) * [[[1.0]], [[3.0]], [[0.2]]] + 0.5).astype(np.float32)
    n_targets = int(offsets[-1]) if kind == "tagging" else len(lengths)
    data = FeatureData(layers, offsets, rng.integers(0, 3, size=n_targets), kind, layer_norm=layer_norm)
    cfg = TrainConfig(epochs=2, hidden=5, layer_norm=layer_norm)
    model, history = train_task_model(kind, data, data, 3, cfg, lambda predicted: 0.0)
    task, head = to_task(model, f"t_{kind}", ["a", "b", "c"], metrics={"metric": "accuracy"})
    save_task(tmp_path, task, head)
    return model, data, history, layers, offsets


@pytest.mark.parametrize("kind", ["tagging", "classification"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_stored_task_reproduces_the_torch_model(tmp_path, kind, layer_norm):
    """The numpy task (normalising and mixing raw layers itself) == the torch model on its (pre-normalised)
    training features: same mix, same logits, same predictions."""
    model, data, history, raw, offsets = _trained_task(tmp_path, kind, layer_norm)
    assert history["epochs"] and history["best_epoch"] >= 1
    task = TaskStore(tmp_path).get(f"t_{kind}")
    assert task.kind == kind and task.labels == ["a", "b", "c"] and task.layer_norm == layer_norm
    assert task.head_layers == [[8 * (2 if kind == "classification" else 1), 5], [5, 3]]
    predicted = predict(model, data)
    for i in range(len(data)):
        sentence = raw[:, offsets[i] : offsets[i + 1]]
        layers, segments, n_sentences, _ = data.batch([i])
        with torch.no_grad():
            torch_mix = model.mix(layers.unsqueeze(0))[0].numpy()
            torch_logits = model(layers, segments, n_sentences).numpy()
        np.testing.assert_allclose(apply_task(sentence, task), torch_mix, atol=2e-3)  # features cached as float16
        np.testing.assert_allclose(task.logits(sentence), torch_logits, atol=1e-2)
        top2 = np.sort(torch_logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2e-2  # near-ties may flip with float16 features: compare the rest
        numpy_labels = np.array([task.labels.index(p) for p in task.predict(sentence)])
        np.testing.assert_array_equal(numpy_labels[clear], predicted[i][clear])


def test_feature_data_layer_norm_matches_numpy():
    rng = np.random.default_rng(6)
    offsets = np.array([0, 4, 5, 12])
    layers = (rng.normal(size=(3, 12, 8)) * 4 + 2).astype(np.float32)
    normalized = normalize_per_sentence(layers, offsets)
    for i in range(3):
        expected = normalize_layers(layers[:, offsets[i] : offsets[i + 1]])
        np.testing.assert_allclose(normalized[:, offsets[i] : offsets[i + 1]], expected, atol=1e-5)
    with pytest.raises(DataError, match="empty training set"):
        FeatureData(layers[:, :0], np.array([0]), np.array([], dtype=np.int64), "tagging")
    with pytest.raises(DataError, match="12 targets for 3 sentences"):
        FeatureData(layers, offsets, np.zeros(12, dtype=np.int64), "classification")


def test_segment_pool_matches_numpy():
    rng = np.random.default_rng(7)
    lengths = [3, 1, 4]
    x = rng.normal(size=(8, 5)).astype(np.float32)
    segments = torch.from_numpy(np.repeat(np.arange(3), lengths))
    parts = np.split(x, np.cumsum(lengths)[:-1])
    for pooling in ("mean", "max", "mean+max"):
        got = segment_pool(torch.from_numpy(x), segments, 3, pooling).numpy()
        np.testing.assert_allclose(got, np.stack([pool(p, pooling) for p in parts]), atol=1e-6)


def test_task_json_is_readable_and_has_the_mix(tmp_path):
    _trained_task(tmp_path, "tagging")
    data = json.loads((tmp_path / "tasks" / "t_tagging" / "task.json").read_text())
    assert data["format"] == 1 and len(data["mix"]["weights"]) == 3
    assert sum(data["mix"]["softmax"]) == pytest.approx(1.0)
    assert list_tasks(tmp_path) == ["t_tagging"]


def test_save_replaces_an_existing_task_atomically(tmp_path):
    task = Task("pos", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0)
    save_task(tmp_path, task)
    store = TaskStore(tmp_path)
    assert store.get("pos").gamma == 1.0
    save_task(tmp_path, Task("pos", "tagging", 3, 4, [0.0, 1.0, 0.0], 2.0))
    assert store.get("pos").gamma == 2.0  # re-read after the change
    assert sorted(p.name for p in (tmp_path / "tasks").iterdir()) == ["pos"]  # no staging leftovers


def test_unknown_task_lists_the_available_ones(tmp_path):
    save_task(tmp_path, Task("pos", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0))
    save_task(tmp_path, Task("ner", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0))
    with pytest.raises(UnknownTaskError, match=r"unknown task 'sentiment'.*available tasks: ner, pos"):
        TaskStore(tmp_path).get("sentiment")
    assert isinstance(UnknownTaskError("x"), InputError)
    with pytest.raises(UnknownTaskError, match="available tasks: none"):
        TaskStore(tmp_path / "elsewhere").get("pos")
    with pytest.raises(UnknownTaskError):
        TaskStore(tmp_path).get("../tasks/pos")


def test_bad_names_and_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="task name"):
        save_task(tmp_path, Task("../evil", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0))
    save_task(tmp_path, Task("pos", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0))
    path = tmp_path / "tasks" / "pos" / "task.json"
    path.write_text("{not json")
    with pytest.raises(ModelFileError, match="task.json: not valid JSON"):
        TaskStore(tmp_path).get("pos")
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "name": "pos",
                "kind": "tagging",
                "n_layers": 3,
                "dim": 4,
                "mix": {"weights": [0.0, 0.0], "gamma": 1.0},
            }
        )
    )
    with pytest.raises(ModelFileError, match="mix has 2 weights for 3 layers"):
        TaskStore(tmp_path).get("pos")


def test_shape_checks(tmp_path):
    save_task(tmp_path, Task("pos", "tagging", 3, 4, [0.0, 0.0, 0.0], 1.0))
    with pytest.raises(ModelFileError, match="expects dim 4 but the model outputs 16"):
        TaskStore(tmp_path, n_layers=3, dim=16).get("pos")
    task = TaskStore(tmp_path).get("pos")
    with pytest.raises(InputError, match=r"mixes layers of shape \(3, n_tokens, 4\)"):
        task.apply(np.zeros((2, 5, 4), np.float32))
    assert task.apply(np.zeros((3, 0, 4), np.float32)).shape == (0, 4)


def test_serving_half_imports_no_torch():
    code = "import sys, elmo.runtime.tasks, elmo.features; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the AllenNLP-style module -------------------------------------------------------------------------------------
def test_elmo_module_k_representations_with_mask():
    torch.manual_seed(0)
    bilm = BiLM(tiny()).eval()
    elmo = Elmo(bilm, num_output_representations=2, dropout=0.0)
    sentences = [["The", "cat", "sat"], ["苹", "果"]]
    out = elmo(sentences)
    assert len(out.representations) == 2
    assert out.representations[0].shape == (2, 3, 16) and out.mask.tolist() == [[True] * 3, [True, True, False]]
    layers, mask = bilm(Elmo.batch_to_ids(sentences))
    # Fresh mixes are the plain average of the layers.
    torch.testing.assert_close(out.representations[1], layers.mean(dim=1) * mask[..., None], atol=1e-6, rtol=0)
    assert not any(p.requires_grad for p in bilm.parameters())
    assert all(p.requires_grad for p in elmo.mixes.parameters())
    # Built on features only: same numbers from precomputed layers.
    on_features = Elmo(None, 2, dropout=0.0, n_layers=3)
    on_features.load_state_dict({k: v for k, v in elmo.state_dict().items() if k.startswith("mixes.")})
    torch.testing.assert_close(on_features.mix_layers(layers, mask).representations[0], out.representations[0])


def test_elmo_from_features_needs_n_layers():
    from elmo.errors import ConfigError

    with pytest.raises(ConfigError, match="n_layers"):
        Elmo(None, 1)
    with pytest.raises(ConfigError, match="no BiLM"):
        Elmo(None, 1, n_layers=3)([["a"]])


def test_task_model_single_layer_baseline_uses_only_that_layer():
    model = TaskModel("tagging", 3, 4, 2, TrainConfig(dropout=0.0), layer=0)
    assert not model.mix.weights.requires_grad and model.mix.normalized_weights() == [1.0, 0.0, 0.0]
    x = torch.randn(3, 5, 4)
    y = x.clone()
    y[1:] = torch.randn(2, 5, 4)  # other layers changed: output unchanged
    segments = torch.tensor([0, 0, 0, 1, 1])
    torch.testing.assert_close(model(x, segments, 2), model(y, segments, 2))


def test_shipped_tasks_load_against_the_shipped_model():
    """The tasks committed in models/default/tasks/ match that model's shape and carry their evaluation."""
    from pathlib import Path

    from elmo.model.config import ModelConfig

    model_dir = Path(__file__).resolve().parents[2] / "models" / "default"
    store = TaskStore(model_dir)
    if not store.names():
        pytest.skip("models/default has no tasks (yet)")
    cfg = ModelConfig.load(model_dir)
    store = TaskStore(model_dir, n_layers=cfg.n_output_layers, dim=cfg.output_dim)
    for task in store.all():
        layers = np.random.default_rng(0).normal(size=(cfg.n_output_layers, 4, cfg.output_dim)).astype(np.float32)
        assert task.apply(layers).shape == (4, cfg.output_dim)
        assert len(task.predict(layers)) == (4 if task.kind == "tagging" else 1)
        assert {"metric", "mix", "layer0"} <= set(task.metrics)
