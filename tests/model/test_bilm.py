import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elmo.errors import ConfigError
from elmo.model.bilm import BiLM, Highway, add_sentence_boundaries, reverse_padded
from elmo.model.config import ModelConfig, elmo_medium, elmo_original, elmo_small, tiny
from elmo.text.chars import batch_to_char_ids
from tests.numpy_reference import config_dict, elmo_forward, from_torch_state

SENTENCES = [["The", "cat", "sat", "."], ["苹", "果"], ["a"], ["x" * 70, "😀", "naïve", "!", "?", "Ok"]]


def random_model(cfg: ModelConfig | None = None, seed: int = 0, scale: float = 0.6) -> BiLM:
    """A model with large random weights so that both clips and every gate matter."""
    torch.manual_seed(seed)
    model = BiLM(cfg or tiny())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, scale)
        model.encoder.char_embedding.weight[0].zero_()
    return model.eval()


def embed(model: BiLM, sentences) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        layers, mask = model(torch.as_tensor(batch_to_char_ids(sentences)).long())
    return layers.numpy(), mask.numpy()


@pytest.mark.parametrize("factory, millions", [(elmo_small, 13.6), (elmo_medium, 28.0), (elmo_original, 93.6)])
def test_published_shapes_have_published_parameter_counts(factory, millions):
    model = BiLM(factory())
    assert round(model.num_parameters() / 1e6, 1) == millions


def test_softmax_is_not_counted_unless_asked():
    model = BiLM(tiny(vocab_size=50))
    assert model.num_parameters(include_softmax=True) - model.num_parameters() == 50 * 8 + 50


