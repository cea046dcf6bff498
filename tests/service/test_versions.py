"""`elmo serve --model-root`: versions picked up, swapped without a dropped request, refused when broken, controlled
through the admin API, pinned by clients, named in every answer; stale task mixes flagged; the memory guard. Real
servers on 127.0.0.1 (free ports), real onnxruntime, tiny random models with different seeds as versions."""

from __future__ import annotations

import gc
import json
import shutil
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

import grpc
import numpy as np
import pytest
from elmo.service.models.versions import ModelManager, estimate_memory, parse_bytes
from elmo.service.server import RepositoryOptions

from elmo.client import EmbedderClient
from elmo.errors import ConfigError
from elmo.runtime import Embedder
from elmo.runtime.repository import publish_copy
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.service_helpers import ServerThread, limits_with

ADMIN = "admin-secret"
CLIENT = "client-secret"
TEXT = "The cat sat on the mat ."


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    """Another tiny model (seed 1): different weights from tiny_model_dir's (seed 0)."""
    from elmo.bench.random_model import write_random_model

    directory = tmp_path_factory.mktemp("tiny_model_seed1")
    return write_random_model(directory, "tiny", seed=1, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)


def open_runtime(directory: Path) -> Embedder:
    return Embedder(directory, intra_op_threads=1)


def repository_server(root: Path, poll: float = 0.0, http: bool = True, **options) -> ServerThread:
    max_memory = options.pop("max_memory", None)
    repository = RepositoryOptions(
        root,
        open_runtime,
        poll_interval_s=poll,
        max_memory=max_memory,
        release_timeout_s=10.0,
        keep_versions=options.pop("keep_versions", 1),
    )
    server = ServerThread({}, limits_with(drain_seconds=1.0), http=http, repository=repository, **options)
    server.warm_up()
    return server


def broken_copy(source: Path, target: Path) -> Path:
    """A version that counts as complete (its verification record passed, weights at the recorded size) but whose
    graphs are garbage: onnxruntime refuses them at load."""
    shutil.copytree(source, target)
    for graph in target.glob("*.onnx"):
        graph.write_bytes(b"not an onnx graph")
    return target


def embed(server: ServerThread, model: str = "", task: str = "", metadata=()) -> pb.EmbedResponse:
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        request = pb.EmbedRequest(inputs=[pb.Input(text=TEXT)], model=model, task=task)
        return stub.Embed(request, timeout=30, metadata=metadata)


def layers(response: pb.EmbedResponse) -> np.ndarray:
    tensor = response.embeddings[0].layers
    return np.frombuffer(tensor.data, dtype="<f4").reshape(tuple(tensor.shape))


