"""Dynamic batching across concurrent requests: when a model's queue (service.models.queue) goes to the runtime,
and on which worker.

Batches are formed on the event loop whenever something changes (requests arrived in this pass of the loop, a batch
ended, a partial batch has waited long enough: ``_pump``, no task of its own) and run the runtime in worker threads
(``workers`` calls in flight per model: one on CUDA, where one session feeds one device stream; on CPU as many as
the runtime runs batches at once, so that the next call's char-CNN and first batches fill the cores while the last
one's final batch finishes). Keeping the event loop free means a slow batch never blocks accepting or answering
other calls. A worker hands its outcome straight back to the event loop (one hop each way).

When a worker is free it takes a batch (service.models.queue chooses which sentences):
  * when a batch ends and no other runs, what arrived while it ran goes at once (a loaded runtime, a GPU's above
    all, runs back to back);
  * when requests arrive at an idle runtime, those that arrived in one pass of the event loop go together at the
    end of that pass (one pump per pass);
  * while a batch runs and a worker is free (``workers`` > 1), a partial batch waits at most ``max_delay`` for
    company;
  * results go back to each caller in its own order;
  * while short requests are about (one arrived in the last ``SHORT_TRAFFIC_S``), a batch that holds a long request
    (over ``express_tokens``) runs in the background: on threads of lower priority (``background_nice``,
    elmo.runtime.priority) and through ``background_fn``, so that the OS gives the cores to the short ones first.
    Under long requests only, nothing is waiting for the cores, and they run at the normal priority.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
from elmo.service.common.errors import Kind, ServiceError, from_library_error
from elmo.service.models.queue import QueuedSentence, RequestQueue
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


@dataclass
class BatchStats:
    """What a sentence's batch looked like (reported back in EmbedResponse.timing)."""

    queue_s: float
    inference_s: float
    sentences: int
    tokens: int  # real tokens in the runtime call
    runtime_s: float = 0.0  # the runtime call alone, the end of ``inference_s`` (the rest: the hand-off to a worker)
    padded_tokens: int = 0  # positions the runtime ran (EmbedStats.padded_tokens)


@dataclass(eq=False)
class _Run:
    """A dispatched batch: its items, which worker took it, whether it holds a long request, when it was handed to
    the worker (time.monotonic()) and the seconds from then to the end of its runtime call."""

    batch: list[QueuedSentence]
    express: bool
    long: bool
    started: float
    seconds: float = 0.0
    called: float = 0.0  # time.monotonic() when the worker called the runtime


@dataclass(frozen=True)
class BatchingPolicy:
    """How one model's requests are batched: the budgets of a runtime call (``max_batch_tokens`` real tokens,
    ``max_batch_sentences``), how long a partial batch may wait for company (``max_delay_s``), what may queue
    (``max_queue_tokens``), the runtime calls in flight (``workers``), the size of a short request that may take
    the express worker (``express_tokens``; 0: no express worker) and how much lower long batches' threads run
    while short requests are about (``background_nice``)."""

    max_batch_tokens: int
    max_batch_sentences: int
    max_delay_s: float
    max_queue_tokens: int
    workers: int = 1
    express_tokens: int = 0
    background_nice: int = 0


