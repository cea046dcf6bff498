"""Memory bounded by configuration, not by clients: a real ``elmo serve`` on 127.0.0.1 against clients that do not
read their answers (a zero HTTP/2 window, an HTTP socket never read), bloat gRPC's header tables, trickle request
bodies or hang up mid-answer.

The memory figures are the server process's own (VmRSS from /proc) with the shipped model (models/default), where
an answer is large enough to matter; the bounds asserted are generous multiples of what was measured, so that they
hold on any x86-64 CPU: they catch memory that grows with the number of calls, not a few MiB of allocator noise.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import REPO
from tests.h2_peer import EMBED, H2Peer, rss_bytes
from tests.serve_process import ServeProcess, health_status, serve_until_exit, wait_until
from tests.service_helpers import metric_value, scrape

MIB = 1024 * 1024
DEFAULT_MODEL = REPO / "models" / "default"
TOKENIZE = "/elmo.v1.Embedder/Tokenize"
OTHER_CLIENT = "127.0.0.2"  # another loopback address: another client to the server's per-address shares
needs_default_model = pytest.mark.skipif(not (DEFAULT_MODEL / "model.onnx").is_file(), reason="models/default absent")


@dataclass(frozen=True)
class Ports:
    grpc: int
    metrics: int
    http: int


def serve(args: list[str], workdir: Path) -> ServeProcess:
    return ServeProcess(["--metrics-port", "0", "--http-port", "0", *args], workdir)


def ports_of(server: ServeProcess) -> Ports:
    grpc_port, metrics_port, http_port = server.port_file.read_text().split("\n")[:3]
    return Ports(int(grpc_port), int(metrics_port), int(http_port))


def embedded_tokens(port: int) -> float:
    return metric_value(scrape(port), "elmo_embedded_tokens_total") or 0.0


def request_count(port: int, **labels: str) -> float:
    text = scrape(port)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("elmo_requests_total{") and all(f'{k}="{v}"' in line for k, v in labels.items())
    )


def embed_body(n_inputs: int, tokens_each: int, encoding: str = "float") -> bytes:
    return json.dumps({"inputs": [" ".join(["a"] * tokens_each)] * n_inputs, "encoding": encoding}).encode()


def post(port: int, path: str, body: bytes, source: str | None = None, rcvbuf: int | None = None) -> socket.socket:
    """A raw HTTP/1.1 POST whose answer is left for the caller to read (or never read)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting, so that the window the client announces stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if source is not None:
        sock.bind((source, 0))
    sock.settimeout(60)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP/1.1 answer with a Content-Length."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before the answer's head: {bytes(data[:200])!r}")
        data.extend(chunk)
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    rest = bytearray(body)
    while len(rest) < int(headers.get("content-length", "0")):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        rest.extend(chunk)
    return int(lines[0].split()[1]), headers, bytes(rest)


