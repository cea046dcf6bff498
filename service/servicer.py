"""The ``elmo.v1.Embedder`` servicer: validate -> queue -> encode. Thin; no numerical code.

Every RPC runs inside :func:`_answer`, which turns a :class:`ServiceError` into its status code (the one mapping in
service.errors) and an undecodable request into INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass

import grpc
import grpc.aio
import numpy as np

from elmo.text.overflow import Overflow, over_limit_message, windowed
from elmo.text.tokenize import tokenize
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import NUMPY_DTYPES, OVERFLOW_VALUES, to_tensor
from service.decode import UndecodableRequest, lenient_parser
from service.errors import Kind, ServiceError, grpc_code, invalid, too_large
from service.limits import MIB, Limits
from service.models import ModelRegistry, ServedModel
from service.tasks import Task

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name  # "elmo.v1.Embedder"
OVERFLOW_POLICIES = {value: Overflow(name) for name, value in OVERFLOW_VALUES.items()}


class ServerState:
    """Draining switch and the count of admitted embedding RPCs (what a drain waits for).

    Once ``draining`` is set, new RPCs get UNAVAILABLE from the servicer itself while the port stays open, so that
    callers see a clear status (gRPC's own shutdown would answer late arrivals with CANCELLED)."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def check_open(self) -> None:
        if self.draining:
            raise ServiceError(Kind.UNAVAILABLE, "server is shutting down; retry on another replica")

    @contextlib.contextmanager
    def admit(self):
        """Count an RPC as in flight for the drain (refused with UNAVAILABLE when draining)."""
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

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sentences)


def prepare_embed(request: pb.EmbedRequest, models: ModelRegistry, limits: Limits) -> PreparedEmbed:
    """Check an EmbedRequest against the model and the limits; tokenize text. Raises ServiceError."""
    model = models.get(request.model)
    _check_count(len(request.inputs), limits)
    if request.dtype not in NUMPY_DTYPES:
        raise invalid(f"dtype {request.dtype} is not FLOAT32 (0) or FLOAT16 (1)")
    for i, layer in enumerate(request.layers):
        if not 0 <= layer < model.n_layers:
            raise invalid(
                f"layers[{i}] = {layer} is out of range: model '{model.name}' has {model.n_layers} "
                f"layers (0..{model.n_layers - 1})"
            )
    task = model.tasks.get(request.task) if request.task else None
    if request.omit_layers and task is None:
        raise invalid("omit_layers needs a task: without one the response would hold no vectors")
    max_per_sentence = min(limits.max_tokens_per_sentence, model.max_tokens_per_sentence)
    policy = overflow_policy(request.overflow, limits)
    sentences, offsets, truncated = [], [], []
    for i, item in enumerate(request.inputs):
        tokens, spans = _input_tokens(item, i)
        cut = 0
        if len(tokens) > max_per_sentence:
            if policy is Overflow.REJECT:
                raise too_large(over_limit_message(f"inputs[{i}]", len(tokens), max_per_sentence))
            if policy is Overflow.TRUNCATE:
                cut = len(tokens) - max_per_sentence
                tokens, spans = tokens[:max_per_sentence], spans and spans[:max_per_sentence]
        sentences.append(tokens)
        offsets.append(spans)
        truncated.append(cut)
    prepared = PreparedEmbed(
        model,
        sentences,
        offsets,
        list(request.layers) or None,
        task,
        request.omit_layers,
        request.dtype,
        truncated,
        max_per_sentence,
    )
    if prepared.n_tokens > limits.max_tokens_per_request:
        raise too_large(
            f"request has {prepared.n_tokens} tokens, over the limit of {limits.max_tokens_per_request} "
            f"(--max-tokens-per-request); split it"
        )
    size = response_bytes(prepared)
    if size > limits.max_response_bytes:
        raise too_large(
            f"response would be {human_bytes(size)}, over the {human_bytes(limits.max_response_bytes)} limit "
            "(--max-response-bytes): ask for fewer inputs or layers, FLOAT16, or use EmbedStream"
        )
    return prepared


