"""Is the mix better than the best single layer, or only tied? A paired bootstrap over test sentences.

Each sentence contributes counts from which the metric is rebuilt for any resample: entity F1 from (true
positives, predicted, gold entities), accuracy from (correct, total). Both systems are scored on the same
resampled sentences, so the interval is that of the difference (Koehn 2004; Berg-Kirkpatrick et al. 2012).
"""

from __future__ import annotations

import numpy as np

from elmo.mix.task_data import LabelledSet, bmes_entities


def sentence_counts(metric: str, gold: LabelledSet, predicted: list[np.ndarray], labels: list[str]) -> np.ndarray:
    """(n_sentences, 3) int counts: (tp, n_pred, n_gold) for entity_f1, (correct, total, total) for accuracy."""
    rows = []
    for index, ids in enumerate(predicted):
        if metric == "entity_f1":
            g, p = bmes_entities(gold.labels[index]), bmes_entities([labels[i] for i in ids])
            rows.append((len(g & p), len(p), len(g)))
        else:
            truth = gold.labels[index] if gold.kind == "tagging" else [gold.labels[index]]
            correct = sum(labels[i] == t for i, t in zip(ids, truth))
            rows.append((correct, len(truth), len(truth)))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def score_counts(metric: str, counts: np.ndarray) -> np.ndarray:
    """Summed counts (..., 3) -> the metric (...,): F1 = 2 tp / (pred + gold), accuracy = correct / total."""
    if metric == "entity_f1":
        return 2 * counts[..., 0] / np.maximum(counts[..., 1] + counts[..., 2], 1)
    return counts[..., 0] / np.maximum(counts[..., 1], 1)


def paired_bootstrap(
    metric: str, counts_a: np.ndarray, counts_b: np.ndarray, resamples: int = 1000, seed: int = 0
) -> dict:
    """Score of a minus score of b, with its 95 % percentile interval over ``resamples`` resamples of sentences."""
    if counts_a.shape != counts_b.shape:
        raise ValueError(f"paired counts differ in shape: {counts_a.shape} vs {counts_b.shape}")
    rng = np.random.default_rng(seed)
    difference = float(score_counts(metric, counts_a.sum(0)) - score_counts(metric, counts_b.sum(0)))
    samples = np.empty(resamples)
    for start in range(0, resamples, 100):  # in blocks: (100, n_sentences, 3) at a time
        index = rng.integers(0, len(counts_a), size=(min(100, resamples - start), len(counts_a)))
        samples[start : start + len(index)] = score_counts(metric, counts_a[index].sum(1)) - score_counts(
            metric, counts_b[index].sum(1)
        )
    low, high = np.percentile(samples, [2.5, 97.5])
    return {"difference": difference, "ci95": [float(low), float(high)], "resamples": resamples}


def verdict(comparison: dict) -> str:
    """'at least as good' (difference >= 0), 'tie' (below, but the interval holds 0) or 'worse'."""
    if comparison["difference"] >= 0:
        return "at least as good"
    low, high = comparison["ci95"]
    return "tie" if low <= 0 <= high else "worse"
