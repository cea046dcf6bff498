"""elmo.client's gRPC retry policy (service config, gRFC A6): on by default, UNAVAILABLE only, and off on request.

The server here is a plain grpc server on 127.0.0.1 whose Embed answers UNAVAILABLE a set number of times, counting
every call it receives: the count server-side is what shows a retry happened (the client sees one call)."""

from __future__ import annotations

import json
import re
import threading
from concurrent import futures

import grpc
import pytest

from elmo.client import RETRY_POLICY, EmbedderClient, RemoteError, channel_options, service_config
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import REPO


class Flaky(pb_grpc.EmbedderServicer):
    """Embed fails with ``code`` for the first ``failures`` calls, then answers an empty EmbedResponse."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.code = grpc.StatusCode.UNAVAILABLE

    def arm(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        with self.lock:
            self.calls, self.failures, self.code = 0, failures, code

    def Embed(self, request, context):
        with self.lock:
            self.calls += 1
            fail = self.calls <= self.failures
        if fail:
            context.abort(self.code, "server is shutting down; retry on another replica")
        return pb.EmbedResponse(model="flaky", request_id=request.request_id)


@pytest.fixture(scope="module")
def flaky():
    servicer = Flaky()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_EmbedderServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_the_default_policy_retries_unavailable_and_the_call_succeeds(flaky):
    servicer, target = flaky
    servicer.arm(failures=2)
    with EmbedderClient(target, timeout=30) as client:
        assert client.embed(["x"]) == []  # the third attempt answered
    assert servicer.calls == 3


def test_retries_stop_at_max_attempts(flaky):
    servicer, target = flaky
    servicer.arm(failures=100)
    with EmbedderClient(target, timeout=30) as client, pytest.raises(RemoteError) as info:
        client.embed(["x"])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls == RETRY_POLICY["maxAttempts"] == 5


def test_other_codes_are_not_retried(flaky):
    servicer, target = flaky
    servicer.arm(failures=1, code=grpc.StatusCode.RESOURCE_EXHAUSTED)  # overloaded: retrying adds load
    with EmbedderClient(target, timeout=30) as client, pytest.raises(RemoteError) as info:
        client.embed(["x"])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and servicer.calls == 1


def test_retries_can_be_turned_off(flaky):
    servicer, target = flaky
    servicer.arm(failures=1)
    with EmbedderClient(target, timeout=30, retry_policy=None) as client, pytest.raises(RemoteError) as info:
        client.embed(["x"])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and servicer.calls == 1
    assert ("grpc.enable_retries", 0) in channel_options(None)


def test_the_policy_can_be_replaced(flaky):
    servicer, target = flaky
    servicer.arm(failures=100)
    policy = {**RETRY_POLICY, "maxAttempts": 2, "initialBackoff": "0.01s"}
    with EmbedderClient(target, timeout=30, retry_policy=policy) as client, pytest.raises(RemoteError):
        client.embed(["x"])
    assert servicer.calls == 2


def test_the_service_config_is_the_documented_json():
    config = json.loads(service_config())
    assert config == {"methodConfig": [{"name": [{"service": "elmo.v1.Embedder"}], "retryPolicy": RETRY_POLICY}]}
    options = dict(channel_options())
    assert options["grpc.enable_retries"] == 1 and json.loads(options["grpc.service_config"]) == config


def test_docs_give_the_same_service_config_for_other_clients():
    """docs/how-to/replicas.md's JSON block (after `<!-- service-config -->`) is what elmo.client sends."""
    text = (REPO / "docs" / "how-to" / "replicas.md").read_text()
    block = re.search(r"<!-- service-config -->\n```json\n(.*?)\n```", text, re.S)
    assert block, "docs/how-to/replicas.md lost its service-config block"
    assert json.loads(block.group(1)) == json.loads(service_config())
