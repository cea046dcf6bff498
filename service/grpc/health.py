"""grpc.health.v1 that no client can stall or exhaust: ``Check`` and ``Watch`` for ``""`` (the whole server) and
each served service.

A status change never waits on a client. :meth:`HealthServicer.set` only records the new status and wakes the
watchers; each Watch stream is its own writer (the call's own task) and sends the latest status when it can. A
client that does not read (its HTTP/2 window shut) delays nobody but itself, and a watcher whose write is not taken
within ``stall_s`` is dropped: it gets no further status, and its stream ends (DEADLINE_EXCEEDED) as soon as the
client reads again.

Health calls are bounded like embedding calls are (service.common.shares), in shares of their own: Watch streams
(``max_watches`` at once, ``max_watches_per_peer`` of them from one client address) and Check calls in progress
(``max_checks``, ``max_checks_per_peer``); beyond, RESOURCE_EXHAUSTED naming the flag. A call takes its place at its
headers, before its request message is read (that must come within ``message_timeout_s``), and keeps it until its
answers have really left: gRPC holds a call whose client does not read until that client reads, goes away, or the
server stops, and so do the shares, so calls that stall never add up beyond them. Both methods are served as
request-streaming handlers, which gRPC starts at the headers (the wire format is the same: clients cannot tell).
Every Watch ends after ``max_age_s`` (status OK; the client watches again), so a place is never held for good.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

import grpc
import grpc.aio
from elmo.service.common.errors import ServiceError, grpc_code
from elmo.service.common.shares import Shares, peer_address
from elmo.service.grpc.interceptors import first_message
from grpc_health.v1 import health_pb2

from elmo.errors import ConfigError
from elmo.flags import add_fields_as_flags, fields_from_args

log = logging.getLogger("service.health")

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # grpc.health.v1.Health


@dataclass(frozen=True)
class HealthLimits:
    """``elmo serve``'s bounds on grpc.health.v1 calls (the ``--health-*`` flags)."""

    max_watches: int = 64  # Watch streams open at once, all clients together
    max_watches_per_peer: int = 8  # of those, what one client address may hold
    max_age_s: float = 300.0  # a Watch ends (OK) after this long; the client watches again
    stall_s: float = 5.0  # a status not taken by its client this soon: that watcher is dropped
    max_checks: int = 128  # Check calls in progress at once (a served Check lasts until its answer has left)
    max_checks_per_peer: int = 32  # of those, what one client address may hold
    http_connections: int = 8  # HTTP connections beyond --max-connections for GET /health only, one per address

    def validate(self) -> HealthLimits:
        for f in fields(self):
            value = getattr(self, f.name)
            zero_ok = f.name in MAY_BE_ZERO
            if not (isinstance(value, (int, float)) and (value >= 0 if zero_ok else value > 0)):
                must = "0 or more" if zero_ok else "positive"
                raise ConfigError(f"--{_FLAGS[f.name]} must be {must} (got {value!r})")
        for total, per_peer in (("max_watches", "max_watches_per_peer"), ("max_checks", "max_checks_per_peer")):
            if getattr(self, per_peer) > getattr(self, total):
                raise ConfigError(f"--{_FLAGS[per_peer]} must not exceed --{_FLAGS[total]}")
        return self

    @property
    def calls(self) -> int:
        """The most health calls the shares let be open at once."""
        return self.max_watches + self.max_checks


