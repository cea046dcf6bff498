"""Per-request observation, written once for both front doors.

gRPC (service.grpc.interceptors) and HTTP (service.http.app) each work out their own method name and outcome (a status
code name or an HTTP status), then hand them here: one in-flight gauge, one request counter and one latency histogram
per method and outcome, and one log line per request (DEBUG; WARNING when the server is at fault, so that the log's
warnings and the 5xx rate mean the same thing). A client that went away is its own outcome, not a server error.

Calls that are not the API's requests (a :data:`KINDS` kind: health checks, gRPC reflection, HTTP requests that
matched no route, such as a browser's /favicon.ico) are counted apart, in ``elmo_other_requests_total{kind, method,
code}``: they neither dilute the API's error rate and latency nor count as requests in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elmo.service.common.shares import peer_address
from elmo.service.telemetry.metrics import ServiceMetrics

log = logging.getLogger("service.requests")

CLIENT_GONE = "client_disconnected"  # the outcome of a request whose client hung up before the answer
API = ""  # the kind of the API's own requests (embed, tokenize, models, admin, the page and the document)
HEALTH, REFLECTION, UNMATCHED = "health", "reflection", "unmatched"
KINDS = (HEALTH, REFLECTION, UNMATCHED)  # the other kinds, counted apart


@dataclass
class Observation:
    """One request being observed: started by :meth:`RequestObserver.start`, ended by :meth:`finish`."""

    observer: RequestObserver
    method: str
    started: float
    kind: str = API

    def finish(self, outcome: str, *, server_fault: bool, describe: Describe) -> None:
        """``describe()`` -> (peer, request id, message), called only when the log line is written."""
        self.observer.finished(self, outcome, server_fault=server_fault, describe=describe)


Describe = Callable[[], tuple[str, str, str]]


# Refusals for want of room (a full answer budget, a client's share, a full queue): a client that keeps calling
# would write one WARNING per call. One per client address and outcome per interval instead, the next one saying
# how many were left out.
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "503"})
REFUSAL_LOG_INTERVAL_S = 60.0
REFUSAL_LOG_PEERS = 4096  # clients remembered at once; past that the oldest are forgotten (logged again)


class RefusalLines:
    """Whether a refusal's WARNING is written: the first per (client address, outcome) per interval is, and carries
    the count of those left out since the last one written; the rest are counted, not written."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self._seen: dict[tuple[str, str], list[float | int]] = {}  # key -> [when last written, left out since]

    def admit(self, key: tuple[str, str]) -> int | None:
        """None: leave this one out. Otherwise write it, with the returned count of those left out before it."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return None
        left_out = int(seen[1]) if seen is not None else 0
        self._seen.pop(key, None)
        while len(self._seen) >= REFUSAL_LOG_PEERS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = [now, 0]
        return left_out


class RequestObserver:
    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics
        self.refusal_lines = RefusalLines()
        # label children by method (and outcome), looked up once each: ``labels()`` locks and builds a key per call
        self._counted: dict[tuple[str, ...], Any] = {}
        self._timed: dict[tuple[str, ...], Any] = {}

    def start(self, method: str, kind: str = API) -> Observation:
        """``kind``: API, or one of :data:`KINDS` (counted apart)."""
        if kind == API:
            self.metrics.in_flight.inc()
        return Observation(self, method, time.perf_counter(), kind)

    def finished(self, seen: Observation, outcome: str, *, server_fault: bool, describe: Describe) -> None:
        seconds = time.perf_counter() - seen.started
        if seen.kind == API:
            self.metrics.in_flight.dec()
            _child(self._counted, (seen.method, outcome), self.metrics.requests).inc()
            _child(self._timed, (seen.method,), self.metrics.latency).observe(seconds)
        else:
            _child(self._counted, (seen.kind, seen.method, outcome), self.metrics.other_requests).inc()
        level = logging.WARNING if server_fault else logging.DEBUG
        if log.isEnabledFor(level):
            peer, request_id, detail = describe()
            if server_fault and outcome in REFUSALS:
                client = peer_address(peer) if peer.startswith(("ipv4:", "ipv6:")) else peer  # HTTP's: no port
                left_out = self.refusal_lines.admit((client, outcome))
                if left_out is None:
                    return
                if left_out:
                    detail = f"{detail} ({left_out} more like it from this client since its last one logged)"
            log.log(
                level,
                "%s %s %.1fms peer=%s request_id=%s %s",
                seen.method,
                outcome,
                1000 * seconds,
                peer,
                request_id,
                detail,
            )


CACHED_CHILDREN = 1024  # label children kept at hand per metric: methods x outcomes is small, a flood is not kept


def _child(cache: dict[tuple[str, ...], Any], labels: tuple[str, ...], metric: Any) -> Any:
    """``metric.labels(*labels)``, looked up once per label values (up to :data:`CACHED_CHILDREN`)."""
    child = cache.get(labels)
    if child is None:
        child = metric.labels(*labels)
        if len(cache) < CACHED_CHILDREN:
            cache[labels] = child
    return child


__all__ = ["API", "CLIENT_GONE", "HEALTH", "KINDS", "REFLECTION", "UNMATCHED", "Observation", "RequestObserver"]
