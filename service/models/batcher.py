"""Dynamic batching across concurrent requests under a token budget.

Requests put their sentences (token lists) in one queue per model; a single loop forms batches and runs the
runtime in worker threads (``workers`` calls in flight per model: one on CUDA, where one session feeds one device
stream; on CPU as many as the runtime runs batches at once, so that the next call's char-CNN and first batches
fill the cores while the last one's final batch finishes). Keeping the event loop free means a slow batch never
blocks accepting or answering other calls.

Batch formation, when the worker is free:
  * expired work (deadline passed) and abandoned work (caller cancelled) is dropped from the queue first;
  * requests take turns, one sentence each per round, the least served first (the fewest of its tokens computed
    so far), while the batch's real token count stays within ``max_batch_tokens`` (first fit): a short request is
    not stuck behind a long one, and a long one alone fills whole batches. Padding is not
    counted here on purpose: the runtime sorts every call by length and cuts it into padding-minimal sub-batches
    itself (elmo.runtime.plan_batches); short requests (``express_tokens``) batch among themselves whenever any
    is queued, so that none rides in a call with a long one;
  * when no batch is running the queue goes at once (an idle server does not wait for company: what arrives
    meanwhile forms the next batch); while one runs and a worker is free (``workers`` > 1), a partial batch waits
    at most ``max_delay`` for company;
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from elmo.service.common.errors import Kind, ServiceError, from_library_error
from elmo.service.telemetry.hooks import BatcherObserver

from elmo.errors import ElmoError
from elmo.runtime import EmbedStats
from elmo.runtime.priority import background_executor

log = logging.getLogger("service.batcher")  # the documented logger name (docs/operations.md)

# (sentences of tokens) -> (per sentence float32 (n_layers, n_tokens, dim), what the call cost):
# Embedder.embed_tokens_with_stats. The cost is the runtime's own, since only it knows how it padded the call.
EmbedFn = Callable[[list[list[str]]], tuple[list[np.ndarray], EmbedStats]]
SHORT_TRAFFIC_S = 1.0  # long batches yield the cores while a short request came within this many seconds


@dataclass
class BatchStats:
    """What a sentence's batch looked like (reported back in EmbedResponse.timing)."""

    queue_s: float
    inference_s: float
    sentences: int
    tokens: int  # real tokens in the runtime call


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
    enqueued: float = field(default_factory=time.monotonic)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


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
        self._running: set[asyncio.Task] = set()
        self._queue: list[_Item] = []
        self._queued_tokens = 0
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.batches_started = 0
        self.batches_run = 0
        self.batches_running = 0  # dispatched and not finished (counted here, not by task callbacks, to be exact)
        self._requests = 0  # embed() calls so far: each one's sentences share a number
        self._served: dict[int, int] = {}  # request -> its tokens dispatched so far, while it is unfinished
        self._sizes: dict[int, int] = {}  # request -> its tokens, while it is unfinished

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def close(self) -> None:
        """Refuse new work, fail what is still queued (UNAVAILABLE), stop the loop, let the running batches fail
        their callers (UNAVAILABLE), stop the threads."""
        self._closed = True
        for item in self._take_all():
            item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for executor in (self.executor, self.background):
            if executor is not None:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def queued_sentences(self) -> int:
        return len(self._queue)

    # -- submitting -----------------------------------------------------------------------------------------------
    async def embed(
        self, sentences: Sequence[list[str]], deadline: float | None = None
    ) -> tuple[list[np.ndarray], list[BatchStats]]:
        """Embed sentences (each a non-empty token list) -> per sentence (n_layers, n_tokens, dim) and batch stats.

        Raises ServiceError OVERLOADED (queue full), DEADLINE (expired while queued), UNAVAILABLE (closing),
        INVALID_INPUT / INTERNAL (runtime errors). Cancelling the caller abandons its queued sentences.
        """
        if self._closed or self._wakeup is None:
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
        loop = asyncio.get_running_loop()
        if n_tokens <= self.express_tokens:
            self._last_short = time.monotonic()
        self._requests += 1
        request = self._requests
        answers = _Answers(loop.create_future(), len(sentences))
        items = [_Item(list(tokens), answers, i, deadline, request) for i, tokens in enumerate(sentences)]
        self._served[request] = 0
        self._sizes[request] = n_tokens
        self._queue.extend(items)
        self._queued_tokens += n_tokens
        self.observer.queue_changed(len(self._queue), self._queued_tokens)
        self._wakeup.set()
        try:
            results = await answers.future
        except BaseException:
            if not answers.future.done():
                answers.future.cancel()  # abandoned: the loop drops cancelled items instead of computing them
            elif not answers.future.cancelled():
                answers.future.exception()  # mark retrieved: no "exception was never retrieved" log at GC time
            raise
        finally:
            self._served.pop(request, None)
            self._sizes.pop(request, None)
        return [r[0] for r in results], [r[1] for r in results]

    # -- the loop -------------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            express = await self._take_worker()
            try:
                if not express:
                    await self._wait_for_work()
                batch = self._form_batch()
            except BaseException:
                self._give_back(express)
                raise
            if not batch:
                self._give_back(express)
                continue
            self.batches_running += 1
            long = not all(self._is_short(item.request) for item in batch)
            self._long_running += long
            task = loop.create_task(self._run_guarded(batch, loop, express, long))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _take_worker(self) -> bool:
        """Wait for a free worker; True when it is the express one (every other busy, one with a long request, and a
        short request queued)."""
        assert self._wakeup is not None
        while True:
            if self._free:
                self._free -= 1
                return False
            self._drop_dead()
            if self._express_free and self._long_running and self._short_requests():
                self._express_free -= 1
                return True
            self._wakeup.clear()
            await self._wakeup.wait()  # set when a batch ends or a request arrives

    def _give_back(self, express: bool) -> None:
        if express:
            self._express_free += 1
        else:
            self._free += 1
        if self._wakeup is not None:
            self._wakeup.set()

    def _is_short(self, request: int) -> bool:
        """At most ``express_tokens`` tokens: what the express worker may take (none when it is off)."""
        return self._sizes.get(request, 0) <= self.express_tokens

    def _short_requests(self) -> set[int]:
        """Queued requests the express worker may take."""
        return {item.request for item in self._queue if self._is_short(item.request)}

    async def _run_guarded(
        self, batch: list[_Item], loop: asyncio.AbstractEventLoop, express: bool, long: bool
    ) -> None:
        try:
            await self._run(batch, loop, long)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must fail this batch's callers, never stop the loop (or hang them)
            log.exception("batcher %s: batch handling failed", self.name)
            for item in batch:
                item.answers.fail(ServiceError(Kind.INTERNAL, "internal error while batching"))
        finally:
            self.batches_running -= 1
            self._long_running -= long
            self._give_back(express)

    async def _wait_for_work(self) -> None:
        """Return when a batch should be formed: full enough, or the oldest item waited ``max_delay``."""
        assert self._wakeup is not None
        while True:
            self._drop_dead()
            if self._queue:
                if self.batches_running == 0:
                    return  # an idle runtime: waiting for company would only add latency
                if self._queued_tokens >= self.max_batch_tokens or len(self._queue) >= self.max_batch_sentences:
                    return
                wait = self._queue[0].enqueued + self.max_delay_s - time.monotonic()
                if wait <= 0:
                    return
            else:
                wait = None
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait)
            except TimeoutError:
                pass

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
        fits the token budget, and the first sentence always goes in."""
        self._drop_dead()
        if not self._queue:
            return []
        # Short requests batch among themselves whenever any is queued (the express worker takes nothing else): a
        # one-sentence request never rides in a call that also carries a long one. Long ones batch when none is.
        allowed = self._short_requests() or None
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
        batch.sort(key=lambda item: item.n_tokens)  # the runtime buckets by length; hand it over sorted
        return batch

    def _in_background(self, long: bool) -> bool:
        """A batch with a long request, while short requests are about (and there is a background pool)."""
        recent_short = time.monotonic() - self._last_short < SHORT_TRAFFIC_S
        return long and recent_short and self.background is not None

    async def _run(self, batch: list[_Item], loop: asyncio.AbstractEventLoop, long: bool) -> None:
        """``long``: the batch holds a request over ``express_tokens`` (it may run in the background)."""
        started = time.monotonic()
        sentences = [item.tokens for item in batch]
        real = sum(item.n_tokens for item in batch)
        self.batches_started += 1
        try:
            if self._in_background(long):
                outputs, cost = await loop.run_in_executor(self.background, self._background_fn, sentences)
            else:
                outputs, cost = await loop.run_in_executor(self.executor, self._embed_fn, sentences)
            if len(outputs) != len(batch):
                raise ServiceError(Kind.INTERNAL, f"runtime returned {len(outputs)} results for {len(batch)} sentences")
        except asyncio.CancelledError:
            for item in batch:
                item.answers.fail(ServiceError(Kind.UNAVAILABLE, "server is shutting down"))
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must reach the callers, never kill the loop
            error = _as_service_error(exc)
            if error.kind is Kind.INTERNAL:
                log.exception("batch of %d sentences failed on model %s", len(batch), self.name)
            for item in batch:
                item.answers.fail(error)
            return
        seconds = time.monotonic() - started
        self.batches_run += 1
        self.observer.batch_done(len(batch), real, cost.padded_tokens, seconds)
        log.info(
            "model %s: batch of %d sentences, %d tokens (%d padded, %d runs), %.1f ms",
            self.name,
            len(batch),
            real,
            cost.padded_tokens,
            cost.runs,
            1000 * seconds,
        )
        for item, output in zip(batch, outputs):
            item.answers.answer(item.index, (output, BatchStats(started - item.enqueued, seconds, len(batch), real)))

    def _take_all(self) -> list[_Item]:
        items, self._queue, self._queued_tokens = self._queue, [], 0
        return items


def _as_service_error(exc: Exception) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, ElmoError):
        return from_library_error(exc)
    return ServiceError(Kind.INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")


__all__ = ["BatchStats", "Batcher", "EmbedFn"]
