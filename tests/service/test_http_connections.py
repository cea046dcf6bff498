"""service.http.connections on real sockets on 127.0.0.1: the header, body and idle timeouts, the connection cap and
a client gone mid-body, against a small aiohttp app served through the guard on a background event loop.

Timeouts are tiny (0.3 s) so that the file runs in seconds; no test measures how fast anything happens. A test
waits (10 s at most) for the server to close the socket, and checks why through the guard's counters; the
deadlines that must not fire are set to 30 s, beyond any wait here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from aiohttp import web
from elmo.service.common.limits import Limits
from elmo.service.http.connections import (
    HEALTH_CONNECTIONS,
    REASONS,
    ClientGone,
    ConnectionGuard,
    over_capacity_response,
    read_body,
)

from elmo.errors import ConfigError
from tests.service_helpers import self_signed_cert

SHORT = 0.3  # a timeout meant to fire
LONG = 30.0  # a timeout that must not fire during a test
WAIT = 10.0  # the most a test waits for the server to act
MAX_BODY = 1024  # the test app's client_max_size
HANDLER_SECONDS = 1.0  # GET /slow: longer than every SHORT timeout


def limits(
    header: float = LONG, body: float = LONG, idle: float = LONG, cap: int = 1000, per_peer: int = 1000
) -> Limits:
    return replace(
        Limits(),
        http_header_timeout=header,
        http_body_timeout=body,
        http_idle_timeout=idle,
        max_connections=cap,
        max_connections_per_peer=per_peer,
    ).validate()


class Served:
    """The test app behind a ConnectionGuard on its own event loop thread; ``seen`` gets what the routes saw."""

    def __init__(
        self, limits: Limits, ssl_context: ssl.SSLContext | None = None, health_connections: int = HEALTH_CONNECTIONS
    ):
        self.limits = limits
        self.seen: queue.Queue[object] = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-http-connections", daemon=True)
        self.thread.start()
        self.guard = ConnectionGuard(limits, health_connections)
        self.runner = self.call(self._runner())
        self.port = self.call(self.guard.listen(self.runner, "127.0.0.1", 0, ssl_context))

    def call(self, coro, timeout: float = WAIT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _runner(self) -> web.AppRunner:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self.guard.middleware])
        app.add_routes(
            [
                web.get("/ok", self.ok),
                web.get("/slow", self.slow),
                web.post("/echo", self.echo),
                web.get("/health", self.ok),
            ]
        )
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        return runner

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(HANDLER_SECONDS)
        return web.Response(text="slow")

    async def echo(self, request: web.Request) -> web.Response:
        self.seen.put("reading")
        try:
            body = await read_body(request, self.limits)
        except ClientGone as exc:
            self.seen.put(exc)
            # Any answer will do: nobody reads it, and aiohttp drops it quietly. Raised on instead, the exception
            # would reach aiohttp, which logs every disconnected client as an ERROR with a traceback.
            return web.Response(status=499)
        except Exception as exc:
            self.seen.put(exc)
            raise
        self.seen.put(body)
        return web.Response(body=body)

    @staticmethod
    async def _cancel_the_rest() -> None:
        """aiohttp may still linger over a body nobody sent (after a 408 or 413): end that before the loop closes,
        or the task is reported destroyed while pending, during whichever test runs next."""
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        try:
            self.call(self.guard.close())
            self.call(self.runner.cleanup())
            self.call(self._cancel_the_rest())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(WAIT)
            self.loop.close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(limits: Limits, ssl_context: ssl.SSLContext | None = None, **options: int) -> Served:
        started.append(Served(limits, ssl_context, **options))
        return started[-1]

    yield start
    for served in started:
        served.stop()


# -- a raw HTTP/1.1 client ----------------------------------------------------------------------------------------
def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


def post_head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\n\r\n".encode()


def wait_closed(sock: socket.socket) -> bytes:
    """Everything the server still sends, until it closes the connection; fails if it is open after WAIT."""
    received = b""
    sock.settimeout(WAIT)
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # an abort while our bytes were unread: closed all the same
            return received
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open for {WAIT} s") from None
        if not chunk:
            return received
        received += chunk


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length: (status, headers with lower-case names, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a complete response: {data!r}"
        data += chunk
    return parse_response(data, sock)


def parse_response(data: bytes, sock: socket.socket | None = None) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    length = int(headers["content-length"])
    while len(body) < length and sock is not None:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def closed_for(served: Served, **expected: int) -> None:
    assert served.guard.closed_for == {**dict.fromkeys(REASONS, 0), **expected}


def eventually(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        time.sleep(0.01)


# -- header timeout -------------------------------------------------------------------------------------------------
def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(serve, caplog):
    served = serve(limits(header=SHORT))
    caplog.set_level(logging.DEBUG, logger="service.http.connections")
    with connect(served.port) as sock:
        assert wait_closed(sock) == b""
    closed_for(served, header_timeout=1)
    eventually(lambda: served.guard.open_connections == 0, "the guard forgets the closed connection")
    lines = [r.getMessage() for r in caplog.records if r.name == "service.http.connections"]
    assert any("header_timeout" in line and "127.0.0.1" in line for line in lines), lines
    assert all(r.exc_info is None for r in caplog.records)


def test_half_sent_headers_are_closed_after_the_header_timeout(serve):
    served = serve(limits(header=SHORT))
    with connect(served.port) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: te")
        assert wait_closed(sock) == b""
    closed_for(served, header_timeout=1)


def test_headers_trickling_in_byte_by_byte_are_closed_after_the_header_timeout(serve):
    """Slowloris: every byte arrives well within any read timeout, but the headers never end."""
    served = serve(limits(header=SHORT))
    with connect(served.port) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        deadline = time.monotonic() + WAIT
        sent = 0
        while True:
            assert time.monotonic() < deadline, f"still open after trickling {sent} header bytes for {WAIT} s"
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            if select.select([sock], [], [], 0.02)[0]:
                assert wait_closed(sock) == b""
                break
    assert sent > 1  # the trickle went on for a while before the server cut it
    closed_for(served, header_timeout=1)


def test_a_handler_outlasting_the_header_and_idle_timeouts_is_not_cut(serve):
    served = serve(limits(header=SHORT, idle=SHORT))
    with connect(served.port) as sock:
        sock.sendall(get("/slow"))
        status, _, body = read_response(sock)
        assert (status, body) == (200, b"slow")
        assert wait_closed(sock) == b""  # then idle, and closed for that
    closed_for(served, idle_timeout=1)


# -- idle timeout ---------------------------------------------------------------------------------------------------
def test_a_keep_alive_connection_serves_requests_then_is_closed_when_idle(serve):
    served = serve(limits(idle=SHORT))
    with connect(served.port) as sock:
        sock.sendall(get("/missing"))  # a handler that raises (404) leaves the connection idle too
        status, headers, _ = read_response(sock)
        assert status == 404 and headers.get("connection", "").lower() != "close"
        sock.sendall(get("/ok"))
        status, _, body = read_response(sock)
        assert (status, body) == (200, b"ok")
        assert wait_closed(sock) == b""
    closed_for(served, idle_timeout=1)


def test_the_header_timeout_restarts_with_the_first_byte_after_a_response(serve):
    served = serve(limits(header=SHORT))
    with connect(served.port) as sock:
        sock.sendall(get("/ok"))
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /ok HT")  # the next request starts and stalls: the header clock, not the idle one
        assert wait_closed(sock) == b""
    closed_for(served, header_timeout=1)


# -- body timeout ---------------------------------------------------------------------------------------------------
def test_a_stalled_body_gets_408_and_connection_close(serve):
    served = serve(limits(body=SHORT))
    with connect(served.port) as sock:
        sock.sendall(post_head("/echo", 100) + b"x" * 10)
        status, headers, body = read_response(sock)
    assert status == 408
    assert headers["connection"].lower() == "close"
    assert f"request body stalled for {SHORT:g} s (--http-body-timeout-s)" in body.decode()
    assert served.seen.get(timeout=WAIT) == "reading"
    assert isinstance(served.seen.get(timeout=WAIT), web.HTTPRequestTimeout)
    closed_for(served)  # the body timeout is the handler's answer, not a close by the guard


def test_a_slow_body_is_fine_while_each_pause_is_under_the_body_timeout(serve):
    body_timeout = 1.0
    served = serve(limits(body=body_timeout))
    pieces = [bytes([65 + i]) * 10 for i in range(8)]  # 8 pauses of 0.2 s: longer in all than the timeout
    with connect(served.port) as sock:
        sock.sendall(post_head("/echo", sum(map(len, pieces))))
        started = time.monotonic()
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.2)
        status, _, body = read_response(sock)
    assert time.monotonic() - started > body_timeout  # the premise: the whole body took longer than one pause may
    assert (status, body) == (200, b"".join(pieces))


def test_a_client_gone_mid_body_raises_client_gone_and_no_error_is_logged(serve, caplog):
    served = serve(limits())
    caplog.set_level(logging.DEBUG)
    with connect(served.port) as sock:
        sock.sendall(post_head("/echo", 1000) + b"x" * 10)
        assert served.seen.get(timeout=WAIT) == "reading"  # the handler is in read_body before the client leaves
    seen = served.seen.get(timeout=WAIT)
    assert isinstance(seen, ClientGone), repr(seen)
    eventually(lambda: not served.runner.server.connections, "aiohttp is done with the request")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_declared_body_over_client_max_size_gets_413_without_being_read(serve):
    served = serve(limits())
    with connect(served.port) as sock:
        sock.sendall(post_head("/echo", MAX_BODY + 1))  # no body sent: the answer cannot depend on reading it
        assert read_response(sock)[0] == 413
    assert served.seen.get(timeout=WAIT) == "reading"
    assert isinstance(served.seen.get(timeout=WAIT), web.HTTPRequestEntityTooLarge)


def test_a_chunked_body_over_client_max_size_gets_413(serve):
    served = serve(limits())
    chunk = b"y" * 600
    with connect(served.port) as sock:
        head = b"POST /echo HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert served.seen.get(timeout=WAIT) == "reading"
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # 1200 bytes > 1024; the terminating chunk never comes
        assert read_response(sock)[0] == 413
    assert isinstance(served.seen.get(timeout=WAIT), web.HTTPRequestEntityTooLarge)


# -- the connection cap -----------------------------------------------------------------------------------------------
def test_a_connection_over_the_cap_gets_503_json_and_is_closed_until_a_place_frees(serve, caplog):
    served = serve(limits(cap=2))
    caplog.set_level(logging.WARNING, logger="service.http.connections")
    first, second = connect(served.port), connect(served.port)
    try:
        for sock in (first, second):
            sock.sendall(get("/ok"))
            assert read_response(sock)[0] == 200  # both are open, kept alive
        assert served.guard.open_connections == 2
        with connect(served.port) as third:
            third.sendall(get("/ok"))
            status, headers, body = parse_response(wait_closed(third))
        assert status == 503
        assert headers["connection"].lower() == "close"
        assert headers["content-type"] == "application/json"
        message = "server busy: 2 connections open at once (--max-connections); retry later"
        assert json.loads(body) == {"error": {"message": message, "type": "overloaded", "code": 503}}
        closed_for(served, over_capacity=1)
        assert any("connection cap reached (2, --max-connections)" in r.getMessage() for r in caplog.records)

        first.close()
        eventually(lambda: served.guard.open_connections == 1, "the first connection's place is free")
        with connect(served.port) as fourth:
            fourth.sendall(get("/ok"))
            status, _, body = read_response(fourth)
            assert (status, body) == (200, b"ok")
        second.sendall(get("/ok"))  # the second one was never disturbed
        assert read_response(second)[0] == 200
    finally:
        first.close()
        second.close()
    closed_for(served, over_capacity=1)


def test_one_client_address_holds_at_most_its_share_of_the_connections(serve):
    served = serve(limits(cap=10, per_peer=2))
    first, second = connect(served.port), connect(served.port)
    try:
        for sock in (first, second):
            sock.sendall(get("/ok"))
            assert read_response(sock)[0] == 200
        with connect(served.port) as third:
            third.sendall(get("/ok"))
            status, _, body = parse_response(wait_closed(third))
        assert status == 503
        message = (
            "this client (127.0.0.1) has 2 connections open at once, its share (--max-connections-per-peer); "
            "retry when one has ended"
        )
        assert json.loads(body)["error"]["message"] == message
        closed_for(served, over_peer_share=1)
        first.close()
        eventually(lambda: served.guard.open_connections == 1, "the first connection's place is free")
        with connect(served.port) as fourth:
            fourth.sendall(get("/ok"))
            assert read_response(fourth)[0] == 200
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("request_bytes", "phrase"),
    [
        (b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n", b"no valid HTTP method"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\x01: <script>\r\n\r\n", b"invalid header token"),
        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"too long"),
        (b"POST /ok HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz<script>\r\n", b"chunk size"),
    ],
    ids=["method", "header", "long-line", "chunked"],
)
def test_what_aiohttps_parser_refuses_is_answered_as_json_without_echo_or_traceback(
    serve, caplog, request_bytes, phrase
):
    served = serve(limits())
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    caplog.set_level(logging.DEBUG, logger="service.http.connections")
    with connect(served.port) as sock:
        sock.sendall(request_bytes)
        status, headers, body = parse_response(wait_closed(sock))
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert headers["x-content-type-options"] == "nosniff"
    error = json.loads(body)["error"]
    assert phrase in error["message"].encode() and b"<script>" not in body and b"\\x" not in body
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert any("refused a malformed HTTP request" in r.getMessage() for r in caplog.records)


def test_a_refused_client_that_stays_is_cut_after_a_short_linger(serve):
    served = serve(limits(header=SHORT, cap=1), health_connections=0)  # no room beyond the cap, even for health
    with connect(served.port) as first, connect(served.port) as refused:
        first.sendall(get("/ok"))
        assert read_response(first)[0] == 200
        assert parse_response(wait_closed(refused))[0] == 503  # answered, and the server's side half-closed
        deadline = time.monotonic() + WAIT
        while True:  # the server still reads (and drops) what we send, until it aborts: then our sends fail
            assert time.monotonic() < deadline, f"the refused connection was still open after {WAIT} s"
            try:
                refused.sendall(b"more")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.02)
    closed_for(served, over_capacity=1)


def test_health_is_answered_beyond_the_cap_while_other_clients_hold_every_connection(serve, caplog):
    """Four client addresses (127.0.0.2-5) hold every connection (cap 8, 2 each): a new client's GET /health is
    answered 200 on a connection beyond the cap, which then closes; any other path there gets the cap's 503; and
    the room beyond the cap is one connection per address, so a flooder cannot take it all."""
    served = serve(limits(cap=8, per_peer=2), health_connections=2)
    caplog.set_level(logging.WARNING, logger="service.http.connections")
    flood = [connect_from(f"127.0.0.{2 + i // 2}", served.port) for i in range(8)]
    try:
        for sock in flood:
            sock.sendall(get("/ok"))
            assert read_response(sock)[0] == 200  # kept open: every place is taken
        assert served.guard.open_connections == 8
        for _ in range(3):  # a probe every period: each answered, each connection closed after it
            with connect(served.port) as probe:
                probe.sendall(get("/health"))
                status, headers, body = parse_response(wait_closed(probe))
                assert (status, body, headers["connection"].lower()) == (200, b"ok", "close")
        with connect(served.port) as other:
            other.sendall(get("/ok"))
            status, headers, body = parse_response(wait_closed(other))
        assert status == 503 and headers["connection"].lower() == "close"
        message = "server busy: 8 connections open at once (--max-connections); retry later"
        assert json.loads(body)["error"]["message"] == message
        closed_for(served, over_capacity=1)

        held = connect_from("127.0.0.2", served.port)  # a flooder takes its one place beyond the cap, silent
        try:
            eventually(lambda: served.guard.open_connections == 9, "the flooder's extra connection served")
            with connect_from("127.0.0.2", served.port) as again:  # its second: refused at once
                assert parse_response(wait_closed(again))[0] == 503
            with connect(served.port) as probe:  # another address still has the other place
                probe.sendall(get("/health"))
                assert parse_response(wait_closed(probe))[0] == 200
        finally:
            held.close()
        assert any("GET /health is still answered on up to 2 more" in r.getMessage() for r in caplog.records)
    finally:
        for sock in flood:
            sock.close()


def test_a_silent_connection_beyond_the_cap_is_closed_after_its_short_header_deadline(serve):
    served = serve(limits(cap=1))  # the header timeout itself is long: the room beyond the cap has its own
    with connect(served.port) as first, connect(served.port) as silent:
        first.sendall(get("/ok"))
        assert read_response(first)[0] == 200
        assert wait_closed(silent) == b""
    closed_for(served, header_timeout=1)


def connect_from(source: str, port: int) -> socket.socket:
    """A connection from another loopback address: another client to the server's per-address shares."""
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT, source_address=(source, 0))


