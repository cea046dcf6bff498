"""Cross-cutting concerns as grpc.aio server interceptors: bearer-token auth and per-RPC observation, both the
shared implementations of service.telemetry.observe (HTTP uses the same), adapted to gRPC's handlers and status
codes; and the call gate, which bounds what one call and one peer can hold (:class:`CallGate`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
import grpc.aio
from elmo.service.common.errors import ServiceError, grpc_code
from elmo.service.common.handlers import WrappingInterceptor, wrap_handler
from elmo.service.common.limits import Limits
from elmo.service.common.shares import Shares, peer_address
from elmo.service.common.tokens import BearerToken
from elmo.service.telemetry.observe import API, CLIENT_GONE, HEALTH, REFLECTION, Observation, RequestObserver

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."  # grpc.reflection.v1alpha and v1: the client listing services and files
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


class ObserverInterceptor(WrappingInterceptor):
    """Times every RPC, works out its final status code and reports it to the shared observer."""

    def __init__(self, observer: RequestObserver):
        super().__init__()
        self._observer = observer

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        short, kind = method.rsplit("/", 1)[-1], call_kind(method)
        return wrap_handler(
            handler,
            lambda context: (self._observer.start(short, kind), _who(context)),
            lambda state, context, error: self._finish(state[0], context, error, state[1]),
        )

    @staticmethod
    def _finish(seen: Observation, context, error: BaseException | None, who: tuple[str, str]) -> None:
        if _client_went_away(error):  # an answer that could not be sent: the client's doing, no fault
            seen.finish(CLIENT_GONE, server_fault=False, describe=lambda: (*who, "client disconnect"))
            return
        code = _final_code(context, error)
        seen.finish(
            code.name,
            server_fault=code is not grpc.StatusCode.OK and code not in CLIENT_FAULT_CODES,
            describe=lambda: (*who, context.details() or ""),
        )


def call_kind(method: str) -> str:
    """Health checks and reflection are counted apart from the API's calls (service.telemetry.observe)."""
    if method.startswith(HEALTH_PREFIX):
        return HEALTH
    return REFLECTION if method.startswith(REFLECTION_PREFIX) else API


def _client_went_away(error: BaseException | None) -> bool:
    """gRPC's core could not carry out a write (grpc.aio.InternalError): the stream is gone, its client closed or
    reset the connection."""
    return isinstance(error, grpc.aio.InternalError)


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
    if isinstance(error, GeneratorExit) or (not isinstance(error, asyncio.CancelledError) and context.cancelled()):
        # A streaming handler left at a ``yield`` when its call ended (the client closed the stream while an answer
        # was being sent: grpcio-reflection's client does so after listing the services), then closed by gRPC or the
        # collector: the call was cancelled under it, nothing failed on the server.
        return grpc.StatusCode.CANCELLED
    if isinstance(error, asyncio.CancelledError):
        remaining = context.time_remaining()
        return (
            grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
        )
    return grpc.StatusCode.UNKNOWN


_CODES_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


T = TypeVar("T")


async def first_message(requests: AsyncIterator[T], context: grpc.aio.ServicerContext, timeout_s: float) -> T:
    """A call's one request message, within ``timeout_s`` of its headers (``--grpc-message-timeout-s``); otherwise the
    call is aborted, naming why."""
    try:
        async with asyncio.timeout(timeout_s):
            return await anext(aiter(requests))
    except StopAsyncIteration:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message")
    except TimeoutError:
        message = (
            f"the request message did not arrive within {timeout_s:g} s of the call's headers "
            "(--grpc-message-timeout-s); the call is closed"
        )
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
    raise AssertionError("unreachable: context.abort raises")


