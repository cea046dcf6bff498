"""Health that no client can stall or exhaust, on real servers on 127.0.0.1 with real clients.

The abusive clients are raw HTTP/2 peers (tests/h2_peer.py) that announce a receive window of 0 and never open it:
the server can send them headers and trailers, never a message. One such grpc.health.v1 Watch must not keep the
server from saying SERVING, nor from saying NOT_SERVING and exiting on SIGTERM. Floods of Watch streams, of Checks
whose answers are never read or whose request never comes, and of unread Embed answers must not keep a new client's
Check or Embed out: health calls have shares of their own (--health-watch-max, --health-check-max and their
per-client parts), and every call keeps its place until gRPC is done with it. GET /health must not be stallable
either. The deadlines below (1 s) are the bound the service promises a probe, not speed measurements: a server that
keeps its promise answers in milliseconds.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.client import EmbedderClient
from elmo.runtime import Embedder
from tests.h2_peer import EMBED, HEALTH_CHECK, HEALTH_WATCH, H2Peer, health_request
from tests.serve_process import ServeProcess, wait_until
from tests.service_helpers import EDGE_LIMITS, ServerThread

PROMISE_S = 1.0  # a probe's Check and an Embed are answered within this, whatever other clients hold
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
TOKEN = "health-abuse-token"


def check(target: str, timeout: float = PROMISE_S) -> str:
    """A new client's grpc.health.v1 Check: the status name, or the error code's name."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as error:
            return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def embed_tokens(target: str, token: str | None = None) -> list[str]:
    """A new client's Embed, answered within PROMISE_S (its deadline)."""
    with EmbedderClient(target, auth_token=token, timeout=PROMISE_S, retry_policy=None) as client:
        return client.embed(["still answered"])[0].tokens


def stalled_watch(target: str, source: str | None = None) -> H2Peer:
    """A Watch whose client never reads a status: once the server has begun answering (its headers arrived), the
    status it writes waits on a window of 0."""
    host, port = target.rsplit(":", 1)
    peer = H2Peer(host, int(port), initial_window=0, source=source)
    stream = peer.send_call(HEALTH_WATCH, health_request())
    deadline = time.monotonic() + 10
    while not peer.streams[stream].headers and time.monotonic() < deadline:
        peer.read_events(0.1)
    assert peer.streams[stream].headers.get(":status") == "200", peer.streams[stream]
    assert not peer.streams[stream].ended
    return peer


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


def test_a_watch_that_never_reads_does_not_keep_health_from_serving(runtime: Embedder) -> None:
    server = ServerThread({"tiny": runtime}, EDGE_LIMITS)
    peer = None
    try:
        assert check(server.target) == "NOT_SERVING"  # the port is open, the model not yet warm
        peer = stalled_watch(server.target)
        server.call(server.server.warm_up(), timeout=20)  # SERVING is set without waiting on any watcher
        assert check(server.target) == "SERVING"
        assert embed_tokens(server.target) == ["still", "answered"]
        # a second one, opened while serving, changes nothing either
        with stalled_watch(server.target):
            assert check(server.target) == "SERVING"
            assert embed_tokens(server.target) == ["still", "answered"]
    finally:
        if peer is not None:
            peer.close()
        server.stop()


def test_a_signal_during_the_warm_up_keeps_health_not_serving(runtime: Embedder) -> None:
    """SIGTERM with --shutdown-delay-s while the model warms up: the warm-up's end must not say SERVING over the
    NOT_SERVING the signal set, or a balancer sends traffic to a replica that is leaving."""
    server = ServerThread({"tiny": runtime}, replace(EDGE_LIMITS, shutdown_delay=30.0))
    try:
        assert check(server.target) == "NOT_SERVING"
        server.loop.call_soon_threadsafe(server.server.request_drain)  # what the SIGTERM handler calls
        wait_until(lambda: server.server.state.leaving, 5, "the server leaving the rotation")
        server.call(server.server.warm_up(), timeout=20)
        assert check(server.target) == "NOT_SERVING"
        assert embed_tokens(server.target) == ["still", "answered"]  # leaving: requests are still answered
    finally:
        server.stop()


