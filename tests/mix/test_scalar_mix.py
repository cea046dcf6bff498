"""The scalar mix γ · Σ_j softmax(w)_j · h_j with uneven weights, against a computation written out by hand.

tests/runtime/test_tasks.py checks the numpy and torch mixes against each other (and with equal weights, where a mix-up
of which weight scales which layer cannot show); here both are held to the formula itself, in float64 numpy, with
weights that single out each layer differently, with and without the per-layer normalisation (AllenNLP's
``do_layer_norm``), on a padded batch, and for the gradients that ``elmo mix train`` follows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo.mix.modules import ScalarMix
from elmo.runtime.tasks import Task, mix_layers

W = [2.0, -1.0, 0.5]  # softmax ≈ 0.786 / 0.039 / 0.175: every layer a different share, none negligible
GAMMA = 1.7
EPS = 1e-12  # the normalisation's epsilon (AllenNLP's ScalarMix has one too)


def _hand_softmax(w: list[float]) -> np.ndarray:
    e = np.array([np.exp(v) for v in w], dtype=np.float64)
    return e / e.sum()


def _hand_normalise(layer: np.ndarray) -> np.ndarray:
    """One layer of one sentence (n, dim): mean 0, variance 1 over its n·dim elements, no affine."""
    values = layer.astype(np.float64)
    mean = values.sum() / values.size
    variance = ((values - mean) ** 2).sum() / values.size
    return (values - mean) / np.sqrt(variance + EPS)


def _hand_mix(layers: np.ndarray, w: list[float], gamma: float, layer_norm: bool) -> np.ndarray:
    """layers (L, n, dim) -> (n, dim), float64, term by term."""
    s = _hand_softmax(w)
    out = np.zeros(layers.shape[1:], dtype=np.float64)
    for j in range(layers.shape[0]):
        h = _hand_normalise(layers[j]) if layer_norm else layers[j].astype(np.float64)
        out += s[j] * h
    return gamma * out


def _sentences(seed: int) -> list[np.ndarray]:
    """Three sentences (3, n, 6) whose layers differ in offset and spread, so a wrong weight or a skipped
    normalisation changes the result visibly."""
    rng = np.random.default_rng(seed)
    offsets, spreads = np.array([3.0, -2.0, 0.5]), np.array([0.5, 4.0, 1.5])
    return [
        (offsets[:, None, None] + spreads[:, None, None] * rng.normal(size=(3, n, 6))).astype(np.float32)
        for n in (5, 1, 3)
    ]


def test_the_softmax_weights_are_uneven_enough_to_tell_the_layers_apart():
    s = _hand_softmax(W)
    assert s == pytest.approx([0.7856, 0.0391, 0.1753], abs=1e-4)
    assert ScalarMix(3, initial=W).normalized_weights() == pytest.approx(list(s), abs=1e-7)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer_norm"])
def test_numpy_mix_and_stored_task_equal_the_hand_computation(layer_norm: bool):
    task = Task(name="t", kind="tagging", n_layers=3, dim=6, weights=W, gamma=GAMMA, layer_norm=layer_norm)
    for layers in _sentences(0):
        expected = _hand_mix(layers, W, GAMMA, layer_norm)
        np.testing.assert_allclose(mix_layers(layers, W, GAMMA, layer_norm), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(task.apply(layers), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer_norm"])
def test_torch_scalar_mix_on_a_padded_batch_equals_the_hand_computation(layer_norm: bool):
    sentences = _sentences(1)
    width = max(s.shape[1] for s in sentences)
    # Padding filled with a large junk value: it must neither leak into the mix nor into the normalisation.
    padded = torch.full((len(sentences), 3, width, 6), 50.0)
    mask = torch.zeros(len(sentences), width, dtype=torch.bool)
    for b, s in enumerate(sentences):
        padded[b, :, : s.shape[1]] = torch.from_numpy(s)
        mask[b, : s.shape[1]] = True
    mix = ScalarMix(3, layer_norm=layer_norm, initial=W, gamma=GAMMA)
    with torch.no_grad():
        out = mix(padded, mask).numpy()
    for b, s in enumerate(sentences):
        np.testing.assert_allclose(out[b, : s.shape[1]], _hand_mix(s, W, GAMMA, layer_norm), rtol=1e-5, atol=1e-5)
        assert np.all(out[b, s.shape[1] :] == 0.0)


def test_batch_scope_normalisation_uses_the_whole_batch_as_allennlp_does():
    # AllenNLP's do_layer_norm: mean and variance over every unmasked element of the batch, per layer.
    sentences = _sentences(2)
    width = max(s.shape[1] for s in sentences)
    padded = torch.zeros(len(sentences), 3, width, 6)
    mask = torch.zeros(len(sentences), width, dtype=torch.bool)
    for b, s in enumerate(sentences):
        padded[b, :, : s.shape[1]] = torch.from_numpy(s)
        mask[b, : s.shape[1]] = True
    mix = ScalarMix(3, layer_norm=True, norm_scope="batch", initial=W, gamma=GAMMA)
    with torch.no_grad():
        out = mix(padded, mask).numpy()
    s = _hand_softmax(W)
    for b, sentence in enumerate(sentences):
        expected = np.zeros(sentence.shape[1:], dtype=np.float64)
        for j in range(3):
            every = np.concatenate([x[j].ravel() for x in sentences]).astype(np.float64)
            mean = every.sum() / every.size
            std = np.sqrt(((every - mean) ** 2).sum() / every.size + EPS)
            expected += s[j] * (sentence[j] - mean) / std
        np.testing.assert_allclose(out[b, : sentence.shape[1]], GAMMA * expected, rtol=1e-5, atol=1e-5)


def test_gradients_of_the_mix_parameters_equal_the_hand_derivatives():
    # What `elmo mix train` follows: d/dγ Σ out = Σ_j s_j Σ h_j and d/dw_k Σ out = γ s_k (Σ h_k - Σ_j s_j Σ h_j).
    layers = _sentences(3)[0]
    mix = ScalarMix(3, initial=W, gamma=GAMMA)
    mix(torch.from_numpy(layers)[None]).sum().backward()
    s = _hand_softmax(W)
    totals = layers.astype(np.float64).sum(axis=(1, 2))  # Σ over tokens and features, per layer
    mixed_total = float((s * totals).sum())
    assert mix.gamma.grad.item() == pytest.approx(mixed_total, rel=1e-5)
    expected = [GAMMA * s[k] * (totals[k] - mixed_total) for k in range(3)]
    np.testing.assert_allclose(mix.weights.grad.numpy(), expected, rtol=1e-4, atol=1e-4)
