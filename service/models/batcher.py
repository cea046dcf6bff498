"""Dynamic batching across concurrent requests under a token budget.

Requests put their sentences (token lists) in one queue per model; batches are formed on the event loop whenever
something changes (requests arrived in this pass of the loop, a batch ended, a partial batch has waited long
enough: ``_pump``, no task of its own) and run the runtime in worker threads (``workers`` calls in flight per
model: one on CUDA, where one session feeds one device stream; on CPU as many as the runtime runs batches at once,
so that the next call's char-CNN and first batches fill the cores while the last one's final batch finishes).
Keeping the event loop free means a slow batch never blocks accepting or answering other calls. A worker hands its
outcome straight back to the event loop (one hop each way).

Batch formation, when a worker is free:
  * expired work (deadline passed) and abandoned work (caller cancelled) is dropped from the queue first;
  * requests take turns, one sentence each per round, the least served first (the fewest of its tokens computed
    so far), while the batch's real token count stays within ``max_batch_tokens`` (first fit): a short request is
    not stuck behind a long one, and a long one alone fills whole batches. Padding is not
    counted here on purpose: the runtime sorts every call by length and cuts it into padding-minimal sub-batches
    itself (elmo.runtime.plan_batches); short requests (``express_tokens``) batch among themselves whenever any
    is queued, so that none rides in a call with a long one;
  * when a batch ends and no other runs, what arrived while it ran goes at once (a loaded runtime, a GPU's above
    all, runs back to back); when requests arrive at an idle runtime, the queue goes as soon as the event loop has
    nothing else ready: no clock, but the requests already in the loop's hands join the batch (grpc.aio hands a
    busy loop its calls one event at a time; a batch of each alone costs the runtime a call each), at most
    ``max_delay`` after the oldest (any ready callback counts, so a loop kept busy, by a large answer's pieces say,
    holds it that long: raising ``max_delay`` raises this bound too); while a batch runs and a worker is free
    (``workers`` > 1), a partial batch waits at most ``max_delay`` for company;
  * the batch goes to the runtime sorted by length, results go back to each caller in its own order;
  * while short requests are about (one arrived in the last ``SHORT_TRAFFIC_S``), a batch that holds a long request
    (over ``express_tokens``) runs in the background: on threads of lower priority (``background_nice``,
    elmo.runtime.priority) and through ``background_fn``, so that the OS gives the cores to the short ones first.
    Under long requests only, nothing is waiting for the cores, and they run at the normal priority.
Admission is per request and all-or-nothing: if the queued tokens would exceed ``max_queue_tokens`` the request
is refused with OVERLOADED before any of it is queued.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from elmo.service.common.errors import Kind, ServiceError, from_library_error
from elmo.service.telemetry.hooks import BatcherObserver

from elmo.errors import ElmoError
from elmo.runtime import EmbedStats
from elmo.runtime.priority import background_executor

log = logging.getLogger("service.batcher")  # the documented logger name (docs/reference/metrics.md)

# (sentences of tokens) -> (per sentence float32 (n_layers, n_tokens, dim), what the call cost):
# Embedder.embed_tokens_with_stats. The cost is the runtime's own, since only it knows how it padded the call.
EmbedFn = Callable[[list[list[str]]], tuple[list[np.ndarray], EmbedStats]]
SHORT_TRAFFIC_S = 1.0  # long batches yield the cores while a short request came within this many seconds
# An event loop's timer wakes no sooner than the selector lets it: epoll counts whole milliseconds and asyncio rounds
# a wait up to the next one (a 0.1 ms timer fires after ~1.1 ms). A partial batch waits for company in whole
# milliseconds, so that the wake-up falls within max_delay; a remainder shorter than this is not waited for.
TIMER_RESOLUTION_S = 0.001
# Per event loop, the batchers' pumps held for the rest of its ready callbacks: they are not requests on their way,
# so two idle batchers on one loop do not hold each other's batches.
_HELD_PUMPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


@dataclass
class BatchStats:
    """What a sentence's batch looked like (reported back in EmbedResponse.timing)."""

    queue_s: float
    inference_s: float
    sentences: int
    tokens: int  # real tokens in the runtime call
    runtime_s: float = 0.0  # the runtime call alone, the end of ``inference_s`` (the rest: the hand-off to a worker)
    padded_tokens: int = 0  # positions the runtime ran (EmbedStats.padded_tokens)


