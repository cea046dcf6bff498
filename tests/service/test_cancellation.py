"""A request's place in flight has one owner, the request core (service/core/requests.py): cancelled at any await of
its path (a gRPC deadline) or left by its client (an HTTP disconnect), it gives its model version back there, so a
swap releases the old version at once and no request is answered by a released version.

Real servers on 127.0.0.1 over a model repository, real onnxruntime. Each await point of the core's path is made to
wait (:class:`Stall`: the core's worker hops, ``run`` — preparing, stitching windows, building the answer — and the
batcher's queue); the request is cancelled or its client leaves while it waits there."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from elmo.service.server import RepositoryOptions

from elmo.bench.random_model import write_random_model
from elmo.runtime.repository import publish_copy
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.service.test_versions import open_runtime, wait_for
from tests.service_helpers import ServerThread, limits_with

# A long sentence under 'window' (the server's sentence limit is 20 tokens): its path has every await point.
LONG = " ".join(f"w{i}" for i in range(45))
POINTS = ("prepare", "queue", "stitch", "answer")  # in the order a request passes them
RUN_POINTS = ("prepare", "stitch", "answer")  # the core's worker hops, in order
NEVER_RELEASED_S = 3600.0  # a leaked count would hold the swap for an hour: the test's own timeout fails it first


class Stall:
    """Makes one await point of the core's path wait until :meth:`release` (or until the request is cancelled)."""

    def __init__(self, server: ServerThread, point: str):
        self.server, self.point = server, point
        self.arrived = threading.Event()
        self._gate: asyncio.Event | None = None
        self._runs = 0
        core = server.server.core
        self._run, self._queue = core.run, None
        core.run = self._core_run  # type: ignore[method-assign]

    async def _wait_here(self) -> None:
        self._gate = asyncio.Event()
        self.arrived.set()
        await self._gate.wait()

    async def _core_run(self, work, heavy: bool = True):
        if work.__qualname__.startswith("RequestCore."):  # (a door's own hops, parsing a body, hold nothing yet)
            point = RUN_POINTS[min(self._runs, len(RUN_POINTS) - 1)]
            self._runs += 1
            if point == self.point:
                await self._wait_here()
        return await self._run(work, heavy)

    def watch_queue(self) -> None:
        """Also stall the batcher's queue (of the version requests resolve to now)."""
        batcher = self.server.model().batcher
        self._queue = (batcher, batcher.embed)

        async def embed(sentences, deadline=None):
            if self.point == "queue":
                await self._wait_here()
            return await self._queue[1](sentences, deadline)

        batcher.embed = embed

    def release(self) -> None:
        assert self._gate is not None
        self.server.loop.call_soon_threadsafe(self._gate.set)

    def undo(self) -> None:
        self.server.server.core.run = self._run  # type: ignore[method-assign]
        if self._queue is not None:
            batcher, embed = self._queue
            batcher.embed = embed


@pytest.fixture()
def repository(tiny_model_dir, tmp_path) -> Path:
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    return root


def swappable_server(root: Path, http: bool) -> ServerThread:
    options = RepositoryOptions(root, open_runtime, release_timeout_s=NEVER_RELEASED_S)
    limits = limits_with(
        overflow="window", drain_seconds=1.0, max_response_bytes=1 << 20, max_queue_tokens=4096, max_batch_tokens=4096
    )
    server = ServerThread({}, limits, http=http, repository=options)
    server.warm_up()
    return server


def grpc_embed(server: ServerThread, timeout: float) -> pb.EmbedResponse:
    with grpc.insecure_channel(server.target) as channel:
        request = pb.EmbedRequest(inputs=[pb.Input(text=LONG)], overflow=pb.OVERFLOW_WINDOW)
        return pb_grpc.EmbedderStub(channel).Embed(request, timeout=timeout)


def nothing_in_flight(server: ServerThread, version: int) -> bool:
    record = server.server.repository.records[("default", version)]
    model = record.model
    return model is not None and model.in_flight == 0 and server.server.state.active == 0


def swap_and_check_release(server: ServerThread, second_model: Path, root: Path) -> None:
    """Publish version 2: version 1 must be released at once (its count is 0), and new requests answered by 2."""
    publish_copy(second_model, root, "default")
    server.call(server.server.repository.reconcile())
    server.call(server.server.repository.wait_released(), timeout=60.0)  # a leaked count: an hour, TimeoutError
    assert server.server.repository.records[("default", 1)].state == pb.VERSION_UNLOADED
    assert grpc_embed(server, timeout=30).model_version == 2