_FLAGS = {
    "max_watches": "health-watch-max",
    "max_watches_per_peer": "health-watch-max-per-peer",
    "max_age_s": "health-watch-max-age-s",
    "stall_s": "health-watch-stall-s",
    "max_checks": "health-check-max",
    "max_checks_per_peer": "health-check-max-per-peer",
    "http_connections": "health-http-connections",
}
MAY_BE_ZERO = frozenset({"http_connections"})  # 0 turns it off
_HELP = {
    "max_watches": "grpc.health.v1 Watch streams open at once, all clients together; beyond, a new Watch gets "
    "RESOURCE_EXHAUSTED. gRPC's own cap on open calls leaves room for all health calls on top of "
    "--max-concurrent-rpcs, so they can never keep an Embed out, nor Watch streams a Check",
    "max_watches_per_peer": "Watch streams one client address may hold open, its share of --health-watch-max "
    "(behind a proxy raise it to --health-watch-max)",
    "max_age_s": "seconds after which a Watch stream ends with OK; the client watches again (grpc's client-side "
    "health checking does so at once)",
    "stall_s": "seconds a Watch stream's client may take to read a new status; a watcher that does not is dropped "
    "(no further statuses; its stream ends with DEADLINE_EXCEEDED once the client reads), and no other watcher, "
    "probe or status change ever waits for it",
    "max_checks": "grpc.health.v1 Check calls in progress at once, all clients together (a Check is answered at "
    "once, but holds its place until its client has taken the answer); beyond, RESOURCE_EXHAUSTED",
    "max_checks_per_peer": "Check calls in progress from one client address, its share of --health-check-max",
    "http_connections": "HTTP connections beyond --max-connections (and beyond a client's "
    "--max-connections-per-peer) on which only GET /health is answered, at most one per client address: a probe "
    "is answered while other clients hold every connection. Such a connection must send its request within 2 s "
    "(or --http-header-timeout-s if shorter), gets the cap's 503 for any other path, and is closed after its "
    "answer. 0: none",
}


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("health checks (grpc.health.v1, GET /health)")
    add_fields_as_flags(group, HealthLimits(), _HELP, _FLAGS.__getitem__)


def health_limits_from_args(args: argparse.Namespace) -> HealthLimits:
    return fields_from_args(HealthLimits, args, _FLAGS.__getitem__).validate()


class _Watcher:
    """One Watch stream: the service it follows, and a flag raised whenever that service's status changes."""

    __slots__ = ("service", "changed")

    def __init__(self, service: str) -> None:
        self.service = service
        self.changed = asyncio.Event()


class _Stalled(Exception):
    """The client did not take a status within the stall bound; ``write`` is that status's write, still going."""

    def __init__(self, write: asyncio.Future) -> None:
        super().__init__("stalled")
        self.write = write