class _Answers:
    """One request's sentences' results and the one future its caller awaits: resolved when its last sentence is
    answered, failed by the first failure (one future per request, not per sentence: each future's callbacks cost the
    event loop a turn)."""

    def __init__(self, future: asyncio.Future, n: int):
        self.future = future
        self.results: list = [None] * n
        self.remaining = n

    def done(self) -> bool:
        return self.future.done()

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    def answer(self, index: int, value: tuple[np.ndarray, BatchStats]) -> None:
        if self.future.done():
            return
        self.results[index] = value
        self.remaining -= 1
        if not self.remaining:
            self.future.set_result(self.results)


@dataclass
class _Item:
    tokens: list[str]
    answers: _Answers  # its request's: the sentence's result goes in at ``index``
    index: int
    deadline: float | None  # time.monotonic() seconds, None = no deadline
    request: int  # which embed() call queued it: requests take turns in a batch
    enqueued: float  # time.monotonic() when its request was queued

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@dataclass(eq=False)
class _Run:
    """A dispatched batch: its items, which worker took it, whether it holds a long request, when it was handed to
    the worker (time.monotonic()) and the seconds from then to the end of its runtime call."""

    batch: list[_Item]
    express: bool
    long: bool
    started: float
    seconds: float = 0.0
    called: float = 0.0  # time.monotonic() when the worker called the runtime


