"""grpc.health.v1 that no client can stall or exhaust: ``Check`` and ``Watch`` for ``""`` (the whole server) and
each served service.

A status change never waits on a client. :meth:`HealthServicer.set` only records the new status and wakes the
watchers; each Watch stream is its own writer (the call's own task) and sends the latest status when it can. A
client that does not read (its HTTP/2 window shut) delays nobody but itself, and a watcher whose write is not taken
within ``stall_s`` is dropped: it gets no further status, and its stream ends (DEADLINE_EXCEEDED) as soon as the
client reads again.

Watch streams are bounded like calls are (service.common.shares): at most ``max_watches`` at once, of which one
client address may hold ``max_watches_per_peer``; beyond either, a new Watch gets RESOURCE_EXHAUSTED naming the
flag. A Watch keeps its place until its stream has really ended on the wire, a dropped one included (a stream whose
client never reads can only be closed by that client, by the connection's age limit or by the shutdown), so stalled
streams never add up beyond the share. Every Watch ends after ``max_age_s`` (status OK; the client watches again),
so a place is never held for good. ``Check`` answers at once from the recorded status.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass, fields

import grpc
import grpc.aio
from elmo.service.common.errors import ServiceError, grpc_code
from elmo.service.common.shares import Shares, peer_address
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.errors import ConfigError

log = logging.getLogger("service.health")

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


@dataclass(frozen=True)
class WatchLimits:
    """``elmo serve``'s bounds on grpc.health.v1 Watch streams (the ``--health-watch-*`` flags)."""

    max_watches: int = 64  # Watch streams open at once, all clients together
    max_watches_per_peer: int = 8  # of those, what one client address may hold
    max_age_s: float = 300.0  # a Watch ends (OK) after this long; the client watches again
    stall_s: float = 5.0  # a status not taken by its client this soon: that watcher is dropped

    def validate(self) -> WatchLimits:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"--{_FLAGS[f.name]} must be positive (got {value!r})")
        if self.max_watches_per_peer > self.max_watches:
            raise ConfigError("--health-watch-max-per-peer must not exceed --health-watch-max")
        return self


_FLAGS = {
    "max_watches": "health-watch-max",
    "max_watches_per_peer": "health-watch-max-per-peer",
    "max_age_s": "health-watch-max-age-s",
    "stall_s": "health-watch-stall-s",
}
_HELP = {
    "max_watches": "grpc.health.v1 Watch streams open at once, all clients together; beyond, a new Watch gets "
    "RESOURCE_EXHAUSTED (Check is never refused for it). gRPC's own cap on open calls leaves room for these on top "
    "of --max-concurrent-rpcs, so Watch streams can never keep a Check or an Embed out",
    "max_watches_per_peer": "Watch streams one client address may hold open, its share of --health-watch-max "
    "(behind a proxy raise it to --health-watch-max)",
    "max_age_s": "seconds after which a Watch stream ends with OK; the client watches again (grpc's client-side "
    "health checking does so at once)",
    "stall_s": "seconds a Watch stream's client may take to read a new status; a watcher that does not is dropped "
    "(no further statuses; its stream ends with DEADLINE_EXCEEDED once the client reads), and no other watcher, "
    "probe or status change ever waits for it",
}


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("health checks (grpc.health.v1, GET /health)")
    defaults = WatchLimits()
    for f in fields(WatchLimits):
        default = getattr(defaults, f.name)
        group.add_argument(
            f"--{_FLAGS[f.name]}",
            dest=f"health_watch_{f.name}",
            type=type(default),
            default=default,
            help=f"{_HELP[f.name]} (default {default:g})",
        )


def watch_limits_from_args(args: argparse.Namespace) -> WatchLimits:
    return WatchLimits(**{f.name: getattr(args, f"health_watch_{f.name}") for f in fields(WatchLimits)}).validate()


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


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health, with statuses set by the server (:meth:`set`, :meth:`enter_graceful_shutdown`)."""

    def __init__(self, limits: WatchLimits | None = None) -> None:
        self.limits = limits or WatchLimits()
        self._status: dict[str, int] = {}
        self._watchers: set[_Watcher] = set()
        self.shares = Shares(self.limits.max_watches, self.limits.max_watches_per_peer, "health Watch streams",
                             ("--health-watch-max", "--health-watch-max-per-peer"))  # fmt: skip
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
        return self.shares.count

    def _record(self, service: str, status: int) -> None:
        self._status[service] = status
        for watcher in self._watchers:
            if watcher.service == service:
                watcher.changed.set()

    # -- the RPCs --------------------------------------------------------------------------------------------------
    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:100]!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        peer = peer_address(context.peer())
        try:
            self.shares.take(peer)
        except ServiceError as exc:
            await context.abort(grpc_code(exc.kind), exc.message)
        watcher = _Watcher(request.service)
        self._watchers.add(watcher)
        try:
            await self._follow(watcher, context)
        except _Stalled as stalled:
            await self._end_dropped(watcher, context, peer, stalled.write)
        finally:
            self._watchers.discard(watcher)
            self.shares.give_back(peer)  # only now: the stream has ended, or gRPC has cancelled the call

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
        log.info("health Watch from %s dropped: its client took no status for %g s (--health-watch-stall-s)",
                 peer, self.limits.stall_s)  # fmt: skip
        await write  # cancelled with this call when gRPC cancels it
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"this Watch did not read its health status within {self.limits.stall_s:g} s (--health-watch-stall-s) "
            "and was dropped; watch again",
        )


__all__ = ["HealthServicer", "WatchLimits", "add_health_arguments", "watch_limits_from_args"]
