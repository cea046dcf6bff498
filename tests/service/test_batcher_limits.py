"""The batcher's two dispatch limits on the real tiny runtime: ``--max-delay-ms`` (how long an idle batcher waits
for company) and ``--max-batch-sentences`` (a cap on each runtime call that also dispatches a full batch at once).

No wall-clock thresholds: "the batcher waited" is read from what the runtime was called with (the batch
compositions), and "it did not run yet" from the batcher's own counters after the event loop was given every chance
to run it. The one duration checked, a lone request's time in the queue, has a lower bound the code guarantees
(the batcher may not start before the delay has passed), so a slow machine can only make it larger.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import numpy as np
import pytest

from elmo.runtime import Embedder, EmbedStats
from service.batcher import Batcher, BatcherObserver, BatchStats
from service.limits import add_limit_arguments, limits_from_args
from service.models import serve_model

HANG_GUARD_S = 30.0  # only turns a batcher that never dispatches into a failure; far below the delays that test it
FOREVER_S = 600.0  # a max delay no test waits out: whatever dispatches, the delay did not


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


class Calls:
    """The real runtime, with each call's sentence lengths written down (the batch compositions). It has what
    service.models.serve_model reads of a runtime, so a batcher can be built the way `elmo serve` builds it."""

    def __init__(self, runtime: Embedder) -> None:
        self.runtime = runtime
        self.info = runtime.info
        self.meta = runtime.meta
        self.batches: list[list[int]] = []

    def embed_tokens_with_stats(self, sentences: list[list[str]]) -> tuple[list[np.ndarray], EmbedStats]:
        self.batches.append([len(s) for s in sentences])
        return self.runtime.embed_tokens_with_stats(sentences)


def sentence(n: int, tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def let_the_loop_run(turns: int = 100) -> None:
    """Give every ready task many turns of the event loop (no clock involved): a batcher that is allowed to dispatch
    takes a batch within a handful of turns (a batcher task wake-up is three or four callbacks)."""
    for _ in range(turns):
        await asyncio.sleep(0)


def batcher_from_flags(calls: Calls, *flags: str) -> Batcher:
    """A batcher built the way `elmo serve` builds it: its limit flags -> Limits -> serve_model."""
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    limits = limits_from_args(parser.parse_args(list(flags)))
    return serve_model(calls, Path(calls.info.model_dir), limits, BatcherObserver(), name="tiny").batcher


def test_max_delay_flag_reaches_the_batcher_and_a_lone_request_waits_it_out(runtime: Embedder) -> None:
    calls = Calls(runtime)

    async def scenario() -> tuple[np.ndarray, BatchStats]:
        batcher = batcher_from_flags(calls, "--max-delay-ms", "250", "--max-batch-sentences", "4")
        assert batcher.max_delay_s == 0.25 and batcher.max_batch_sentences == 4
        batcher.start()
        try:
            (vectors,), (stats,) = await asyncio.wait_for(batcher.embed([sentence(3, "a")]), HANG_GUARD_S)
        finally:
            await batcher.close()
        return vectors, stats

    vectors, stats = asyncio.run(scenario())
    assert calls.batches == [[3]]  # answered, alone
    assert vectors.tobytes() == runtime.embed_tokens([sentence(3, "a")])[0].tobytes()
    # The batcher may not start a partial batch before its oldest sentence waited max_delay: a lower bound by
    # construction (time.monotonic), which no slow machine can break.
    assert stats.queue_s >= 0.25


def test_a_request_arriving_within_the_delay_joins_the_waiting_one(runtime: Embedder) -> None:
    calls = Calls(runtime)

    async def scenario() -> list[tuple[list[np.ndarray], list[BatchStats]]]:
        batcher = Batcher(
            calls.embed_tokens_with_stats,
            max_batch_tokens=1000,
            max_batch_sentences=2,
            max_delay_s=FOREVER_S,
            max_queue_tokens=1000,
        )
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
            await let_the_loop_run()
            # Alone and within its delay: queued, not dispatched, although the runtime thread is free.
            assert (batcher.queued_sentences, batcher.batches_started) == (1, 0)
            second = asyncio.ensure_future(batcher.embed([sentence(5, "b")]))
            results = await asyncio.wait_for(asyncio.gather(first, second), HANG_GUARD_S)
        finally:
            await batcher.close()
        return results

    (first, second) = asyncio.run(scenario())
    # One runtime call for both (sorted by length), dispatched by the sentence cap long before the delay ran out.
    assert calls.batches == [[3, 5]]
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

    async def scenario() -> list[tuple[list[np.ndarray], list[BatchStats]]]:
        batcher = Batcher(
            calls.embed_tokens_with_stats,
            max_batch_tokens=8,
            max_batch_sentences=100,
            max_delay_s=FOREVER_S,
            max_queue_tokens=100,
        )
        batcher.start()
        try:
            small = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
            await let_the_loop_run()
            assert (batcher.queued_sentences, batcher.batches_started) == (1, 0)  # 3 of 8 tokens: waits for company
            filling = asyncio.ensure_future(batcher.embed([sentence(5, "b")]))
            return await asyncio.wait_for(asyncio.gather(small, filling), HANG_GUARD_S)
        finally:
            await batcher.close()

    asyncio.run(scenario())
    assert calls.batches == [[3, 5]]  # 8 queued tokens fill the budget: dispatched at once, together