def test_a_watcher_that_does_not_read_is_dropped_and_others_still_follow(runtime: Embedder) -> None:
    from elmo.service.grpc.health import HealthLimits

    limits = HealthLimits(stall_s=0.3)
    server = ServerThread({"tiny": runtime}, EDGE_LIMITS, health_limits=limits)
    try:
        server.warm_up()
        with stalled_watch(server.target), grpc.insecure_channel(server.target) as channel:
            follower = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
            assert next(follower).status == health_pb2.HealthCheckResponse.SERVING
            health = server.server.health
            wait_until(lambda: health.dropped == 1, 10, "the stalled watcher dropped")
            assert health.watching == 2  # the dropped one keeps its place until its stream has ended
            server.loop.call_soon_threadsafe(health.set, "", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert next(follower).status == health_pb2.HealthCheckResponse.NOT_SERVING
            follower.cancel()
    finally:
        server.stop()


def exits_cleanly_in_time(server: ServeProcess, signalled: float, bound_s: float) -> None:
    """The signalled server exits 0 within ``bound_s`` of ``signalled``, its log ending with the drain, no traceback."""
    assert server.wait(bound_s) == 0
    assert time.monotonic() - signalled <= bound_s
    log = server.stderr()
    assert log.rstrip().endswith("drained and stopped"), log
    assert "Traceback" not in log


@pytest.mark.parametrize("delay_s", [0.0, 1.0])
def test_sigterm_with_a_stalled_watch_reaches_not_serving_and_exits_in_time(
    tiny_model_dir: Path, tmp_path: Path, delay_s: float
) -> None:
    drain_s, slack_s = 2.0, 2.0  # slack: the process's own teardown (the batchers' threads, the interpreter)
    args = ["--model", str(tiny_model_dir), "--shutdown-delay-s", f"{delay_s:g}", "--drain-timeout-s", f"{drain_s:g}"]
    with ServeProcess(args, tmp_path) as server:
        target = server.wait_serving()
        with stalled_watch(target):
            server.sigterm()
            signalled = time.monotonic()
            if delay_s:  # leaving: NOT_SERVING while requests are still answered
                wait_until(lambda: check(target) == "NOT_SERVING", delay_s, "NOT_SERVING during --shutdown-delay-s")
                assert embed_tokens(target) == ["still", "answered"]
            exits_cleanly_in_time(server, signalled, delay_s + drain_s + slack_s)


def read_refusals(peers: list[H2Peer], streams: list[list[int]], expected: int, wait_s: float = 10.0) -> None:
    """Read the peers' sockets until ``expected`` of their streams have ended (HTTP/2 sends a refusal's trailers
    whatever the window), or ``wait_s`` has passed."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ended = sum(peer.streams[i].ended for peer, ids in zip(peers, streams, strict=True) for i in ids)
        if ended >= expected:
            return
        for peer in peers:
            peer.read_events(0.05)


def _loopback_alias_works() -> bool:
    """127.0.0.2 can be a client's address on this host (Linux routes all of 127/8 to lo)."""
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.2", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("method", "message_sent", "token"),
    [
        (HEALTH_WATCH, True, None),  # Watch streams whose statuses are never read
        (HEALTH_WATCH, True, TOKEN),
        (HEALTH_CHECK, True, TOKEN),  # Checks whose answers are never read
        (HEALTH_CHECK, False, None),  # Checks whose request message never comes
    ],
    ids=["watch", "watch-token", "check-token", "check-half-sent"],
)
def test_a_health_flood_keeps_no_check_or_embed_out(
    tiny_model_dir: Path, tmp_path: Path, method: str, message_sent: bool, token: str | None
) -> None:
    if not _loopback_alias_works():
        pytest.skip("needs 127.0.0.2-4 as client addresses (Linux routes all of 127/8 to lo)")
    # gRPC's own cap on open calls is 2 x 16 + 256 (+ the health shares' 8 + 16 on this server): 3 x 100 health calls
    # held open would fill it if they were not counted in shares of their own
    args = [
        "--model",
        str(tiny_model_dir),
        "--max-concurrent-rpcs",
        "16",
        "--max-calls-per-peer",
        "16",
        "--health-watch-max",
        "8",
        "--health-watch-max-per-peer",
        "4",
        "--health-check-max",
        "16",
        "--health-check-max-per-peer",
        "4",
    ]
    watch = method == HEALTH_WATCH
    flag = "--health-watch-max" if watch else "--health-check-max"
    env = {"ELMO_AUTH_TOKEN": token} if token else None
    with ServeProcess(args, tmp_path, env=env) as server:
        target = server.wait_serving()
        host, port = target.rsplit(":", 1)
        # three client addresses flood; the probe and the Embed below come from a fourth, 127.0.0.1
        peers = [H2Peer(host, int(port), initial_window=0, source=f"127.0.0.{n}") for n in (2, 3, 4)]
        try:
            request = health_request() if message_sent else None
            streams = [peer.send_calls(method, request, 100, end_stream=message_sent) for peer in peers]
            expected_held = 8 if watch else 12  # Watch: the whole (8) of 3 x 4; Check: 3 x 4 of 16
            read_refusals(peers, streams, 300 - expected_held)
            refused = [[peer.streams[i] for i in ids if peer.streams[i].ended] for peer, ids in zip(peers, streams)]
            held = [100 - len(ended) for ended in refused]
            # each client address gets at most its share (4), all of them together at most the whole
            assert sum(held) == expected_held, held
            assert all(n <= 4 for n in held), held
            for ended in refused:
                assert {s.grpc_status for s in ended} == {RESOURCE_EXHAUSTED}
            messages = {s.grpc_message for ended in refused for s in ended}
            assert any(f"{flag}-per-peer" in m for m in messages), messages
            if watch:
                assert any(f"{flag})" in m for m in messages), messages
            # the flood still open (the held calls, their answers unread), a new client is answered at once
            assert check(target) == "SERVING"
            assert embed_tokens(target, token) == ["still", "answered"]
        finally:
            for peer in peers:
                peer.close()