TCP_ESTABLISHED = 1  # linux/tcp_states.h


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server has closed or reset ``sock`` (its TCP state leaves ESTABLISHED), within ``within``
    seconds. Reads nothing: a client that read would take the answer, and the server would have no reason to."""
    deadline = time.monotonic() + within
    while sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_ESTABLISHED:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# -- the HTTP body deadline -----------------------------------------------------------------------------------------
def test_a_body_trickled_slower_than_its_deadline_gets_408_and_the_connection_closes(tiny_model_dir, tmp_path):
    """One byte every 0.3 s never pauses for --http-body-timeout-s (30 s), but the whole body must be in within
    --http-body-deadline-s: 408 naming that flag, then the connection is closed."""
    with serve(["--model", str(tiny_model_dir), "--http-body-deadline-s", "2"], tmp_path) as server:
        server.wait_serving()
        port = ports_of(server).http
        body = b'{"inputs": ["a b c"]}'.ljust(64)
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        head = (
            f"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head)
        sent = 0
        sock.settimeout(0.3)
        answer = bytearray()
        while sent < len(body) and b"\r\n\r\n" not in answer:
            sock.sendall(body[sent : sent + 1])
            sent += 1
            try:
                answer.extend(sock.recv(65536))
            except TimeoutError:
                pass
        sock.settimeout(30)
        status_line = bytes(answer).split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 408"), (status_line, sent)
        assert sent < len(body)
        while not answer.endswith(b"}") and (chunk := sock.recv(65536)):
            answer.extend(chunk)
        assert b"--http-body-deadline-s" in answer
        assert closed_by_server(sock, 20)  # once aiohttp's linger over the unsent rest (10 s) is over
        sock.close()


# -- a client that hangs up mid-answer -------------------------------------------------------------------------------
def test_a_client_that_hangs_up_mid_answer_is_an_info_line_not_an_error(tiny_model_dir, tmp_path):
    """The client reads the head of a multi-MB answer and resets its connection: the server logs one INFO line
    "client disconnect", no ERROR and no traceback, and counts no 500."""
    with serve(["--model", str(tiny_model_dir)], tmp_path) as server:
        server.wait_serving()
        ports = ports_of(server)
        sock = post(ports.http, "/v1/embed", embed_body(16, 500), rcvbuf=4096)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a FIN
        sock.close()
        wait_until(lambda: "client disconnect" in server.stderr(), 30, "the disconnect logged")
        assert request_count(ports.metrics, method="POST /v1/embed", code="client_disconnected") == 1
        assert request_count(ports.metrics, code="500") == 0
        log = server.stderr()
        assert re.search(r" INFO service\.http: client disconnect: POST /v1/embed", log), log[-2000:]
        assert " ERROR " not in log and "Traceback" not in log, log[-4000:]


# -- answers nobody reads: the budget of answer bytes in flight ------------------------------------------------------
def stall_flags(share_mib: int) -> list[str]:
    return ["--model", str(DEFAULT_MODEL), "--in-flight-answer-bytes-per-peer", str(share_mib * MIB)]


def grpc_embed_request(n_inputs: int = 16, tokens_each: int = 499) -> pb.EmbedRequest:
    """7,984 tokens by default: a 23.5 MiB answer from models/default, in one HTTP/2 frame (under 16 KiB)."""
    return pb.EmbedRequest(inputs=[pb.Input(text=" ".join(["a"] * tokens_each))] * n_inputs)


def another_client_is_served(target: str) -> float:
    """A fresh client at 127.0.0.1: health SERVING and a small Embed answered; returns the Embed's seconds."""
    assert health_status(target) == "SERVING"
    with grpc.insecure_channel(target) as channel:
        started = time.monotonic()
        reply = pb_grpc.EmbedderStub(channel).Embed(grpc_embed_request(1, 3), timeout=10)
        elapsed = time.monotonic() - started
    assert [len(e.tokens) for e in reply.embeddings] == [3]
    return elapsed


@needs_default_model
def test_unread_http_answers_hold_their_share_until_the_write_timeout_closes_them(tmp_path):
    """Two 15.7 MiB base64 answers that their client (127.0.0.2) never reads fill its 40 MiB share: its third big
    call gets 503 with Retry-After before any vector is computed, while another client is served. The write timeout
    then aborts both connections and frees the share: the same big call is answered."""
    # 5 s: the third call still finds the share held, even with both cores busy elsewhere
    with serve([*stall_flags(40), "--answer-write-timeout-s", "5"], tmp_path) as server:
        target = server.wait_serving()
        ports, pid = ports_of(server), server.proc.pid
        body = embed_body(16, 250, "base64")  # 4,000 tokens
        base_rss, base_tokens = rss_bytes(pid), embedded_tokens(ports.metrics)
        stalled = [post(ports.http, "/v1/embed", body, source=OTHER_CLIENT, rcvbuf=4096) for _ in range(2)]
        wait_until(lambda: embedded_tokens(ports.metrics) >= base_tokens + 8000, 120, "both answers computed")

        refused = post(ports.http, "/v1/embed", body, source=OTHER_CLIENT)
        status, headers, answer = read_answer(refused)
        refused.close()
        assert status == 503 and headers.get("retry-after") == "1", (status, headers, answer[:300])
        assert "--in-flight-answer-bytes-per-peer" in json.loads(answer)["error"]["message"]
        assert embedded_tokens(ports.metrics) == base_tokens + 8000  # refused before its vectors were computed
        seconds = another_client_is_served(target)
        held_rss = rss_bytes(pid)
        print(
            f"HTTP unread: RSS {base_rss / MIB:.0f} -> {held_rss / MIB:.0f} MiB with 2 answers held; "
            f"another client's Embed {seconds:.3f} s"
        )
        assert held_rss - base_rss < 400 * MIB

        assert all(closed_by_server(sock, 60) for sock in stalled)  # the write timeout aborted them
        for sock in stalled:
            sock.close()
        again = post(ports.http, "/v1/embed", body, source=OTHER_CLIENT)
        status, _, answer = read_answer(again)
        again.close()
        assert status == 200, answer[:300]
        print(f"HTTP unread: RSS {rss_bytes(pid) / MIB:.0f} MiB once the stalled connections were closed")