class Batcher:
    def __init__(
        self,
        embed_fn: EmbedFn,
        policy: BatchingPolicy | None = None,
        *,
        name: str = "model",
        observer: BatcherObserver | None = None,
        background_fn: EmbedFn | None = None,
        **policy_fields,
    ):
        """``policy`` (:class:`BatchingPolicy`); ``policy_fields`` give its fields by name, over ``policy``."""
        policy = replace(policy, **policy_fields) if policy is not None else BatchingPolicy(**policy_fields)
        self.policy = policy
        max_batch_tokens, max_batch_sentences = policy.max_batch_tokens, policy.max_batch_sentences
        max_delay_s, max_queue_tokens, workers = policy.max_delay_s, policy.max_queue_tokens, policy.workers
        express_tokens, background_nice = policy.express_tokens, policy.background_nice
        self._embed_fn = embed_fn
        self._background_fn = background_fn or embed_fn
        self.max_delay_s = max_delay_s
        self.name = name
        self.observer = observer or BatcherObserver()
        self.queue = RequestQueue(
            max_batch_tokens=max_batch_tokens,
            max_batch_sentences=max_batch_sentences,
            max_queue_tokens=max_queue_tokens,
            express_tokens=express_tokens,
            observer=self.observer,
        )
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
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._timer: asyncio.TimerHandle | None = None  # pumps again once a partial batch has waited max_delay
        self._pump_queued = False  # a pump is scheduled for this pass of the event loop
        self._closed = False
        self.batches_started = 0
        self.batches_run = 0
        self.batches_running = 0  # dispatched and not finished (counted here, not by task callbacks, to be exact)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on the running event loop: batches are formed there, once per pass in which requests arrived, when
        a batch ends and when a partial batch has waited ``max_delay`` (:meth:`_pump`; no task of its own)."""
        self._loop = asyncio.get_running_loop()
        self._pump_queued = False  # a pump left on a loop that has gone never runs

    async def close(self) -> None:
        """Refuse new work, fail what is still queued and what is running (UNAVAILABLE), stop the threads."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for item in self.queue.take_all():
            item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
        for run in list(self._running):
            for item in run.batch:
                item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
        for executor in (self.executor, self.background):
            if executor is not None:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    @property
    def max_batch_tokens(self) -> int:
        return self.queue.max_batch_tokens

    @property
    def max_batch_sentences(self) -> int:
        return self.queue.max_batch_sentences

    @property
    def max_queue_tokens(self) -> int:
        return self.queue.max_queue_tokens

    @property
    def queued_tokens(self) -> int:
        return self.queue.tokens

    @property
    def queued_sentences(self) -> int:
        return len(self.queue)

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
        request, answers = self.queue.add(sentences, deadline, self._loop.create_future())
        if self.queue.is_short(request):
            self._last_short = time.monotonic()
        try:
            self._pump_soon()
            results = await answers.future
        except BaseException:
            if not answers.future.done():
                answers.future.cancel()
            elif not answers.future.cancelled():
                answers.future.exception()  # mark retrieved: no "exception was never retrieved" log at GC time
            if answers.future.cancelled():
                self.queue.drop_dead()  # abandoned: its queued sentences leave the queue now, uncomputed
            raise
        finally:
            self.queue.forget(request)
        return [r[0] for r in results], [r[1] for r in results]

    # -- forming and dispatching batches --------------------------------------------------------------------------
    def _pump(self) -> None:
        """Start every batch that may start now, on the event loop: while work is queued and a worker may take it.
        A free worker takes the queue when a full batch is queued or when no batch runs (what arrived while the last
        one ran goes the moment it ends, so a loaded runtime runs back to back; an idle runtime waits for no clock);
        else a partial batch waits for company until its oldest item has waited ``max_delay`` (a timer pumps again
        then, in whole milliseconds:
        :data:`TIMER_RESOLUTION_S`). With every worker busy, the express one takes short requests while a long one
        runs."""
        while not self._closed:
            self.queue.drop_dead()
            if not self.queue.items:
                return
            express = False
            if not self._free:
                if not (self._express_free and self._long_running and self.queue.short_requests()):
                    return  # every worker busy: the next batch's end pumps again
                express = True
            elif self.batches_running and not self.queue.full():
                wait = self.queue.items[0].enqueued + self.max_delay_s - time.monotonic()
                if wait >= TIMER_RESOLUTION_S:
                    self._pump_in(wait // TIMER_RESOLUTION_S * TIMER_RESOLUTION_S)
                    return
            batch = self.queue.form_batch()
            if not batch:
                return
            self._dispatch(batch, express)

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

    def _dispatch(self, batch: list[QueuedSentence], express: bool) -> None:
        """Hand ``batch`` to a worker thread; it reports back with :meth:`_finished` on the event loop (one hop
        each way, no task in between)."""
        assert self._loop is not None
        long = not all(self.queue.is_short(item.request) for item in batch)
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
            self._pump()

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
                stats[item.request] = BatchStats(
                    run.started - item.enqueued, run.seconds, len(batch), real, runtime_s, cost.padded_tokens
                )
            item.answers.answer(item.index, (output, stats[item.request]))


def _as_service_error(exc: Exception) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ElmoError):
        return from_library_error(exc)
    return ServiceError(Kind.INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")


__all__ = ["BatchStats", "Batcher", "BatchingPolicy", "EmbedFn"]