def overflow_policy(value: int, limits: Limits) -> Overflow:
    """The request's policy, or the server's default (``--overflow``) when it names none."""
    if value == pb.OVERFLOW_DEFAULT:
        return Overflow.parse(limits.overflow)
    if value not in OVERFLOW_POLICIES:
        raise invalid(f"overflow {value} is not OVERFLOW_REJECT (1), OVERFLOW_TRUNCATE (2) or OVERFLOW_WINDOW (3)")
    return OVERFLOW_POLICIES[value]


def human_bytes(n: int) -> str:
    for unit, size in (("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _check_count(n: int, limits: Limits, field: str = "inputs") -> None:
    if n == 0:
        raise invalid(f"{field} is empty: send at least one sentence")
    if n > limits.max_inputs:
        raise too_large(
            f"too many {field}: {n}, limit {limits.max_inputs} per request (--max-inputs); split the request"
        )


def _input_tokens(item: pb.Input, i: int) -> tuple[list[str], list[tuple[int, int]] | None]:
    kind = item.WhichOneof("kind")
    if kind == "text":
        tokenized = tokenize(item.text)
        if not tokenized.tokens:
            raise invalid(f"inputs[{i}] is empty: the text has no tokens")
        return tokenized.tokens, tokenized.offsets
    if kind == "tokens":
        tokens = list(item.tokens.tokens)
        if not tokens:
            raise invalid(f"inputs[{i}] is empty: no tokens")
        for j, token in enumerate(tokens):
            if not token:
                raise invalid(f"inputs[{i}].tokens[{j}] is an empty string")
        return tokens, None
    raise invalid(f"inputs[{i}] has neither text nor tokens")


def response_bytes(prepared: PreparedEmbed) -> int:
    """Upper estimate of the serialized response size (vectors dominate; strings and framing approximated)."""
    n_layers = 0 if prepared.omit_layers else len(prepared.layers or range(prepared.model.n_layers))
    per_token = (n_layers + (1 if prepared.task else 0)) * prepared.model.dim * NUMPY_DTYPES[prepared.dtype].itemsize
    strings = sum(len(t.encode("utf-8", "surrogatepass")) + 16 for s in prepared.sentences for t in s)
    return prepared.n_tokens * per_token + strings + 64 * len(prepared.sentences) + 256


def build_response(prepared: PreparedEmbed, vectors: list[np.ndarray]) -> pb.EmbedResponse:
    response = pb.EmbedResponse(model=prepared.model.name)
    response.layers.extend(prepared.layers or range(prepared.model.n_layers))
    for tokens, spans, cut, layers in zip(prepared.sentences, prepared.offsets, prepared.truncated, vectors):
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
    return response


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _answer(method):
    """Run an RPC body; ServiceError -> its status, undecodable request -> INVALID_ARGUMENT."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            if isinstance(request, UndecodableRequest):
                raise invalid(request.message)
            return await method(self, request, context)
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)

    return wrapper


class EmbedderServicer:
    def __init__(self, models: ModelRegistry, limits: Limits, state: ServerState):
        self.models = models
        self.limits = limits
        self.state = state

    @staticmethod
    def _check_ready(model: ServedModel) -> None:
        if not model.ready:
            raise ServiceError(Kind.UNAVAILABLE, f"model '{model.name}' is warming up; retry shortly")

    async def embed_request(self, request: pb.EmbedRequest, deadline: float | None = None) -> pb.EmbedResponse:
        """The one embedding path of gRPC and HTTP: check, queue (windows of long sentences included), answer.
        ``deadline`` is a time.monotonic() instant."""
        started = time.monotonic()
        prepared = prepare_embed(request, self.models, self.limits)
        self._check_ready(prepared.model)
        batch = windowed(prepared.sentences, prepared.window_size, self.limits.window_overlap)
        pieces, stats = await prepared.model.batcher.embed(batch.pieces, deadline)
        response = build_response(prepared, batch.stitch(pieces))
        response.request_id = request.request_id
        slowest = max(stats, key=lambda s: s.queue_s + s.inference_s)
        largest = max(stats, key=lambda s: s.tokens)
        timing = response.timing
        timing.queue_ms = 1000 * slowest.queue_s
        timing.inference_ms = 1000 * slowest.inference_s
        timing.total_ms = 1000 * (time.monotonic() - started)
        timing.batch_sentences = largest.sentences
        timing.batch_tokens = largest.tokens
        return response

    @_answer
    async def Embed(self, request, context):  # noqa: N802 - gRPC method names
        with self.state.admit():
            return await self.embed_request(request, _deadline(context))

    async def EmbedStream(self, request_iterator, context):  # noqa: N802
        """Requests are embedded concurrently (so they batch together), answered in order; at most
        ``max_stream_inflight`` in flight (being embedded, or answered and waiting to be sent), which pushes back
        on a fast writer and on a slow reader. A stream that was open before a drain began is in flight: it keeps
        being served until it ends or the drain grace period runs out."""
        try:
            with self.state.admit():
                async for response in self._stream(request_iterator, context):
                    yield response
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)

    async def _stream(self, request_iterator, context):
        # A slot is taken before a request's embedding starts and given back once its response was handed to gRPC
        # (which takes it only as the client's flow-control window allows): at most max_stream_inflight requests
        # are queued, computing or answered-but-unsent, whatever the pace of either side.
        slots = asyncio.Semaphore(self.limits.max_stream_inflight)
        inflight: asyncio.Queue = asyncio.Queue()  # bounded by the slots (plus one error and the end mark)
        done = object()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if isinstance(request, UndecodableRequest):
                        inflight.put_nowait(invalid(request.message))
                        return
                    await slots.acquire()
                    inflight.put_nowait(asyncio.ensure_future(self.embed_request(request, _deadline(context))))
            finally:
                inflight.put_nowait(done)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await inflight.get()) is not done:
                if isinstance(item, ServiceError):
                    raise item
                yield await item
                slots.release()
        finally:
            reader.cancel()
            while not inflight.empty():
                item = inflight.get_nowait()
                if isinstance(item, asyncio.Future):
                    item.cancel()
                    if item.done() and not item.cancelled():
                        item.exception()  # retrieved: no "exception was never retrieved" noise

    @_answer
    async def Tokenize(self, request, context):  # noqa: N802
        return self.tokenize_request(request)

    def tokenize_request(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        self.models.get(request.model)
        self.state.check_open()
        _check_count(len(request.texts), self.limits, "texts")
        response = pb.TokenizeResponse()
        for text in request.texts:
            tokenized = tokenize(text)
            out = response.texts.add()
            out.tokens.extend(tokenized.tokens)
            out.offsets.extend(pb.Span(start=s, end=e) for s, e in tokenized.offsets)
        return response

    @_answer
    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.model_info(request.model)

    def model_info(self, name: str) -> pb.ModelInfo:
        model = self.models.get(name)
        lim = self.limits
        return pb.ModelInfo(
            name=model.name,
            version=model.version,
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
            ),
        )

    @_answer
    async def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(models=[m.name for m in self.models])


def embedder_handler(servicer: EmbedderServicer) -> grpc.GenericRpcHandler:
    """The Embedder service's handlers, with deserializers that report invalid UTF-8 instead of failing."""
    serialize = {
        "Embed": pb.EmbedResponse.SerializeToString,
        "EmbedStream": pb.EmbedResponse.SerializeToString,
        "Tokenize": pb.TokenizeResponse.SerializeToString,
        "GetModelInfo": pb.ModelInfo.SerializeToString,
        "ListModels": pb.ListModelsResponse.SerializeToString,
    }
    parse = {
        "Embed": lenient_parser(pb.EmbedRequest),
        "EmbedStream": lenient_parser(pb.EmbedRequest),
        "Tokenize": lenient_parser(pb.TokenizeRequest),
        "GetModelInfo": lenient_parser(pb.GetModelInfoRequest),
        "ListModels": lenient_parser(pb.ListModelsRequest),
    }
    handlers = {}
    for name in serialize:
        kwargs = dict(request_deserializer=parse[name], response_serializer=serialize[name])
        behavior = getattr(servicer, name)
        if name == "EmbedStream":
            handlers[name] = grpc.stream_stream_rpc_method_handler(behavior, **kwargs)
        else:
            handlers[name] = grpc.unary_unary_rpc_method_handler(behavior, **kwargs)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


__all__ = ["SERVICE_NAME", "EmbedderServicer", "PreparedEmbed", "ServerState", "embedder_handler", "prepare_embed"]
