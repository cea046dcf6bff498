"""The biLM's language-model loss against a cross-entropy written from the definition.

Forward LM: the state at position t of ``[<S>, w_1, ..., w_n, </S>]`` predicts the token at t + 1; backward LM:
the state at t predicts the token at t - 1; the loss of a direction is the mean negative log-likelihood over every
predicted token under the full softmax. Padding predicts nothing, nor does a boundary at a cut made by
``chunk_long`` (a Piece's ``cut_before`` has no ``<S>`` target, ``cut_after`` no ``</S>``). The reference below
builds its targets from ``Vocab.ids`` and the Piece flags alone (not from ``lm_arrays`` or ``backward_targets``)
and takes -log softmax in float64 numpy; the model's own code paths must agree: ``BiLM.lm_loss``, the training
objective ``LMObjective`` with the full softmax, and ``score_sentences`` (what ``elmo eval-lm`` reports).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo.bench.random_model import random_bilm
from elmo.train.evaluate import score_sentences
from elmo.train.objective import LMObjective
from elmo.train.vocab import Piece, Vocab, lm_arrays

VOCAB = Vocab(["<S>", "</S>", "<UNK>", "the", "cat", "sat", "on", "mat", ".", "a", "dog"])
# Uneven lengths (padding in both directions), an out-of-vocabulary word (scored as <UNK>), and the two halves
# of a sentence cut by chunk_long: the first has no </S> target, the second no <S> target.
SENTENCES = [
    ["the", "cat", "sat", "on", "the", "mat", "."],
    ["a", "dog", "."],
    ["the", "zebra"],
    Piece(["a", "cat", "sat"], cut_after=True),
    Piece(["on", "a", "mat", "."], cut_before=True),
    ["dog"],
]


def _model() -> torch.nn.Module:
    # N(0, 0.3) weights make the predictions far from uniform, so a target off by one position costs visibly.
    model = random_bilm("tiny", seed=3, scale=0.3, vocab_size=len(VOCAB), dropout=0.0)
    return model.double().eval()  # float64 throughout: the comparison is about the definition, not rounding


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def _reference_nll(model, sentences) -> tuple[list[float], list[float]]:
    """Per predicted token: forward and backward negative log-likelihoods, from the definition."""
    char_ids, _ = lm_arrays(sentences, VOCAB)
    with torch.no_grad():
        forward_h, backward_h, _ = model.lm_hidden(torch.from_numpy(char_ids))
    weight = model.softmax.weight.detach().numpy()  # (V, P)
    bias = model.softmax.bias.detach().numpy()  # (V,)
    forward, backward = [], []
    for row, sentence in enumerate(sentences):
        ids = list(VOCAB.ids(sentence))  # [<S>, w_1 .. w_n, </S>], OOV as <UNK>
        has_start = not getattr(sentence, "cut_before", False)
        has_end = not getattr(sentence, "cut_after", False)
        for t in range(len(ids) - 1):  # forward: position t predicts ids[t + 1]
            if t + 1 == len(ids) - 1 and not has_end:
                continue
            logp = _log_softmax(forward_h[row, t].numpy() @ weight.T + bias)
            forward.append(-logp[ids[t + 1]])
        for t in range(1, len(ids)):  # backward: position t predicts ids[t - 1]
            if t - 1 == 0 and not has_start:
                continue
            logp = _log_softmax(backward_h[row, t].numpy() @ weight.T + bias)
            backward.append(-logp[ids[t - 1]])
    return forward, backward


def test_the_reference_counts_every_target_once():
    forward, backward = _reference_nll(_model(), SENTENCES)
    # n + 1 targets per whole sentence and direction, one fewer for each cut boundary on that direction's side.
    whole = sum(len(s) + 1 for s in SENTENCES)
    assert len(forward) == whole - 1 and len(backward) == whole - 1


def test_lm_loss_and_the_training_objective_equal_the_reference_cross_entropy():
    model = _model()
    forward, backward = _reference_nll(model, SENTENCES)
    char_ids, targets = (torch.from_numpy(a) for a in lm_arrays(SENTENCES, VOCAB))
    with torch.no_grad():
        lm_forward, lm_backward = model.lm_loss(char_ids, targets)
        train_forward, train_backward = LMObjective(model)(char_ids, targets, None, None)  # full softmax
    for got_forward, got_backward in ((lm_forward, lm_backward), (train_forward, train_backward)):
        assert got_forward.item() == pytest.approx(np.mean(forward), rel=1e-10)
        assert got_backward.item() == pytest.approx(np.mean(backward), rel=1e-10)
    # The two directions differ on these weights: a loss that scored one direction twice could not pass.
    assert abs(np.mean(forward) - np.mean(backward)) > 1e-3


def test_evaluation_sums_the_same_negative_log_likelihoods():
    model = _model()
    whole = [s for s in SENTENCES if not isinstance(s, Piece)]  # eval-lm scores whole sentences
    forward, backward = _reference_nll(model, whole)
    score = score_sentences(model, VOCAB, whole)
    assert score.tokens == len(forward) == len(backward)
    assert score.forward_nll == pytest.approx(sum(forward), rel=1e-10)
    assert score.backward_nll == pytest.approx(sum(backward), rel=1e-10)


def test_a_direction_never_sees_the_token_it_predicts():
    # The reference takes the model's states as given; they must not contain their own targets: the forward state
    # at t must not change when a later token does, nor the backward state when an earlier one does.
    model = _model()
    sentence = ["the", "cat", "sat", "on", "the", "mat", "."]
    changed = list(sentence)
    changed[3] = "dog"  # position 4 in [<S>, tokens, </S>]
    with torch.no_grad():
        states = [model.lm_hidden(torch.from_numpy(lm_arrays([s], VOCAB)[0]))[:2] for s in (sentence, changed)]
    (forward, backward), (forward_changed, backward_changed) = states
    torch.testing.assert_close(forward[0, :4], forward_changed[0, :4], rtol=0, atol=0)
    torch.testing.assert_close(backward[0, 5:], backward_changed[0, 5:], rtol=0, atol=0)
    assert not torch.allclose(forward[0, 4:], forward_changed[0, 4:])  # the change does reach the states after it
    assert not torch.allclose(backward[0, :5], backward_changed[0, :5])