@pytest.mark.parametrize("point", POINTS)
def test_a_grpc_deadline_at_each_await_point_gives_the_version_back(repository, second_model, point):
    server = swappable_server(repository, http=False)
    try:
        stall = Stall(server, point)
        stall.watch_queue()
        with pytest.raises(grpc.RpcError) as failure:
            grpc_embed(server, timeout=0.5)
        assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert stall.arrived.is_set(), f"the request never reached {point}"
        wait_for(lambda: nothing_in_flight(server, 1))  # the cancellation lands on the server's loop
        stall.undo()
        swap_and_check_release(server, second_model, repository)
    finally:
        server.stop()


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    conn.sendall(head.encode() + data)
    return conn


@pytest.mark.parametrize("point", POINTS)
def test_an_http_client_that_leaves_at_each_await_point_gives_the_version_back(repository, second_model, point):
    server = swappable_server(repository, http=True)
    try:
        stall = Stall(server, point)
        stall.watch_queue()
        conn = raw_post(server.server.http_port, "/v1/embed", {"inputs": [LONG], "overflow": "window"})
        assert stall.arrived.wait(30), f"the request never reached {point}"
        conn.close()  # the client leaves while its request waits at the point
        stall.release()
        wait_for(lambda: nothing_in_flight(server, 1))
        stall.undo()
        swap_and_check_release(server, second_model, repository)
    finally:
        server.stop()


def test_a_request_held_during_a_swap_is_answered_by_its_version_which_is_released_after(repository, second_model):
    """The old version keeps serving the request that holds it (and is not released under it), then goes at once."""
    server = swappable_server(repository, http=False)
    try:
        stall = Stall(server, "answer")
        answers: list[pb.EmbedResponse] = []
        caller = threading.Thread(target=lambda: answers.append(grpc_embed(server, timeout=60)))
        caller.start()
        assert stall.arrived.wait(30)
        publish_copy(second_model, repository, "default")
        server.call(server.server.repository.reconcile())  # 2 takes new requests; 1 is held by the stalled one
        record = server.server.repository.records[("default", 1)]
        assert record.state == pb.VERSION_UNLOADING and record.model is not None and record.model.in_flight == 1
        stall.release()
        caller.join(30)
        assert [a.model_version for a in answers] == [1]
        server.call(server.server.repository.wait_released(), timeout=60.0)
        assert record.state == pb.VERSION_UNLOADED
        stall.undo()
        assert grpc_embed(server, timeout=30).model_version == 2
    finally:
        server.stop()


def test_openai_dimensions_are_checked_against_the_version_that_embeds_them(repository, tmp_path):
    """/v1/embeddings resolves its model once: a swap to a version of another width between the check of
    ``dimensions`` and the embedding changes neither (the old version checks, embeds and names the answer)."""
    wider = write_random_model(tmp_path / "wider", "tiny", seed=2, scale=0.3, export=True, projection_dim=12)
    server = swappable_server(repository, http=True)
    try:
        narrow_dim = server.model().dim
        stall = Stall(server, "prepare")  # the check has run against version 1; the embedding has not
        answers: list[tuple[int, dict]] = []
        body = {"input": ["the cat sat"], "dimensions": narrow_dim}
        caller = threading.Thread(target=lambda: answers.append(post(server, "/v1/embeddings", body)))
        caller.start()
        assert stall.arrived.wait(30)
        publish_copy(wider, repository, "default")
        server.call(server.server.repository.reconcile())  # version 2, 24 wide, takes new requests
        assert server.model().dim != narrow_dim
        stall.release()
        caller.join(30)
        [(status, answer)] = answers
        assert status == 200 and answer["model_version"] == 1
        assert len(answer["data"][0]["embedding"]) == narrow_dim
        stall.undo()
        status, answer = post(server, "/v1/embeddings", body)  # now checked against version 2: refused
        assert status == 400 and f"has {server.model().dim}" in answer["error"]["message"]
    finally:
        server.stop()


def post(server: ServerThread, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.http_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_model_seed1")
    return write_random_model(directory, "tiny", seed=1, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)