class CallGate(WrappingInterceptor):
    """Every call's request read against a clock, and every call but health checks counted in bounded shares.

    gRPC starts a unary-request handler only once its message is whole, so a call whose message never completes
    would be held unanswered, unseen by any handler, until its connection closes. Here every handler is served as
    a *request-streaming* one (the wire format is the same, clients cannot tell): it starts at the call's headers,
    takes its place in ``shares`` (refused with RESOURCE_EXHAUSTED when the server or this peer is full), and
    the request message must then arrive within ``message_timeout`` seconds (a stream's next message within
    ``stream_idle_timeout``), else DEADLINE_EXCEEDED. Health checks take no place: a probe is never refused
    because embedding calls are full. Put this interceptor last, so that auth refuses a caller before it counts.
    """

    def __init__(
        self,
        shares: Shares,
        message_timeout: float,
        stream_idle_timeout: float,
        exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,),
    ):
        super().__init__()
        self.shares = shares
        self.message_timeout, self.stream_idle_timeout = message_timeout, stream_idle_timeout
        self._exempt = exempt_prefixes

    @classmethod
    def for_limits(cls, limits: Limits) -> CallGate:
        """The gate of ``limits``: its own shares of --max-concurrent-rpcs calls, --max-calls-per-peer a peer, and
        the request message's clocks (--grpc-message-timeout-s, --grpc-idle-timeout-s)."""
        calls = Shares(
            limits.max_concurrent_rpcs,
            limits.max_calls_per_peer,
            "calls",
            ("--max-concurrent-rpcs", "--max-calls-per-peer"),
        )
        return cls(calls, limits.grpc_message_timeout, limits.grpc_idle_timeout)

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return self._gate(handler, counted=not method.startswith(self._exempt))

    @contextlib.asynccontextmanager
    async def _place(self, context: grpc.aio.ServicerContext, counted: bool):
        if not counted:
            yield
            return
        peer = peer_address(context.peer())
        try:
            self.shares.take(peer)
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)
        # Given back once gRPC is done with the call, not when the handler returns: a unary answer whose client
        # does not read (its window shut) keeps the call open in gRPC, and must keep its place in the shares too.
        context.add_done_callback(lambda _: self.shares.give_back(peer))
        yield

    async def _first(self, requests, context) -> object:
        """The one request message of a unary-request call."""
        return await first_message(requests, context, self.message_timeout)

    def _gate(self, handler: grpc.RpcMethodHandler, counted: bool) -> grpc.RpcMethodHandler:
        kwargs = dict(
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
        place, first = self._place, self._first
        if handler.unary_unary or handler.stream_unary:
            unary_request = handler.unary_unary is not None
            behavior = handler.unary_unary or handler.stream_unary

            async def su(requests, context):
                async with place(context, counted):
                    if unary_request:
                        result = behavior(await first(requests, context), context)
                        return (await result) if inspect.isawaitable(result) else result
                    reader = _TimedReader(requests, self.stream_idle_timeout)
                    result = await behavior(reader, context)
                    await reader.abort_if_idle(context)
                    return result

            return grpc.stream_unary_rpc_method_handler(su, **kwargs)
        unary_request = handler.unary_stream is not None
        behavior = handler.unary_stream or handler.stream_stream

        async def ss(requests, context):
            async with place(context, counted):
                reader = None if unary_request else _TimedReader(requests, self.stream_idle_timeout)
                request = await first(requests, context) if unary_request else reader
                if inspect.isasyncgenfunction(behavior):
                    async for response in behavior(request, context):
                        yield response
                else:  # a coroutine that writes with context.write (grpc's health Watch)
                    await behavior(request, context)
                if reader is not None:
                    await reader.abort_if_idle(context)

        return grpc.stream_stream_rpc_method_handler(ss, **kwargs)


class _TimedReader:
    """A stream's requests, each of which must arrive within ``timeout`` of the one before (or of the call's
    start). A stream that falls silent ends as if the client had half-closed it: the requests already read are
    still answered, then :meth:`abort_if_idle` ends the call with DEADLINE_EXCEEDED."""

    def __init__(self, requests, timeout: float):
        self._requests = aiter(requests)
        self._timeout = timeout
        self.idle = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            async with asyncio.timeout(self._timeout):  # no extra task: a cancelled read stays cancelled
                return await anext(self._requests)
        except TimeoutError:
            self.idle = True
            raise StopAsyncIteration from None

    async def abort_if_idle(self, context) -> None:
        if self.idle:
            message = f"no request message for {self._timeout:g} s (--grpc-idle-timeout-s); the stream is closed"
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)


__all__ = ["AuthInterceptor", "CallGate", "ObserverInterceptor", "call_kind"]
