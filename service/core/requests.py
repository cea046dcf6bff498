"""The request core of both front doors: admit -> resolve the version -> validate (cheap bounds first) -> tokenize
-> queue -> answer, all inside one scope that owns the request's place in flight.

gRPC (service.grpc.servicer) and HTTP (service.http.app) are thin adapters over :class:`RequestCore`: they decode
their wire format into an ``elmo.v1`` request, call one of its public operations (:meth:`~RequestCore.embed`,
:meth:`~RequestCore.embed_pooled`, :meth:`~RequestCore.tokenize`, :meth:`~RequestCore.model_info`,
:meth:`~RequestCore.statuses`) with the encoding of their answer and a function that builds it, and send what
comes back. Everything that costs more than a few microseconds per byte (tokenizing, window planning, building and
encoding answers) runs on the core's worker threads (``--request-threads``), never on the event loop that accepts
connections and answers health checks; only requests small enough to cost less than a thread hop run in place.

Ownership. An embedding request's admission (the drain's count) and its model version's in-flight count are taken
together on the event loop, before the first await, and given back in the same ``with`` block however the request
ends: answered, refused, failed, or cancelled at any await (a gRPC deadline, a drain's cut). So a swap releases the
old version the moment its last request leaves (service.models.versions), and the version a request resolved to is
the one that checks it, embeds it and answers it: it is resolved once.

Bounds are checked before the work they bound: counts, layers, the task and the dtype first; then the token limits,
knowing that a text of N code points has at most N tokens (so short texts need no counting), with tokenizing that
stops as soon as a limit is crossed; then the size of the answer in the encoding it will be sent in, before it is
built.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
from elmo.service.common.errors import Kind, ServiceError, clip, invalid, too_large
from elmo.service.common.limits import Limits
from elmo.service.core.answers import (
    EmbedResult,
    PooledResult,
    PreparedEmbed,
    answer_bytes,
    input_chunks,
    pooled,
    pooled_bytes,
)
from elmo.service.core.budget import AnswerBudget, AnswerClaim
from elmo.service.core.checks import (
    Bounds,
    check_count,
    gil_yielder,
    input_tokens,
    overflow_policy,
    request_chars,
    request_tokens_message,
    response_size_message,
)
from elmo.service.core.encodings import AnswerEncoding
from elmo.service.core.state import ServerState
from elmo.service.models.registry import ModelRegistry, ServedModel
from elmo.service.models.tasks import Task
from elmo.service.telemetry import tracing

from elmo.runtime.priority import background_executor
from elmo.text.overflow import Overflow, over_limit_message, windowed
from elmo.text.tokenize import tokenize
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import NUMPY_DTYPES

T = TypeVar("T")

# Below these sizes a step costs less than handing it to a worker thread and back (~0.1 ms), so it runs in place.
INLINE_CHARS = 4096  # code points of text in one request (tokenizing costs about this much per code point)
INLINE_POOL_TOKENS = 256  # tokens of vectors pooled in place (averaging reads every vector once)


class Versions(Protocol):
    """The model repository the core lists versions from (service.models.versions: a --model-root repository, or
    the fixed one a --model DIR serves)."""

    def status(self, name: str, on_disk: bool = True) -> pb.ModelStatus: ...


@dataclass(frozen=True)
class _Plan:
    """What the cheap checks decided about one request before any text was tokenized."""

    model: ServedModel
    task: Task | None
    policy: Overflow
    max_per_sentence: int
    bounds: Bounds
    max_per_input: int  # tokens one input may have under ``window`` (its windows are queued together)


class RequestCore:
    """The embedding, tokenizing and model-info operations shared by gRPC and HTTP, and the workers that run them."""

    def __init__(self, models: ModelRegistry, limits: Limits, versions: Versions):
        self.models = models
        self.limits = limits
        self.state = ServerState()  # the drain switch and the count it waits for: the server's drain sets it
        self.versions = versions
        self.answers = AnswerBudget.for_limits(limits)  # answer bytes in flight: the doors release what they sent
        # Only large requests reach the workers (small ones run in place). They run at the event loop's priority,
        # not lowered: they hold the GIL (Python work), and a lowered thread that holds it while the OS runs others
        # keeps the event loop waiting (health waited 0.7-1.3 s under the noisy-neighbour bench on 2 busy cores).
        # Lowering is for the runtime's threads, which release the GIL while they compute.
        self.workers = background_executor(limits.request_workers, "request", 0)

    def close(self) -> None:
        self.workers.shutdown(wait=False, cancel_futures=True)

    async def run(self, work: Callable[[], T], heavy: bool = True) -> T:
        """``work()`` on a worker thread, or in place when it is known to be light."""
        if not heavy:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.workers, work)

    # -- the request's place in flight ---------------------------------------------------------------------------
    def check_open(self) -> None:
        """UNAVAILABLE once the drain began: a door's early refusal, before it reads a body."""
        self.state.check_open()

    @property
    def taking_requests(self) -> bool:
        """False once the server leaves the rotation (--shutdown-delay-s) or drains: what health answers follow."""
        return not (self.state.draining or self.state.leaving)

    def admit(self) -> contextlib.AbstractContextManager[None]:
        """A stream's admission for the drain: requests embedded inside it pass ``admitted=True``, so that a stream
        open before a drain began keeps being served until it ends or the drain's grace runs out."""
        return self.state.admit()

    @contextlib.contextmanager
    def _in_flight(self, model_name: str, admitted: bool) -> Iterator[tuple[ServedModel, str]]:
        """Admission (unless the caller's stream holds it) and the version ``model_name`` resolves to, counted in
        flight from here until the block ends, however it ends. Entered on the event loop before any await."""
        with contextlib.nullcontext() if admitted else self.state.admit():
            model, alias_task = self.models.acquire(model_name)
            try:
                yield model, alias_task
            finally:
                model.release()

    # -- embedding -------------------------------------------------------------------------------------------------
    async def embed(
        self,
        request: pb.EmbedRequest,
        encoding: AnswerEncoding,
        answer: Callable[[EmbedResult], T],
        deadline: float | None = None,
        *,
        admitted: bool = False,
        claim: AnswerClaim | None = None,
    ) -> T:
        """Per-token vectors: prepare, queue, then ``answer(result)`` (the door's builder, on a worker when the answer
        is large), all while the request holds its version. ``claim``: the answer's place in the budget of answer
        bytes in flight, taken once its size is known, before any vector is computed; the door releases it once the
        answer has left."""
        started = time.monotonic()
        with self._in_flight(request.model, admitted) as (model, alias_task):
            with tracing.phase("admission"):
                prepared = await self.run(
                    lambda: self._prepare(request, model, alias_task, encoding),
                    heavy=request_chars(request) > INLINE_CHARS,
                )
                if claim is not None:
                    await claim.take_in_turn(prepared.answer_bytes)
            result = await self._vectors(prepared, deadline, started)
            with tracing.phase("answer"):
                return await self.run(lambda: answer(result), heavy=prepared.answer_bytes > encoding.inline_bytes)

    async def embed_pooled(
        self,
        request: pb.EmbedRequest,
        encoding: AnswerEncoding,
        answer: Callable[[PooledResult], T],
        normalize: bool = False,
        check: Callable[[ServedModel, Task | None], None] | None = None,
        deadline: float | None = None,
        claim: AnswerClaim | None = None,
    ) -> T:
        """One vector per input (OpenAI's /v1/embeddings; the pooled limits hold). ``check(model, task)``: the door's
        own checks against the resolved version (``dimensions``), run with the preparation, before any other work.
        ``claim``: as for :meth:`embed`."""
        started = time.monotonic()
        with self._in_flight(request.model, admitted=False) as (model, alias_task):
            with tracing.phase("admission"):
                prepared = await self.run(
                    lambda: self._prepare(request, model, alias_task, encoding, True, check),
                    heavy=request_chars(request) > INLINE_CHARS,
                )
                if claim is not None:
                    await claim.take_in_turn(prepared.answer_bytes)
            vectors = await self._pooled_vectors(prepared, deadline, started, normalize)
            result = PooledResult(prepared, vectors)
            with tracing.phase("answer"):
                return await self.run(lambda: answer(result), heavy=prepared.answer_bytes > encoding.inline_bytes)

    async def _vectors(self, prepared: PreparedEmbed, deadline: float | None, started: float) -> EmbedResult:
        """Queue a prepared request's sentences (windows of long ones) and wait for their vectors."""
        if not prepared.model.ready:
            raise ServiceError(Kind.UNAVAILABLE, f"model '{clip(prepared.model.name)}' is warming up; retry shortly")
        batch = windowed(prepared.sentences, prepared.window_size, self.limits.window_overlap)
        queued = time.monotonic()
        pieces, stats = await prepared.model.batcher.embed(batch.pieces, deadline)
        tracing.batch_spans(queued, stats)
        if len(batch.pieces) == len(batch.plans):
            return EmbedResult(prepared, pieces, stats, started)
        # Stitching copies every vector once, into fresh memory (page faults: 6-85 ms for 8,192 tokens of
        # ELMo-small): off the event loop, where health checks would wait for it.
        stitched = await self.run(lambda: batch.stitch(pieces), heavy=prepared.n_tokens > INLINE_POOL_TOKENS)
        return EmbedResult(prepared, stitched, stats, started)

    async def _pooled_vectors(
        self, prepared: PreparedEmbed, deadline: float | None, started: float, normalize: bool
    ) -> list[np.ndarray]:
        """One float32 vector per input (:func:`pooled`), embedded a chunk of inputs at a time: each chunk within
        the per-token limits (``--max-request-tokens``, ``--max-inputs``), as many in flight as the model runs
        calls at once, each chunk's per-token vectors pooled and dropped as it ends. Memory is bounded by the answer
        and the chunks in flight, not by the request; the queue admits each chunk on its own."""
        chunks = input_chunks(
            [len(s) for s in prepared.sentences], self.limits.max_tokens_per_request, self.limits.max_inputs
        )
        vectors: list[np.ndarray | None] = [None] * len(prepared.sentences)
        slots = asyncio.Semaphore(max(1, prepared.model.batcher.workers))

        async def run(chunk: range) -> None:
            async with slots:
                part = dataclasses.replace(
                    prepared,
                    sentences=prepared.sentences[chunk.start : chunk.stop],
                    offsets=prepared.offsets[chunk.start : chunk.stop],
                    truncated=prepared.truncated[chunk.start : chunk.stop],
                )
                result = await self._vectors(part, deadline, started)
                vectors[chunk.start : chunk.stop] = await self.run(
                    lambda: pooled(result, normalize), heavy=part.n_tokens > INLINE_POOL_TOKENS
                )

        try:
            async with asyncio.TaskGroup() as group:  # one chunk failing cancels the others
                for chunk in chunks:
                    group.create_task(run(chunk))
        except BaseExceptionGroup as failed:  # the request fails as its first failing chunk did (429, 503, ...)
            raise failed.exceptions[0] from None
        return vectors  # type: ignore[return-value]

    # -- preparing: checks, then tokens (thread-safe: runs on a worker for large requests) ---------------------------
    def _prepare(
        self,
        request: pb.EmbedRequest,
        model: ServedModel,
        alias_task: str,
        encoding: AnswerEncoding,
        pooled: bool = False,
        check: Callable[[ServedModel, Task | None], None] | None = None,
    ) -> PreparedEmbed:
        """Check an EmbedRequest against its resolved version and the limits, cheapest first; tokenize its texts.
        ``pooled``: the answer is one vector per input: the pooled limits hold, and the size limit counts one vector
        per input. ``check(model, task)``: the door's own checks, once the task is known (reading a task may touch
        the disk, so this runs where the preparation runs, off the event loop for large requests)."""
        task = self._task(model, request.task or alias_task)
        if check is not None:
            check(model, task)
        plan = self._checked_plan(request, Bounds.of(self.limits, pooled), model, task)
        sentences, offsets, truncated = self._tokens(request, plan)
        if pooled:  # one vector per input: the offsets are never sent, and 300,000 of them are worth freeing
            offsets = [None] * len(sentences)
        prepared = PreparedEmbed(
            plan.model,
            sentences,
            offsets,
            list(request.layers) or None,
            plan.task,
            request.omit_layers,
            request.dtype,
            truncated,
            plan.max_per_sentence,
            answer_bytes=0,
        )
        if pooled:
            prepared.answer_bytes = pooled_bytes(len(sentences), plan.model.dim, encoding)
        else:
            prepared.answer_bytes = answer_bytes(prepared, encoding)
        if prepared.answer_bytes > self.limits.max_response_bytes:
            raise too_large(response_size_message(prepared.answer_bytes, self.limits, encoding))
        return prepared

    @staticmethod
    def _task(model: ServedModel, name: str) -> Task | None:
        """The task mix ``name`` of ``model`` (None without a name), or NOT_FOUND."""
        return model.tasks.get(name) if name else None

    def _checked_plan(self, request: pb.EmbedRequest, bounds: Bounds, model: ServedModel, task: Task | None) -> _Plan:
        check_count(len(request.inputs), bounds)
        if request.dtype not in NUMPY_DTYPES:
            raise invalid(f"dtype {request.dtype} is not FLOAT32 (0) or FLOAT16 (1)")
        for i, layer in enumerate(request.layers):
            if not 0 <= layer < model.n_layers:
                raise invalid(
                    f"layers[{i}] = {layer} is out of range: model '{clip(model.name)}' has {model.n_layers} "
                    f"layers (0..{model.n_layers - 1})"
                )
        if request.omit_layers and task is None:
            raise invalid("omit_layers needs a task: without one the response would hold no vectors")
        if request.omit_layers and request.layers:  # a field that cannot take effect is refused, never echoed
            raise invalid(
                "layers has no effect with omit_layers (the answer holds only the task's mix): send one or the other"
            )
        max_per_sentence = min(self.limits.max_tokens_per_sentence, model.max_tokens_per_sentence)
        max_per_input = min(bounds.max_tokens, self.limits.max_tokens_per_request)
        policy = overflow_policy(request.overflow, self.limits)
        return _Plan(model, task, policy, max_per_sentence, bounds, max_per_input)

    def _tokens(
        self, request: pb.EmbedRequest, plan: _Plan
    ) -> tuple[list[list[str]], list[list[tuple[int, int]] | None], list[int]]:
        """Every input's tokens, within the limits: tokenizing stops once the request is known to be over one."""
        budget = plan.bounds.max_tokens  # tokens the request may still embed
        sentences, offsets, truncated = [], [], []
        give_way = gil_yielder()
        for i, item in enumerate(request.inputs):
            give_way()
            tokens, spans, complete = input_tokens(item, i, self._stop_after(plan, budget))
            cut = 0
            if len(tokens) > plan.max_per_sentence:
                if plan.policy is Overflow.REJECT:
                    found = len(tokens) if complete else f"more than {plan.max_per_sentence}"
                    raise too_large(over_limit_message(f"inputs[{i}]", found, plan.max_per_sentence))
                if plan.policy is Overflow.TRUNCATE:
                    cut = len(tokens) - plan.max_per_sentence
                    tokens, spans = tokens[: plan.max_per_sentence], spans and spans[: plan.max_per_sentence]
                elif plan.max_per_input < plan.bounds.max_tokens and len(tokens) > plan.max_per_input:
                    found = f"more than {plan.max_per_input}" if not complete else str(len(tokens))
                    raise too_large(
                        f"inputs[{i}] has {found} tokens: under 'window' one input may have at most "
                        f"{plan.max_per_input} (--max-request-tokens); split it"
                    )
            budget -= len(tokens)
            if budget < 0:
                already = plan.bounds.max_tokens - budget
                more = not complete or i + 1 < len(request.inputs)
                raise too_large(request_tokens_message(already, plan.bounds, at_least=more))
            sentences.append(tokens)
            offsets.append(spans)
            truncated.append(cut)
        return sentences, offsets, truncated

    @staticmethod
    def _stop_after(plan: _Plan, budget: int) -> int | None:
        """How many tokens of one text are worth finding: past the sentence limit under ``reject`` (refused), past
        the request's remaining budget under ``window``; ``truncate`` counts them all (it reports how many it cut)."""
        if plan.policy is Overflow.REJECT:
            return min(plan.max_per_sentence, budget)
        if plan.policy is Overflow.WINDOW:
            return min(budget, plan.max_per_input + 1)
        return None

    # -- tokenizing and model info -----------------------------------------------------------------------------
    async def tokenize(
        self,
        request: pb.TokenizeRequest,
        answer: Callable[[pb.TokenizeResponse], T],
        claim: AnswerClaim | None = None,
        size: Callable[[T], int] | None = None,
    ) -> T:
        """The service's tokens and offsets, then ``answer(response)``: on a worker when the texts are long.
        ``claim``: the answer's place in the budget of answer bytes in flight, taken at its ``size(answer)`` once it
        is built (its size is known only then; tokenizing costs far less than embedding): an answer that does not
        fit is dropped before it is sent, so unread answers hold no more than the budget."""

        def built() -> tuple[T, int]:
            made = answer(self._tokenize(request))
            return made, size(made) if size is not None else 0

        chars = sum(len(text) for text in request.texts)
        made, n = await self.run(built, heavy=chars > INLINE_CHARS)
        if claim is not None:
            await claim.take_in_turn(n)
        return made

    def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """The same input and token limits as embedding."""
        self.models.get(request.model)
        self.state.check_open()
        bounds = Bounds.of(self.limits)
        check_count(len(request.texts), bounds, "texts")
        budget = bounds.max_tokens
        response = pb.TokenizeResponse()
        give_way = gil_yielder()
        for i, text in enumerate(request.texts):
            give_way()
            tokenized = tokenize(text, stop_after=budget)
            budget -= len(tokenized.tokens)
            if budget < 0:
                n_tokens = bounds.max_tokens - budget
                more = not tokenized.complete or i + 1 < len(request.texts)
                raise too_large(request_tokens_message(n_tokens, bounds, at_least=more))
            out = response.texts.add()
            out.tokens.extend(tokenized.tokens)
            out.offsets.extend(pb.Span(start=s, end=e) for s, e in tokenized.offsets)
        return response

    def statuses(self) -> list[pb.ModelStatus]:
        """Every served model's loaded versions (ListModels, /v1/models)."""
        return [self.versions.status(name, on_disk=False) for name in list(self.models.models)]

    def model_info(self, name: str) -> pb.ModelInfo:
        model = self.models.get(name)
        lim = self.limits
        return pb.ModelInfo(
            name=model.name,
            version=model.version,
            model_version=model.number,
            n_layers=model.n_layers,
            dim=model.dim,
            max_tokens_per_sentence=min(lim.max_tokens_per_sentence, model.max_tokens_per_sentence),
            tasks=model.tasks.names(),
            stale_tasks=model.tasks.stale_names(),
            execution_provider=model.provider,
            limits=pb.Limits(
                max_inputs=lim.max_inputs,
                max_tokens_per_sentence=min(lim.max_tokens_per_sentence, model.max_tokens_per_sentence),
                max_tokens_per_request=lim.max_tokens_per_request,
                max_message_bytes=lim.max_message_bytes,
                max_response_bytes=lim.max_response_bytes,
                max_pooled_inputs=lim.max_pooled_inputs,
                max_pooled_tokens=lim.max_pooled_tokens,
            ),
        )


__all__ = ["INLINE_CHARS", "RequestCore", "Versions"]
