"""The dynamic batcher on the real tiny runtime: batch formation under the token budget, admission,
deadlines, cancellation, runtime errors, shutdown. The runtime's worker thread is held with a threading.Event
where a test needs work to queue up, so nothing depends on timing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import threading
import time

import numpy as np
import pytest
from elmo.service.common.errors import Kind, ServiceError
from elmo.service.models.batcher import Batcher
from elmo.service.telemetry.hooks import BatcherObserver

from elmo.runtime import Embedder
from elmo.runtime.priority import per_thread_priorities, thread_nice


@pytest.fixture(scope="module")
def runtime(tiny_model_dir) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


class Recorder(BatcherObserver):
    """Real runtime calls, with the batch compositions and observer events written down."""

    def __init__(self, runtime: Embedder):
        self.runtime = runtime
        self.batches: list[list[int]] = []
        self.done: list[tuple[int, int, int]] = []  # (sentences, tokens, padded tokens) per finished batch
        self.dropped_counts: dict[str, int] = {}

    def embed(self, sentences: list[list[str]]):
        self.batches.append([len(s) for s in sentences])
        return self.runtime.embed_tokens_with_stats(sentences)

    def batch_done(self, sentences: int, tokens: int, padded_tokens: int, seconds: float) -> None:
        self.done.append((sentences, tokens, padded_tokens))

    def dropped(self, reason: str, count: int) -> None:
        self.dropped_counts[reason] = self.dropped_counts.get(reason, 0) + count


def make(recorder: Recorder, **limits) -> Batcher:
    settings = dict(max_batch_tokens=20, max_batch_sentences=8, max_delay_s=0.0, max_queue_tokens=100)
    settings.update(limits)
    batcher = Batcher(recorder.embed, name="tiny", observer=recorder, **settings)
    batcher.start()
    return batcher


def sentence(n: int, tag: str = "w") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def held(batcher: Batcher) -> threading.Event:
    """Occupy the runtime thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    batcher.executor.submit(lambda: (started.set(), release.wait(30)))
    await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
    return release


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_batches_take_the_oldest_first_and_fill_the_token_budget(runtime):
    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        sentences = [sentence(n, f"s{i}_") for i, n in enumerate([10, 2, 9, 3, 10, 1])]
        vectors, stats = await batcher.embed(sentences)
        await batcher.close()
        return recorder, sentences, vectors, stats

    recorder, sentences, vectors, stats = asyncio.run(scenario())
    # Budget 20 real tokens, first fit in arrival order: 10 + 2 (+9 no) + 3 (+10 no) + 1 = 16, then 9 + 10 = 19.
    # Every call reaches the runtime sorted by length.
    assert recorder.batches == [[1, 2, 3, 10], [9, 10]]
    for tokens, got in zip(sentences, vectors, strict=True):
        # Order restored; values as the sentence alone, within the runtime's batch-composition bound (issue 8).
        np.testing.assert_allclose(got, runtime.embed_tokens([tokens])[0], rtol=0, atol=1e-6)
    assert [s.sentences for s in stats] == [4, 4, 2, 4, 2, 4]
    assert [s.tokens for s in stats] == [16, 16, 19, 16, 19, 16]
    # The observer gets the runtime's padded positions, rows x (longest + 2) per run. Under the default CPU budget
    # (4096) each call is one run: splitting would cost more (plan_batches: longest x (rows + 8) + 64 per run, e.g.
    # 12 x 12 + 64 = 208 for [1, 2, 3, 10] together against 5 x 11 + 64 + 12 x 9 + 64 = 291 for [1, 2, 3] + [10]).
    assert recorder.done == [(4, 16, 4 * (10 + 2)), (2, 19, 2 * (10 + 2))]


