"""The paired bootstrap (elmo.significance) and the verdict that says what its interval says; the per-sentence counts
of a labelled set (elmo.mix.task_data.sentence_counts) it resamples."""

from __future__ import annotations

import numpy as np
import pytest

from elmo.mix.task_data import LabelledSet, entity_f1, sentence_counts
from elmo.significance import TIE_MARGIN, paired_bootstrap, score_counts, verdict

LABELS = ["B-PER", "E-PER", "O", "S-LOC"]


def _ids(tags):
    return np.array([LABELS.index(t) for t in tags])


def test_entity_counts_rebuild_the_corpus_f1():
    gold = [["B-PER", "E-PER", "O", "S-LOC"], ["O", "S-LOC"], ["B-PER", "E-PER"]]
    predicted = [["B-PER", "E-PER", "O", "O"], ["S-LOC", "S-LOC"], ["O", "O"]]
    counts = sentence_counts(
        "entity_f1", LabelledSet("tagging", [["x"] * len(g) for g in gold], gold), [_ids(p) for p in predicted], LABELS
    )
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
    assert gain["difference"] > 0 and gain["ci95"][0] > 0 and verdict(gain) == "better"
    same = paired_bootstrap("accuracy", as_counts(base), as_counts(base))
    assert same["difference"] == 0 and same["ci95"] == [0.0, 0.0]
    noise = np.where(rng.random(n) < 0.02, 1 - base, base)  # a few changes either way
    tie = paired_bootstrap("accuracy", as_counts(noise), as_counts(base), seed=1)
    assert tie["ci95"][0] <= 0 <= tie["ci95"][1]
    inside = max(map(abs, tie["ci95"])) <= TIE_MARGIN
    assert verdict(tie) == (f"tie (within ±{TIE_MARGIN:g})" if inside else "inconclusive")
    loss = paired_bootstrap("accuracy", as_counts(base), as_counts(better))
    assert verdict(loss) == "worse" and loss["ci95"][1] < 0


@pytest.mark.parametrize(
    "ci95, expected",
    [
        ([0.007, 0.021], "better"),  # wholly above 0, however small
        ([-0.021, -0.007], "worse"),
        ([-0.0003, 0.0035], "tie (within ±0.01)"),  # the README's POS row: inside the margin
        ([-0.059, 0.072], "inconclusive"),  # docs/how-to/adapt.md's senses row: holds 0, reaches far past the margin
        ([-0.032, 0.006], "inconclusive"),  # a negative point difference is not called a tie either
    ],
)
def test_the_verdict_says_what_the_interval_says_whatever_the_point_difference(ci95, expected):
    for difference in (ci95[0], sum(ci95) / 2, ci95[1]):  # the verdict reads the interval, not the point
        assert verdict({"difference": difference, "ci95": ci95}) == expected


def test_the_tie_margin_is_stated_in_the_verdict_and_can_be_set():
    assert verdict({"difference": 0.0, "ci95": [-0.03, 0.03]}, margin=0.05) == "tie (within ±0.05)"
    assert verdict({"difference": 0.0, "ci95": [-0.03, 0.03]}, margin=0.01) == "inconclusive"


def test_every_verdict_written_in_the_docs_is_what_the_code_says_of_its_interval():
    """README, docs, the model card and the report quote intervals with verdicts; each must be verdict() of it."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    verdicts = r"better|worse|inconclusive|tie \(within ±[\d.]+\)|at least as good|tie"  # the old ones too
    quoted = re.compile(rf"\[([+−-]?\d\.\d+), ([+−-]?\d\.\d+)\]:\s+\**({verdicts})")
    found = 0
    for path in [repo / "README.md", *sorted((repo / "docs").rglob("*.md")), *sorted((repo / "models").rglob("*.md"))]:
        for low, high, said in quoted.findall(path.read_text(encoding="utf-8")):
            interval = [float(x.replace("−", "-")) for x in (low, high)]
            assert said == verdict({"ci95": interval}), f"{path.name}: [{low}, {high}]: {said}"
            found += 1
    assert found >= 10  # the README's task and sense tables, docs/how-to/{tasks,adapt}.md, the model card, report.md
