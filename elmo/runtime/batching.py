"""How a call is cut into onnxruntime runs: the token-vector cache (the char-CNN runs once per distinct token)
and the batch plan (length-sorted rows under a token budget, priced per recurrence step), with its cost.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("elmo.runtime")

ENCODER_CHUNK = 256  # distinct tokens per char-CNN run: its conv activations are ~0.4 MB per token


# -- token-vector cache --------------------------------------------------------------------------------------------
class TokenVectorCache:
    """A thread-safe LRU map token -> char-CNN vector (P,) float32. Capacity 0 disables it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: Sequence[str]) -> list[np.ndarray | None]:
        with self._lock:
            found = []
            for token in tokens:
                vector = self._entries.get(token)
                if vector is not None:
                    self._entries.move_to_end(token)
                found.append(vector)
            hits = sum(v is not None for v in found)
            self.hits += hits
            self.misses += len(found) - hits
            return found

    def store(self, tokens: Sequence[str], vectors: np.ndarray) -> None:
        if not self.capacity:
            return
        with self._lock:
            for token, vector in zip(tokens[-self.capacity :], vectors[-self.capacity :]):
                self._entries[token] = vector.copy()  # not a view: an evicted row must not pin its whole batch
                self._entries.move_to_end(token)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


# -- batching ------------------------------------------------------------------------------------------------------
# Cost of one recurrence step in "rows": a step costs (rows + STEP_COST) units, whatever the rows. On CPU the
# per-step overhead is small next to a row's MatMul work; on CUDA a step is a fixed train of kernel launches and
# extra rows are almost free, so fewer, wider batches win.
CPU_STEP_COST = 8.0
CUDA_STEP_COST = 256.0
RUN_COST = 64.0  # per onnxruntime run, in row-steps


# A window of at most this many candidate starts is searched in plain Python: numpy's argmin gives the GIL away on
# every call, and beside a busy thread (the service's event loop) each take back waited for the switch interval
# (planning 64 sentences: 0.5 ms alone, 30 ms beside a spinning thread). Wider windows (large CUDA budgets) use numpy.
PYTHON_WINDOW = 128


def plan_batches(steps: Sequence[int], max_batch_tokens: int, step_cost: float) -> list[int]:
    """Cut ``steps`` (per sentence, sorted ascending, boundaries included) into consecutive batches; returns the
    batch sizes. Minimises the sum over batches of ``longest * (rows + step_cost) + RUN_COST`` (padding counts
    as work) with ``rows * longest <= max_batch_tokens`` unless one row alone exceeds it. A dynamic programme,
    O(n * rows)."""
    n = len(steps)
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = steps[end - 1]
        first = end - max(1, min(end, max_batch_tokens // longest))
        cut[end], best[end] = _cheapest_start(best, first, end, longest, step_cost)
    sizes = []
    end = n
    while end > 0:
        sizes.append(end - cut[end])
        end = cut[end]
    return sizes[::-1]


def _cheapest_start(best: list[float], first: int, end: int, longest: int, step_cost: float) -> tuple[int, float]:
    """The start in [first, end) of the cheapest last batch ending at ``end``, and the plan's cost with it (the
    first start of least cost: both kernels break ties alike and compute the same float64 sums)."""
    if end - first <= PYTHON_WINDOW:
        pick, least = first, None
        for start in range(first, end):
            cost = best[start] + longest * ((end - start) + step_cost) + RUN_COST
            if least is None or cost < least:
                pick, least = start, cost
        return pick, least
    starts = np.arange(first, end)
    costs = np.asarray(best[first:end]) + longest * ((end - starts) + step_cost) + RUN_COST
    pick = int(np.argmin(costs))
    return first + pick, float(costs[pick])


def batch_positions(lengths: Sequence[int]) -> int:
    """The biLSTM positions one run of sentences of these token counts computes: rows x (longest + 2), the
    <S>/</S> boundaries and the padding of shorter rows included (the unit of ``max_batch_tokens``)."""
    return len(lengths) * (max(lengths) + 2)


def padded_count(rows: int) -> int:
    """The next power of two (at least 16, at most ENCODER_CHUNK) >= rows."""
    return min(ENCODER_CHUNK, max(16, 1 << (rows - 1).bit_length()))


@dataclass(frozen=True)
class EmbedStats:
    """What one embed call computed: ``tokens`` real tokens, ``padded_tokens`` biLSTM positions actually run
    (per run rows x (longest + 2): the <S>/</S> boundaries and the padding of shorter rows included, the unit of
    ``max_batch_tokens``) in ``runs`` onnxruntime runs. Returned per call, so concurrent callers never mix."""

    sentences: int
    tokens: int
    padded_tokens: int
    runs: int
