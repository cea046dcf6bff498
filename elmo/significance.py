"""Is one system better than another, worse, or tied? A paired bootstrap over sentences, and a verdict that says
what its interval says.

Each sentence contributes counts from which the metric is rebuilt for any resample: entity F1 from (true
positives, predicted, gold entities), accuracy from (correct, total). Both systems are scored on the same
resampled sentences, so the interval is that of the difference (Koehn 2004; Berg-Kirkpatrick et al. 2012).
Numpy only: the training side (`elmo adapt`'s word-sense change) and the task mixes (`elmo mix`) both use it.
"""

from __future__ import annotations

import numpy as np

# A difference inside ±TIE_MARGIN (one point of accuracy or F1) is too small to matter: an interval that lies
# wholly inside it is a tie. Wider intervals that hold 0 decide nothing (inconclusive).
TIE_MARGIN = 0.01


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


def verdict(comparison: dict, margin: float = TIE_MARGIN) -> str:
    """What the 95 % interval says: 'better' (wholly above 0), 'worse' (wholly below), 'tie (within ±m)' (wholly
    inside ±margin) or 'inconclusive' (it holds 0 but reaches past the margin: more data would be needed)."""
    low, high = comparison["ci95"]
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    if -margin <= low and high <= margin:
        return f"tie (within ±{margin:g})"
    return "inconclusive"
