"""``elmo baseline``: an interpolated modified Kneser-Ney n-gram LM (Chen & Goodman 1998), both directions.

Trained on the same tokenized train split and scored with the same vocabulary as the biLM (out-of-vocabulary
tokens become ``<UNK>``), so its perplexities sit next to ``elmo eval-lm``'s. Forward: every sentence is
``<S>^(n-1) w_1 .. w_k </S>`` and ``w_1 .. w_k </S>`` are predicted; backward: the reversed sentence with the
roles of ``<S>``/``</S>`` swapped, predicting ``w_k .. w_1 <S>``. Same ``k + 1`` targets per sentence as the biLM.

All counting is vectorised with numpy: an n-gram is one int64 key ``((u * V) + v) * V + w``, tables are sorted
key arrays looked up with ``searchsorted``. Highest order uses raw counts, lower orders continuation counts,
three discounts per order (D1, D2, D3+) from the counts of counts; the unigram level interpolates with uniform.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elmo.errors import DataError
from elmo.model.checkpoint import load_vocab
from elmo.text.files import read_user_text
from elmo.train.vocab import BOS_ID, EOS_ID, Vocab, read_sentences

log = logging.getLogger(__name__)


@dataclass
class Level:
    """One order's table: sorted n-gram keys with their (raw or continuation) counts, and per-context sums."""

    keys: np.ndarray  # (K,) int64 sorted
    counts: np.ndarray  # (K,) int64
    ctx_keys: np.ndarray  # (C,) int64 sorted: the (n-1)-gram contexts
    ctx_totals: np.ndarray  # (C,) float64: sum of counts over the context
    ctx_gamma_mass: np.ndarray  # (C,) float64: D1*N1 + D2*N2 + D3*N3+ of the context
    discounts: np.ndarray  # (4,) float64: [0, D1, D2, D3+]


def modified_discounts(counts: np.ndarray) -> np.ndarray:
    """Chen & Goodman: Y = n1 / (n1 + 2 n2), D_c = c - (c + 1) Y n_{c+1} / n_c for c = 1, 2, 3+."""
    n = [int((counts == c).sum()) for c in (1, 2, 3, 4)]
    if min(n) == 0:  # tiny data: fall back to the classic single discount
        return np.array([0.0, 0.75, 0.75, 0.75])
    y = n[0] / (n[0] + 2 * n[1])
    d = [c - (c + 1) * y * n[c] / n[c - 1] for c in (1, 2, 3)]
    return np.array([0.0, *(min(max(v, 0.05), c) for c, v in zip((1, 2, 3), d))])


def _discount(discounts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return discounts[np.minimum(counts, 3)]


def _level(keys: np.ndarray, counts: np.ndarray, vocab_size: int) -> Level:
    discounts = modified_discounts(counts)
    ctx = keys // vocab_size
    ctx_keys, starts = np.unique(ctx, return_index=True)  # keys sorted -> contexts contiguous
    totals = np.add.reduceat(counts.astype(np.float64), starts)
    gamma = np.add.reduceat(_discount(discounts, counts), starts)
    return Level(keys, counts, ctx_keys, totals, gamma, discounts)


def _lookup(sorted_keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """values[sorted_keys == q] for each query, 0 where absent."""
    if len(sorted_keys) == 0:
        return np.zeros(len(queries), dtype=values.dtype)
    pos = np.minimum(np.searchsorted(sorted_keys, queries), len(sorted_keys) - 1)
    return np.where(sorted_keys[pos] == queries, values[pos], 0)


class KneserNey:
    """Interpolated modified Kneser-Ney of order ``n`` over integer ids in ``[0, vocab_size)``."""

    def __init__(self, order: int, vocab_size: int) -> None:
        if order < 1 or vocab_size**order >= 2**62:
            raise DataError(f"n-gram order {order} with vocabulary {vocab_size} does not fit 64-bit keys")
        self.order, self.V = order, vocab_size
        self.levels: list[Level] = []  # levels[k - 1] holds the k-grams

    def keys(self, sequences: Sequence[np.ndarray], start_id: int) -> np.ndarray:
        """Highest-order keys of every predicted position: each sequence ``[w_1 .. w_k, end]`` gets ``n - 1``
        start ids in front; position j's key encodes ``(x_{j-n+1} .. x_j)``."""
        n = self.order
        pad = np.full(n - 1, start_id, dtype=np.int64)
        padded = [np.concatenate([pad, np.asarray(s, dtype=np.int64)]) for s in sequences]
        flat = np.concatenate(padded)
        ends = np.cumsum([len(p) for p in padded])
        starts = ends - np.array([len(s) for s in sequences])
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, ends)])
        key = np.zeros(len(positions), dtype=np.int64)
        for i in range(n):
            key = key * self.V + flat[positions - (n - 1) + i]
        return key

    def fit(self, sequences: Sequence[np.ndarray], start_id: int) -> KneserNey:
        top_keys, top_counts = np.unique(self.keys(sequences, start_id), return_counts=True)
        levels = [_level(top_keys, top_counts, self.V)]
        higher = top_keys
        for k in range(self.order - 1, 0, -1):  # continuation counts: distinct left extensions of each k-gram
            lower_keys, lower_counts = np.unique(higher % self.V**k, return_counts=True)
            levels.insert(0, _level(lower_keys, lower_counts, self.V))
            higher = lower_keys
        self.levels = levels
        return self

    def log_probs(self, keys: np.ndarray) -> np.ndarray:
        """Natural-log probabilities of the last id of each highest-order key given the rest."""
        p = np.full(len(keys), 1.0 / self.V)
        for k, level in enumerate(self.levels, start=1):
            gram = keys % self.V**k
            ctx = gram // self.V
            count = _lookup(level.keys, level.counts, gram)
            total = _lookup(level.ctx_keys, level.ctx_totals, ctx)
            gamma = _lookup(level.ctx_keys, level.ctx_gamma_mass, ctx)
            seen = total > 0
            discounted = np.maximum(count - _discount(level.discounts, count), 0.0)
            p = np.where(seen, (discounted + gamma * p) / np.where(seen, total, 1.0), p)
        return np.log(p)