def http_health(url: str) -> int:
    """A new client's GET /health: its status code, answered within PROMISE_S."""
    try:
        with urllib.request.urlopen(url, timeout=PROMISE_S) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_http_health_is_not_stalled_by_a_client_that_never_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """GET /health answers from the server's state at once: a client that pipelines probes and reads no answer holds
    only its own connection (aiohttp stops reading it), and SIGTERM still turns it 503 and ends the process."""
    delay_s, drain_s, slack_s = 1.0, 2.0, 3.0  # slack: the process's teardown, and the HTTP door's own close
    args = [
        "--model",
        str(tiny_model_dir),
        "--http-port",
        "0",
        "--shutdown-delay-s",
        f"{delay_s:g}",
        "--drain-timeout-s",
        f"{drain_s:g}",
    ]
    with ServeProcess(args, tmp_path) as server:
        server.wait_serving()
        http_port = int(server.port_file.read_text().split("\n")[2])  # lines: gRPC, metrics, HTTP
        url = f"http://127.0.0.1:{http_port}/health"
        assert http_health(url) == 200
        with socket.create_connection(("127.0.0.1", http_port)) as hog:
            hog.settimeout(0.2)
            probes = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 2000
            pushed, stop_at = 0, time.monotonic() + 3.0
            while time.monotonic() < stop_at:  # until the server stops reading it (the socket's buffers full)
                try:
                    pushed += hog.send(probes)
                except TimeoutError:
                    continue
            assert pushed > 1 << 20  # far more than the answers the kernel can hold for a client that never reads
            assert [http_health(url) for _ in range(3)] == [200, 200, 200]
            server.sigterm()
            signalled = time.monotonic()
            wait_until(lambda: http_health(url) == 503, delay_s, "GET /health 503 during --shutdown-delay-s")
            exits_cleanly_in_time(server, signalled, delay_s + drain_s + slack_s)