class Batcher:
    def __init__(
        self,
        embed_fn: EmbedFn,
        *,
        max_batch_tokens: int,
        max_batch_sentences: int,
        max_delay_s: float,
        max_queue_tokens: int,
        name: str = "model",
        observer: BatcherObserver | None = None,
        workers: int = 1,
        express_tokens: int = 0,
        background_fn: EmbedFn | None = None,
        background_nice: int = 0,
    ):
        self._embed_fn = embed_fn
        self._background_fn = background_fn or embed_fn
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sentences = max_batch_sentences
        self.max_delay_s = max_delay_s
        self.max_queue_tokens = max_queue_tokens
        self.name = name
        self.observer = observer or BatcherObserver()
        if workers < 1:
            raise ValueError(f"workers must be >= 1, not {workers}")
        self.workers = workers  # runtime calls in flight at once
        # One more call, only for requests of at most express_tokens tokens, while every worker is busy and a long
        # request is among what they run: the OS then shares the cores between it and the long calls instead of the
        # short request waiting for one to end. (Under short requests only, batching them is what pays.)
        self.express_tokens = express_tokens
        self.threads = workers + (1 if express_tokens else 0)
        self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"runtime-{name}")
        # Batches with a long request run here (only while there is an express lane: without one, nothing is short)
        self.background = (
            background_executor(workers, f"runtime-background-{name}", background_nice) if express_tokens else None
        )
        self._last_short = float("-inf")  # time.monotonic() when the last short request arrived
        self._free = workers  # workers not running a batch
        self._express_free = 1 if express_tokens else 0
        self._long_running = 0  # running batches that hold a request over express_tokens (only those make it wait)
        self._running: set[_Run] = set()  # dispatched batches, until their answers are out
        self._running_sentences = 0  # their sentences
        self._queue: list[_Item] = []
        self._queued_tokens = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._timer: asyncio.TimerHandle | None = None  # pumps again once a partial batch has waited max_delay
        self._pump_queued = False  # a pump is scheduled for this pass of the event loop
        self._pump_held = False  # a pump waits for the loop's ready callbacks (_pump_after_the_ready_callbacks)
        self._closed = False
        self.batches_started = 0
        self.batches_run = 0
        self.batches_running = 0  # dispatched and not finished (counted here, not by task callbacks, to be exact)
        self._requests = 0  # embed() calls so far: each one's sentences share a number
        self._served: dict[int, int] = {}  # request -> its tokens dispatched by turns so far, while it is queued
        self._sizes: dict[int, int] = {}  # request -> its tokens, while it is unfinished

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on the running event loop: batches are formed there, once per pass in which requests arrived, when
        a batch ends and when a partial batch has waited ``max_delay`` (:meth:`_pump`; no task of its own)."""
        self._loop = asyncio.get_running_loop()
        self._pump_queued = self._pump_held = False  # a pump left on a loop that has gone never runs

    async def close(self) -> None:
        """Refuse new work, fail what is still queued and what is running (UNAVAILABLE), stop the threads."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for item in self._take_all():
            item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
        for run in list(self._running):
            for item in run.batch:
                item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
        for executor in (self.executor, self.background):
            if executor is not None:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_sentences(self) -> int:
        return len(self._queue)

    @property
    def running_sentences(self) -> int:
        """Sentences in dispatched batches whose answers are not out yet (a count: safe to read from any thread)."""
        return self._running_sentences

    # -- submitting -----------------------------------------------------------------------------------------------
    async def embed(
        self, sentences: Sequence[list[str]], deadline: float | None = None
    ) -> tuple[list[np.ndarray], list[BatchStats]]:
        """Embed sentences (each a non-empty token list) -> per sentence (n_layers, n_tokens, dim) and batch stats.

        Raises ServiceError OVERLOADED (queue full), DEADLINE (expired while queued), UNAVAILABLE (closing),
        INVALID_INPUT / INTERNAL (runtime errors). Cancelling the caller abandons its queued sentences.
        """
        if self._closed or self._loop is None:
            raise ServiceError(Kind.UNAVAILABLE, "server is shutting down")
        if not sentences:
            return [], []
        n_tokens = sum(len(s) for s in sentences)
        if self._queued_tokens + n_tokens > self.max_queue_tokens:
            self.observer.dropped("overloaded", len(sentences))
            raise ServiceError(
                Kind.OVERLOADED,
                f"overloaded: {self._queued_tokens} tokens queued, this request adds {n_tokens}, "
                f"limit {self.max_queue_tokens} (--max-queue-tokens); retry with backoff",
            )
        if n_tokens <= self.express_tokens:
            self._last_short = time.monotonic()
        self._requests += 1
        request = self._requests
        answers = _Answers(self._loop.create_future(), len(sentences))
        now = time.monotonic()  # the request's sentences are queued together: one clock reading for all
        items = [_Item(list(tokens), answers, i, deadline, request, now) for i, tokens in enumerate(sentences)]
        self._served[request] = 0
        self._sizes[request] = n_tokens
        self._queue.extend(items)
        self._queued_tokens += n_tokens
        self.observer.queue_changed(len(self._queue), self._queued_tokens)
        try:
            self._pump_soon()
            results = await answers.future
        except BaseException:
            if not answers.future.done():
                answers.future.cancel()
            elif not answers.future.cancelled():
                answers.future.exception()  # mark retrieved: no "exception was never retrieved" log at GC time
            if answers.future.cancelled():
                self._drop_dead()  # abandoned: its queued sentences leave the queue now, uncomputed
            raise
        finally:
            self._served.pop(request, None)
            self._sizes.pop(request, None)
        return [r[0] for r in results], [r[1] for r in results]

    # -- forming and dispatching batches --------------------------------------------------------------------------
    def _pump(self, batch_ended: bool = False) -> None:
        """Start every batch that may start now, on the event loop: while work is queued and a worker may take it.
        A free worker takes the queue when a full batch is queued, when a batch has just ended and no other runs
        (``batch_ended``: what arrived while it ran goes at once, so a loaded runtime runs back to back), or when
        no batch runs and the event loop has no other callback ready (an idle runtime waits for no clock:
        :meth:`_loop_has_more_requests_coming`); else a partial batch waits for company until its oldest item has
        waited ``max_delay`` (a timer pumps again then, in whole milliseconds: :data:`TIMER_RESOLUTION_S`). With
        every worker busy, the express one takes short requests while a long one runs."""
        while not self._closed:
            self._drop_dead()
            if not self._queue:
                return
            express = False
            if not self._free:
                if not (self._express_free and self._long_running and self._short_requests()):
                    return  # every worker busy: the next batch's end pumps again
                express = True
            elif self.batches_running and not self._full():
                wait = self._queue[0].enqueued + self.max_delay_s - time.monotonic()
                if wait >= TIMER_RESOLUTION_S:
                    self._pump_in(wait // TIMER_RESOLUTION_S * TIMER_RESOLUTION_S)
                    return
            elif not batch_ended and self._loop_has_more_requests_coming():
                self._pump_after_the_ready_callbacks()
                return
            batch = self._form_batch()
            if not batch:
                return
            self._dispatch(batch, express)

    def _loop_has_more_requests_coming(self) -> bool:
        """An idle runtime holds a partial batch while the event loop has callbacks ready besides batchers' held
        pumps (other requests on their way to the queue: grpc.aio hands a busy loop its calls one event at a time,
        each a pass or two from here), until the oldest queued sentence has waited ``max_delay``. A lone caller's
        loop has nothing else ready, and its request goes at once."""
        if self._full() or self.max_delay_s <= 0:
            return False
        ready = getattr(self._loop, "_ready", None)  # asyncio's ready queue (CPython's event loops; absent: go)
        if ready is None or len(ready) <= _HELD_PUMPS.get(self._loop, 0):
            return False
        return time.monotonic() < self._queue[0].enqueued + self.max_delay_s

    def _pump_after_the_ready_callbacks(self) -> None:
        """Pump again once the callbacks ready now have run (one held pump per batcher at a time)."""
        assert self._loop is not None
        if self._pump_held:
            return
        self._pump_held = True
        _HELD_PUMPS[self._loop] = _HELD_PUMPS.get(self._loop, 0) + 1
        self._loop.call_soon(self._held_pump, self._loop)

    def _held_pump(self, loop: asyncio.AbstractEventLoop) -> None:
        self._pump_held = False
        _HELD_PUMPS[loop] -= 1
        self._pump()

    def _pump_soon(self) -> None:
        """Pump once the requests of this pass of the event loop are all queued (one pump for a burst: requests that
        arrive together at an idle server share its first batch instead of the first one going alone)."""
        assert self._loop is not None
        if not self._pump_queued:
            self._pump_queued = True
            self._loop.call_soon(self._queued_pump)

    def _queued_pump(self) -> None:
        self._pump_queued = False
        self._pump()

    def _full(self) -> bool:
        return self._queued_tokens >= self.max_batch_tokens or len(self._queue) >= self.max_batch_sentences

    def _pump_in(self, seconds: float) -> None:
        """Pump again in ``seconds`` (a timer that would fire later is moved earlier; an earlier one is kept: the
        pump it makes sets the next)."""
        assert self._loop is not None
        when = self._loop.time() + seconds
        if self._timer is not None and self._timer.when() <= when:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._timer_fired)

    def _timer_fired(self) -> None:
        self._timer = None
        self._pump()

    def _is_short(self, request: int) -> bool:
        """At most ``express_tokens`` tokens: what the express worker may take (none when it is off)."""
        return self._sizes.get(request, 0) <= self.express_tokens

    def _short_requests(self) -> set[int]:
        """Queued requests the express worker may take."""
        return {item.request for item in self._queue if self._is_short(item.request)}

    def _dispatch(self, batch: list[_Item], express: bool) -> None:
        """Hand ``batch`` to a worker thread; it reports back with :meth:`_finished` on the event loop (one hop
        each way, no task in between)."""
        assert self._loop is not None
        long = not all(self._is_short(item.request) for item in batch)
        if express:
            self._express_free -= 1
        else:
            self._free -= 1
        run = _Run(batch, express, long, time.monotonic())
        self._running.add(run)
        self._running_sentences += len(batch)
        self.batches_running += 1
        self._long_running += long
        self.batches_started += 1
        executor, embed_fn = self.executor, self._embed_fn
        if self._in_background(long):
            assert self.background is not None
            executor, embed_fn = self.background, self._background_fn
        try:
            handed = executor.submit(self._work, embed_fn, run, self._loop)
        except Exception as exc:  # noqa: BLE001 - no thread to be had: the batch fails, its worker comes back
            self._loop.call_soon(self._finished, run, None, exc)
            return
        handed.add_done_callback(lambda future: self._check_handed(future, run))

    def _check_handed(self, future: Future, run: _Run) -> None:
        """A batch whose ``_work`` never ran (its pool broke, or was shut down with it queued) fails like a runtime
        error, so that its callers hear and its worker comes back. (``_work`` itself never raises.)"""
        error = CancelledError("the worker pool dropped the batch") if future.cancelled() else future.exception()
        if error is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._finished, run, None, error)
            except RuntimeError:  # the event loop is closed: close() failed these callers already
                pass

    def _work(self, embed_fn: EmbedFn, run: _Run, loop: asyncio.AbstractEventLoop) -> None:
        """On a worker thread: the runtime call, then its outcome back to the event loop."""
        run.called = time.monotonic()
        try:
            outcome = embed_fn([item.tokens for item in run.batch])
            error = None
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the callers
            outcome, error = None, exc
        run.seconds = time.monotonic() - run.started
        try:
            loop.call_soon_threadsafe(self._finished, run, outcome, error)
        except RuntimeError:  # the event loop is closed: close() failed these callers already
            pass

    def _finished(
        self, run: _Run, outcome: tuple[list[np.ndarray], EmbedStats] | None, error: BaseException | None
    ) -> None:
        """On the event loop: a batch's answers (or its failure) to its callers, its worker back, the next batch."""
        try:
            self._answer(run, outcome, error)
        except Exception:  # a bug here must fail this batch's callers, never stop the batcher (or hang them)
            log.exception("batcher %s: batch handling failed", self.name)
            for item in run.batch:
                item.answers.fail(ServiceError(Kind.INTERNAL, "internal error while batching"))
        finally:
            self._running.discard(run)
            self._running_sentences -= len(run.batch)
            self.batches_running -= 1
            self._long_running -= run.long
            if run.express:
                self._express_free += 1
            else:
                self._free += 1
            self._pump(batch_ended=True)

    def _drop_dead(self) -> None:
        """Remove cancelled items and fail expired ones with DEADLINE, so no compute is spent on them."""
        now = time.monotonic()
        keep: list[_Item] = []
        expired = cancelled = 0
        for item in self._queue:
            if item.answers.future.cancelled():
                cancelled += 1
            elif item.deadline is not None and item.deadline <= now:
                expired += 1
                item.answers.fail(ServiceError(Kind.DEADLINE, "deadline exceeded while queued; the work was dropped"))
            elif item.answers.done():  # another sentence of its request failed: the request is over
                cancelled += 1
            else:
                keep.append(item)
        if expired or cancelled:
            self._queue = keep
            self._queued_tokens = sum(item.n_tokens for item in keep)
            self.observer.queue_changed(len(keep), self._queued_tokens)
            if expired:
                self.observer.dropped("deadline", expired)
            if cancelled:
                self.observer.dropped("cancelled", cancelled)

    def _form_batch(self) -> list[_Item]:
        """Fair and first fit: requests take turns, one sentence each per round, the one that has had the fewest of
        its tokens computed so far first (least attained service: a short request goes ahead of a long one that has
        been served for a while, and a long one alone fills whole batches); each takes its next sentence that still
        fits the token budget, and the first sentence always goes in. The queue holds live items only (the pump
        dropped the dead ones just before)."""
        if not self._queue:
            return []
        # Short requests batch among themselves whenever any is queued (the express worker takes nothing else): a
        # one-sentence request never rides in a call that also carries a long one. Long ones batch when none is.
        allowed = self._short_requests() or None
        if self._all_fit(allowed):
            return self._take_queue()
        lanes: dict[int, list[int]] = {}  # request -> its queued sentences' indices, in arrival order
        for i, item in enumerate(self._queue):
            if allowed is None or item.request in allowed:
                lanes.setdefault(item.request, []).append(i)
        chosen: list[int] = []
        tokens = 0
        turns = [lanes[r] for r in sorted(lanes, key=lambda r: (self._served.get(r, 0), lanes[r][0]))]
        while turns and len(chosen) < self.max_batch_sentences:
            still = []
            for lane in turns:
                if len(chosen) >= self.max_batch_sentences:
                    break
                fit = next(
                    (
                        k
                        for k, i in enumerate(lane)
                        if not chosen or tokens + self._queue[i].n_tokens <= self.max_batch_tokens
                    ),
                    None,
                )
                if fit is None:
                    continue  # nothing of this request fits any more: out of this batch
                i = lane.pop(fit)
                chosen.append(i)
                tokens += self._queue[i].n_tokens
                request = self._queue[i].request
                self._served[request] = self._served.get(request, 0) + self._queue[i].n_tokens
                if lane:
                    still.append(lane)
            turns = still
        taken = set(chosen)
        batch = [self._queue[i] for i in chosen]
        self._queue = [item for i, item in enumerate(self._queue) if i not in taken]
        self._queued_tokens -= tokens
        self.observer.queue_changed(len(self._queue), self._queued_tokens)
        return _by_length(batch)

    def _all_fit(self, allowed: set[int] | None) -> bool:
        """The whole queue is one batch: within both budgets and of one lane (all short, or no short request queued).
        The turns of :meth:`_form_batch` would take every sentence then, in another order that the batch's sort by
        length undoes but for ties; this takes them without the per-sentence turns."""
        if self._queued_tokens > self.max_batch_tokens or len(self._queue) > self.max_batch_sentences:
            return False
        return allowed is None or all(item.request in allowed for item in self._queue)

    def _take_queue(self) -> list[_Item]:
        """The whole queue as the next batch, sorted by length. Its requests leave the queue whole, so none takes a
        turn again: their served tokens, which only order the turns, need no count."""
        batch = self._take_all()
        self.observer.queue_changed(0, 0)
        return _by_length(batch)

    def _in_background(self, long: bool) -> bool:
        """A batch with a long request, while short requests are about (and there is a background pool)."""
        recent_short = time.monotonic() - self._last_short < SHORT_TRAFFIC_S
        return long and recent_short and self.background is not None

    def _answer(
        self, run: _Run, outcome: tuple[list[np.ndarray], EmbedStats] | None, error: BaseException | None
    ) -> None:
        """Each caller its sentences' vectors and the batch's stats, or every caller the batch's failure. Nothing
        once closed: close() answered these callers (UNAVAILABLE), and the batch is not counted as served."""
        if self._closed:
            return
        batch = run.batch
        if error is None and outcome is not None and len(outcome[0]) != len(batch):
            returned = len(outcome[0])
            error = ServiceError(Kind.INTERNAL, f"runtime returned {returned} results for {len(batch)} sentences")
        if error is not None or outcome is None:
            failure = _as_service_error(error if isinstance(error, Exception) else RuntimeError(repr(error)))
            if failure.kind is Kind.INTERNAL:
                log.error("batch of %d sentences failed on model %s", len(batch), self.name, exc_info=error)
            for item in batch:
                item.answers.fail(failure)
            return
        outputs, cost = outcome
        real = sum(item.n_tokens for item in batch)
        self.batches_run += 1
        self.observer.batch_done(len(batch), real, cost.padded_tokens, run.seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "model %s: batch of %d sentences, %d tokens (%d padded, %d runs), %.1f ms",
                self.name,
                len(batch),
                real,
                cost.padded_tokens,
                cost.runs,
                1000 * run.seconds,
            )
        stats: dict[int, BatchStats] = {}  # one per request: its sentences were queued together
        for item, output in zip(batch, outputs):
            if item.request not in stats:
                runtime_s = run.started + run.seconds - run.called
                stats[item.request] = BatchStats(run.started - item.enqueued, run.seconds, len(batch), real, runtime_s,
                                                 cost.padded_tokens)  # fmt: skip
            item.answers.answer(item.index, (output, stats[item.request]))

    def _take_all(self) -> list[_Item]:
        items, self._queue, self._queued_tokens = self._queue, [], 0
        return items


def _by_length(batch: list[_Item]) -> list[_Item]:
    """``batch`` sorted by tokens, in place: the runtime buckets by length, so it is handed over sorted."""
    batch.sort(key=lambda item: item.n_tokens)
    return batch


def _as_service_error(exc: Exception) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ElmoError):
        return from_library_error(exc)
    return ServiceError(Kind.INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")


__all__ = ["BatchStats", "Batcher", "EmbedFn"]
