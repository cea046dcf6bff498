"""The paired bootstrap that says whether the mix is at least as good as the best single layer, or only tied."""

from __future__ import annotations

import numpy as np
import pytest

from elmo.mix.significance import paired_bootstrap, score_counts, sentence_counts, verdict
from elmo.mix.task_data import LabelledSet, entity_f1

LABELS = ["B-PER", "E-PER", "O", "S-LOC"]


def _ids(tags):
    return np.array([LABELS.index(t) for t in tags])


def test_entity_counts_rebuild_the_corpus_f1():
    gold = [["B-PER", "E-PER", "O", "S-LOC"], ["O", "S-LOC"], ["B-PER", "E-PER"]]
    predicted = [["B-PER", "E-PER", "O", "O"], ["S-LOC", "S-LOC"], ["O", "O"]]
    counts = sentence_counts("entity_f1", LabelledSet("tagging", [["x"] * len(g) for g in gold], gold),
                             [_ids(p) for p in predicted], LABELS)  # fmt: skip
    assert counts.tolist() == [[1, 1, 2], [1, 2, 1], [0, 0, 1]]
    assert float(score_counts("entity_f1", counts.sum(0))) == pytest.approx(entity_f1(gold, predicted)["f1"])


def test_accuracy_counts_for_tagging_and_classification():
    tagging = LabelledSet("tagging", [["a", "b"], ["c"]], [["O", "S-LOC"], ["O"]])
    counts = sentence_counts("accuracy", tagging, [_ids(["O", "O"]), _ids(["O"])], LABELS)
    assert counts.tolist() == [[1, 2, 2], [1, 1, 1]]
    classes = LabelledSet("classification", [["a"], ["b"], ["c"]], ["pos", "neg", "pos"])
    counts = sentence_counts("accuracy", classes, [np.array([0]), np.array([0]), np.array([1])], ["neg", "pos"])
    assert float(score_counts("accuracy", counts.sum(0))) == pytest.approx(2 / 3)  # neg, neg, pos vs pos, neg, pos


def test_bootstrap_interval_separates_a_real_gain_from_noise():
    rng = np.random.default_rng(0)
    n = 400
    base = rng.integers(0, 2, size=n)
    better = np.where(rng.random(n) < 0.3, 1, base)  # flips 30 % of the sentences to correct
    as_counts = lambda c: np.stack([c, np.ones(n, int), np.ones(n, int)], axis=1)  # noqa: E731
    gain = paired_bootstrap("accuracy", as_counts(better), as_counts(base))
    assert gain["difference"] > 0 and gain["ci95"][0] > 0 and verdict(gain) == "at least as good"
    same = paired_bootstrap("accuracy", as_counts(base), as_counts(base))
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0]
    noise = np.where(rng.random(n) < 0.02, 1 - base, base)  # a few changes either way
    tie = paired_bootstrap("accuracy", as_counts(noise), as_counts(base), seed=1)
    if tie["difference"] < 0:
        assert verdict(tie) == "tie"
    loss = paired_bootstrap("accuracy", as_counts(base), as_counts(better))
    assert verdict(loss) == "worse" and loss["ci95"][1] < 0