def test_admission_is_all_or_nothing_and_overload_is_refused_at_once(runtime):
    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder, max_queue_tokens=10)
        release = await held(batcher)
        first = asyncio.ensure_future(batcher.embed([sentence(6)]))
        await until(lambda: batcher.batches_started == 1)  # taken into a batch, waiting for the thread
        second = asyncio.ensure_future(batcher.embed([sentence(6)]))
        await until(lambda: batcher.queued_tokens == 6)
        with pytest.raises(ServiceError) as info:
            await batcher.embed([sentence(2), sentence(3)])  # 6 + 5 > 10: none of it is queued
        assert info.value.kind is Kind.OVERLOADED and info.value.message.startswith("overloaded")
        assert batcher.queued_tokens == 6
        release.set()
        results = await asyncio.gather(first, second)
        await batcher.close()
        return recorder, results

    recorder, results = asyncio.run(scenario())
    assert [r[0][0].shape[1] for r in results] == [6, 6]
    assert recorder.dropped_counts == {"overloaded": 2}


def test_expired_and_cancelled_work_never_reaches_the_runtime(runtime):
    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        with pytest.raises(ServiceError) as info:
            await batcher.embed([sentence(4)], deadline=time.monotonic() - 1)
        assert info.value.kind is Kind.DEADLINE
        release = await held(batcher)
        filler = asyncio.ensure_future(batcher.embed([sentence(7)]))
        await until(lambda: batcher.batches_started == 1)
        expiring = asyncio.ensure_future(batcher.embed([sentence(5)], deadline=time.monotonic() + 0.05))
        abandoned = asyncio.ensure_future(batcher.embed([sentence(3)]))
        await until(lambda: batcher.queued_tokens == 8)
        abandoned.cancel()
        await asyncio.sleep(0.1)  # past the deadline of `expiring` while it is still queued
        release.set()
        await filler
        with pytest.raises(ServiceError) as info:
            await expiring
        assert info.value.kind is Kind.DEADLINE and "dropped" in info.value.message
        await batcher.close()
        return recorder

    recorder = asyncio.run(scenario())
    assert recorder.batches == [[7]]
    assert recorder.dropped_counts == {"deadline": 2, "cancelled": 1}


def test_an_abandoned_request_leaves_the_queue_at_once_and_frees_its_room(runtime):
    """Its tokens stop counting against --max-queue-tokens when its caller goes, not when a batch next forms."""

    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder, max_queue_tokens=10)
        release = await held(batcher)
        filler = asyncio.ensure_future(batcher.embed([sentence(2)]))
        await until(lambda: batcher.batches_started == 1)  # the only worker took it: the rest queues
        abandoned = asyncio.ensure_future(batcher.embed([sentence(8)]))
        await until(lambda: batcher.queued_tokens == 8)
        abandoned.cancel()
        await asyncio.gather(abandoned, return_exceptions=True)
        queued_after_cancel = batcher.queued_tokens
        after = asyncio.ensure_future(batcher.embed([sentence(9)]))  # 9 fits only once the 8 are gone
        await until(lambda: batcher.queued_tokens == 9)
        release.set()
        await asyncio.gather(filler, after)
        await batcher.close()
        return recorder, queued_after_cancel

    recorder, queued_after_cancel = asyncio.run(scenario())
    assert queued_after_cancel == 0
    assert recorder.batches == [[2], [9]]
    assert recorder.dropped_counts == {"cancelled": 1}


def test_requests_that_arrive_together_at_an_idle_server_share_its_first_batch(runtime):
    """One pump per pass of the event loop: a burst is queued whole before the first batch forms."""

    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        results = await asyncio.gather(*(batcher.embed([sentence(n, f"b{n}_")]) for n in (2, 3, 4)))
        await batcher.close()
        return recorder, results

    recorder, results = asyncio.run(scenario())
    assert recorder.batches == [[2, 3, 4]]
    assert [r[1][0].sentences for r in results] == [3, 3, 3]


@contextlib.contextmanager
def a_callback_always_ready():
    """A callback that keeps itself ready on the running event loop until the block ends: a loop never idle."""
    loop = asyncio.get_running_loop()
    busy = True

    def spin() -> None:
        if busy:
            loop.call_soon(spin)

    spin()
    try:
        yield
    finally:
        busy = False