def test_the_over_capacity_answer_is_well_formed_http():
    status, headers, body = parse_response(over_capacity_response("server busy"))
    assert status == 503 and int(headers["content-length"]) == len(body)
    assert json.loads(body)["error"]["message"] == "server busy"


# -- TLS and listening ------------------------------------------------------------------------------------------------
def test_tls_connections_are_served_and_timed_out_alike(serve, tmp_path):
    cert = self_signed_cert(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert.cert, cert.key)
    client_context = ssl.create_default_context(cafile=str(cert.cert))
    served = serve(limits(header=SHORT), server_context)
    with client_context.wrap_socket(connect(served.port), server_hostname="127.0.0.1") as sock:
        sock.sendall(get("/ok"))
        status, _, body = read_response(sock)
        assert (status, body) == (200, b"ok")
    with client_context.wrap_socket(connect(served.port), server_hostname="127.0.0.1") as sock:
        assert wait_closed(sock) == b""  # handshake done, then silence
    closed_for(served, header_timeout=1)


def test_a_port_in_use_is_a_config_error(serve):
    served = serve(limits())
    guard = ConnectionGuard(limits())
    with pytest.raises(
        ConfigError, match=rf"cannot listen for HTTP on 127\.0\.0\.1:{served.port}: .*\(port in use\?\)"
    ):
        served.call(guard.listen(served.runner, "127.0.0.1", served.port, None))
    served.call(guard.close())