class HealthServicer:
    """grpc.health.v1.Health, with statuses set by the server (:meth:`set`, :meth:`enter_graceful_shutdown`);
    :func:`health_handler` serves it. ``message_timeout_s``: how soon a call's request message must follow its
    headers (--grpc-message-timeout-s)."""

    def __init__(self, limits: HealthLimits | None = None, message_timeout_s: float = 30.0) -> None:
        self.limits = limits or HealthLimits()
        self.message_timeout_s = message_timeout_s
        self._status: dict[str, int] = {}
        self._watchers: set[_Watcher] = set()
        self.watches = Shares(
            self.limits.max_watches,
            self.limits.max_watches_per_peer,
            "health Watch streams",
            ("--health-watch-max", "--health-watch-max-per-peer"),
        )
        self.checks = Shares(
            self.limits.max_checks,
            self.limits.max_checks_per_peer,
            "health Check calls",
            ("--health-check-max", "--health-check-max-per-peer"),
        )
        self._closing = False
        self.dropped = 0  # watchers dropped for not reading their status

    # -- the server's side -----------------------------------------------------------------------------------------
    def set(self, service: str, status: int) -> None:
        """Record ``service``'s status and wake its watchers; never waits on a client. Ignored once shutting down."""
        if not self._closing:
            self._record(service, status)

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; each watcher sends it and its stream ends."""
        self._closing = True
        for service in list(self._status):
            self._record(service, NOT_SERVING)
        for watcher in self._watchers:
            watcher.changed.set()

    def status(self, service: str = "") -> int | None:
        return self._status.get(service)

    @property
    def watching(self) -> int:
        """Watch streams holding a place now (dropped ones whose streams are still open included)."""
        return self.watches.count

    def _record(self, service: str, status: int) -> None:
        self._status[service] = status
        for watcher in self._watchers:
            if watcher.service == service:
                watcher.changed.set()

    # -- the RPCs (request-streaming handlers: they start at the call's headers) ------------------------------------
    async def check(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: grpc.aio.ServicerContext
    ) -> None:
        async with self._place(self.checks, context):
            request = await first_message(requests, context, self.message_timeout_s)
            status = self._status.get(request.service)
            if status is None:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:100]!r}")
            # a client that does not read holds this write, and with it its place, until it reads or goes
            await context.write(health_pb2.HealthCheckResponse(status=status))

    async def watch(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: grpc.aio.ServicerContext
    ) -> None:
        async with self._place(self.watches, context) as peer:
            request = await first_message(requests, context, self.message_timeout_s)
            watcher = _Watcher(request.service)
            self._watchers.add(watcher)
            try:
                await self._follow(watcher, context)
            except _Stalled as stalled:
                await self._end_dropped(watcher, context, peer, stalled.write)
            finally:
                self._watchers.discard(watcher)

    @contextlib.asynccontextmanager
    async def _place(self, shares: Shares, context: grpc.aio.ServicerContext) -> AsyncIterator[str]:
        """A place in ``shares`` for this call's client address, or RESOURCE_EXHAUSTED naming the limit; given back
        only when the call is over (its answers sent, or gRPC has cancelled it)."""
        peer = peer_address(context.peer())
        try:
            shares.take(peer)
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)
        try:
            yield peer
        finally:
            shares.give_back(peer)

    async def _follow(self, watcher: _Watcher, context: grpc.aio.ServicerContext) -> None:
        """Send each new status of the watched service until the stream's age is up or the server shuts down."""
        ends_at = asyncio.get_running_loop().time() + self.limits.max_age_s
        sent: int | None = None
        while True:
            watcher.changed.clear()  # before reading the status: a change from here on raises it again
            status = self._status.get(watcher.service, SERVICE_UNKNOWN)
            if status != sent:
                await self._send(context, status)
                sent = status
                continue  # the status may have changed while it was being sent
            if self._closing:
                return  # NOT_SERVING sent: the stream ends, the server is going
            try:
                async with asyncio.timeout_at(ends_at):
                    await watcher.changed.wait()
            except TimeoutError:
                return  # its age is up: OK, and the client watches again

    async def _send(self, context: grpc.aio.ServicerContext, status: int) -> None:
        """Write one status; raise _Stalled if the client has not taken it within ``stall_s`` (the write goes on)."""
        write = asyncio.ensure_future(context.write(health_pb2.HealthCheckResponse(status=status)))
        try:
            done, _ = await asyncio.wait({write}, timeout=self.limits.stall_s)
        except BaseException:
            write.cancel()
            raise
        if write not in done:
            raise _Stalled(write)
        write.result()

    async def _end_dropped(
        self, watcher: _Watcher, context: grpc.aio.ServicerContext, peer: str, write: asyncio.Future
    ) -> None:
        """A watcher that did not read: no further statuses; once its client takes the pending one (or goes away,
        or the server stops: gRPC then cancels this call), the stream ends with DEADLINE_EXCEEDED."""
        self._watchers.discard(watcher)
        self.dropped += 1
        log.info(
            "health Watch from %s dropped: its client took no status for %g s (--health-watch-stall-s)",
            peer,
            self.limits.stall_s,
        )
        await write  # cancelled with this call when gRPC cancels it
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"this Watch did not read its health status within {self.limits.stall_s:g} s (--health-watch-stall-s) "
            "and was dropped; watch again",
        )


def health_handler(servicer: HealthServicer) -> grpc.GenericRpcHandler:
    """grpc.health.v1.Health's two methods, served by ``servicer`` as request-streaming handlers (same wire format
    as the unary-request methods of the contract: gRPC starts them at the headers, so a call takes its place in the
    shares before its request message is read)."""
    kwargs = dict(
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler(
        HEALTH_SERVICE,
        {
            "Check": grpc.stream_stream_rpc_method_handler(servicer.check, **kwargs),
            "Watch": grpc.stream_stream_rpc_method_handler(servicer.watch, **kwargs),
        },
    )


__all__ = [
    "HEALTH_SERVICE",
    "HealthLimits",
    "HealthServicer",
    "add_health_arguments",
    "health_handler",
    "health_limits_from_args",
]
