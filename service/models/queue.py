"""A model's queue of sentences waiting for the runtime, and how a batch is chosen from it.

Requests put their sentences (token lists) in the queue together. Admission is per request and all-or-nothing: if
the queued tokens would exceed ``max_queue_tokens`` the request is refused with OVERLOADED before any of it is
queued. Expired work (deadline passed) and abandoned work (caller cancelled) leaves the queue before a batch forms.

A batch is chosen fairly and first fit: requests take turns, one sentence each per round, the least served first
(the fewest of its tokens computed so far), while the batch's real token count stays within ``max_batch_tokens``: a
short request is not stuck behind a long one, and a long one alone fills whole batches. Padding is not counted here
on purpose: the runtime sorts every call by length and cuts it into padding-minimal sub-batches itself
(elmo.runtime.plan_batches). Short requests (``express_tokens``) batch among themselves whenever any is queued, so
that none rides in a call with a long one. A batch leaves sorted by length.

When a batch forms, and on which worker, is the scheduler's (service.models.batcher).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from elmo.service.common.errors import Kind, ServiceError
from elmo.service.telemetry.hooks import BatcherObserver


class Answers:
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

    def answer(self, index: int, value: tuple[np.ndarray, object]) -> None:
        if self.future.done():
            return
        self.results[index] = value
        self.remaining -= 1
        if not self.remaining:
            self.future.set_result(self.results)


@dataclass
class QueuedSentence:
    tokens: list[str]
    answers: Answers  # its request's: the sentence's result goes in at ``index``
    index: int
    deadline: float | None  # time.monotonic() seconds, None = no deadline
    request: int  # which request queued it: requests take turns in a batch
    enqueued: float  # time.monotonic() when its request was queued

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


class RequestQueue:
    """The sentences waiting for one model's runtime, by request."""

    def __init__(
        self,
        *,
        max_batch_tokens: int,
        max_batch_sentences: int,
        max_queue_tokens: int,
        express_tokens: int,
        observer: BatcherObserver,
    ) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_sentences = max_batch_sentences
        self.max_queue_tokens = max_queue_tokens
        self.express_tokens = express_tokens
        self.observer = observer
        self.items: list[QueuedSentence] = []
        self.tokens = 0
        self.requests = 0  # requests queued so far: each one's sentences share a number
        self._served: dict[int, int] = {}  # request -> its tokens dispatched by turns so far, while it is queued
        self._sizes: dict[int, int] = {}  # request -> its tokens, while it is unfinished

    def __len__(self) -> int:
        return len(self.items)

    # -- in and out ---------------------------------------------------------------------------------------------------
    def add(
        self, sentences: Sequence[list[str]], deadline: float | None, future: asyncio.Future
    ) -> tuple[int, Answers]:
        """Queue a request's sentences whole, or refuse it (OVERLOADED) with nothing queued: (its number, answers)."""
        n_tokens = sum(len(s) for s in sentences)
        if self.tokens + n_tokens > self.max_queue_tokens:
            self.observer.dropped("overloaded", len(sentences))
            raise ServiceError(
                Kind.OVERLOADED,
                f"overloaded: {self.tokens} tokens queued, this request adds {n_tokens}, "
                f"limit {self.max_queue_tokens} (--max-queue-tokens); retry with backoff",
            )
        self.requests += 1
        request = self.requests
        answers = Answers(future, len(sentences))
        now = time.monotonic()  # the request's sentences are queued together: one clock reading for all
        self.items.extend(
            QueuedSentence(list(tokens), answers, i, deadline, request, now) for i, tokens in enumerate(sentences)
        )
        self._served[request] = 0
        self._sizes[request] = n_tokens
        self.tokens += n_tokens
        self.observer.queue_changed(len(self.items), self.tokens)
        return request, answers

    def forget(self, request: int) -> None:
        """The request is over (answered, failed or abandoned)."""
        self._served.pop(request, None)
        self._sizes.pop(request, None)

    def take_all(self) -> list[QueuedSentence]:
        items, self.items, self.tokens = self.items, [], 0
        return items

    def drop_dead(self) -> None:
        """Remove cancelled items and fail expired ones with DEADLINE, so no compute is spent on them."""
        now = time.monotonic()
        keep: list[QueuedSentence] = []
        expired = cancelled = 0
        for item in self.items:
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
            self.items = keep
            self.tokens = sum(item.n_tokens for item in keep)
            self.observer.queue_changed(len(keep), self.tokens)
            if expired:
                self.observer.dropped("deadline", expired)
            if cancelled:
                self.observer.dropped("cancelled", cancelled)

    # -- what is queued ---------------------------------------------------------------------------------------------
    def full(self) -> bool:
        """A whole batch is queued."""
        return self.tokens >= self.max_batch_tokens or len(self.items) >= self.max_batch_sentences

    def is_short(self, request: int) -> bool:
        """At most ``express_tokens`` tokens: what the express worker may take (none when it is off)."""
        return self._sizes.get(request, 0) <= self.express_tokens

    def short_requests(self) -> set[int]:
        """Queued requests the express worker may take."""
        return {item.request for item in self.items if self.is_short(item.request)}

    # -- choosing a batch -------------------------------------------------------------------------------------------
    def form_batch(self) -> list[QueuedSentence]:
        """Fair and first fit: requests take turns, one sentence each per round, the one that has had the fewest of
        its tokens computed so far first (least attained service: a short request goes ahead of a long one that has
        been served for a while, and a long one alone fills whole batches); each takes its next sentence that still
        fits the token budget, and the first sentence always goes in. Call :meth:`drop_dead` just before: the queue
        must hold live items only."""
        if not self.items:
            return []
        # Short requests batch among themselves whenever any is queued (the express worker takes nothing else): a
        # one-sentence request never rides in a call that also carries a long one. Long ones batch when none is.
        allowed = self.short_requests() or None
        if self._all_fit(allowed):
            # its requests leave whole: their served tokens, which only order the turns, need no count
            batch = self.take_all()
            self.observer.queue_changed(0, 0)
            return by_length(batch)
        lanes: dict[int, list[int]] = {}  # request -> its queued sentences' indices, in arrival order
        for i, item in enumerate(self.items):
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
                budget = self.max_batch_tokens - tokens
                fit = next((k for k, i in enumerate(lane) if not chosen or self.items[i].n_tokens <= budget), None)
                if fit is None:
                    continue  # nothing of this request fits any more: out of this batch
                i = lane.pop(fit)
                chosen.append(i)
                tokens += self.items[i].n_tokens
                request = self.items[i].request
                self._served[request] = self._served.get(request, 0) + self.items[i].n_tokens
                if lane:
                    still.append(lane)
            turns = still
        taken = set(chosen)
        batch = [self.items[i] for i in chosen]
        self.items = [item for i, item in enumerate(self.items) if i not in taken]
        self.tokens -= tokens
        self.observer.queue_changed(len(self.items), self.tokens)
        return by_length(batch)

    def _all_fit(self, allowed: set[int] | None) -> bool:
        """The whole queue is one batch: within both budgets and of one lane (all short, or no short request queued).
        The turns of :meth:`form_batch` would take every sentence then, in another order that the batch's sort by
        length undoes but for ties; this takes them without the per-sentence turns."""
        if self.tokens > self.max_batch_tokens or len(self.items) > self.max_batch_sentences:
            return False
        return allowed is None or all(item.request in allowed for item in self.items)


def by_length(batch: list[QueuedSentence]) -> list[QueuedSentence]:
    """``batch`` sorted by tokens, in place: the runtime buckets by length, so it is handed over sorted."""
    batch.sort(key=lambda item: item.n_tokens)
    return batch


__all__ = ["Answers", "QueuedSentence", "RequestQueue", "by_length"]
