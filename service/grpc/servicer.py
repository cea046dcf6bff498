"""The ``elmo.v1.Embedder`` servicer: a thin gRPC adapter over the request core (service.core.requests). No
numerical code.

Every RPC runs inside :func:`_answer`, which turns a :class:`ServiceError` into its status code (the one mapping in
service.common.errors) and an undecodable request into INVALID_ARGUMENT.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
import grpc.aio
from elmo.service.common.errors import ServiceError, grpc_code, invalid
from elmo.service.common.shares import peer_address
from elmo.service.core.answers import EmbedResult, response_bytes
from elmo.service.core.budget import AnswerBudgetFull, AnswerClaim
from elmo.service.core.encodings import PROTOBUF
from elmo.service.core.requests import RequestCore
from elmo.service.grpc.decode import UndecodableRequest, lenient_parser

from elmo.v1 import embedder_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Embedder"].full_name  # "elmo.v1.Embedder"


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


def _embed(core: RequestCore, request: pb.EmbedRequest, context, claim: AnswerClaim, admitted: bool = False):
    """One EmbedRequest through the core, answered as the serialized EmbedResponse (its request id echoed): the
    bytes gRPC sends, which its serializer passes through (:func:`_serialized`). ``claim`` holds the answer's bytes
    in the budget of answers in flight; the caller releases it once the answer has left."""

    def answer(result: EmbedResult) -> bytes:
        return response_bytes(result, request.request_id)

    return core.embed(request, PROTOBUF, answer, _deadline(context), admitted=admitted, claim=claim)


class EmbedderServicer:
    def __init__(self, core: RequestCore):
        self.core = core

    @_answer
    async def Embed(self, request, context):  # noqa: N802 - gRPC method names
        # The answer holds its bytes until the call is done: gRPC sends it only as the client's window allows, so
        # an answer the client never reads stays in the budget (and its peer's next large calls are refused).
        claim = self.core.answers.claim(peer_address(context.peer()))
        context.add_done_callback(lambda _: claim.release())
        return await _embed(self.core, request, context, claim)

    async def EmbedStream(self, request_iterator, context):  # noqa: N802
        """Requests are embedded concurrently (so they batch together), answered in order; at most
        ``max_stream_inflight`` in flight (being embedded, or answered and waiting to be sent), which pushes back
        on a fast writer and on a slow reader. A stream that was open before a drain began is in flight: it keeps
        being served until it ends or the drain grace period runs out."""
        try:
            with self.core.admit():
                async for response in self._stream(request_iterator, context):
                    yield response
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)

    async def _stream(self, request_iterator, context):
        # A slot is taken before a request's embedding starts and given back once its response was handed to gRPC
        # (which takes it only as the client's flow-control window allows): at most max_stream_inflight requests
        # are queued, computing or answered-but-unsent, whatever the pace of either side.
        slots = asyncio.Semaphore(self.core.limits.max_stream_inflight)
        inflight: asyncio.Queue = asyncio.Queue()  # bounded by the slots (plus one error and the end mark)
        done = object()
        peer = peer_address(context.peer())
        claims: list[AnswerClaim] = []  # the answers in flight's bytes, in order, released as each is taken by gRPC
        left = asyncio.Event()  # set each time one of this stream's answers has left

        async def embed(request: pb.EmbedRequest, claim: AnswerClaim) -> bytes:
            # The stream's answers take their places in the budget in the order they are sent: one that does not
            # fit waits for an answer ahead of it to leave (never for one behind it, which is sent after it), and
            # is refused only when none of this stream's is ahead.
            try:
                while True:
                    left.clear()
                    try:
                        return await _embed(self.core, request, context, claim, admitted=True)
                    except AnswerBudgetFull:
                        if not any(ahead.bytes for ahead in claims[: claims.index(claim)]):
                            raise
                        await left.wait()
            finally:
                claim.settle()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if isinstance(request, UndecodableRequest):
                        inflight.put_nowait(invalid(request.message))
                        return
                    await slots.acquire()
                    claim = self.core.answers.claim(peer, after=claims[-1] if claims else None)
                    claims.append(claim)
                    inflight.put_nowait((asyncio.ensure_future(embed(request, claim)), claim))
            finally:
                inflight.put_nowait(done)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await inflight.get()) is not done:
                if isinstance(item, ServiceError):
                    raise item
                embedding, claim = item
                yield await embedding  # resumed once gRPC has sent it
                claim.release()
                claims.remove(claim)
                left.set()
                slots.release()
        finally:
            reader.cancel()
            for claim in claims:
                claim.release()
            while not inflight.empty():
                item = inflight.get_nowait()
                if isinstance(item, tuple):
                    item = item[0]
                if isinstance(item, asyncio.Future):
                    item.cancel()
                    if item.done() and not item.cancelled():
                        item.exception()  # retrieved: no "exception was never retrieved" noise

    @_answer
    async def Tokenize(self, request, context):  # noqa: N802
        claim = self.core.answers.claim(peer_address(context.peer()))
        context.add_done_callback(lambda _: claim.release())
        return await self.core.tokenize(request, lambda response: response, claim, pb.TokenizeResponse.ByteSize)

    @_answer
    async def GetModelInfo(self, request, context):  # noqa: N802
        return self.core.model_info(request.model)

    @_answer
    async def ListModels(self, request, context):  # noqa: N802
        return pb.ListModelsResponse(models=[m.name for m in self.core.models], statuses=self.core.statuses())


def _serialized(response: bytes | pb.EmbedResponse) -> bytes:
    """Embed's answers are serialized already (service.core.answers.response_bytes); a message is serialized here."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def embedder_handler(servicer: EmbedderServicer) -> grpc.GenericRpcHandler:
    """The Embedder service's handlers, with deserializers that report invalid UTF-8 instead of failing."""
    serialize = {
        "Embed": _serialized,
        "EmbedStream": _serialized,
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


__all__ = ["SERVICE_NAME", "EmbedderServicer", "embedder_handler"]
