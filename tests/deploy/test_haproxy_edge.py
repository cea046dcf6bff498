"""deploy/haproxy.cfg as the edge: Debian's haproxy running the shipped file in front of a real `elmo serve`, against
the clients that a replica alone cannot stop (gRPC core offers no way to close a connection that never reads, and
decodes an HPACK bomb before any handler sees it): a raw HTTP/2 client that never opens its receive window, and one
that sends header blocks built to expand. The file's edge timeouts come from the environment
(ELMO_LB_CLIENT_TIMEOUT, ELMO_LB_IDLE_TIMEOUT), set short here so that the test takes seconds; the shipped values
are 60 s each.

Each case ends with a fresh client through the balancer: health Check SERVING and an Embed answered. The replica's
memory figures are its own (VmRSS from /proc); the bounds asserted are generous multiples of what was measured, to
catch memory that grows with the calls, not allocator noise."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import grpc
import pytest

from bench.service.replicas import HAPROXY_CFG, Balancer
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.h2_peer import EMBED, H2Peer, rss_bytes
from tests.serve_process import ServeProcess, health_status, wait_until
from tests.service_helpers import metric_value, scrape

pytestmark = pytest.mark.slow  # haproxy (make test installs it, make check does not) and a replica: ~20 s

MIB = 1024 * 1024
CLIENT_TIMEOUT_S, IDLE_TIMEOUT_S = 3, 2  # the edge's timeouts for this test (shipped: 60 s each)
BIG_TOKENS = (16, 499)  # inputs x tokens: 7,984 tokens, an answer of MBs even from the tiny model
BOMB_HEADER = ("x-bomb", "A" * 4000)  # one 4 KB HPACK table entry, which every further copy only refers to


@pytest.fixture(scope="module")
def edge(haproxy, tiny_model_dir, tmp_path_factory):
    """One replica (as deploy/compose.yaml runs them: a client's shares are the whole, HAProxy is every client)
    behind deploy/haproxy.cfg, whose three servers all point at it. Yields (replica, balancer)."""
    workdir = tmp_path_factory.mktemp("edge")
    flags = ["--model", str(tiny_model_dir), "--metrics-port", "0", "--http-port", "0"]
    flags += ["--max-calls-per-peer", "1024", "--in-flight-answer-bytes-per-peer", str(1 << 30)]
    replica = ServeProcess(flags, workdir / "replica")
    balancer = None
    try:
        replica.wait_serving()
        grpc_port, metrics_port, http_port = map(int, replica.port_file.read_text().split("\n")[:3])
        replica.ports = SimpleNamespace(grpc_port=grpc_port, http_port=http_port, metrics=metrics_port)
        edge_env = {"ELMO_LB_CLIENT_TIMEOUT": f"{CLIENT_TIMEOUT_S}s", "ELMO_LB_IDLE_TIMEOUT": f"{IDLE_TIMEOUT_S}s"}
        with pytest.MonkeyPatch.context() as patch:  # Balancer passes its own environment on to haproxy
            for name, value in edge_env.items():
                patch.setenv(name, value)
            balancer = Balancer([replica.ports] * 3, workdir, config=HAPROXY_CFG)
        balancer.wait_states({"elmo1": "UP", "elmo2": "UP", "elmo3": "UP"})
        yield replica, balancer
    finally:
        if balancer is not None:
            balancer.stop()
        replica.close()


def embed_request(n_inputs: int, tokens_each: int) -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=[pb.Input(text=" ".join(["a"] * tokens_each))] * n_inputs)


def embedded_tokens(replica: ServeProcess) -> float:
    return metric_value(scrape(replica.ports.metrics), "elmo_embedded_tokens_total") or 0.0


def embed_outcomes(replica: ServeProcess, code: str) -> float:
    """Embed calls the replica has counted with ``code`` (OK, client_disconnected, ...)."""
    return metric_value(scrape(replica.ports.metrics), "elmo_requests_total", method="Embed", code=code) or 0.0


def undelivered(replica: ServeProcess) -> int:
    """Embed answers the replica could not deliver, their streams reset (its INFO line for each)."""
    return replica.stderr().count("client disconnect: the answer to /elmo.v1.Embedder/Embed was not delivered")


def a_new_client_is_served(balancer: Balancer) -> float:
    """A fresh gRPC client through the balancer: health SERVING and a small Embed answered; the Embed's seconds."""
    assert health_status(balancer.grpc_target) == "SERVING"
    with grpc.insecure_channel(balancer.grpc_target) as channel:
        started = time.monotonic()
        reply = pb_grpc.EmbedderStub(channel).Embed(embed_request(1, 3), timeout=10)
        seconds = time.monotonic() - started
    assert [len(e.tokens) for e in reply.embeddings] == [3]
    return seconds


def wait_closed(peer: H2Peer, within: float) -> float | None:
    """Read (never opening a window) until the balancer closes the connection: the seconds it took, or None."""
    started = time.monotonic()
    while not peer.closed_by_server and time.monotonic() - started < within:
        peer.read_events(0.2)
    return time.monotonic() - started if peer.closed_by_server else None


def test_a_client_that_never_reads_is_cut_off_and_its_calls_end_on_the_replica(edge):
    """Eight 7,984-token Embeds on one HTTP/2 connection whose receive window stays 0: the replica computes them
    and can send none. The balancer's client timeout ends each (the replica logs a client disconnect for every one:
    its stream reset, its answer freed), and its idle timeout then closes the client's connection, well before the
    60 s that the file's default idle timeout would take. The replica's RSS ends near where it was; a new client is
    served."""
    replica, balancer = edge
    pid = replica.proc.pid
    request = embed_request(*BIG_TOKENS).SerializeToString()
    calls, tokens = 8, BIG_TOKENS[0] * BIG_TOKENS[1]
    base_rss, base_tokens = rss_bytes(pid), embedded_tokens(replica)
    base_gone = undelivered(replica)
    with H2Peer("127.0.0.1", balancer.grpc_port, initial_window=0) as peer:
        streams = [peer.send_call(EMBED, request) for _ in range(calls)]
        wait_until(lambda: embedded_tokens(replica) >= base_tokens + calls * tokens, 120, "every answer computed")
        held_rss = rss_bytes(pid)
        seconds = wait_closed(peer, 30)  # guard: the connection stays open 60 s and more without the edge timeouts
        assert seconds is not None, "the balancer kept the connection of a client that never reads"
        assert not any(peer.streams[i].data for i in streams)  # nothing reached the client: its window stayed shut
    ended = [line for line in balancer.log_lines() if "/elmo.v1.Embedder/Embed " in line and " cD" in line]
    assert len(ended) >= calls, ended  # "cD": ended by the client-side timeout, while sending the answer
    wait_until(lambda: undelivered(replica) == base_gone + calls, 30, "the replica's calls ended")
    after_rss = rss_bytes(pid)
    answered = a_new_client_is_served(balancer)
    print(
        f"zero window through the edge: connection closed {seconds:.1f} s after the answers were computed "
        f"(client timeout {CLIENT_TIMEOUT_S} s, idle timeout {IDLE_TIMEOUT_S} s); replica RSS "
        f"{base_rss / MIB:.0f} -> {held_rss / MIB:.0f} -> {after_rss / MIB:.0f} MiB; "
        f"a new client's Embed {answered:.3f} s"
    )
    assert after_rss - base_rss < 64 * MIB


def test_an_hpack_bomb_ends_at_the_balancer(edge):
    """100 calls on one connection, each with 4,000 copies of a 4 KB header (16 MB decoded per call, a few KB on
    the wire): the balancer refuses the connection (over tune.http.maxhdr headers, over one buffer) and closes it;
    no bombed call reaches the replica, whose RSS stays flat, and a new client is served."""
    replica, balancer = edge
    pid = replica.proc.pid
    request = embed_request(1, 2).SerializeToString()
    base_rss, base_calls = rss_bytes(pid), embed_outcomes(replica, "OK")
    with H2Peer("127.0.0.1", balancer.grpc_port, initial_window=0) as peer:
        try:
            for _ in range(100):
                peer.send_call(EMBED, request, headers=[BOMB_HEADER] * 4000)
        except OSError:  # the balancer closed the connection while the bomb was still being sent
            peer.closed_by_server = True
        seconds = wait_closed(peer, 30)
        assert seconds is not None, "the balancer kept a connection that sent an HPACK bomb"
        refused = {i: r for i, r in peer.streams.items() if r.ended}
    bombed_rss = rss_bytes(pid)
    answered = a_new_client_is_served(balancer)
    assert embed_outcomes(replica, "OK") == base_calls + 1  # only the new client's: no bombed call reached it
    print(
        f"HPACK bomb through the edge: connection closed after {len(peer.streams)} calls sent "
        f"({len(refused)} ended with a status first); replica RSS {base_rss / MIB:.0f} -> {bombed_rss / MIB:.0f} "
        f"MiB; a new client's Embed {answered:.3f} s"
    )
    assert bombed_rss - base_rss < 16 * MIB


def test_a_header_block_over_the_edge_bound_is_refused_with_400(edge):
    """A block within tune.http.maxhdr and one buffer (40 copies of a 4 KB header, 160 KB decoded) that HAProxy
    would otherwise pass on, written out in full, to the replica: refused at the balancer by its header-bytes bound
    (HTTP 400, which a gRPC client reads as an error status), and the replica never sees it."""
    replica, balancer = edge
    base_calls = sum(embed_outcomes(replica, code) for code in ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"))
    with H2Peer("127.0.0.1", balancer.grpc_port, initial_window=65535) as peer:
        stream = peer.send_call(EMBED, embed_request(1, 2).SerializeToString(), headers=[BOMB_HEADER] * 40)
        wait_until(lambda: bool(peer.read_events(0.2)) or peer.closed_by_server, 30, "an answer from the balancer")
        assert peer.streams[stream].headers.get(":status") == "400", peer.streams[stream]
    after = sum(embed_outcomes(replica, code) for code in ("OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"))
    assert after == base_calls
    a_new_client_is_served(balancer)


def test_the_edge_bounds_are_in_the_shipped_file():
    """The edge settings that the tests above rely on are the file's own, not this test's."""
    text = HAPROXY_CFG.read_text()
    settings = (
        "tune.h2.header-table-size 4096",
        "tune.h2.max-concurrent-streams 100",
        "tune.http.maxhdr 64",
        'timeout client "${ELMO_LB_CLIENT_TIMEOUT-60s}"',
        'timeout http-keep-alive "${ELMO_LB_IDLE_TIMEOUT-60s}"',
        'req.hdrs,length gt "${ELMO_LB_MAX_HEADER_BYTES-16384}"',
    )
    for line in settings:
        assert text.count(line) == (1 if line.startswith("tune.") else 2), line  # tune: global; others: both frontends
    assert os.environ.get("ELMO_LB_CLIENT_TIMEOUT") is None  # the module's settings did not leak into the process
