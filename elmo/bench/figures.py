"""How every benchmark reports its numbers, ``elmo bench`` and the repository's bench/ scripts alike: percentiles of a
sample, and the machine the figures come from (elmo.runtime.host: the CPU model and the flags that pick onnxruntime's
kernels; cores and load average, since the benches run on shared machines)."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable, Sequence

import numpy as np

from elmo.runtime.host import host_facts

LATENCY_QUANTILES = (50, 90, 99)


def percentiles(
    values: Iterable[float], quantiles: Sequence[float] = LATENCY_QUANTILES, scale: float = 1.0, digits: int = 2
) -> dict:
    """{"n", "p50", ..., "max", "mean"} of ``values`` times ``scale``, rounded to ``digits`` (numpy's linear
    interpolation, so p50 is the median); {"n": 0} when there is nothing. Keys: ``p{q}`` (``p1``, ``p99.9``)."""
    data = np.asarray(values if isinstance(values, np.ndarray | list | tuple) else list(values), dtype=float) * scale
    if data.size == 0:
        return {"n": 0}
    out: dict = {"n": int(data.size)}
    out |= {f"p{q:g}": round(float(np.percentile(data, q)), digits) for q in quantiles}
    return out | {"max": round(float(data.max()), digits), "mean": round(float(data.mean()), digits)}


def percentiles_ms(seconds: Iterable[float], quantiles: Sequence[float] = LATENCY_QUANTILES, digits: int = 2) -> dict:
    """:func:`percentiles` of durations in seconds, reported in milliseconds."""
    return percentiles(seconds, quantiles, 1000.0, digits)


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load average, rounded."""
    return [round(v, 2) for v in os.getloadavg()]


def machine(load_at_start: Sequence[float] | None = None) -> dict:
    """The machine, and its load average now and, when given, at the bench's start: read the figures with the load
    beside them. ``host``: elmo.runtime.host.host_facts (CPU model, kernel-relevant flags, cores, library versions)."""
    out = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "host": host_facts(),
    }
    if load_at_start is not None:
        out["load_average_at_start"] = [round(v, 2) for v in load_at_start]
    out["load_average_at_end"] = load_average()
    return out