@needs_default_model
def test_zero_window_grpc_answers_hold_their_share_until_the_connection_is_closed(tmp_path):
    """A raw HTTP/2 client (127.0.0.2) with a zero receive window asks for two 23.5 MiB answers, which gRPC can
    never send: they fill its 50 MiB share, and its third call ends RESOURCE_EXHAUSTED before any vector is
    computed, while another client is served. --grpc-connection-age-s then closes the connection after
    --answer-write-timeout-s of grace, which frees the share: the same client's big calls are computed again."""
    # an age of 12 s: the two answers are computed and the third call refused within it even with both cores busy
    # elsewhere (8 s was not enough then)
    flags = [*stall_flags(50), "--grpc-connection-age-s", "12", "--answer-write-timeout-s", "3"]
    with serve(flags, tmp_path) as server:
        target = server.wait_serving()
        ports, pid = ports_of(server), server.proc.pid
        request = grpc_embed_request().SerializeToString()
        base_rss, base_tokens = rss_bytes(pid), embedded_tokens(ports.metrics)
        with H2Peer("127.0.0.1", ports.grpc, initial_window=0, source=OTHER_CLIENT) as peer:
            held = [peer.send_call(EMBED, request) for _ in range(2)]
            wait_until(lambda: embedded_tokens(ports.metrics) >= base_tokens + 2 * 7984, 120, "both computed")
            third = peer.send_call(EMBED, request)
            assert peer.wait_ended([third], 30)
            result = peer.streams[third]
            assert result.grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], (result, peer.streams)
            assert "--in-flight-answer-bytes-per-peer" in result.grpc_message
            assert not any(peer.streams[i].ended for i in held)
            assert embedded_tokens(ports.metrics) == base_tokens + 2 * 7984  # refused before computing
            seconds = another_client_is_served(target)
            held_rss = rss_bytes(pid)
            print(
                f"gRPC zero window: RSS {base_rss / MIB:.0f} -> {held_rss / MIB:.0f} MiB with 2 answers held; "
                f"another client's Embed {seconds:.3f} s"
            )
            assert held_rss - base_rss < 400 * MIB
            assert closed_by_server(peer.sock, 90)  # the connection's age (12 s) and its grace (3 s)
        after_tokens = embedded_tokens(ports.metrics)
        with H2Peer("127.0.0.1", ports.grpc, initial_window=0, source=OTHER_CLIENT) as peer:
            again = [peer.send_call(EMBED, request) for _ in range(2)]
            wait_until(lambda: embedded_tokens(ports.metrics) >= after_tokens + 2 * 7984, 120, "computed again")
            assert not any(peer.streams[i].ended for i in again)
        print(f"gRPC zero window: RSS {rss_bytes(pid) / MIB:.0f} MiB after the stalled connection was closed")


# -- an HPACK bomb ---------------------------------------------------------------------------------------------------
BOMB_HEADER = ("x-bomb", "A" * 4000)  # one 4 KB entry of the HPACK table, which each further copy only refers to


