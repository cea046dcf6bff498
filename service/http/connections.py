"""Read and idle timeouts and a connection cap for the HTTP server (``--http-*-timeout``, ``--max-connections``).

aiohttp on its own keeps a connection that sends nothing, half a request line or a trickle of header bytes open
for its keep-alive timeout (3630 s by default, and trickling bytes never reset it), and it has no limit at all on
a request body that stops arriving; a few thousand such sockets use up the process's file descriptors. The
:class:`ConnectionGuard` opens the listening socket itself and wraps every protocol aiohttp makes, so it sees each
connection from accept to close. Every served connection is in one of three states:

    awaiting headers   from the connection's opening, and again from the first byte after a response: the
                       request's headers must be complete within ``http_header_timeout``, however many bytes
                       trickle in meanwhile (the deadline is never pushed back)
    in request         a handler runs (``guard.middleware`` marks its start and end): no deadline here; the body
                       is bounded by :func:`read_body` (``http_body_timeout`` per pause between two reads)
    idle               a response was handed over and no byte of a next request has arrived: closed after
                       ``http_idle_timeout``; progress in writing the response pushes the deadline back

    opened ──> awaiting headers ──(handler starts)──> in request ──(handler ends)──> idle ──(a byte)──┐
                     ^                                                                                 │
                     └─────────────────────────────────────────────────────────────────────────────────┘

A connection beyond ``max_connections``, or beyond ``max_connections_per_peer`` from one client address, is never
handed to aiohttp: it gets a fixed ``503`` JSON answer with
``Connection: close`` and is closed (after a short linger, so that the answer is not lost to a reset when the client
has already sent its request). One sweeper task closes every connection past its deadline; there is no timer per
connection.

Health has headroom of its own: a few connections beyond the cap (``health_connections``, one per client address)
are handed to aiohttp for ``GET /health`` only, so that a probe is answered while other clients hold every
connection. Such a connection must send its request within :data:`HEALTH_ONLY_HEADER_S`; any other path gets the
same 503 as a refused connection, and it is closed after its one answer.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from elmo.service.common.limits import Limits
from elmo.service.common.shares import Shares, peer_address

from elmo.errors import ConfigError

log = logging.getLogger("service.http.connections")

REASONS = ("header_timeout", "idle_timeout", "over_capacity", "over_peer_share")
COMMON_HEADERS = {"X-Content-Type-Options": "nosniff"}  # on every answer: no browser guesses a JSON body is HTML
REFUSAL_LINGER_S = 1.0  # how long a refused connection may stay open for its client to read the 503 and close
HEALTH_PATH = "/health"
HEALTH_CONNECTIONS = 8  # connections beyond the cap for GET /health only (elmo serve: --health-http-connections)
HEALTH_ONLY_HEADER_S = 2.0  # a connection beyond the cap must send its health request this soon (a probe does at once)
LISTEN_BACKLOG = 128  # aiohttp's TCPSite default
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ClientGone(Exception):
    """The client closed its connection before the request body was complete: nobody is left to answer."""


class State(enum.Enum):
    HEADERS = "awaiting headers"
    REQUEST = "in request"
    IDLE = "idle"
    REFUSED = "refused"  # over the cap: answered 503, lingering until the client closes


def over_capacity_response(message: str) -> bytes:
    """The whole answer to a connection over the cap, built by hand: aiohttp never sees that connection."""
    body = over_capacity_body(message).decode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "\r\n"
    )
    return (head + body).encode()


def over_capacity_body(message: str) -> bytes:
    error = {"error": {"message": message, "type": "overloaded", "code": 503}}
    return json.dumps(error, separators=(",", ":")).encode()


# What a request aiohttp's parser refused is called in the answer: a fixed phrase per error, never the client's
# bytes (aiohttp's own answer echoes them as text/plain).
_PARSER_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (http_exceptions.BadHttpMethod, "the request line names no valid HTTP method"),
    (http_exceptions.LineTooLong, "a request line or header is too long"),
    (http_exceptions.InvalidHeader, "a header is malformed"),
    (http_exceptions.BadStatusLine, "the request line is malformed"),
    (http_exceptions.InvalidURLError, "the request target is not a valid URL"),
    (http_exceptions.TransferEncodingError, "the chunked body encoding is malformed"),
    (http_exceptions.ContentLengthError, "the body does not match its Content-Length"),
)


# aiohttp's RequestHandler options the service serves with: no aiohttp access log (the service logs its own)
HANDLER_OPTIONS = {"access_log": None}


class _ServiceRequestHandler(RequestHandler):
    """aiohttp's protocol with the service's answer to what its parser refuses. aiohttp offers no hook for that
    answer but ``handle_error``, a public method of its public RequestHandler: the guard makes each connection's
    handler of this subclass itself, as ``web.Server()`` would (the same constructor, the runner's server,
    :data:`HANDLER_OPTIONS`). Kept for what users get (a JSON error that does not echo the client's bytes), not for
    speed: docs/speed.md, "What each trick is worth", measures what it costs."""

    __slots__ = ()

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        return _parser_error_answer(request, status, exc)


def _parser_phrase(exc: BaseException | None) -> str:
    """A fixed phrase for the parser's error: ours for the errors we know; llhttp's own reason (the first line of
    its message, which is llhttp's text, not the client's bytes) for the rest."""
    known = next((phrase for kind, phrase in _PARSER_ERRORS if isinstance(exc, kind)), None)
    if known is not None:
        return known
    first = str(getattr(exc, "message", "") or "").split("\n", 1)[0].strip().rstrip(":")
    if first and len(first) <= 80 and first.isascii() and first.isprintable() and not set(first) & set("'\"<>\\"):
        return f"malformed HTTP request: {first[0].lower()}{first[1:]}"
    return "malformed HTTP request"


def _parser_error_answer(request: web.BaseRequest, status: int, exc: BaseException | None) -> web.StreamResponse:
    """Stands in for aiohttp's ``RequestHandler.handle_error``, which answers what its parser refused (and a
    handler's crash) with text/plain echoing the request's bytes, and logs each at ERROR with a traceback. Here:
    the service's JSON error with a fixed phrase and nosniff, logged at DEBUG (a malformed request is the client's
    fault); a 500 from aiohttp itself is still logged with its traceback."""
    why = _parser_phrase(exc)
    if status >= 500:
        log.error("HTTP request from %s failed inside aiohttp", request.remote, exc_info=exc)
    else:
        log.debug("refused a malformed HTTP request from %s: %s (%s)", request.remote, why, type(exc).__name__)
    if request.writer.output_size > 0:  # as aiohttp: an answer already began, the connection is broken
        raise ConnectionError("an answer was already being sent: no room for the error")
    text = why if status < 500 else "internal error (logged on the server)"
    body = {"error": {"message": text, "type": "invalid_input" if status < 500 else "internal", "code": status}}
    response = web.json_response(body, status=status, headers=COMMON_HEADERS)
    response.force_close()
    return response


class _Refusal(asyncio.Protocol):
    """Stands in for aiohttp on a connection over the cap: answers 503 once, discards whatever the client sends."""

    def __init__(self, answer: bytes):
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.answer)
        if transport.can_write_eof():
            transport.write_eof()  # FIN after the answer; we keep reading so that unread bytes cause no reset
        else:
            transport.close()  # TLS cannot half-close: close_notify after the answer instead

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool | None:
        return None  # the client is done too: let the transport close


class _Connection(asyncio.Protocol):
    """The protocol asyncio sees: tracks the connection's state and deadline, and hands every event to ``inner``
    (aiohttp's RequestHandler, or a :class:`_Refusal`). aiohttp's server never calls transport.get_protocol() or
    set_protocol(); asyncio's sendfile fallback does, and puts back what it found (this wrapper)."""

    __slots__ = ("guard", "inner", "transport", "state", "deadline", "client", "refusal")

    def __init__(self, guard: ConnectionGuard):
        self.guard = guard
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.state = State.HEADERS
        self.deadline: float | None = None
        self.client = ""  # the client's address without its port, set once the connection is made
        self.refusal: tuple[str, str] | None = None  # beyond the cap, for health only: (reason, message) otherwise

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.client = peer_address(self.peer())  # what its share of the connections is counted by
        self.inner = self.guard._admit(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.state is State.IDLE:  # the first byte of the next request: its headers are now on the clock
            self.set_state(State.HEADERS, self.guard.limits.http_header_timeout)
        assert self.inner is not None
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        assert self.inner is not None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard._forget(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        assert self.inner is not None
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.state is State.IDLE:  # the client is reading the response: progress, not idleness
            self.set_state(State.IDLE, self.guard.limits.http_idle_timeout)
        assert self.inner is not None
        self.inner.resume_writing()

    # -- state -----------------------------------------------------------------------------------------------------
    def set_state(self, state: State, timeout: float | None) -> None:
        self.state = state
        self.deadline = None if timeout is None else self.guard.loop.time() + timeout

    def peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


class ConnectionGuard:
    """Owns the HTTP listening socket: the connection cap, the header and idle deadlines and their sweeper."""

    def __init__(self, limits: Limits, health_connections: int = HEALTH_CONNECTIONS):
        self.limits = limits
        self.health_connections = health_connections  # beyond the cap, for GET /health only; 0: none
        self._health_only: dict[str, _Connection] = {}  # client address -> its one connection beyond the cap
        self.closed_for: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._served: dict[asyncio.BaseProtocol, _Connection] = {}  # aiohttp's protocol -> its wrapper
        self._shares = Shares(
            limits.max_connections,
            limits.max_connections_per_peer,
            "connections",
            ("--max-connections", "--max-connections-per-peer"),
        )
        self._refused: set[_Connection] = set()
        self._listener: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._server: web.Server | None = None  # the runner's: it counts and shuts down the connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._at_capacity = False  # one warning per episode of refusals, not one per connection
        timeouts = (limits.http_header_timeout, limits.http_body_timeout, limits.http_idle_timeout)
        self.sweep_interval = min(0.5, min(timeouts) / 4)  # a deadline is enforced at most this late

    @property
    def open_connections(self) -> int:
        """Connections handed to aiohttp and still open (refused ones are not counted)."""
        return len(self._served)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "ConnectionGuard.listen() first"
        return self._loop

    # -- lifecycle -------------------------------------------------------------------------------------------------
    async def listen(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
    ) -> int:
        """Listen on host:port (0 = any free port; ``reuse_port``: SO_REUSEPORT, the port shared with sibling
        processes) for ``runner``'s app, after ``runner.setup()``; returns the bound port. Use this instead of a
        ``web.TCPSite``."""
        if runner.server is None:
            raise RuntimeError("ConnectionGuard.listen() needs runner.setup() first")
        if self._listener is not None:
            raise RuntimeError("ConnectionGuard is already listening")
        self._loop = asyncio.get_running_loop()
        self._server = runner.server
        # The header deadline starts once TLS is up; the handshake gets as long again, not asyncio's 60 s.
        tls = {"ssl": ssl_context, "ssl_handshake_timeout": self.limits.http_header_timeout} if ssl_context else {}
        try:
            self._listener = await self._loop.create_server(
                lambda: _Connection(self), host, port, backlog=LISTEN_BACKLOG, reuse_port=reuse_port or None, **tls
            )
        except OSError as exc:
            raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror} (port in use?)") from None
        self._sweeper = self._loop.create_task(self._sweep_forever(), name="http-connection-sweeper")
        return int(self._listener.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop accepting and sweeping. Served connections are left to ``runner.cleanup()``, which lets running
        handlers finish; call this first, so that no connection arrives during the cleanup."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
            self._sweeper = None
        for conn in list(self._refused):
            self._abort(conn)

    # -- the middleware: where the guard learns that headers are in and that a request is over -------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Put it first in the app's middlewares, so that it spans the others."""
        conn = self._served.get(request.protocol)
        if conn is None:  # an app run without this guard (a TCPSite, aiohttp's test client)
            return await handler(request)
        conn.set_state(State.REQUEST, None)
        try:
            if conn.refusal is None:
                return await handler(request)
            return await self._health_only_answer(conn, request, handler)
        finally:
            conn.set_state(State.IDLE, self.limits.http_idle_timeout)

    async def _health_only_answer(
        self, conn: _Connection, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        """A connection beyond the cap: GET /health is answered, anything else refused as the cap would; either
        way the connection closes after this one answer, giving its place back."""
        assert conn.refusal is not None
        if self._health_only.get(conn.client) is conn:  # closing after this answer: its client may probe again
            del self._health_only[conn.client]
        if request.path == HEALTH_PATH:
            response = await handler(request)
        else:
            reason, why = conn.refusal
            self._count_refusal(conn, reason)
            body = over_capacity_body(why)
            response = web.Response(body=body, status=503, content_type="application/json", headers=COMMON_HEADERS)
        response.force_close()
        return response

    # -- bookkeeping, called by _Connection ----------------------------------------------------------------------
    def _admit(self, conn: _Connection) -> asyncio.Protocol:
        """The protocol that will serve ``conn``: aiohttp's, or a 503 when the cap is reached. Decided when the
        connection is made (after TLS), so that connections still in their handshake do not take places."""
        why = self._shares.refusal(conn.client)
        if why is None:
            self._shares.take(conn.client)
            return self._serve(conn, self.limits.http_header_timeout)
        # one client over its share while the server itself has room, or the server full
        reason = "over_capacity" if self._shares.full else "over_peer_share"
        if reason == "over_capacity":
            self._note_capacity()
        if len(self._health_only) < self.health_connections and conn.client not in self._health_only:
            conn.refusal = (reason, why)
            self._health_only[conn.client] = conn
            return self._serve(conn, min(self.limits.http_header_timeout, HEALTH_ONLY_HEADER_S))
        return self._refuse(conn, reason, why)

    def _serve(self, conn: _Connection, header_timeout: float) -> asyncio.Protocol:
        assert self._server is not None
        inner = _ServiceRequestHandler(self._server, loop=self.loop, **HANDLER_OPTIONS)
        self._served[inner] = conn
        conn.set_state(State.HEADERS, header_timeout)
        return inner

    def _refuse(self, conn: _Connection, reason: str, why: str) -> asyncio.Protocol:
        self._count_refusal(conn, reason)
        # Lingering is bounded too: past as many lingering refusals as the cap, the next ones go at the next sweep.
        linger = min(REFUSAL_LINGER_S, self.limits.http_header_timeout)
        conn.set_state(State.REFUSED, linger if len(self._refused) < self.limits.max_connections else 0.0)
        self._refused.add(conn)
        return _Refusal(over_capacity_response(why))

    def _note_capacity(self) -> None:
        if not self._at_capacity:
            self._at_capacity = True
            log.warning(
                "HTTP connection cap reached (%d, --max-connections): new connections get 503 (GET /health is "
                "still answered on up to %d more, --health-http-connections) until one closes",
                self.limits.max_connections,
                self.health_connections,
            )

    def _count_refusal(self, conn: _Connection, reason: str) -> None:
        self.closed_for[reason] += 1
        log.debug("refused HTTP connection from %s: %s (%d open)", conn.peer(), reason, len(self._served))

    def _forget(self, conn: _Connection) -> None:
        if conn.state is State.REFUSED:
            self._refused.discard(conn)
            return
        if self._served.pop(conn.inner, None) is not None:  # type: ignore[arg-type]
            if conn.refusal is None:
                self._shares.give_back(conn.client)
            elif self._health_only.get(conn.client) is conn:
                del self._health_only[conn.client]
        if not self._shares.full:
            self._at_capacity = False

    # -- the sweeper -----------------------------------------------------------------------------------------------
    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval)
            try:
                self.sweep()
            except Exception:  # a bug here must not end the timeouts for good
                log.exception("HTTP connection sweep failed")

    def sweep(self) -> None:
        """Close every connection past its deadline (one pass; the sweeper runs it every ``sweep_interval``)."""
        now = self.loop.time()
        for conn in [c for c in self._served.values() if c.deadline is not None and c.deadline <= now]:
            self._expire(conn)
        for conn in [c for c in self._refused if c.deadline is not None and c.deadline <= now]:
            self._abort(conn)

    def _expire(self, conn: _Connection) -> None:
        if conn.state is State.HEADERS:
            reason, why = "header_timeout", f"headers incomplete after {self.limits.http_header_timeout:g} s"
        else:
            reason, why = "idle_timeout", f"idle for {self.limits.http_idle_timeout:g} s"
        self.closed_for[reason] += 1
        log.debug("closed HTTP connection from %s: %s (%s)", conn.peer(), reason, why)
        self._abort(conn)

    @staticmethod
    def _abort(conn: _Connection) -> None:
        # abort, not close: close() would wait for a client that does not read to take the rest of a response
        conn.deadline = None  # closing takes a loop turn; do not count it twice
        if conn.transport is not None:
            conn.transport.abort()


def reset(transport: asyncio.BaseTransport) -> None:
    """Close a connection that stopped reading its answer at once: abort, not close (close() would wait for the
    client to take the rest), with a zero linger, so that the kernel sends a reset instead of keeping the unsent
    bytes for that client (it would, for minutes, into a window that never opens)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:  # already gone
            pass
    transport.abort()


async def read_body(request: web.Request, limits: Limits) -> bytes:
    """The request body, read chunk by chunk with at most ``limits.http_body_timeout`` between two chunks, and all
    of it within ``limits.http_body_deadline_s`` (a sender that trickles a byte now and then never pauses long).

    Raises ``web.HTTPRequestEntityTooLarge`` past the app's ``client_max_size`` (before reading on), a 408
    ``web.HTTPRequestTimeout`` when the body stalls or misses its deadline, ``web.HTTPBadRequest`` for a malformed
    body (bad chunked encoding) and :class:`ClientGone` when the client disconnects before the body is complete.
    """
    max_size = request.client_max_size  # 0: no limit, as in aiohttp's own request.read()
    declared = request.content_length
    if max_size and declared is not None and declared > max_size:
        raise web.HTTPRequestEntityTooLarge(max_size=max_size, actual_size=declared)
    body = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.http_body_deadline_s
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise _late(limits.http_body_deadline_s)
        if left < limits.http_body_timeout:
            chunk = await _next_chunk(request, left, lambda: _late(limits.http_body_deadline_s))
        else:
            chunk = await _next_chunk(request, limits.http_body_timeout)
        if not chunk:
            return bytes(body)
        body.extend(chunk)
        if max_size and len(body) > max_size:
            raise web.HTTPRequestEntityTooLarge(max_size=max_size, actual_size=len(body))


async def _next_chunk(
    request: web.Request, timeout: float, on_timeout: Callable[[], web.HTTPRequestTimeout] | None = None
) -> bytes:
    try:
        return await asyncio.wait_for(request.content.readany(), timeout)
    except TimeoutError:
        raise (on_timeout() if on_timeout is not None else _stalled(timeout)) from None
    except ConnectionError as exc:  # aiohttp cancels the body with ConnectionResetError when the connection drops
        raise ClientGone(f"client disconnected before the request body was complete ({exc})") from None
    except RequestPayloadError as exc:
        raise web.HTTPBadRequest(reason=f"malformed request body: {exc}") from None


def _stalled(timeout: float) -> web.HTTPRequestTimeout:
    return _timed_out(f"request body stalled for {timeout:g} s (--http-body-timeout-s)")


def _late(deadline: float) -> web.HTTPRequestTimeout:
    return _timed_out(f"request body not complete within {deadline:g} s (--http-body-deadline-s)")


def _timed_out(message: str) -> web.HTTPRequestTimeout:
    error = web.HTTPRequestTimeout(reason=message, text=message)
    error.force_close()  # the rest of that body may still come: the connection cannot carry another request
    return error


__all__ = ["COMMON_HEADERS", "REASONS", "ClientGone", "ConnectionGuard", "over_capacity_response", "read_body", "reset"]
