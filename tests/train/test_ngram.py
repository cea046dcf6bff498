from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import numpy as np
import pytest

from elmo.cli import main
from elmo.train.ngram import Directional, KneserNey, modified_discounts
from elmo.train.vocab import Vocab


def _random_sequences(seed: int, vocab_size: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Zipf-ish ids 3.. so that counts of counts are all non-zero; end id 1.
    return [np.append(np.minimum(rng.zipf(1.3, size=rng.integers(1, 9)) + 2, vocab_size - 1), 1) for _ in range(n)]


def _keys(context: list[int], vocab_size: int) -> np.ndarray:
    keys = []
    for w in range(vocab_size):
        k = 0
        for x in [*context, w]:
            k = k * vocab_size + x
        keys.append(k)
    return np.array(keys, dtype=np.int64)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_context_is_a_distribution(order):
    V = 15
    kn = KneserNey(order, V).fit(_random_sequences(0, V, 400), start_id=0)
    for context in ([0, 0, 0], [0, 0, 3], [3, 4, 5], [14, 14, 14], [2, 2, 2]):
        probs = np.exp(kn.log_probs(_keys(context[len(context) - (order - 1) :] if order > 1 else [], V)))
        assert probs.min() > 0
        assert probs.sum() == pytest.approx(1.0, abs=1e-9)


def _reference_trigram(sequences, V, start):
    """Straightforward dictionary implementation of interpolated modified Kneser-Ney (Chen & Goodman)."""
    tri = Counter()
    for s in sequences:
        x = [start, start, *map(int, s)]
        for j in range(2, len(x)):
            tri[tuple(x[j - 2 : j + 1])] += 1
    bi = Counter(g[1:] for g in tri)  # continuation counts N1+(. v w)
    uni = Counter(g[1:] for g in bi)  # N1+(. w)

    def discounts(counts):
        n = [sum(1 for c in counts.values() if c == k) for k in (1, 2, 3, 4)]
        assert min(n) > 0, "test data too small for modified discounts"
        y = n[0] / (n[0] + 2 * n[1])
        return [0, 1 - 2 * y * n[1] / n[0], 2 - 3 * y * n[2] / n[1], 3 - 4 * y * n[3] / n[2]]

    def level(counts):
        d = discounts(counts)
        total, gamma = defaultdict(float), defaultdict(float)
        for g, c in counts.items():
            total[g[:-1]] += c
            gamma[g[:-1]] += d[min(c, 3)]
        return counts, d, total, gamma

    levels = [level(uni), level(bi), level(tri)]

    def prob(u, v, w):
        p = 1.0 / V
        for gram in ((w,), (v, w), (u, v, w)):
            counts, d, total, gamma = levels[len(gram) - 1]
            ctx = gram[:-1]
            if total[ctx] > 0:
                c = counts.get(gram, 0)
                p = (max(c - d[min(c, 3)], 0) + gamma[ctx] * p) / total[ctx]
        return p

    return prob


def test_matches_a_plain_dictionary_reference():
    V = 400  # large enough that every level has continuation counts 1, 2, 3 and 4
    train = _random_sequences(1, V, 3000)
    kn = KneserNey(3, V).fit(train, start_id=0)
    reference = _reference_trigram(train, V, 0)
    rng = np.random.default_rng(2)
    for u, v, w in rng.integers(0, V, size=(200, 3)):
        key = (int(u) * V + int(v)) * V + int(w)
        assert math.exp(kn.log_probs(np.array([key]))[0]) == pytest.approx(reference(u, v, w), rel=1e-9)


def test_discounts_follow_counts_of_counts():
    counts = np.array([1] * 50 + [2] * 20 + [3] * 10 + [4] * 5)
    y = 50 / (50 + 40)
    assert modified_discounts(counts)[1] == pytest.approx(1 - 2 * y * 20 / 50)


def test_directional_scores_count_the_same_targets_as_the_bilm():
    vocab = Vocab(["<S>", "</S>", "<UNK>", "a", "b", "c"])
    train = [["a", "b", "c"], ["a", "b"], ["c", "a", "b"]] * 5
    model = Directional.train(vocab, train)
    result = model.score(vocab, [["a", "b"], ["zzz"]])
    assert result["tokens"] == 3 + 2  # n + 1 per sentence, OOV counted as <UNK>
    assert 1 < result["forward_ppl"] < len(vocab) and 1 < result["backward_ppl"] < len(vocab)
    # the backward model really reads right to left: "b" is always preceded by "a"
    lp_backward_b_a = model.backward.log_probs(model.backward.keys([np.array([4, 3, 0])], 1))
    assert math.exp(lp_backward_b_a[1]) > 0.5


def test_baseline_cli_on_real_brown(brown_corpus, capsys):
    test_file = brown_corpus / "test.en.txt"
    assert (
        main(
            [
                "baseline",
                "--train",
                str(brown_corpus / "train.txt"),
                "--vocab",
                str(brown_corpus / "vocab.txt"),
                "--text",
                str(test_file),
                "--tokenized",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip())
    assert result["tokens"] == sum(len(line.split()) + 1 for line in test_file.read_text().splitlines())
    assert 20 < result["avg_ppl"] < 3000
    assert result["avg_ppl"] == pytest.approx(math.sqrt(result["forward_ppl"] * result["backward_ppl"]), rel=1e-3)


def test_baseline_cli_defaults_to_the_corpus_test_splits(brown_corpus, capsys):
    """README's `elmo baseline --corpus data/corpus`: train.txt, vocab.txt and the test splits of one folder; the
    Brown-only corpus has no Chinese test text, so only English is scored."""
    assert main(["baseline", "--corpus", str(brown_corpus)]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    test_file = brown_corpus / "test.en.txt"
    assert json.loads(line)["tokens"] == sum(len(s.split()) + 1 for s in test_file.read_text().splitlines())
