"""The request core of both front doors: admit -> validate (cheap bounds first) -> tokenize -> queue -> answer.

gRPC (service.servicer) and HTTP (service.http.app) are thin adapters over :class:`RequestCore`: they decode their
wire format into an ``elmo.v1`` request, and encode what the core returns. Everything that costs more than a few
microseconds per byte — tokenizing, window planning, building and encoding answers — runs on the core's worker
threads (``--request-workers``), never on the event loop that accepts connections and answers health checks; only
requests small enough to cost less than a thread hop are handled in place.

Bounds are checked before the work they bound: counts, layers, the task and the dtype first; then the token limits,
knowing that a text of N code points has at most N tokens (so short texts need no counting), with tokenizing that
stops as soon as a limit is crossed; then the size of the answer in the encoding it will be sent in, before it is
built.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from elmo.service import switching
from elmo.service.batcher import BatchStats
from elmo.service.errors import Kind, ServiceError, clip, invalid, too_large
from elmo.service.limits import Limits, human_bytes
from elmo.service.models import ModelRegistry, ServedModel
from elmo.service.tasks import Task

from elmo.runtime.priority import background_executor
from elmo.text.overflow import Overflow, over_limit_message, windowed
from elmo.text.tokenize import Tokenized, tokenize
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import NUMPY_DTYPES, OVERFLOW_VALUES, to_tensor

OVERFLOW_POLICIES = {value: Overflow(name) for name, value in OVERFLOW_VALUES.items()}
T = TypeVar("T")

# Below these sizes a step costs less than handing it to a worker thread and back (~0.1 ms), so it runs in place.
INLINE_CHARS = 4096  # code points of text in one request
INLINE_ANSWER_BYTES = 256 * 1024  # bytes of one JSON answer, as sent
INLINE_MESSAGE_BYTES = 4 * 1024 * 1024  # bytes of one protobuf answer (building it is a copy: ~0.1 ms per MiB)
INLINE_POOL_TOKENS = 256  # tokens of vectors pooled in place (averaging reads every vector once)
# The longest JSON number service.http.encode writes for a float32 or float16 (the shortest text that reads back as
# the same float32, e.g. "-1.1754944e-38"), with its separator: the JSON answer's size bound.
JSON_NUMBER_BYTES = 16


class Encoding(enum.Enum):
    """How an answer's vectors are sent: what its size limit counts."""

    PROTOBUF = "protobuf"  # gRPC: raw little-endian bytes
    JSON_FLOAT = "float"  # HTTP: JSON numbers
    JSON_BASE64 = "base64"  # HTTP: base64 of the raw bytes


class ServerState:
    """Draining switch and the count of admitted embedding requests (what a drain waits for).

    Once ``draining`` is set, new requests get UNAVAILABLE from the core itself while the ports stay open, so that
    callers see a clear status (gRPC's own shutdown would answer late arrivals with CANCELLED)."""

    def __init__(self) -> None:
        self.draining = False
        self.leaving = False  # SIGTERM's --shutdown-delay: health says NOT_SERVING, requests are still answered
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def check_open(self) -> None:
        if self.draining:
            raise ServiceError(Kind.UNAVAILABLE, "server is shutting down; retry on another replica")

    @contextlib.contextmanager
    def admit(self):
        """Count a request as in flight for the drain (refused with UNAVAILABLE when draining)."""
        self.check_open()
        self.active += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()


@dataclass
class PreparedEmbed:
    model: ServedModel
    sentences: list[list[str]]
    offsets: list[list[tuple[int, int]] | None]  # None for pre-tokenized inputs
    layers: list[int] | None  # None = all layers in order
    task: Task | None
    omit_layers: bool
    dtype: int
    truncated: list[int]  # per sentence, tokens cut off under TRUNCATE
    window_size: int  # the per-sentence limit: longer sentences (WINDOW) run as windows of this size
    answer_bytes: int  # upper bound of the answer's size in the encoding it will be sent in

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sentences)


@dataclass
class EmbedResult:
    """A request's vectors: per sentence float32 (n_layers, n_tokens, dim), long sentences' windows stitched."""

    prepared: PreparedEmbed
    vectors: list[np.ndarray]
    stats: list[BatchStats]
    started: float  # time.monotonic() when the request was admitted


