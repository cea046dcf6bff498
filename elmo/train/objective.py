"""The LM objective: the shared softmax over both directions (full, or sampled with log-uniform negatives and
the expected-count correction), the distinct-token char encoder, and the softmax bias from unigram counts.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo.model.bilm import BiLM, CharEncoder, backward_targets
from elmo.train.vocab import IGNORE, Vocab, boundary_targets, length_batches, lm_arrays, slice_by_tokens

log = logging.getLogger(__name__)


# -- the objective -----------------------------------------------------------------------------------------------
def log_uniform_probs(vocab_size: int) -> Tensor:
    """Zipf-like sampling distribution over ids sorted by falling frequency: p(k) ∝ log((k+2)/(k+1))."""
    k = torch.arange(vocab_size, dtype=torch.float64)
    return ((torch.log(k + 2) - torch.log(k + 1)) / math.log(vocab_size + 1)).float()


class LMObjective(nn.Module):
    """Wraps the BiLM so that DDP sees one ``forward`` computing both directions' losses."""

    def __init__(self, bilm: BiLM) -> None:
        super().__init__()
        self.bilm = bilm

    def forward(self, char_ids: Tensor, targets: Tensor, negatives: Tensor | None, neg_log_q: Tensor | None):
        """``char_ids`` (B, T, 50), ``targets`` (B, T+2) with -100 padding; ``negatives`` (K,) unique ids and
        their log expected counts (K,) for sampled softmax, or None for full softmax.
        Returns (forward_loss, backward_loss, true_log_q unused) mean per predicted token."""
        fwd_h, bwd_h, lengths = self.bilm.lm_hidden(char_ids)
        fwd = self._loss(fwd_h[:, :-1].flatten(0, 1), targets[:, 1:].flatten(), negatives, neg_log_q)
        bwd_targets = backward_targets(targets, lengths).flatten()
        bwd = self._loss(bwd_h[:, 1:].flatten(0, 1), bwd_targets, negatives, neg_log_q)
        return fwd, bwd

    @staticmethod
    def target_counts(char_ids: Tensor, targets: Tensor) -> tuple[int, int]:
        """How many targets the forward and the backward loss average over (they differ at cuts)."""
        lengths = (char_ids > 0).any(dim=-1).sum(dim=-1) + 2
        forward = int((targets[:, 1:] != IGNORE).sum())
        return forward, int((backward_targets(targets, lengths) != IGNORE).sum())

    def _loss(self, hidden: Tensor, targets: Tensor, negatives: Tensor | None, neg_log_q: Tensor | None) -> Tensor:
        keep = targets != IGNORE
        hidden, targets = hidden[keep], targets[keep]  # (N, P), (N,)
        softmax = self.bilm.softmax
        if negatives is None:
            return F.cross_entropy(softmax(hidden), targets)
        log_q = self.log_q  # (V,) log expected count of every id under the sampler
        true_logit = (hidden * softmax.weight[targets]).sum(-1) + softmax.bias[targets] - log_q[targets]
        neg_logits = F.linear(hidden, softmax.weight[negatives], softmax.bias[negatives]) - neg_log_q
        neg_logits = neg_logits.masked_fill(negatives.view(1, -1) == targets.view(-1, 1), float("-inf"))
        logits = torch.cat([true_logit.unsqueeze(1), neg_logits], dim=1)
        return (torch.logsumexp(logits, dim=1) - true_logit).mean()


class NegativeSampler:
    """K log-uniform draws with replacement, deduplicated; the correction is log of each id's expected count."""

    def __init__(self, vocab_size: int, n_samples: int, device: torch.device) -> None:
        self.n = n_samples
        self.probs = log_uniform_probs(vocab_size).to(device)
        p = self.probs.double()
        self.log_q = torch.log(-torch.expm1(n_samples * torch.log1p(-p))).float().to(device)

    def sample(self) -> tuple[Tensor, Tensor]:
        ids = torch.unique(torch.multinomial(self.probs, self.n, replacement=True))
        return ids, self.log_q[ids]


