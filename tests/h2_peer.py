"""A raw HTTP/2 peer over a plain socket (the ``h2`` package), for abuse tests that grpc's own client cannot do.

gRPC clients always read what the server sends and always open their flow-control windows again. This peer does
neither unless told: it opens a connection with a chosen ``SETTINGS_INITIAL_WINDOW_SIZE`` (0: the server may send
headers and trailers, never a byte of a response message), sends gRPC calls (any method path, request bytes and
extra headers, e.g. a header block built to bloat the server's HPACK table) and never sends WINDOW_UPDATE. It only
reads the socket when a test asks it to (:meth:`H2Peer.read_events`), e.g. to see the status a refused call ended
with; reading the socket does not open any window.

    with H2Peer("127.0.0.1", port, initial_window=0) as peer:
        stream = peer.send_call(HEALTH_WATCH, health_request())
        ...                                     # the server can send this stream nothing but its trailers

Also here: the server process's resident memory from /proc (:func:`rss_bytes`), for tests that bound it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
EMBED = "/elmo.v1.Embedder/Embed"


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    """One gRPC length-prefixed message: a compressed flag byte, the length (4 bytes, big-endian), the payload."""
    return bytes([1 if compressed else 0]) + len(payload).to_bytes(4, "big") + payload


def health_request(service: str = "") -> bytes:
    """A serialized grpc.health.v1.HealthCheckRequest."""
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckRequest(service=service).SerializeToString()


@dataclass
class StreamResult:
    """What the server sent on one stream so far: its headers, message bytes and trailers (grpc-status, ...)."""

    headers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    reset: int | None = None  # the error code of a RST_STREAM from the server

    @property
    def ended(self) -> bool:
        return bool(self.trailers) or self.reset is not None or "grpc-status" in self.headers

    @property
    def grpc_status(self) -> int | None:
        value = self.trailers.get("grpc-status", self.headers.get("grpc-status"))
        return None if value is None else int(value)

    @property
    def grpc_message(self) -> str:
        return self.trailers.get("grpc-message", self.headers.get("grpc-message", ""))


class H2Peer:
    """One HTTP/2 connection to ``host:port`` (plaintext, prior knowledge, as gRPC's own clients speak it).

    ``initial_window``: the SETTINGS_INITIAL_WINDOW_SIZE this peer announces for its receive side (0 = the server
    can send no response data at all). The connection-level window is HTTP/2's fixed 65,535 bytes and is never
    opened further either. ``settings``: more SETTINGS to announce (h2.settings.SettingCodes -> value).
    ``source``: the local address to connect from (another loopback address, 127.0.0.2, is another client
    address to the server: another peer for its per-client shares)."""

    def __init__(
        self,
        host: str,
        port: int,
        initial_window: int = 0,
        settings: dict[int, int] | None = None,
        timeout: float = 10.0,
        source: str | None = None,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.sock = socket.create_connection(
            (host, port), timeout=timeout, source_address=(source, 0) if source else None
        )
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config=config)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: initial_window, **(settings or {})})
        self.streams: dict[int, StreamResult] = {}
        self.closed_by_server = False
        self.flush()

    # -- sending ------------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        """Bytes straight onto the socket, past the h2 state machine (hand-built frames)."""
        self.sock.sendall(data)

    def send_call(
        self,
        method: str,
        request: bytes | None = b"",
        headers: Sequence[tuple[str, str]] = (),
        end_stream: bool = True,
        authority: str | None = None,
    ) -> int:
        """Open a stream for a gRPC call to ``method`` ("/package.Service/Method"); returns its stream id.

        ``request``: the serialized request message, sent as one gRPC message (None: headers only, the message
        never sent). ``headers``: extra headers after the gRPC ones (authorization, custom metadata).
        ``end_stream``: half-close after the message (a unary call's client does)."""
        stream_id = self.conn.get_next_available_stream_id()
        block = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method),
            (":authority", authority or f"{self.host}:{self.port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *headers,
        ]
        self.conn.send_headers(stream_id, block, end_stream=request is None and end_stream)
        self.streams[stream_id] = StreamResult()
        if request is not None:
            message = grpc_message(request)
            self._wait_send_window(stream_id, len(message))
            self.conn.send_data(stream_id, message, end_stream=end_stream)
        self.flush()
        return stream_id

    def _wait_send_window(self, stream_id: int, size: int) -> None:
        """Read (which takes the server's WINDOW_UPDATEs) until ``size`` bytes may be sent on ``stream_id``: a
        server that announces small windows (HAProxy: 64 KiB a connection) opens them as it takes the requests."""
        if self.conn.local_flow_control_window(stream_id) >= size:
            return
        self.flush()
        deadline = time.monotonic() + self.timeout
        while self.conn.local_flow_control_window(stream_id) < size and not self.closed_by_server:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server kept its receive window under {size} bytes")
            self.read_events(0.05)

    def send_calls(self, method: str, request: bytes | None, count: int, **options) -> list[int]:
        """``count`` calls at once (one write): the streams' ids."""
        return [self.send_call(method, request, **options) for _ in range(count)]

    # -- reading (only when asked) ------------------------------------------------------------------------------------
    def read_events(self, seconds: float) -> list[h2.events.Event]:
        """Read what the server sends for up to ``seconds`` (less when it closes the connection), recording each
        stream's headers, data and trailers in :attr:`streams`. Acknowledges SETTINGS and PINGs (h2 does), never
        opens a window: received data is not acknowledged."""
        events: list[h2.events.Event] = []
        deadline = time.monotonic() + seconds
        while not self.closed_by_server:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionError:
                chunk = b""
            if not chunk:
                self.closed_by_server = True
                break
            new = self.conn.receive_data(chunk)
            self._record(new)
            events.extend(new)
            self.flush()
        return events

    def wait_ended(self, stream_ids: Iterable[int], seconds: float, share: float = 1.0) -> bool:
        """Read until ``share`` of ``stream_ids`` (all, by default) have ended (trailers or reset) or ``seconds``
        have passed; whether they have."""
        ids = list(stream_ids)
        deadline = time.monotonic() + seconds

        def enough() -> bool:
            return sum(self.streams[i].ended for i in ids) >= share * len(ids)

        while not enough() and not self.closed_by_server:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.read_events(min(left, 0.2))
        return enough()

    def _record(self, events: Iterable[h2.events.Event]) -> None:
        for event in events:
            stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
            if isinstance(event, h2.events.ResponseReceived) and stream is not None:
                stream.headers.update(dict(event.headers))
            elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
                stream.trailers.update(dict(event.headers))
            elif isinstance(event, h2.events.DataReceived) and stream is not None:
                stream.data.extend(event.data)
            elif isinstance(event, h2.events.StreamReset) and stream is not None:
                stream.reset = event.error_code
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.closed_by_server = True

    # -- closing ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> H2Peer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (VmRSS), in bytes."""
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident memory so far (VmHWM), in bytes."""
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise LookupError(f"/proc/{pid}/status has no {key}")


__all__ = [
    "EMBED",
    "HEALTH_CHECK",
    "HEALTH_WATCH",
    "H2Peer",
    "StreamResult",
    "grpc_message",
    "health_request",
    "peak_rss_bytes",
    "rss_bytes",
]