@dataclass
class Directional:
    """Forward and backward models over the same vocabulary."""

    forward: KneserNey
    backward: KneserNey

    @staticmethod
    def sequences(vocab: Vocab, sentences: Sequence[Sequence[str]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        ids = [vocab.ids(s) for s in sentences]  # [<S>, w.., </S>]
        return [x[1:] for x in ids], [x[:-1][::-1] for x in ids]

    @classmethod
    def train(cls, vocab: Vocab, sentences: Sequence[Sequence[str]], order: int = 3) -> Directional:
        fwd, bwd = cls.sequences(vocab, sentences)
        return cls(KneserNey(order, len(vocab)).fit(fwd, BOS_ID), KneserNey(order, len(vocab)).fit(bwd, EOS_ID))

    def score(self, vocab: Vocab, sentences: Sequence[Sequence[str]]) -> dict:
        fwd, bwd = self.sequences(vocab, sentences)
        fwd_nll = -float(self.forward.log_probs(self.forward.keys(fwd, BOS_ID)).sum())
        bwd_nll = -float(self.backward.log_probs(self.backward.keys(bwd, EOS_ID)).sum())
        tokens = sum(len(s) for s in fwd)
        return {
            "forward_ppl": round(math.exp(fwd_nll / tokens), 3),
            "backward_ppl": round(math.exp(bwd_nll / tokens), 3),
            "avg_ppl": round(math.exp((fwd_nll + bwd_nll) / (2 * tokens)), 3),
            "tokens": tokens,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus",
        default="data/corpus",
        help="`elmo data fetch` output: train.txt, vocab.txt and, unless --text is given, the tokenized test.en.txt "
        "and test.zh.txt are taken from here (default data/corpus)",
    )
    parser.add_argument("--train", default=None, help="tokenized training text (default CORPUS/train.txt)")
    parser.add_argument("--vocab", default=None, help="vocabulary, the biLM's (default CORPUS/vocab.txt)")
    parser.add_argument("--text", nargs="+", help="text file(s) to score, one sentence per line (default: test splits)")
    parser.add_argument("--tokenized", action="store_true", help="--text lines are already space-separated tokens")
    parser.add_argument("--order", type=int, default=3, help="n-gram order (default 3: trigrams)")


def run(args: argparse.Namespace) -> int:
    corpus = Path(args.corpus)
    vocab = Vocab(load_vocab(args.vocab or corpus / "vocab.txt"))
    train_path = Path(args.train or corpus / "train.txt")
    started = time.perf_counter()
    train_sentences = read_sentences(train_path)
    log.info("counting %d-grams of %s (%d sentences)", args.order, train_path, len(train_sentences))
    model = Directional.train(vocab, train_sentences, args.order)
    del train_sentences
    log.info("Kneser-Ney %d-gram ready in %.0f s; scoring", args.order, time.perf_counter() - started)
    # Without --text: the corpus' test splits, per language like `elmo eval-lm --report` (always tokenized); a
    # language the corpus has no test text for (e.g. `elmo data fetch --sources brown`) is left out, not scored.
    if args.text:
        texts = [(text, read_sentences(Path(text), tokenized=args.tokenized)) for text in args.text]
    else:
        splits = [corpus / f"test.{lang}.txt" for lang in ("en", "zh")]
        present = [path for path in splits if path.is_file() and read_user_text(path, "test split").strip()]
        texts = [(str(path), read_sentences(path)) for path in present]
        if not texts:
            raise DataError(f"{corpus}: test.en.txt and test.zh.txt hold no sentences")
    for text, sentences in texts:
        result = model.score(vocab, sentences)
        result.update(order=args.order, oov_rate=round(vocab.oov_rate(sentences), 5))
        if len(texts) > 1:
            result["file"] = text
        print(json.dumps(result), flush=True)
    return 0