def held_http_connection(port: int, source: str) -> socket.socket:
    """A keep-alive connection from ``source`` that has had one answer and stays open, holding its place."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = sock.recv(4096)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return sock


@pytest.mark.parametrize("reserve", [2, 0])
def test_http_health_has_headroom_while_other_clients_hold_every_connection(
    tiny_model_dir: Path, tmp_path: Path, reserve: int
) -> None:
    """Four client addresses (127.0.0.2-5) hold every HTTP connection (--max-connections 8, 2 each): a new client's
    GET /health is still answered 200 within the probe's bound, on a connection beyond the cap
    (--health-http-connections), where any other request gets 503; with --health-http-connections 0 the probe gets
    the cap's 503 like everyone else."""
    if not _loopback_alias_works():
        pytest.skip("needs 127.0.0.2-5 as client addresses (Linux routes all of 127/8 to lo)")
    args = [
        "--model",
        str(tiny_model_dir),
        "--http-port",
        "0",
        "--max-connections",
        "8",
        "--max-connections-per-peer",
        "2",
        "--health-http-connections",
        str(reserve),
    ]
    with ServeProcess(args, tmp_path) as server:
        server.wait_serving()
        http_port = int(server.port_file.read_text().split("\n")[2])  # lines: gRPC, metrics, HTTP
        flood = [held_http_connection(http_port, f"127.0.0.{2 + i // 2}") for i in range(8)]
        try:
            url = f"http://127.0.0.1:{http_port}"
            assert [http_health(f"{url}/health") for _ in range(3)] == [200 if reserve else 503] * 3
            assert http_health(f"{url}/v1/models") == 503  # beyond the cap: health only
        finally:
            for sock in flood:
                sock.close()


def test_watch_ends_at_its_age_and_at_the_drain_and_unknown_services_are_named(runtime: Embedder) -> None:
    from elmo.service.grpc.health import HealthLimits

    server = ServerThread({"tiny": runtime}, EDGE_LIMITS, health_limits=HealthLimits(max_age_s=0.5))
    try:
        server.warm_up()
        with grpc.insecure_channel(server.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            aged = stub.Watch(health_pb2.HealthCheckRequest(service="elmo.v1.Embedder"), timeout=10)
            assert [reply.status for reply in aged] == [health_pb2.HealthCheckResponse.SERVING]  # then OK, at 0.5 s
            assert aged.code() == grpc.StatusCode.OK
            with pytest.raises(grpc.RpcError) as unknown:
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            assert "no.such.Service" in unknown.value.details()
    finally:
        server.stop()
    # a Watch open at the drain is told NOT_SERVING, and its stream ends
    server = ServerThread({"tiny": runtime}, EDGE_LIMITS)
    with grpc.insecure_channel(server.target) as channel:
        server.warm_up()
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        server.stop()
        assert [reply.status for reply in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert watch.code() == grpc.StatusCode.OK


def test_health_share_flags_are_checked_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.serve_process import serve_until_exit

    args = ["--model", str(tiny_model_dir), "--health-watch-max", "4", "--health-watch-max-per-peer", "8"]
    finished = serve_until_exit(args, tmp_path)
    assert finished.returncode == 2
    assert finished.error_lines() == [
        "elmo serve: error: --health-watch-max-per-peer must not exceed --health-watch-max"
    ], finished.stderr


def test_unread_embed_answers_keep_no_check_out(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An Embed whose client never reads its answer stays open in gRPC after its handler returns: it keeps its place
    in --max-calls-per-peer until gRPC is done with it, so one client's unread answers never fill gRPC's own cap."""
    if not _loopback_alias_works():
        pytest.skip("needs 127.0.0.2 as a client address (Linux routes all of 127/8 to lo)")
    from elmo.v1 import embedder_pb2 as pb

    args = ["--model", str(tiny_model_dir), "--max-concurrent-rpcs", "16", "--max-calls-per-peer", "8"]
    with ServeProcess(args, tmp_path) as server:
        target = server.wait_serving()
        host, port = target.rsplit(":", 1)
        request = pb.EmbedRequest(inputs=[pb.Input(text="never read")]).SerializeToString()
        # 500 calls from one client address: more than gRPC's own cap here (2 x 16 + 256 + the health shares' 192)
        peers = [H2Peer(host, int(port), initial_window=0, source="127.0.0.2") for _ in range(5)]
        try:
            streams = [peer.send_calls(EMBED, request, 100) for peer in peers]
            read_refusals(peers, streams, 500 - 8)
            held = sum(not peer.streams[i].ended for peer, ids in zip(peers, streams) for i in ids)
            assert held == 8  # its share, however many of its answers have been computed meanwhile
            assert check(target) == "SERVING"
            assert embed_tokens(target) == ["still", "answered"]
        finally:
            for peer in peers:
                peer.close()