@dataclass(frozen=True)
class Bounds:
    """The count and token limits a request is held to: the per-token endpoints', or the pooled endpoint's (one
    vector per input answers, so OpenAI's far larger requests are fine there)."""

    max_inputs: int
    max_tokens: int
    inputs_flag: str
    tokens_flag: str

    @staticmethod
    def of(limits: Limits, pooled: bool = False) -> Bounds:
        if pooled:
            return Bounds(limits.max_pooled_inputs, limits.max_pooled_tokens, "max-pooled-inputs", "max-pooled-tokens")
        return Bounds(limits.max_inputs, limits.max_tokens_per_request, "max-inputs", "max-tokens-per-request")


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
    """The embedding, tokenizing and model-info logic shared by gRPC and HTTP, and the workers that run it."""

    def __init__(self, models: ModelRegistry, limits: Limits, state: ServerState):
        self.models = models
        self.limits = limits
        self.state = state
        self.manager = None  # service.versions.ModelManager under --model-root (versions for ListModels)
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
        return await asyncio.get_running_loop().run_in_executor(self.workers, switching.PROCESS.wrap(work))

    # -- embedding ---------------------------------------------------------------------------------------------
    async def embed_request(self, request: pb.EmbedRequest, deadline: float | None = None) -> pb.EmbedResponse:
        """gRPC's whole path: prepare, embed, build the response message."""
        started = time.monotonic()
        prepared = await self.run(
            lambda: self.prepare(request, Encoding.PROTOBUF), heavy=request_chars(request) > INLINE_CHARS
        )
        with prepared.model.counted():
            result = await self.embed(prepared, deadline, started)
        response = await self.run(lambda: build_response(result), heavy=prepared.answer_bytes > INLINE_MESSAGE_BYTES)
        response.request_id = request.request_id
        return response

    async def embed(self, prepared: PreparedEmbed, deadline: float | None, started: float) -> EmbedResult:
        """Queue a prepared request's sentences (windows of long ones) and wait for their vectors."""
        if not prepared.model.ready:
            raise ServiceError(Kind.UNAVAILABLE, f"model '{clip(prepared.model.name)}' is warming up; retry shortly")
        batch = windowed(prepared.sentences, prepared.window_size, self.limits.window_overlap)
        pieces, stats = await prepared.model.batcher.embed(batch.pieces, deadline)
        if len(batch.pieces) == len(batch.plans):
            return EmbedResult(prepared, pieces, stats, started)
        # Stitching copies every vector once, into fresh memory (page faults: 6-85 ms for 8,192 tokens of
        # ELMo-small): off the event loop, where health checks would wait for it.
        stitched = await self.run(lambda: batch.stitch(pieces), heavy=prepared.n_tokens > INLINE_POOL_TOKENS)
        return EmbedResult(prepared, stitched, stats, started)

    async def embed_pooled(
        self, prepared: PreparedEmbed, deadline: float | None, started: float, normalize: bool = False
    ) -> list[np.ndarray]:
        """One float32 vector per input (:func:`pooled`), embedded a chunk of inputs at a time: each chunk within
        the per-token limits (``--max-tokens-per-request``, ``--max-inputs``), as many in flight as the model runs
        calls at once, each chunk's per-token vectors pooled and dropped as it ends. Memory is bounded by the answer
        and the chunks in flight, not by the request; the queue admits each chunk on its own."""
        chunks = input_chunks([len(s) for s in prepared.sentences], self.limits.max_tokens_per_request,
                              self.limits.max_inputs)  # fmt: skip
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
                result = await self.embed(part, deadline, started)
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

    def prepare(self, request: pb.EmbedRequest, encoding: Encoding, pooled: bool = False) -> PreparedEmbed:
        """Check an EmbedRequest against the model and the limits, cheapest first; tokenize its texts. Raises
        ServiceError. Thread-safe: runs on a worker for large requests. ``pooled``: the answer is one vector per
        input (OpenAI's /v1/embeddings): the pooled limits hold, and the size limit counts one vector per input."""
        plan = self._plan(request, Bounds.of(self.limits, pooled))
        try:
            return self._prepared(request, plan, encoding, pooled)
        except BaseException:
            plan.model.release()
            raise

    def _prepared(self, request: pb.EmbedRequest, plan: _Plan, encoding: Encoding, pooled: bool) -> PreparedEmbed:
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

    def model_and_task(self, request: pb.EmbedRequest) -> tuple[ServedModel, Task | None]:
        """The request's model and task mix (its own ``task``, else the one its model alias names), or NOT_FOUND."""
        model, alias_task = self.models.resolve(request.model)
        name = request.task or alias_task
        return model, model.tasks.get(name) if name else None

    def _plan(self, request: pb.EmbedRequest, bounds: Bounds) -> _Plan:
        """The cheap checks. The model version the request resolves to counts it in flight (so that a swap does not
        release it under the request) until :func:`release` is called with the prepared request."""
        model, alias_task = self.models.acquire(request.model)
        try:
            name = request.task or alias_task
            return self._checked_plan(request, bounds, model, model.tasks.get(name) if name else None)
        except BaseException:
            model.release()
            raise

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
            tokens, spans, complete = _input_tokens(item, i, self._stop_after(plan, budget))
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
                        f"{plan.max_per_input} (--max-tokens-per-request); split it"
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
    def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """The service's tokens and offsets; the same input and token limits as embedding."""
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
        from elmo.service.versions import served_status

        return [served_status(self.models, name, self.manager) for name in list(self.models.models)]

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


