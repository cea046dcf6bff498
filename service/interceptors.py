"""Cross-cutting concerns as grpc.aio server interceptors: bearer-token auth, and one observer that records
metrics and logs one line per RPC (DEBUG; failures other than the caller's at WARNING).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from collections.abc import Callable

import grpc
import grpc.aio

log = logging.getLogger("service.rpc")

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
    """Require ``authorization: Bearer <token>`` on every RPC except health checks (probes carry no secrets)."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        self._expected = f"Bearer {token}".encode()
        self._exempt = exempt_prefixes

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self._exempt):
            return handler
        presented = _metadata(details, "authorization")
        if presented is None:
            return _aborting(
                handler, grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
            )
        if not hmac.compare_digest(presented.encode(), self._expected):
            return _aborting(handler, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return handler


def _aborting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that only aborts (so streaming RPCs fail cleanly too)."""

    async def abort(request_or_iterator, context):
        await context.abort(code, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    return grpc.stream_stream_rpc_method_handler(abort_stream, **kwargs)


# (method, code, seconds, peer, request_id) -> None
RpcDoneHook = Callable[[str, grpc.StatusCode, float], None]


class ObserverInterceptor(grpc.aio.ServerInterceptor):
    """Times every RPC, works out its final status code and reports it to ``on_done`` and to the log."""

    def __init__(self, on_start: Callable[[], None], on_done: RpcDoneHook):
        self._on_start = on_start
        self._on_done = on_done

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        return _observed(handler, details, self._on_start, self._finish)

    def _finish(self, details, context, started: float, error: BaseException | None) -> None:
        code = _final_code(context, error)
        seconds = time.perf_counter() - started
        method = details.method
        self._on_done(method, code, seconds)
        level = logging.DEBUG if code is grpc.StatusCode.OK or code in CLIENT_FAULT_CODES else logging.WARNING
        if log.isEnabledFor(level):
            request_id = _metadata(details, "x-request-id") or "-"
            log.log(
                level,
                "%s %s %.1fms peer=%s request_id=%s %s",
                method,
                code.name,
                1000 * seconds,
                context.peer(),
                request_id,
                context.details() or "",
            )


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


def _observed(handler, details, on_start, finish) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def unary_response(behavior, request, context):
        on_start()
        started, error = time.perf_counter(), None
        try:
            result = behavior(request, context)
            return (await result) if inspect.isawaitable(result) else result
        except BaseException as exc:
            error = exc
            raise
        finally:
            finish(details, context, started, error)

    async def stream_response(behavior, request, context):
        on_start()
        started, error = time.perf_counter(), None
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            finish(details, context, started, error)

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
