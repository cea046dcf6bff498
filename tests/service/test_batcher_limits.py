"""The batcher's dispatch rules on the real tiny runtime: an idle batcher with nothing else ready on the event loop
dispatches at once; while a batch runs, ``--max-delay-ms`` is how long a partial batch waits for company;
``--max-batch-sentences`` caps each runtime call and dispatches a full batch at once.

No wall-clock thresholds: "the batcher waited" is read from what the runtime was called with (the batch
compositions), and "it did not run yet" from the batcher's own counters after the event loop was given every chance
to run it. A batch "runs" for as long as a test holds its gate (:class:`Calls`), so no timing decides what is busy.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from elmo.service.common.limits import add_limit_arguments, limits_from_args
from elmo.service.models.batcher import Batcher, BatchStats
from elmo.service.models.registry import serve_model
from elmo.service.telemetry.hooks import BatcherObserver

from elmo.runtime import Embedder, EmbedStats

HANG_GUARD_S = 30.0  # only turns a batcher that never dispatches into a failure; far below the delays that test it
FOREVER_S = 600.0  # a max delay no test waits out: whatever dispatches, the delay did not


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


class Calls:
    """The real runtime, with each call's sentence lengths written down (the batch compositions). It has what
    service.models.registry.serve_model reads of a runtime, so a batcher can be built the way `elmo serve` builds it."""

    def __init__(self, runtime: Embedder) -> None:
        self.runtime = runtime
        self.info = runtime.info
        self.meta = runtime.meta
        self.batches: list[list[int]] = []
        self.gate = threading.Event()  # a call whose first token is "HOLD" waits for it: a batch that keeps running
        self.gate.set()

    def embed_tokens_with_stats(self, sentences: list[list[str]]) -> tuple[list[np.ndarray], EmbedStats]:
        self.batches.append([len(s) for s in sentences])
        if any(s[0] == "HOLD" for s in sentences):
            self.gate.wait(HANG_GUARD_S)
        return self.runtime.embed_tokens_with_stats(sentences)


def sentence(n: int, tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def let_the_loop_run(turns: int = 100) -> None:
    """Give every ready task many turns of the event loop: a batcher that is allowed to dispatch takes a batch within
    a handful of turns (a batcher task wake-up is three or four callbacks). The test waits on the loop's timers, not
    in its ready queue: an idle batcher holds a batch while other callbacks are ready (requests on their way to it),
    and a test that yielded with ``sleep(0)`` would be one of them, every turn. A millisecond a turn (the selector's
    resolution) leaves the ready queue empty between turns however slow the machine. The timers only pace the
    turns; no assertion depends on how long they take."""
    for _ in range(turns):
        await asyncio.sleep(0.001)


def batcher_from_flags(calls: Calls, *flags: str) -> Batcher:
    """A batcher built the way `elmo serve` builds it: its limit flags -> Limits -> serve_model."""
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    limits = limits_from_args(parser.parse_args(list(flags)))
    return serve_model(calls, Path(calls.info.model_dir), limits, BatcherObserver(), name="tiny").batcher


def test_max_delay_flag_reaches_the_batcher_and_an_idle_batcher_does_not_wait(runtime: Embedder) -> None:
    calls = Calls(runtime)

    async def scenario() -> tuple[np.ndarray, int]:
        batcher = batcher_from_flags(calls, "--max-delay-ms", str(FOREVER_S * 1000), "--max-batch-sentences", "4")
        assert batcher.max_delay_s == FOREVER_S and batcher.max_batch_sentences == 4
        batcher.start()
        try:
            lone = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
            await let_the_loop_run()
            started = batcher.batches_started  # nothing runs: a lone request goes at once, whatever the delay
            (vectors,), _ = await asyncio.wait_for(lone, HANG_GUARD_S)
        finally:
            await batcher.close()
        return vectors, started

    vectors, started = asyncio.run(scenario())
    assert started == 1 and calls.batches == [[3]]
    assert vectors.tobytes() == runtime.embed_tokens([sentence(3, "a")])[0].tobytes()


def _two_worker_batcher(calls: Calls, max_batch_tokens: int, max_batch_sentences: int) -> Batcher:
    return Batcher(
        calls.embed_tokens_with_stats,
        max_batch_tokens=max_batch_tokens,
        max_batch_sentences=max_batch_sentences,
        max_delay_s=FOREVER_S,
        max_queue_tokens=1000,
        workers=2,
    )


async def _start_a_running_batch(batcher: Batcher, calls: Calls) -> asyncio.Future:
    """One batch held running (its gate closed): the second worker is free, so the delay rules what waits."""
    calls.gate.clear()
    held = asyncio.ensure_future(batcher.embed([["HOLD"]]))
    await let_the_loop_run()
    assert batcher.batches_running == 1
    return held


def test_a_request_arriving_within_the_delay_joins_the_waiting_one(runtime: Embedder) -> None:
    calls = Calls(runtime)

    async def scenario() -> list[tuple[list[np.ndarray], list[BatchStats]]]:
        batcher = _two_worker_batcher(calls, max_batch_tokens=1000, max_batch_sentences=2)
        batcher.start()
        try:
            held = await _start_a_running_batch(batcher, calls)
            first = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
            await let_the_loop_run()
            # A batch runs and this one is partial and within its delay: queued, although a worker is free.
            assert (batcher.queued_sentences, batcher.batches_started) == (1, 1)
            second = asyncio.ensure_future(batcher.embed([sentence(5, "b")]))
            results = await asyncio.wait_for(asyncio.gather(first, second), HANG_GUARD_S)
            calls.gate.set()
            await asyncio.wait_for(held, HANG_GUARD_S)
        finally:
            calls.gate.set()
            await batcher.close()
        return results

    (first, second) = asyncio.run(scenario())
    # One runtime call for both (sorted by length), dispatched by the sentence cap long before the delay ran out.
    assert calls.batches == [[1], [3, 5]]
    assert [stats.sentences for stats in first[1] + second[1]] == [2, 2]
    assert first[0][0].shape == (3, 3, 16) and second[0][0].shape == (3, 5, 16)


def test_max_batch_sentences_caps_every_runtime_call(runtime: Embedder) -> None:
    calls = Calls(runtime)
    sentences = [sentence(n, f"s{k}_") for k, n in enumerate([4, 1, 3, 2, 5, 1, 2])]

    async def scenario() -> tuple[list[np.ndarray], list[BatchStats]]:
        batcher = batcher_from_flags(calls, "--max-batch-sentences", "3", "--max-delay-ms", "250")
        batcher.start()
        try:
            return await asyncio.wait_for(batcher.embed(sentences), HANG_GUARD_S)
        finally:
            await batcher.close()

    vectors, stats = asyncio.run(scenario())
    # Oldest first, at most 3 per runtime call, each call sorted by length (the last one, partial, after the delay).
    assert calls.batches == [[1, 3, 4], [1, 2, 5], [2]]
    assert [s.sentences for s in stats] == [3, 3, 3, 3, 3, 3, 1]
    for tokens, got in zip(sentences, vectors, strict=True):  # in request order, within the batching bound (issue 8)
        np.testing.assert_allclose(got, runtime.embed_tokens([tokens])[0], rtol=0, atol=1e-6)


def test_a_full_token_budget_dispatches_without_waiting_for_the_delay(runtime: Embedder) -> None:
    calls = Calls(runtime)

    async def scenario() -> None:
        batcher = _two_worker_batcher(calls, max_batch_tokens=8, max_batch_sentences=100)
        batcher.start()
        try:
            held = await _start_a_running_batch(batcher, calls)
            small = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
            await let_the_loop_run()
            assert (batcher.queued_sentences, batcher.batches_started) == (1, 1)  # 3 of 8 tokens: waits for company
            filling = asyncio.ensure_future(batcher.embed([sentence(5, "b")]))
            await asyncio.wait_for(asyncio.gather(small, filling), HANG_GUARD_S)
            calls.gate.set()
            await asyncio.wait_for(held, HANG_GUARD_S)
        finally:
            calls.gate.set()
            await batcher.close()

    asyncio.run(scenario())
    assert calls.batches == [[1], [3, 5]]  # 8 queued tokens fill the budget: dispatched at once, together