def test_an_hpack_bomb_is_refused_and_costs_no_memory(tiny_model_dir, tmp_path):
    """100 calls on one zero-window connection, each with 4,000 copies of a 4 KB header (16 MB decoded per call, a
    few KB on the wire; 1.6 GB if the server kept them): gRPC refuses them RESOURCE_EXHAUSTED by the headers' size
    bound before anything is kept (all but one or two, which it serves with the bomb dropped), the server's RSS stays
    within 64 MiB of where it was, and another client gets health SERVING and its Embed answered."""
    with serve(["--model", str(tiny_model_dir)], tmp_path) as server:
        target = server.wait_serving()
        ports, pid = ports_of(server), server.proc.pid
        request = grpc_embed_request(1, 2).SerializeToString()
        base_rss = rss_bytes(pid)
        with H2Peer("127.0.0.1", ports.grpc, initial_window=0) as peer:
            bombed = []
            for _ in range(2):
                bombed += [peer.send_call(EMBED, request, headers=[BOMB_HEADER] * 4000) for _ in range(50)]
                peer.read_events(0.2)
            peer.wait_ended(bombed, 30, share=0.9)  # the one or two served wait for a window that never opens
            refused = [i for i in bombed if peer.streams[i].grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
            assert len(refused) >= 0.9 * len(bombed), {i: peer.streams[i] for i in bombed if i not in refused}
            bombed_rss = rss_bytes(pid)
            seconds = another_client_is_served(target)
        print(
            f"HPACK bomb: RSS {base_rss / MIB:.0f} -> {bombed_rss / MIB:.0f} MiB; another client's Embed "
            f"{seconds:.3f} s"
        )
        assert bombed_rss - base_rss < 64 * MIB


def test_a_per_peer_share_over_the_whole_budget_is_refused_at_start(tmp_path):
    finished = serve_until_exit(
        [
            "--model",
            str(tmp_path / "never-read"),
            "--in-flight-answer-bytes",
            str(64 * MIB),
            "--in-flight-answer-bytes-per-peer",
            str(128 * MIB),
        ],
        tmp_path,
    )
    assert finished.returncode == 2
    assert finished.error_lines() == [
        "elmo serve: error: --in-flight-answer-bytes-per-peer must not exceed --in-flight-answer-bytes"
    ], finished.stderr


def test_a_streams_answers_wait_their_turn_in_its_share_instead_of_failing(tiny_model_dir, tmp_path):
    """A share that holds one 100-token answer of the tiny model (~21 KB as protobuf) but not two: an EmbedStream of
    five such requests (sent at once, embedded concurrently) gets all five answers in order, each taking its place
    once the one ahead of it has left, and the client's next Embed is answered: nothing is left held."""
    flags = ["--model", str(tiny_model_dir), "--in-flight-answer-bytes-per-peer", "30000"]
    with serve(flags, tmp_path) as server:
        target = server.wait_serving()
        requests = [grpc_embed_request(1, 100 - i) for i in range(5)]
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            answers = list(stub.EmbedStream(iter(requests), timeout=60))
            assert [len(a.embeddings[0].tokens) for a in answers] == [100, 99, 98, 97, 96]
            assert len(stub.Embed(requests[0], timeout=60).embeddings[0].tokens) == 100


def test_unread_tokenize_answers_hold_their_share_too(tiny_model_dir, tmp_path):
    """Tokenize answers (every token and its offsets: about the text's size again) count in the budget as well, at
    their size once built: a zero-window client's first 8,000-token answer (~100 KB) fills its 150 KB share, its
    second is dropped and the call refused RESOURCE_EXHAUSTED, as are ten more, logged in one WARNING line (one per
    client and interval), and another client is served."""
    flags = ["--model", str(tiny_model_dir), "--in-flight-answer-bytes-per-peer", "150000"]
    with serve(flags, tmp_path) as server:
        target = server.wait_serving()
        request = pb.TokenizeRequest(texts=[" ".join(["a"] * 8000)]).SerializeToString()
        with H2Peer("127.0.0.1", ports_of(server).grpc, initial_window=0, source=OTHER_CLIENT) as peer:
            held = peer.send_call(TOKENIZE, request)
            peer.read_events(1.0)
            refused = peer.send_call(TOKENIZE, request)
            assert peer.wait_ended([refused], 30)
            assert peer.streams[refused].grpc_status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert "--in-flight-answer-bytes-per-peer" in peer.streams[refused].grpc_message
            assert not peer.streams[held].ended
            more = [peer.send_call(TOKENIZE, request) for _ in range(10)]  # refused too: no more WARNING lines
            assert peer.wait_ended(more, 30)
            assert {peer.streams[i].grpc_status for i in more} == {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
            another_client_is_served(target)
        warnings = [line for line in server.stderr().splitlines() if " WARNING service.requests: Tokenize " in line]
        assert len(warnings) == 1, warnings  # one per client and interval, not one per refused call