def test_what_queued_while_a_batch_ran_goes_when_it_ends_whatever_the_loop_has_ready(runtime):
    """One worker: a request queued while the first batch runs goes the moment that batch ends, although a callback
    keeps itself ready on the loop all along (a loaded runtime, a GPU's above all, runs back to back); held until
    max_delay, a minute here, it would time out."""

    async def scenario():
        gate = Gate(runtime)
        batcher = Batcher(
            gate.embed,
            name="tiny",
            observer=gate,
            workers=1,
            max_batch_tokens=64,
            max_batch_sentences=8,
            max_delay_s=60.0,
            max_queue_tokens=100,
        )
        batcher.start()
        first = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
        await until(lambda: gate.inside == 1)
        second = asyncio.ensure_future(batcher.embed([sentence(4, "b")]))
        await until(lambda: batcher.queued_sentences == 1)
        with a_callback_always_ready():
            gate.release.set()
            results = await asyncio.wait_for(asyncio.gather(first, second), 30)
        await batcher.close()
        return gate, results

    gate, results = asyncio.run(scenario())
    assert gate.batches == [[3], [4]]
    assert [r[1][0].sentences for r in results] == [1, 1]


class _NoThread(RuntimeError):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["submit raises", "pool drops it"])
def test_a_batch_that_never_reaches_a_worker_fails_its_callers_and_the_batcher_goes_on(runtime, how):
    """No thread to be had (a pid limit), or a pool that broke before the work ran: the callers get INTERNAL and the
    worker comes back, so later requests are served (a lost worker would leave them queued for ever)."""

    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        submit, failures = batcher.executor.submit, []

        def flaky_submit(fn, *args):
            if failures:
                return submit(fn, *args)
            failures.append(how)
            if how == "submit raises":
                raise _NoThread("can't start new thread")
            dropped = concurrent.futures.Future()
            dropped.set_exception(concurrent.futures.BrokenExecutor("a thread initializer failed"))
            return dropped

        batcher.executor.submit = flaky_submit
        with pytest.raises(ServiceError) as info:
            await batcher.embed([sentence(3)])
        (vectors,), _ = await batcher.embed([sentence(2)])
        state = (batcher.batches_running, batcher.queued_tokens)
        await batcher.close()
        return info.value, vectors, state

    error, vectors, state = asyncio.run(scenario())
    assert error.kind is Kind.INTERNAL
    assert vectors.shape[1] == 2 and state == (0, 0)


def test_a_failing_batch_fails_its_callers_and_the_loop_goes_on(runtime):
    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        with pytest.raises(ServiceError) as info:
            await batcher.embed([["fine"], ["has", ""]])  # the runtime itself refuses an empty token
        assert info.value.kind is Kind.INVALID_INPUT
        (vectors,), _ = await batcher.embed([["still", "serving"]])
        await batcher.close()
        return vectors

    assert asyncio.run(scenario()).shape == (3, 2, 16)


def test_a_request_of_no_sentences_is_answered_at_once(runtime):
    async def scenario():
        batcher = make(Recorder(runtime))
        answer = await asyncio.wait_for(batcher.embed([]), timeout=10)
        await batcher.close()
        return answer

    assert asyncio.run(scenario()) == ([], [])


def test_close_fails_queued_work_with_unavailable(runtime):
    async def scenario():
        recorder = Recorder(runtime)
        batcher = make(recorder)
        release = await held(batcher)
        running = asyncio.ensure_future(batcher.embed([sentence(2)]))
        await until(lambda: batcher.batches_started == 1)
        queued = asyncio.ensure_future(batcher.embed([sentence(3)]))
        await until(lambda: batcher.queued_tokens == 3)
        closing = asyncio.ensure_future(batcher.close())
        with pytest.raises(ServiceError) as info:
            await queued
        assert info.value.kind is Kind.UNAVAILABLE
        release.set()
        await closing
        with pytest.raises(ServiceError) as info:
            await running  # answered by close(): its batch result is not waited for
        assert info.value.kind is Kind.UNAVAILABLE
        with pytest.raises(ServiceError):
            await batcher.embed([sentence(1)])
        await asyncio.sleep(0.05)  # the held batch's end reaches the loop after close()
        return recorder

    recorder = asyncio.run(scenario())
    assert recorder.done == []  # a batch whose callers were told UNAVAILABLE is not counted as served


