"""Cross-cutting concerns as grpc.aio server interceptors: bearer-token auth and per-RPC observation, both the
shared implementations of service.observe (HTTP uses the same), adapted to gRPC's handlers and status codes.
"""

from __future__ import annotations

import asyncio
import inspect

import grpc
import grpc.aio
from elmo.service.errors import ServiceError, grpc_code
from elmo.service.observe import BearerToken, Observation, RequestObserver

HEALTH_PREFIX = "/grpc.health.v1.Health/"
CLIENT_FAULT_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for item in details.invocation_metadata or ():
        if item[0] == key:
            return item[1]
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC except health checks (probes carry no secrets), or,
    with ``only_prefixes``, on those RPCs alone (the admin token on ``elmo.v1.ModelAdmin``). ``token``: the token
    itself, or an object with BearerToken's ``check(presented, where)`` that raises ServiceError."""

    def __init__(
        self,
        token: str | BearerToken,
        exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,),
        only_prefixes: tuple[str, ...] | None = None,
    ):
        self._token = BearerToken(token) if isinstance(token, str) else token
        self._exempt = exempt_prefixes
        self._only = only_prefixes

    def _checks(self, method: str) -> bool:
        if self._only is not None:
            return method.startswith(self._only)
        return not method.startswith(self._exempt)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not self._checks(details.method):
            return handler
        try:
            self._token.check(_metadata(details, "authorization"), "metadata")
        except ServiceError as exc:
            return _aborting(handler, grpc_code(exc.kind), exc.message)
        return handler


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that only aborts, with ``handler``'s response kind and (de)serializers, always *request-streaming*:
    gRPC starts a unary-request handler only once the request message is whole, so a refused caller who never
    finishes its message would hold the call (and one of --max-concurrent-rpcs) unanswered; a streaming one starts
    at the headers, and the refusal goes out before a byte of the message is read."""

    async def abort(request_or_iterator, context):
        await context.abort(code, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary or handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)


class ObserverInterceptor(grpc.aio.ServerInterceptor):
    """Times every RPC, works out its final status code and reports it to the shared observer. The observing
    handler is built once per method (a method's handler never changes), not once per call."""

    def __init__(self, observer: RequestObserver):
        self._observer = observer
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            short = details.method.rsplit("/", 1)[-1]
            cached = (handler, _observed(handler, lambda: self._observer.start(short), self._finish))
            self._wrapped[details.method] = cached
        return cached[1]

    @staticmethod
    def _finish(seen: Observation, context, error: BaseException | None, who: tuple[str, str]) -> None:
        code = _final_code(context, error)
        seen.finish(
            code.name,
            server_fault=code is not grpc.StatusCode.OK and code not in CLIENT_FAULT_CODES,
            describe=lambda: (*who, context.details() or ""),
        )


def _who(context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """(peer, x-request-id), read while the call is alive: after gRPC has cut a call (a stream's oversized message),
    ``context.peer()`` crashes the process (a segfault in grpc's C core)."""
    request_id = next((v for k, v in context.invocation_metadata() or () if k == "x-request-id"), "-")
    return context.peer(), request_id


def _final_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if code is not None and not isinstance(code, grpc.StatusCode):
        code = _CODES_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    if code is not None:
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        return (
            grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
        )
    return grpc.StatusCode.UNKNOWN


_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def _observed(handler, start, finish) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def unary_response(behavior, request, context):
        seen, error, who = start(), None, _who(context)
        try:
            result = behavior(request, context)
            return (await result) if inspect.isawaitable(result) else result
        except BaseException as exc:
            error = exc
            raise
        finally:
            finish(seen, context, error, who)

    async def stream_response(behavior, request, context):
        seen, error, who = start(), None, _who(context)
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            finish(seen, context, error, who)

    # grpc.aio decides how to run a behavior by inspecting it: these must be real `async def` functions.
    if handler.unary_unary:

        async def uu(request, context):
            return await unary_response(handler.unary_unary, request, context)

        return grpc.unary_unary_rpc_method_handler(uu, **kwargs)
    if handler.stream_unary:

        async def su(request_iterator, context):
            return await unary_response(handler.stream_unary, request_iterator, context)

        return grpc.stream_unary_rpc_method_handler(su, **kwargs)
    # Streaming responses: keep the behavior's style (async generator, or a coroutine calling context.write).
    if handler.unary_stream:
        behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if inspect.isasyncgenfunction(behavior):

        async def streaming(request, context):
            async for response in stream_response(behavior, request, context):
                yield response

        return make(streaming, **kwargs)

    async def writing(request, context):
        return await unary_response(behavior, request, context)

    return make(writing, **kwargs)


__all__ = ["AuthInterceptor", "ObserverInterceptor"]