# -- checks and messages --------------------------------------------------------------------------------------------
def overflow_policy(value: int, limits: Limits) -> Overflow:
    """The request's policy, or the server's default (``--overflow``) when it names none."""
    if value == pb.OVERFLOW_DEFAULT:
        return Overflow.parse(limits.overflow)
    if value not in OVERFLOW_POLICIES:
        raise invalid(f"overflow {value} is not OVERFLOW_REJECT (1), OVERFLOW_TRUNCATE (2) or OVERFLOW_WINDOW (3)")
    return OVERFLOW_POLICIES[value]


def check_count(n: int, bounds: Bounds, field: str = "inputs") -> None:
    if n == 0:
        raise invalid(f"{field} is empty: send at least one sentence")
    if n > bounds.max_inputs:
        raise too_large(
            f"too many {field}: {n}, limit {bounds.max_inputs} per request (--{bounds.inputs_flag}); split the request"
        )


def gil_yielder() -> Callable[[], None]:
    """What to call between two texts being tokenized: off the event loop (on a worker), give the GIL away, since
    `tokenizers`' calls let no waiting thread in (2,048 texts tokenized back to back on a worker made the event loop
    wait ~300 ms; with a yield between them, 3 ms); on the event loop, nothing (the request is small there, and the
    loop would then have to wait for the GIL to come back)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _give_way
    return _stay


def _give_way() -> None:
    time.sleep(0)


def _stay() -> None:
    pass


def request_chars(request: pb.EmbedRequest) -> int:
    """Code points of text in a request (pre-tokenized tokens included): what its preparation costs."""
    return sum(
        len(item.text) if item.WhichOneof("kind") == "text" else sum(map(len, item.tokens.tokens))
        for item in request.inputs
    )


def request_tokens_message(n_tokens: int, bounds: Bounds, at_least: bool = False) -> str:
    """``at_least``: counting stopped once the limit was crossed, so the request's own count is unknown."""
    limit = bounds.max_tokens
    found = f"more than {limit}" if at_least else str(n_tokens)
    return f"request has {found} tokens, over the limit of {limit} (--{bounds.tokens_flag}); split it"


def response_size_message(size: int, limits: Limits, encoding: Encoding) -> str:
    advice = {
        Encoding.PROTOBUF: "ask for fewer inputs or layers, FLOAT16, or use EmbedStream",
        Encoding.JSON_FLOAT: 'ask for fewer inputs or layers, or "encoding": "base64" (4x smaller than JSON numbers)',
        Encoding.JSON_BASE64: 'ask for fewer inputs or layers, or "dtype": "float16"',
    }[encoding]
    return (
        f"response would be up to {human_bytes(size)} as {encoding.value}, over the "
        f"{human_bytes(limits.max_response_bytes)} limit (--max-response-bytes): {advice}"
    )


def _input_tokens(
    item: pb.Input, i: int, stop_after: int | None
) -> tuple[list[str], list[tuple[int, int]] | None, bool]:
    """(tokens, offsets or None for pre-tokenized input, whether all tokens were found)."""
    kind = item.WhichOneof("kind")
    if kind == "text":
        tokenized: Tokenized = tokenize(item.text, stop_after=stop_after)
        if not tokenized.tokens:
            raise invalid(f"inputs[{i}] is empty: the text has no tokens")
        return tokenized.tokens, tokenized.offsets, tokenized.complete
    if kind == "tokens":
        tokens = list(item.tokens.tokens)
        if not tokens:
            raise invalid(f"inputs[{i}] is empty: no tokens")
        for j, token in enumerate(tokens):
            if not token:
                raise invalid(f"inputs[{i}].tokens[{j}] is an empty string")
        return tokens, None, True
    raise invalid(f"inputs[{i}] has neither text nor tokens")