class Gate(Recorder):
    """Holds every runtime call until ``release`` is set, counting how many are inside at once."""

    def __init__(self, runtime: Embedder):
        super().__init__(runtime)
        self.release = threading.Event()
        self.inside = self.most_inside = 0
        self.lock = threading.Lock()

    def embed(self, sentences: list[list[str]]):
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self.release.wait(30)
            return super().embed(sentences)
        finally:
            with self.lock:
                self.inside -= 1


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_bound_the_runtime_calls_in_flight(runtime, workers):
    # Three requests that cannot share a batch (10 tokens each, budget 10): with one worker the second waits for
    # the first call to return; with two, two calls are inside the runtime at once, never three.
    async def scenario():
        gate = Gate(runtime)
        batcher = Batcher(
            gate.embed,
            name="tiny",
            observer=gate,
            workers=workers,
            max_batch_tokens=10,
            max_batch_sentences=8,
            max_delay_s=0.0,
            max_queue_tokens=100,
        )
        batcher.start()
        calls = [asyncio.ensure_future(batcher.embed([sentence(10, f"r{i}_")])) for i in range(3)]
        await until(lambda: gate.inside == workers)
        await asyncio.sleep(0.05)  # room for a call beyond the bound to start, were it allowed to
        inside = gate.inside
        gate.release.set()
        results = await asyncio.gather(*calls)
        await batcher.close()
        return gate, inside, results

    gate, inside, results = asyncio.run(scenario())
    assert inside == workers and gate.most_inside == workers
    assert sorted(gate.batches) == [[10], [10], [10]]
    expected = runtime.embed_tokens([sentence(10, f"r{i}_") for i in range(3)])
    for (vectors, _), want in zip(results, expected):
        np.testing.assert_allclose(vectors[0], want, atol=1e-6, rtol=0)


def test_a_partial_batch_waits_for_company_within_max_delay_in_whole_milliseconds(runtime):
    # A batch runs and a second worker is free: a lone request waits for company, at most max_delay (10.5 ms here),
    # then goes alone. The loop's timer wakes in whole milliseconds (epoll; asyncio rounds a wait up), so every
    # wake-up the batcher asks for, rounded up to a millisecond, must fall within the request's max_delay: a timer
    # for the exact remainder (10.5 ms) would wake at 11.
    max_delay = 0.0105

    async def scenario():
        loop = asyncio.get_running_loop()
        gate = Gate(runtime)
        batcher = Batcher(
            gate.embed,
            name="tiny",
            observer=gate,
            workers=2,
            max_batch_tokens=64,
            max_batch_sentences=8,
            max_delay_s=max_delay,
            max_queue_tokens=100,
        )
        batcher.start()
        wakeups: list[tuple[float, float]] = []  # (the wake-up as the selector rounds it, the request's bound)
        call_at = loop.call_at

        def recorded(when, callback, *args, **kwargs):
            if callback == batcher._timer_fired:
                now = loop.time()
                rounded = now + math.ceil(round((when - now) * 1e3, 6)) / 1e3
                wakeups.append((rounded, batcher.queue.items[0].enqueued + max_delay))
            return call_at(when, callback, *args, **kwargs)

        loop.call_at = recorded
        first = asyncio.ensure_future(batcher.embed([sentence(3, "a")]))
        await until(lambda: gate.inside == 1)  # the first batch runs (held), the second worker is free
        second = asyncio.ensure_future(batcher.embed([sentence(3, "b")]))
        await until(lambda: gate.inside == 2)  # it went alone once max_delay was up, the first still held
        gate.release.set()
        await asyncio.gather(first, second)
        await batcher.close()
        return gate, wakeups

    gate, wakeups = asyncio.run(scenario())
    assert gate.batches == [[3], [3]]
    assert wakeups, "the lone request never waited for company"
    assert all(wake <= bound + 1e-6 for wake, bound in wakeups), wakeups