class DistinctTokenCharEncoder(CharEncoder):
    """CharEncoder with the same parameters and math that runs the char-CNN once per distinct token of the
    batch (a batch of 2 K tokens has a few hundred distinct ones), then scatters the results back."""

    def forward(self, char_ids: Tensor) -> Tensor:
        """``char_ids`` (B, T, W) -> (B, T, P)."""
        batch, tokens, width = char_ids.shape
        distinct, inverse = torch.unique(char_ids.reshape(batch * tokens, width), dim=0, return_inverse=True)
        embedded = super().forward(distinct.unsqueeze(0))[0]  # (U, P)
        return embedded[inverse].reshape(batch, tokens, -1)


def use_distinct_token_encoder(bilm: BiLM) -> None:
    """Swap the encoder's class in place: state_dict keys and parameters stay exactly those of BiLM."""
    bilm.encoder.__class__ = DistinctTokenCharEncoder


# -- softmax bias ----------------------------------------------------------------------------------------------
def target_frequencies(sentences: list[list[str]], vocab: Vocab) -> Tensor:
    """Relative frequency of every id as a target of either direction: tokens plus one </S> (forward) and one
    <S> (backward) per sentence (not at a marked cut), OOV as <UNK>. (V,) float64, sums to 1."""
    counts = np.zeros(len(vocab), dtype=np.float64)
    for sentence in sentences:
        ids = vocab.ids(sentence)
        np.add.at(counts, ids[1:-1], 2.0)
        real_start, real_end = boundary_targets(sentence)
        counts[ids[0]] += real_start
        counts[ids[-1]] += real_end
    return torch.from_numpy(counts / counts.sum())


@torch.no_grad()
def init_bias_from_unigram(bilm: BiLM, freqs: Tensor) -> None:
    """Sampled softmax learns the bias slowly; starting at log unigram frequencies spares that work."""
    bilm.softmax.bias.copy_(torch.log(freqs.clamp_min(1e-9)).float().to(bilm.softmax.bias.device))


@torch.no_grad()
def calibrate_softmax_bias(
    bilm: BiLM, vocab: Vocab, sentences: list[list[str]], freqs: Tensor, n_tokens: int, iterations: int = 12
) -> dict:
    """Refit only the softmax bias for the full softmax, the other weights frozen.

    Sampled softmax (log-uniform negatives) rarely pushes down the logits of rare words, so the full softmax
    used at evaluation spreads too much mass over the tail. The maximum-likelihood bias for fixed hidden states
    makes the mean predicted distribution match the target frequencies: iterative scaling
    ``b += log(f) - log(mean_i softmax(W h_i + b))`` over the hidden states of a train sample, with ``f`` the
    target frequencies of the whole train split (so rare words are not judged on a small sample).
    """
    was_training = bilm.training
    bilm.eval()
    device = bilm.softmax.weight.device
    states = []
    sample = slice_by_tokens(sentences, n_tokens)
    for batch in length_batches([len(s) for s in sample], 4000):
        char_ids, targets = (torch.from_numpy(a).to(device) for a in lm_arrays([sample[i] for i in batch], vocab))
        fwd_h, bwd_h, lengths = bilm.lm_hidden(char_ids)
        fwd_valid = targets[:, 1:] != IGNORE  # (B, S-1): positions that predict a real target
        bwd_valid = backward_targets(targets, lengths) != IGNORE
        states += [fwd_h[:, :-1][fwd_valid], bwd_h[:, 1:][bwd_valid]]
    hidden = torch.cat(states)  # (N, P)
    logits = F.linear(hidden, bilm.softmax.weight)  # (N, V) without bias
    log_target = torch.log(freqs.to(device=device, dtype=torch.float32).clamp_min(1e-12))
    bias = bilm.softmax.bias.detach().clone()
    for _ in range(iterations):
        mean_prob = torch.softmax(logits + bias, dim=1).mean(0)
        bias += log_target - torch.log(mean_prob.clamp_min(1e-30))
        bias -= bias.max()
    bilm.softmax.bias.copy_(bias)
    bilm.train(was_training)
    return {"calibrated_bias_on_states": int(hidden.shape[0]), "iterations": iterations}