@pytest.mark.parametrize("residual", [True, False])
def test_matches_independent_numpy_reference(residual):
    cfg = tiny()
    cfg.residual = residual
    model = random_model(cfg)
    weights = from_torch_state(model.state_dict(), cfg)
    layers, mask = embed(model, SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        expected = elmo_forward(weights, sentence, config_dict(cfg))
        assert layers.shape[1] == cfg.n_layers + 1
        np.testing.assert_allclose(layers[i, :, : len(sentence)], expected, atol=1e-5, rtol=0)
        assert mask[i].sum() == len(sentence)


def test_clipping_is_active_in_the_reference_comparison():
    # Without clips the same weights give different vectors, so the comparison above does test clipping.
    cfg = tiny()
    model = random_model(cfg)
    unclipped = ModelConfig(**{**cfg.to_dict(), "cell_clip": 0.0, "proj_clip": 0.0})
    other = BiLM(unclipped).eval()
    other.load_state_dict(model.state_dict())
    assert np.abs(embed(model, SENTENCES)[0] - embed(other, SENTENCES)[0]).max() > 1e-2


def test_highway_gate_weights_the_input():
    layer = Highway(3, 1)
    with torch.no_grad():
        layer.layers[0].weight.zero_()
        layer.layers[0].bias.copy_(torch.tensor([5.0, 5.0, 5.0, 100.0, 100.0, 100.0]))  # gate ~ 1
    x = torch.tensor([[1.0, -2.0, 3.0]])
    torch.testing.assert_close(layer(x), x)  # gate 1 -> pure carry of the input
    with torch.no_grad():
        layer.layers[0].bias[3:] = -100.0  # gate 0 -> relu(nonlinear) = 5
    torch.testing.assert_close(layer(x), torch.full((1, 3), 5.0))


def test_boundaries_are_added_per_sentence():
    ids = torch.as_tensor(batch_to_char_ids([["a", "b"], ["c"]])).long()
    with_boundaries, lengths = add_sentence_boundaries(ids)
    assert lengths.tolist() == [4, 3]
    assert with_boundaries[0, 0, 1] == 257 and with_boundaries[0, 3, 1] == 258  # BOS, EOS after "b"
    assert with_boundaries[1, 2, 1] == 258 and (with_boundaries[1, 3] == 0).all()


def test_reverse_padded_reverses_only_the_valid_part():
    x = torch.arange(8.0).view(2, 4, 1)
    out = reverse_padded(x, torch.tensor([4, 2]))
    assert out[:, :, 0].tolist() == [[3, 2, 1, 0], [5, 4, 6, 7]]


def test_padding_never_leaks_into_the_backward_direction():
    model = random_model()
    alone, _ = embed(model, [["a", "b"]])
    padded, _ = embed(model, [["a", "b"], ["c", "d", "e", "f", "g", "h"]])
    np.testing.assert_allclose(padded[0, :, :2], alone[0], atol=1e-6, rtol=0)
    assert (padded[0, :, 2:] == 0).all()


def test_backward_direction_sees_the_future_and_forward_does_not():
    model = random_model()
    first, _ = embed(model, [["a", "b", "c"]])
    changed, _ = embed(model, [["a", "b", "z"]])
    half = first.shape[-1] // 2
    np.testing.assert_allclose(first[0, 1:, 0, :half], changed[0, 1:, 0, :half], atol=1e-7)
    assert np.abs(first[0, 1:, 0, half:] - changed[0, 1:, 0, half:]).max() > 1e-4


def test_lm_states_never_see_the_token_they_predict():
    """lm_hidden runs over [<S>, w1..wn, </S>]: forward state t predicts slot t + 1, backward state t slot t - 1.
    Changing w3 (slot 3) may move forward states from slot 3 on and backward states up to slot 3, nothing else."""
    model = random_model()
    model.eval()
    words = ["a", "b", "c", "d", "e"]
    ids = torch.as_tensor(batch_to_char_ids([words, words[:2] + ["zz"] + words[3:]]).astype(np.int64))
    with torch.no_grad():
        forward, backward, _ = model.lm_hidden(ids)
    moved_forward = (forward[0] - forward[1]).abs().amax(-1) > 1e-6
    moved_backward = (backward[0] - backward[1]).abs().amax(-1) > 1e-6
    assert moved_forward.tolist() == [False, False, False, True, True, True, True]
    assert moved_backward.tolist() == [True, True, True, True, False, False, False]


def test_deterministic_and_stateless_across_calls():
    model = random_model()
    first, _ = embed(model, SENTENCES)
    embed(model, [["something", "else", "entirely"]] * 3)
    again, _ = embed(model, SENTENCES)
    assert np.array_equal(first, again)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "bb", "苹果", "Apple", ".", "😀", "x" * 60]), min_size=0, max_size=9),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_a_sentence_is_the_same_alone_or_in_any_batch(batch, data):
    # Realistic weight scale: at scale 0.6 outputs reach |6| and float32 rounding alone is ~1e-6.
    model = random_model(seed=1, scale=0.3)
    index = data.draw(st.integers(0, len(batch) - 1))
    target = batch[index]
    in_batch, _ = embed(model, batch)
    alone, _ = embed(model, [target])
    np.testing.assert_allclose(in_batch[index, :, : len(target)], alone[0, :, : len(target)], atol=1e-6, rtol=0)
    assert (in_batch[index, :, len(target) :] == 0).all()


def test_lm_loss_ignores_padding():
    model = random_model(tiny(vocab_size=11))
    ids = torch.as_tensor(batch_to_char_ids([["a", "b"], ["c", "d", "e", "f"]])).long()
    targets = torch.tensor([[1, 4, 5, 2, -100, -100], [1, 6, 7, 8, 9, 2]])
    with torch.no_grad():
        forward_loss, backward_loss = model.lm_loss(ids[:1, :2], targets[:1, :4])
        batch_forward, batch_backward = model.lm_loss(ids, targets)
        alone_second = model.lm_loss(ids[1:], targets[1:])
    # The batch loss is the token-weighted mean of each sentence's loss: 3 and 5 predicted tokens.
    torch.testing.assert_close(batch_forward, (3 * forward_loss + 5 * alone_second[0]) / 8)
    torch.testing.assert_close(batch_backward, (3 * backward_loss + 5 * alone_second[1]) / 8)


@pytest.mark.parametrize(
    "field, value",
    [("projection_dim", 0), ("filters", [[0, 3]]), ("activation", "gelu"), ("n_chars", 261), ("dropout", 1.5)],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{field: value}).validate()


def test_config_round_trip_and_unknown_field(tmp_path):
    cfg = tiny(vocab_size=7)
    cfg.save(tmp_path)
    assert ModelConfig.load(tmp_path) == cfg
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_dict({"hidden_size": 3})