def test_served_model_runs_as_many_calls_as_the_runtime_runs_batches(tiny_model_dir):
    from elmo.service.common.limits import Limits
    from elmo.service.models.registry import serve_model

    for runs in (1, 2):
        embedder = Embedder(tiny_model_dir, intra_op_threads=2, runs_in_flight=runs)
        served = serve_model(embedder, tiny_model_dir, Limits(), BatcherObserver())
        assert served.batcher.workers == runs
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Batcher(
            lambda sentences: None,
            workers=0,
            max_batch_tokens=1,
            max_batch_sentences=1,
            max_delay_s=0.0,
            max_queue_tokens=1,
        )


class Gated:
    """The real runtime, whose calls with a sentence starting with ``hold_prefix`` run until the test opens the
    gate; batch compositions written down. ``batcher()`` is a one-worker batcher with an express worker for
    requests of at most 10 tokens (or none)."""

    def __init__(self, runtime, hold_prefix: str):
        self.runtime, self.prefix = runtime, hold_prefix
        self.gate = threading.Event()
        self.batches: list[list[int]] = []

    def embed(self, sentences):
        self.batches.append([len(s) for s in sentences])
        if sentences[0][0].startswith(self.prefix):
            self.gate.wait(30)
        return self.runtime.embed_tokens_with_stats(sentences)

    def batcher(self, express_tokens: int = 10) -> Batcher:
        batcher = Batcher(
            self.embed,
            max_batch_tokens=64,
            max_batch_sentences=8,
            max_delay_s=0.0,
            max_queue_tokens=200,
            name="tiny",
            workers=1,
            express_tokens=express_tokens,
        )
        batcher.start()
        return batcher

    async def run(self, scenario, express_tokens: int = 10):
        """``scenario(batcher)`` with a held call possible; the gate always opens and the batcher closes after."""
        batcher = self.batcher(express_tokens)
        try:
            return await scenario(batcher)
        finally:
            self.gate.set()
            await batcher.close()


async def let_run(turns: int = 100) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


def test_a_short_request_takes_the_express_worker_while_long_ones_hold_the_others(runtime):
    """Every regular worker busy with a long request: a short one runs at once on the express worker; a long one
    queued meanwhile does not get it, and waits."""
    gated = Gated(runtime, "long")

    async def scenario(batcher):
        long_one = asyncio.ensure_future(batcher.embed([sentence(30, "long")]))
        await until(lambda: batcher.batches_running == 1)
        long_two = asyncio.ensure_future(batcher.embed([sentence(20, "long")]))  # over 10 tokens: not express
        short = asyncio.ensure_future(batcher.embed([sentence(3, "short")]))
        (vectors,), _ = await asyncio.wait_for(short, 30)  # answered while the long one still runs
        waiting = (batcher.queued_sentences, long_one.done(), long_two.done())
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(long_one, long_two), 30)
        return vectors, waiting

    vectors, waiting = asyncio.run(gated.run(scenario))
    assert waiting == (1, False, False)  # the second long request queued behind the first, not on the express worker
    np.testing.assert_allclose(vectors, runtime.embed_tokens([sentence(3, "short")])[0], rtol=0, atol=1e-6)


def test_without_an_express_worker_a_short_request_waits_behind_a_long_one(runtime):
    gated = Gated(runtime, "long")

    async def scenario(batcher):
        long_one = asyncio.ensure_future(batcher.embed([sentence(30, "long")]))
        await until(lambda: batcher.batches_running == 1)
        short = asyncio.ensure_future(batcher.embed([sentence(3, "short")]))
        await let_run()
        queued = (batcher.queued_sentences, short.done())
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(long_one, short), 30)
        return queued

    assert asyncio.run(gated.run(scenario, express_tokens=0)) == (1, False)


def test_the_express_worker_stays_idle_while_only_short_requests_run(runtime):
    """Short requests behind a short one are batched as usual: the express worker is for waits behind long ones."""
    gated = Gated(runtime, "hold")

    async def scenario(batcher):
        held = asyncio.ensure_future(batcher.embed([sentence(3, "hold")]))  # short, and running
        await until(lambda: batcher.batches_running == 1)
        short = asyncio.ensure_future(batcher.embed([sentence(3, "short")]))
        await let_run()
        queued = (batcher.queued_sentences, batcher.batches_running, short.done())
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(held, short), 30)
        return queued

    assert asyncio.run(gated.run(scenario)) == (1, 1, False)


