"""One Embedder shared by several threads (what elmo.runtime promises: "safe to call from several threads") gives,
call for call, bit for bit the vectors the same calls give one after another. On CPU a call's vectors depend only
on its own sentences (the token cache holds vectors that do not depend on context, and the runtime cuts each call
into the same sub-batches whatever runs beside it), so anything shared that leaks between concurrent calls shows as
a changed bit. (tests/runtime/test_embedder.py checks that each call's EmbedStats are its own; this checks the
vectors.)"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from elmo.runtime import CPU, DEFAULT_CACHE_SIZE, Embedder

THREADS = 4
WORDS = "the cat dog sat on a mat 苹 果 公 司 run fast slow , . ! big small red naïve café 🙂".split() + [
    f"w{i}" for i in range(120)
]


def calls(seed: int = 7, n: int = 32) -> list[list[list[str]]]:
    """Calls of 1-6 sentences of 1-30 tokens, with many tokens shared between calls (so that cache entries are
    written by one thread while another reads them)."""
    rng = random.Random(seed)
    return [
        [[rng.choice(WORDS) for _ in range(rng.randint(1, 30))] for _ in range(rng.randint(1, 6))] for _ in range(n)
    ]


def embedder(model_dir: Path, cache_size: int) -> Embedder:
    # A small sub-batch budget so that most calls run as several onnxruntime runs.
    return Embedder(model_dir, providers=[CPU], intra_op_threads=1, max_batch_tokens=64, cache_size=cache_size)


@pytest.mark.parametrize("cache_size", [DEFAULT_CACHE_SIZE, 40, 0], ids=["cache", "evicting cache", "no cache"])
def test_concurrent_calls_equal_serial_calls_bit_for_bit(tiny_model_dir: Path, cache_size: int) -> None:
    work = calls()
    serial = [embedder(tiny_model_dir, cache_size).embed_tokens(call) for call in work]

    shared = embedder(tiny_model_dir, cache_size)  # cold: the threads fill its cache as they go
    start = threading.Barrier(THREADS)
    running, most_running = 0, 0
    lock = threading.Lock()

    def worker(indices: list[int]) -> list[tuple[int, list[np.ndarray]]]:
        nonlocal running, most_running
        start.wait(30)  # every thread begins together
        out = []
        for i in indices:
            with lock:
                running += 1
                most_running = max(most_running, running)
            out.append((i, shared.embed_tokens(work[i])))
            with lock:
                running -= 1
        return out

    with ThreadPoolExecutor(THREADS) as pool:
        parts = list(pool.map(worker, [list(range(k, len(work), THREADS)) for k in range(THREADS)]))
    concurrent = dict(pair for part in parts for pair in part)

    assert sorted(concurrent) == list(range(len(work)))
    assert most_running > 1  # the calls did overlap
    for i, expected in enumerate(serial):
        got = concurrent[i]
        assert len(got) == len(expected)
        for sentence, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g.shape == e.shape and g.dtype == e.dtype == np.float32
            assert g.tobytes() == e.tobytes(), f"call {i} sentence {sentence} differs from the serial run"
