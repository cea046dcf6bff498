"""Wrapping a gRPC method's handler: the one way the service's interceptors (the observer, the call gate, tracing)
run code around every call, whatever the method's shape.

    enter(context) -> state        before the behavior runs
    leave(state, context, error)   after it ended: returned, raised (``error``) or was cancelled
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

Enter = Callable[[Any], Any]
Leave = Callable[[Any, Any, "BaseException | None"], None]


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each method's handler once (a method's handler never changes), not once per call: ``wrap(method,
    handler)`` builds the wrapped handler the first time a method is called."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = (handler, self.wrap(details.method, handler))
            self._wrapped[details.method] = cached
        return cached[1]


def wrap_handler(handler: grpc.RpcMethodHandler, enter: Enter, leave: Leave) -> grpc.RpcMethodHandler:
    """``handler`` with ``enter`` before and ``leave`` after each call, for all four method shapes."""
    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)

    async def unary_response(behavior, request, context):
        state, error = enter(context), None
        try:
            result = behavior(request, context)
            return (await result) if inspect.isawaitable(result) else result
        except BaseException as exc:
            error = exc
            raise
        finally:
            leave(state, context, error)

    async def stream_response(behavior, request, context):
        state, error = enter(context), None
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as exc:
            error = exc
            raise
        finally:
            leave(state, context, error)

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