def test_short_requests_batch_among_themselves_ahead_of_a_long_one(runtime):
    """A long request queued first and a short one after: the short one goes in a call of its own, first, instead
    of riding in the long one's (where it would wait for the whole long call)."""
    gated = Gated(runtime, "hold")

    async def scenario(batcher):
        held = asyncio.ensure_future(batcher.embed([sentence(2, "hold")]))  # short: no express worker for others
        await until(lambda: batcher.batches_running == 1)
        long = asyncio.ensure_future(batcher.embed([sentence(30, "long")]))
        short = asyncio.ensure_future(batcher.embed([sentence(3, "short")]))
        await until(lambda: batcher.queued_sentences == 2)
        gated.gate.set()
        await asyncio.wait_for(asyncio.gather(held, long, short), 30)

    asyncio.run(gated.run(scenario))
    assert gated.batches == [[2], [3], [30]]  # not [[2], [3, 30]]: the budget had room for both


@pytest.mark.skipif(not per_thread_priorities(), reason="per-thread priorities are Linux's")
@pytest.mark.parametrize("short_traffic_s", [60.0, 0.0], ids=["short requests about", "short requests long gone"])
def test_a_long_request_yields_to_short_ones_only_while_they_are_about(runtime, monkeypatch, short_traffic_s):
    """With an express lane, a batch holding a request over express_tokens runs on a lowered thread, through the
    background embed function, while a short request came within SHORT_TRAFFIC_S; otherwise (no short request yet,
    or none for that long) it runs at the normal priority. Short requests always do."""
    import elmo.service.models.batcher

    monkeypatch.setattr(elmo.service.models.batcher, "SHORT_TRAFFIC_S", short_traffic_s)
    seen: list[tuple[str, int, int]] = []  # (function, tokens, the thread's nice value)

    def recording(name):
        def embed(sentences):
            seen.append((name, sum(map(len, sentences)), thread_nice()))
            return runtime.embed_tokens_with_stats(sentences)

        return embed

    async def scenario():
        batcher = Batcher(
            recording("foreground"),
            background_fn=recording("background"),
            background_nice=5,
            max_batch_tokens=64,
            max_batch_sentences=8,
            max_delay_s=0.0,
            max_queue_tokens=200,
            name="tiny",
            express_tokens=10,
        )
        batcher.start()
        try:
            await batcher.embed([sentence(30, "long")])  # no short request yet
            await batcher.embed([sentence(3, "short")])
            long_vectors, _ = await batcher.embed([sentence(30, "long")])
        finally:
            await batcher.close()
        return long_vectors

    long_vectors = asyncio.run(scenario())
    base, lowered = thread_nice(), min(19, thread_nice() + 5)
    last = ("background", 30, lowered) if short_traffic_s else ("foreground", 30, base)
    assert seen == [("foreground", 30, base), ("foreground", 3, base), last]
    np.testing.assert_allclose(long_vectors[0], runtime.embed_tokens([sentence(30, "long")])[0], rtol=0, atol=1e-6)


def test_the_batching_policy_comes_as_one_object_or_by_name(runtime):
    from elmo.service.models.batcher import BatchingPolicy

    policy = BatchingPolicy(max_batch_tokens=20, max_batch_sentences=8, max_delay_s=0.0, max_queue_tokens=100)
    by_object = Batcher(Recorder(runtime).embed, policy, name="tiny")
    by_name = Batcher(Recorder(runtime).embed, policy, name="tiny", max_queue_tokens=50, workers=2)  # over the object
    for batcher in (by_object, by_name):
        batcher.executor.shutdown()
    assert by_object.policy == policy and (by_object.max_queue_tokens, by_object.workers) == (100, 1)
    assert (by_name.max_queue_tokens, by_name.workers, by_name.max_batch_tokens) == (50, 2, 20)
    with pytest.raises(TypeError, match="max_queue_token"):
        Batcher(Recorder(runtime).embed, policy, max_queue_token=5)  # a misspelt field is refused by name
