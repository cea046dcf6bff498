"""The drain switch and the count of admitted requests: owned by the core (service.core.requests), set by the
server's shutdown (service.server), read by the doors' health answers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from elmo.service.common.errors import Kind, ServiceError


class ServerState:
    """Draining switch and the count of admitted embedding requests (what a drain waits for).

    Once ``draining`` is set, new requests get UNAVAILABLE from the core itself while the ports stay open, so that
    callers see a clear status (gRPC's own shutdown would answer late arrivals with CANCELLED)."""

    def __init__(self) -> None:
        self.draining = False
        self.leaving = False  # SIGTERM's --shutdown-delay-s: health says NOT_SERVING, requests are still answered
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def check_open(self) -> None:
        if self.draining:
            raise ServiceError(Kind.UNAVAILABLE, "server is shutting down; retry on another replica")

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
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


__all__ = ["ServerState"]
