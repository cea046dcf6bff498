"""Background threads (elmo.runtime.priority) and the Embedder's background calls: lowered threads where the
platform has per-thread priorities, the caller's own priority untouched, the same vectors either way."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from elmo.errors import InputError
from elmo.runtime import CPU, Embedder
from elmo.runtime.priority import (
    MAX_NICE,
    background_executor,
    lower_this_thread,
    per_thread_priorities,
    thread_nice,
)

linux_only = pytest.mark.skipif(not per_thread_priorities(), reason="per-thread priorities are Linux's")


def _in_new_thread(work):
    out = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    thread.join(30)
    return out[0]


@linux_only
def test_a_thread_lowers_itself_and_no_other():
    before = thread_nice()
    lowered = _in_new_thread(lambda: (lower_this_thread(3), thread_nice()))
    assert lowered == (min(MAX_NICE, before + 3),) * 2
    assert thread_nice() == before  # the caller's thread (and so the process's other threads) unchanged


@linux_only
def test_lowering_stops_at_the_lowest_priority():
    assert _in_new_thread(lambda: (lower_this_thread(15), lower_this_thread(15))) == (
        min(MAX_NICE, thread_nice() + 15),
        MAX_NICE,
    )


def test_a_thread_cannot_be_asked_to_raise_its_priority():
    with pytest.raises(ValueError, match="can only lower"):
        lower_this_thread(-1)


@linux_only
def test_background_executor_threads_start_lowered():
    base = thread_nice()
    pool = background_executor(2, "test-background", 4)
    try:
        seen = {pool.submit(thread_nice).result(30) for _ in range(4)}
    finally:
        pool.shutdown()
    assert seen == {min(MAX_NICE, base + 4)}


def _parallel_embedder(model_dir, background_nice=7) -> Embedder:
    # a small budget: every call below runs as several batches, which go to the parallel runs' pools
    return Embedder(
        model_dir,
        providers=[CPU],
        intra_op_threads=2,
        runs_in_flight=2,
        max_batch_tokens=24,
        cache_size=0,
        background_nice=background_nice,
    )


SENTENCES = [[f"w{i}" for i in range(n)] for n in (3, 9, 14, 2, 7, 11)]


def test_a_background_call_gives_the_same_vectors(tiny_model_dir):
    embedder = _parallel_embedder(tiny_model_dir)
    foreground, stats = embedder.embed_tokens_with_stats(SENTENCES)
    background, background_stats = embedder.embed_tokens_with_stats(SENTENCES, background=True)
    assert stats.runs >= 2 and background_stats == stats
    for a, b in zip(foreground, background):
        np.testing.assert_array_equal(a, b)


@linux_only
def test_background_batches_run_on_lowered_threads_and_foreground_ones_do_not(tiny_model_dir):
    embedder = _parallel_embedder(tiny_model_dir)
    base, ran_at = thread_nice(), []
    contextualize = embedder._contextualize

    def recorded(table, rows, parallel=False):
        ran_at.append((parallel, thread_nice()))
        return contextualize(table, rows, parallel)

    embedder._contextualize = recorded
    embedder.embed_tokens_with_stats(SENTENCES, background=True)
    background, ran_at = ran_at, []
    embedder.embed_tokens_with_stats(SENTENCES)
    assert len(background) >= 2 and set(background) == {(True, min(MAX_NICE, base + 7))}
    assert len(ran_at) >= 2 and set(ran_at) == {(True, base)}


def test_background_nice_is_checked(tiny_model_dir):
    with pytest.raises(InputError, match="background_nice must be in 0..19"):
        Embedder(tiny_model_dir, providers=[CPU], background_nice=20)
