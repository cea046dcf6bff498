"""EmbedStream on a real server on 127.0.0.1: back-pressure (``--max-stream-inflight`` bounds what one stream has
in the server at once, and a client that stops reading stops the server, which then waits for it) and a request
that fails validation in the middle of a stream (the answers before it arrive, then its status ends the stream).

Counts, not clocks, decide. Two checks are about something that must *not* happen (the server taking more work);
they watch the server for a settle period after it stopped moving, which can only make them miss a regression on
a machine that stalls that long, never fail a correct server.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import pytest
from elmo.service.common.limits import Limits

from elmo.runtime import Embedder
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.serve_process import wait_until
from tests.service_helpers import EDGE_LIMITS, ServerThread

SETTLE_CHECKS = 25  # consecutive unchanged observations, 20 ms apart, that count as "the server stopped"
HTTP2_DEFAULT_WINDOW = 65535  # bytes a receiver takes before it has read anything (no BDP probing: see below)


@pytest.fixture(scope="module")
def runtime(tiny_model_dir) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


def tokens_request(tokens: list[str]) -> pb.EmbedRequest:
    return pb.EmbedRequest(inputs=[pb.Input(tokens=pb.Tokens(tokens=tokens))])


def settled(observe: Callable[[], object]) -> object:
    """The value of ``observe()`` once it stayed the same for SETTLE_CHECKS observations in a row."""
    last, same = observe(), 0
    while same < SETTLE_CHECKS:
        time.sleep(0.02)
        now = observe()
        same = same + 1 if now == last else 0
        last = now
    return last


def test_max_stream_inflight_bounds_what_one_stream_has_in_the_server(runtime: Embedder) -> None:
    inflight, total = 3, 12
    limits = replace(Limits(drain_seconds=2.0), max_stream_inflight=inflight, express_tokens=0)  # one worker: exact
    srv = ServerThread({"tiny": runtime}, limits)
    srv.warm_up()
    batcher = srv.model().batcher

    try:
        # The runtime thread held: the stream's first batch is dispatched (with what else the event loop had in hand)
        # and waits for the thread; what the stream admitted after it stays queued. Both are countable.
        batches = batcher.batches_started  # the warm-up's

        def in_the_server() -> tuple[int, int]:
            return batcher.queued_sentences + batcher.running_sentences, batcher.batches_started - batches

        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            requests = [tokens_request([f"r{i}", "x"]) for i in range(total)]
            with srv.hold_worker():
                responses = stub.EmbedStream(iter(requests), timeout=60)
                wait_until(lambda: in_the_server()[0] >= inflight, 30, "the stream's first requests queued")
                in_server = settled(in_the_server)
            answered = [list(response.embeddings[0].tokens) for response in responses]
        assert in_server == (inflight, 1)
        assert answered == [[f"r{i}", "x"] for i in range(total)]
    finally:
        srv.stop()


def test_a_client_that_stops_reading_stops_the_server_which_then_waits_for_it(runtime: Embedder) -> None:
    inflight, total, length = 4, 200, 20
    srv = ServerThread({"tiny": runtime}, replace(Limits(drain_seconds=2.0), max_stream_inflight=inflight))
    srv.warm_up()

    def embedded() -> int:  # sentences the server computed (all of the stream's have the same length)
        return int(srv.metric("elmo_embedded_tokens_total", model="tiny") - warm_up_tokens) // length

    try:
        warm_up_tokens = srv.metric("elmo_embedded_tokens_total", model="tiny")
        requests = [tokens_request([f"s{i}"] + ["w"] * (length - 1)) for i in range(total)]
        # BDP probing off: the client's HTTP/2 window stays at its default instead of growing with what arrives, so
        # the bytes the transport may hold for a client that does not read are known.
        options = [("grpc.http2.bdp_probe", 0)]
        with grpc.insecure_channel(srv.target, options=options) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            response_bytes = len(stub.Embed(requests[0], timeout=30).SerializeToString()) + 5  # + gRPC framing
            warm_up_tokens += length
            responses = stub.EmbedStream(iter(requests), timeout=60)
            wait_until(lambda: embedded() >= inflight, 30, "the stream started")
            stopped_at = settled(embedded)
            # What the server may compute for a client that reads nothing: max_stream_inflight in the server, plus
            # the responses one HTTP/2 window holds (counted twice, as slack for how the transports split it). Not
            # the 200 (780 KB) it was sent: past that, the server waits.
            bound = inflight + 2 * math.ceil(HTTP2_DEFAULT_WINDOW / response_bytes)
            assert inflight <= stopped_at <= bound, (stopped_at, bound)
            answered = [list(response.embeddings[0].tokens)[0] for response in responses]
        assert answered == [f"s{i}" for i in range(total)]  # then every answer, in order
        assert embedded() == total
    finally:
        srv.stop()


def stream_until_error(target: str, requests: list[pb.EmbedRequest]) -> tuple[list[list[str]], grpc.RpcError | None]:
    """Feed ``requests`` over one EmbedStream; the answers received, and the error that ended it (if any)."""
    feed: queue.Queue = queue.Queue()
    for request in requests:
        feed.put(request)
    feed.put(None)
    answers: list[list[str]] = []
    with grpc.insecure_channel(target) as channel:
        try:
            for response in pb_grpc.EmbedderStub(channel).EmbedStream(iter(feed.get, None), timeout=60):
                answers.append(list(response.embeddings[0].tokens))
        except grpc.RpcError as error:
            return answers, error
    return answers, None


@pytest.fixture(scope="module")
def edges(runtime: Embedder) -> Iterator[ServerThread]:
    srv = ServerThread({"tiny": runtime}, EDGE_LIMITS)  # 20 tokens per sentence at most
    srv.warm_up()
    yield srv
    srv.stop()


def test_a_bad_request_mid_stream_ends_it_after_the_answers_before_it(edges: ServerThread) -> None:
    before = edges.metric("elmo_requests_total", method="EmbedStream", code="INVALID_ARGUMENT")
    requests = [
        tokens_request(["first"]),
        tokens_request(["second", "one"]),
        tokens_request(["w"] * 21),  # over --max-sentence-tokens: refused at validation
        tokens_request(["after", "it"]),
    ]
    batcher = edges.model().batcher
    started = batcher.batches_started
    with edges.hold_worker():
        # The good requests are queued behind the held runtime while the bad one fails at once: its error is known
        # before the answers ahead of it exist, and must still come after them.
        outcome: dict[str, object] = {}
        reader = threading.Thread(target=lambda: outcome.update(result=stream_until_error(edges.target, requests)))
        reader.start()
        wait_until(lambda: batcher.batches_started > started, 30, "the first request reached the batcher")
    reader.join(60)
    answers, error = outcome["result"]
    assert answers == [["first"], ["second", "one"]]
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("inputs[0] has 21 tokens, over the limit of 20 per sentence")
    wait_until(
        lambda: edges.metric("elmo_requests_total", method="EmbedStream", code="INVALID_ARGUMENT") == before + 1,
        30,
        "the stream counted as INVALID_ARGUMENT",
    )


def test_a_bad_first_request_ends_the_stream_with_nothing_before_it(edges: ServerThread) -> None:
    answers, error = stream_until_error(edges.target, [pb.EmbedRequest(), tokens_request(["fine"])])
    assert answers == []
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "inputs is empty: send at least one sentence"