# -- answers -------------------------------------------------------------------------------------------------------
def vector_bytes(n_values: int, dtype: int, encoding: Encoding) -> int:
    """Bytes that ``n_values`` numbers take in an answer (an upper bound for JSON numbers)."""
    raw = n_values * NUMPY_DTYPES[dtype].itemsize
    if encoding is Encoding.JSON_FLOAT:
        return n_values * JSON_NUMBER_BYTES
    if encoding is Encoding.JSON_BASE64:
        return 4 * ((raw + 2) // 3)
    return raw


def answer_bytes(prepared: PreparedEmbed, encoding: Encoding) -> int:
    """Upper bound of the per-token answer's size: vectors in ``encoding``, tokens, offsets and framing."""
    n_layers = 0 if prepared.omit_layers else len(prepared.layers or range(prepared.model.n_layers))
    per_token = (n_layers + (1 if prepared.task else 0)) * prepared.model.dim
    vectors = vector_bytes(prepared.n_tokens * per_token, prepared.dtype, encoding)
    # per token its string (UTF-8) and its offsets with their framing (JSON: quotes, brackets, separators); per
    # sentence its fields; per answer its envelope
    token, sentence, envelope = (16, 64, 256) if encoding is Encoding.PROTOBUF else (32, 256, 512)
    strings = sum(len(t.encode("utf-8", "surrogatepass")) + token for s in prepared.sentences for t in s)
    return vectors + strings + sentence * len(prepared.sentences) + envelope


def pooled_bytes(n_inputs: int, dim: int, encoding: Encoding) -> int:
    """Upper bound of an OpenAI ``/v1/embeddings`` answer: one float32 vector per input."""
    return n_inputs * (vector_bytes(dim, pb.FLOAT32, encoding) + 64) + 512


def build_response(result: EmbedResult) -> pb.EmbedResponse:
    prepared = result.prepared
    response = pb.EmbedResponse(
        model=prepared.model.name,
        model_version=prepared.model.number,
        task_stale=bool(prepared.task is not None and getattr(prepared.task, "stale", False)),
    )
    response.layers.extend(prepared.layers or range(prepared.model.n_layers))
    for tokens, spans, cut, layers in zip(prepared.sentences, prepared.offsets, prepared.truncated, result.vectors):
        embedding = response.embeddings.add()
        embedding.tokens.extend(tokens)
        embedding.truncated_tokens = cut
        if spans is not None:
            embedding.offsets.extend(pb.Span(start=s, end=e) for s, e in spans)
        if not prepared.omit_layers:
            selected = layers if prepared.layers is None else layers[prepared.layers]
            to_tensor(selected, prepared.dtype, out=embedding.layers)
        if prepared.task is not None:
            to_tensor(prepared.task.apply(layers), prepared.dtype, out=embedding.mix)
    fill_timing(response.timing, result)
    return response


def fill_timing(timing: pb.Timing, result: EmbedResult) -> None:
    """The slowest piece's queue and inference time, the largest batch it rode in, and the total so far."""
    slowest = max(result.stats, key=lambda s: s.queue_s + s.inference_s)
    largest = max(result.stats, key=lambda s: s.tokens)
    timing.queue_ms = 1000 * slowest.queue_s
    timing.inference_ms = 1000 * slowest.inference_s
    timing.total_ms = 1000 * (time.monotonic() - result.started)
    timing.batch_sentences = largest.sentences
    timing.batch_tokens = largest.tokens


def pooled(result: EmbedResult, normalize: bool = False) -> list[np.ndarray]:
    """One float32 vector per input: the mean over its tokens of the mean of its layers, or of the task's mix;
    ``normalize``: scaled to unit length (the direction unchanged). Computed from the vectors directly (no per-token
    answer is built only to be averaged)."""
    task = result.prepared.task
    if task is not None:
        means = [task.apply(v).astype(np.float64).mean(axis=0) for v in result.vectors]
    else:
        means = [v.astype(np.float64).mean(axis=(0, 1)) for v in result.vectors]
    if normalize:
        means = [m / norm if (norm := np.linalg.norm(m)) > 0 else m for m in means]
    return [m.astype(np.float32) for m in means]


def input_chunks(lengths: list[int], max_tokens: int, max_inputs: int) -> list[range]:
    """Consecutive inputs, cut into chunks of at most ``max_tokens`` tokens and ``max_inputs`` inputs (an input
    longer than ``max_tokens`` alone)."""
    chunks, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (tokens + n > max_tokens or i - start >= max_inputs):
            chunks.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if lengths:
        chunks.append(range(start, len(lengths)))
    return chunks


__all__ = [
    "Bounds",
    "EmbedResult",
    "Encoding",
    "PreparedEmbed",
    "RequestCore",
    "ServerState",
    "answer_bytes",
    "build_response",
    "check_count",
    "human_bytes",
    "overflow_policy",
    "pooled",
    "input_chunks",
    "pooled_bytes",
    "request_chars",
]