def http(server: ServerThread, path: str, body=None, token: str | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.http_url + path, data=data, headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def wait_for(predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_poll_picks_up_a_new_version_and_releases_the_old(tiny_model_dir, second_model, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    server = repository_server(root, poll=0.1)
    try:
        first = embed(server)
        assert (first.model, first.model_version) == ("default", 1)
        np.testing.assert_allclose(layers(first), open_runtime(tiny_model_dir).embed_texts([TEXT])[0], atol=1e-6)
        old = weakref.ref(server.server.registry.models["default"])
        status, headers, answer = http(server, "/v1/embeddings", {"input": TEXT})
        assert status == 200 and headers["X-Elmo-Model"] == "default@1" and answer["model_version"] == 1
        publish_copy(second_model, root, "default")
        second = wait_for(lambda: (r := embed(server)).model_version == 2 and r)
        np.testing.assert_allclose(layers(second), open_runtime(second_model).embed_texts([TEXT])[0], atol=1e-6)
        server.call(server.server.repository.wait_released())
        gc.collect()
        assert old() is None  # the old version's objects are gone, not merely unlisted
        status, headers, answer = http(server, "/v1/embed", {"inputs": [TEXT]})
        assert headers["X-Elmo-Model"] == "default@2" and answer["model_version"] == 2 and not answer["task_stale"]
        assert server.metric("elmo_model_loads_total", model="default") == 2
        assert server.metric("elmo_model_unloads_total", model="default") == 1
        assert server.metric("elmo_model_serving_version", model="default") == 2
        with grpc.insecure_channel(server.target) as channel:
            listed = pb_grpc.EmbedderStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        assert list(listed.models) == ["default"]
        assert [(v.version, v.state, v.serving) for v in listed.statuses[0].versions] == [(2, pb.VERSION_READY, True)]
        status, _, models = http(server, "/v1/models")
        assert [v["version"] for v in models["data"][0]["versions"]] == [2] and models["data"][0]["model_version"] == 2
    finally:
        server.stop()


def test_queued_requests_finish_on_the_version_they_started_on(tiny_model_dir, second_model, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    server = repository_server(root, http=False)
    want = {v: open_runtime(d).embed_texts([TEXT])[0] for v, d in ((1, tiny_model_dir), (2, second_model))}
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            request = pb.EmbedRequest(inputs=[pb.Input(text=TEXT)])
            with server.hold_worker("default"):  # version 1's threads are busy: these wait in its queue
                queued = [stub.Embed.future(request, timeout=60) for _ in range(4)]
                wait_for(lambda: server.server.registry.models["default"].in_flight == 4)
                publish_copy(second_model, root, "default")
                server.call(server.server.repository.reconcile())  # v2 loads, takes new requests; v1 still has 4
                assert server.server.registry.models["default"].number == 2
                fresh = stub.Embed(request, timeout=30)
                record = server.server.repository.records[("default", 1)]
                assert record.state == pb.VERSION_UNLOADING and record.model.in_flight == 4
            answers = [future.result() for future in queued]
        assert [a.model_version for a in answers] == [1, 1, 1, 1] and fresh.model_version == 2
        for answer in [*answers, fresh]:
            np.testing.assert_allclose(layers(answer), want[answer.model_version], atol=1e-6)
        server.call(server.server.repository.wait_released())
        assert server.server.repository.records[("default", 1)].state == pb.VERSION_UNLOADED
    finally:
        server.stop()


def test_a_broken_version_is_refused_and_the_old_one_keeps_serving(tiny_model_dir, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    server = repository_server(root, http=False)
    try:
        broken_copy(tiny_model_dir, root / "default" / "2")
        server.call(server.server.repository.reconcile())
        server.call(server.server.repository.reconcile())  # not tried again: the folder did not change
        record = server.server.repository.records[("default", 2)]
        assert record.state == pb.VERSION_FAILED and ".onnx" in record.reason
        assert server.metric("elmo_model_load_failures_total", model="default") == 1
        assert embed(server).model_version == 1
    finally:
        server.stop()


def test_admin_api_needs_its_token_and_loads_unloads_lists(tiny_model_dir, second_model, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    publish_copy(second_model, root, "default")
    truncated = shutil.copytree(tiny_model_dir, root / "default" / "3")
    data = truncated / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    server = repository_server(root, auth_token=CLIENT, admin_token=ADMIN)
    client = [("authorization", f"Bearer {CLIENT}")]
    admin = [("authorization", f"Bearer {ADMIN}")]
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.ModelAdminStub(channel)
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED), (client, grpc.StatusCode.PERMISSION_DENIED)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=metadata, timeout=10)
                assert refused.value.code() == code
            (index,) = stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=admin, timeout=10).models
            states = {v.version: (v.state, v.serving) for v in index.versions}
            assert states[1][0] == pb.VERSION_UNLOADED and states[2] == (pb.VERSION_READY, True)
            assert states[3][0] == pb.VERSION_UNLOADED and "model.onnx.data" in index.versions[2].reason
            # pin the older version: both stay loaded, new requests still go to the latest
            status = stub.LoadModel(pb.LoadModelRequest(name="default", version=1), metadata=admin, timeout=60)
            assert {v.version: v.state for v in status.versions if v.state == pb.VERSION_READY} == {
                1: pb.VERSION_READY,
                2: pb.VERSION_READY,
            }
            assert embed(server, "default@1", metadata=client).model_version == 1
            assert embed(server, metadata=client).model_version == 2
            with pytest.raises(grpc.RpcError) as refused:
                stub.LoadModel(pb.LoadModelRequest(name="default", version=3), metadata=admin, timeout=60)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model.onnx.data" in refused.value.details()
            stub.UnloadModel(pb.UnloadModelRequest(name="default", version=1), metadata=admin, timeout=30)
            with pytest.raises(grpc.RpcError) as missing:
                embed(server, "default@1", metadata=client)
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "default@2" in missing.value.details()
        # the same over HTTP
        assert http(server, "/admin/models")[0] == 401
        assert http(server, "/admin/models", token=CLIENT)[0] == 403
        status, _, index = http(server, "/admin/models", token=ADMIN)
        assert status == 200 and index["models"][0]["name"] == "default"
        status, _, unloaded = http(server, "/admin/models/default/unload", {}, token=ADMIN)
        assert status == 200 and all(v["state"] != "ready" for v in unloaded["versions"])
        assert http(server, "/v1/embed", {"inputs": [TEXT]}, token=CLIENT)[0] == 404
        status, _, loaded = http(server, "/admin/models/default/load", {"version": 2}, token=ADMIN)
        assert status == 200 and [v["version"] for v in loaded["versions"] if v["serving"]] == [2]
        assert http(server, "/admin/models/default/load", {"version": 3}, token=ADMIN)[0] == 409
        assert http(server, "/admin/models/nothing/load", {}, token=ADMIN)[0] == 404
        status, headers, _ = http(server, "/v1/embed", {"inputs": [TEXT], "model": "default"}, token=CLIENT)
        assert status == 200 and headers["X-Elmo-Model"] == "default@2"
    finally:
        server.stop()


def test_an_answer_that_applied_a_stale_mix_says_so(tiny_model_dir, tmp_path):
    from elmo.runtime.tasks import Task, mark_tasks_stale, save_task

    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    save_task(source, Task("old_mix", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8))
    save_task(source, Task("new_mix", "tagging", 3, 16, [0.0, 0.0, 0.0], 1.0))
    mark_tasks_stale(source, "trained on earlier weights")
    save_task(source, Task("new_mix", "tagging", 3, 16, [0.1, 0.0, 0.0], 1.0))  # retrained: current again
    root = tmp_path / "models"
    publish_copy(source, root, "default")
    server = repository_server(root)
    try:
        assert embed(server, task="old_mix").task_stale and not embed(server, task="new_mix").task_stale
        with EmbedderClient(server.target) as client:  # the Python client hands the same on
            stale, fresh = (client.embed([TEXT], task=name)[0] for name in ("old_mix", "new_mix"))
        assert stale.task_stale and not fresh.task_stale
        assert (stale.model, stale.model_version) == ("default", 1)
        assert not embed(server).task_stale
        status, headers, answer = http(server, "/v1/embeddings", {"input": TEXT, "model": "default:old_mix"})
        assert status == 200 and answer["task_stale"] and headers["X-Elmo-Task-Stale"] == "old_mix"
        status, headers, answer = http(server, "/v1/embed", {"inputs": [TEXT], "task": "new_mix"})
        assert not answer["task_stale"] and "X-Elmo-Task-Stale" not in headers
    finally:
        server.stop()


def test_memory_guard_refuses_a_load_over_the_limit(tiny_model_dir, second_model, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    limit = int(estimate_memory(root / "default" / "1") * 1.5)  # one version fits, two (a swap) do not
    server = repository_server(root, http=False, max_memory=limit)
    try:
        publish_copy(second_model, root, "default")
        server.call(server.server.repository.reconcile())
        record = server.server.repository.records[("default", 2)]
        assert record.state == pb.VERSION_FAILED and "--max-model-memory-bytes" in record.reason
        assert "default@1" in record.reason  # names what is loaded, and its size
        assert embed(server).model_version == 1
    finally:
        server.stop()


def test_flags():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes("512") == 512
    with pytest.raises(ConfigError):
        parse_bytes("two gigs")
    with pytest.raises(ConfigError, match="keep at least 1"):
        ModelManager(Path("."), None, None, None, open_runtime, keep_versions=0)  # type: ignore[arg-type]


def test_serve_flags_take_one_source_of_models(tmp_path):
    import argparse

    from elmo.service.common.limits import limits_from_args
    from elmo.service.server import _repository_from_args, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def repository(*argv: str):
        args = parser.parse_args(list(argv))
        return _repository_from_args(args, limits_from_args(args))

    with pytest.raises(ConfigError, match="either --model DIR"):
        repository("--model", "a", "--model-root", str(tmp_path))
    with pytest.raises(ConfigError, match="either --model DIR"):
        repository()
    with pytest.raises(ConfigError, match="--admin-token goes with --model-root"):
        repository("--model", "a", "--admin-token", "x")
    with pytest.raises(ConfigError, match="--poll-interval-s goes with --model-root"):
        repository("--model", "a", "--poll-interval-s", "5")
    assert repository("--model", "a") is None
    options = repository("--model-root", str(tmp_path), "--max-model-memory-bytes", "2GiB", "--poll-interval-s", "5")
    assert options.max_memory == 2 << 30 and options.poll_interval_s == 5 and options.keep_versions == 1


def test_keep_versions_keeps_older_ones_pinnable(tiny_model_dir, second_model, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    publish_copy(second_model, root, "default")
    server = repository_server(root, keep_versions=2)
    try:
        assert embed(server).model_version == 2 and embed(server, "default@1").model_version == 1
        assert http(server, "/v1/models/default@1")[2]["model_version"] == 1
        status, headers, _ = http(server, "/v1/embeddings", {"input": TEXT, "model": "default@1"})
        assert status == 200 and headers["X-Elmo-Model"] == "default@1"
        with pytest.raises(grpc.RpcError) as missing:
            embed(server, "default@7")
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "default@1, default@2" in missing.value.details()
        for number in ("²", "٣", "1²", "01", "-1", " 1"):  # str.isdigit() is True for the first two: a 500 once
            status, _, body = http(server, "/v1/embeddings", {"input": TEXT, "model": f"default@{number}"})
            assert status == 404 and "is not loaded" in body["error"]["message"], (number, status, body)
            with pytest.raises(grpc.RpcError) as odd:
                embed(server, f"default@{number}")
            assert odd.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop()


def test_a_version_that_fails_its_load_time_check_is_not_swapped_in(tiny_model_dir, tmp_path):
    """A version complete on disk whose graph was edited after export: the probe refuses it before the swap."""
    from tests.runtime.test_probe import edit_a_graph_after_export

    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    server = repository_server(root, http=False)
    try:
        staged = Path(shutil.copytree(tiny_model_dir, tmp_path / "edited"))
        edit_a_graph_after_export(staged)
        shutil.copytree(staged, root / "default" / "2")
        server.call(server.server.repository.reconcile())
        record = server.server.repository.records[("default", 2)]
        assert record.state == pb.VERSION_FAILED and "load-time check" in record.reason and "FAILED" in record.reason
        assert embed(server).model_version == 1
    finally:
        server.stop()


def test_health_says_not_serving_while_no_model_is_loaded(tiny_model_dir, tmp_path):
    """A repository with nothing loadable: the server is up (admin API, polling) but not healthy, on both doors; a
    version that loads makes it SERVING, unloading the last one NOT_SERVING again."""
    root = tmp_path / "models"
    broken_copy(tiny_model_dir, root / "default" / "1")
    server = repository_server(root, admin_token=ADMIN)
    try:
        with EmbedderClient(server.target) as client:
            assert client.health() == "NOT_SERVING" and client.health("elmo.v1.Embedder") == "NOT_SERVING"
            assert http_status(server, "/health") == 503
            publish_copy(tiny_model_dir, root, "default")  # version 2
            server.call(server.server.repository.reconcile())
            wait_for(lambda: client.health() == "SERVING")
            assert http_status(server, "/health") == 200 and embed(server).model_version == 2
            status, _, _ = http(server, "/admin/models/default/unload", {}, token=ADMIN)
            assert status == 200
            wait_for(lambda: client.health() == "NOT_SERVING")
            assert http_status(server, "/health") == 503
    finally:
        server.stop()


def http_status(server: ServerThread, path: str) -> int:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_at_start_a_broken_latest_version_falls_back_to_the_one_before(tiny_model_dir, tmp_path):
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "default")
    broken_copy(tiny_model_dir, root / "default" / "2")
    server = repository_server(root, http=False)
    try:
        assert embed(server).model_version == 1
        assert server.server.repository.records[("default", 2)].state == pb.VERSION_FAILED
        assert server.metric("elmo_model_load_failures_total", model="default") == 1
    finally:
        server.stop()
