"""A served task: ``Embed`` with ``task=NAME`` on a real gRPC server (127.0.0.1) returns the mix that the library
computes offline from the same model directory; the feature API gives the same numbers locally and remotely."""

from __future__ import annotations

import shutil

import grpc
import numpy as np
import pytest

from elmo.client import EmbedderClient, RemoteError
from elmo.features import Features
from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, TaskStore, apply_task, save_task
from tests.service_helpers import ServerThread, limits_with

TEXTS = ["The cat sat on the mat.", "我买了一台苹果电脑。", "苹果很甜", "a"]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """(server, model dir): a copy of the tiny model with two tasks, served on a free loopback port."""
    directory = tmp_path_factory.mktemp("server_tasks") / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, Task("pos_demo", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8, layer_norm=True))
    save_task(directory, Task("plain", "tagging", 3, 16, [0.0, 0.0, 0.0], 1.0))
    server = ServerThread({"": Embedder(directory, intra_op_threads=1)})
    server.warm_up()
    yield server, directory
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    server, _ = served
    with EmbedderClient(server.target) as c:
        yield c


def test_model_info_lists_the_tasks(client):
    assert list(client.model_info().tasks) == ["plain", "pos_demo"]


@pytest.mark.parametrize("task_name", ["pos_demo", "plain"])
def test_served_mix_equals_the_offline_library(client, served, task_name):
    _, directory = served
    task = TaskStore(directory).get(task_name)
    offline_runtime = Embedder(directory, intra_op_threads=1)
    served_embeddings = client.embed(TEXTS, task=task_name)
    for text, embedding in zip(TEXTS, served_embeddings):
        (offline_result,) = offline_runtime.embed([text])
        assert embedding.tokens == offline_result.tokens
        offline = apply_task(offline_result.layers, task)
        assert embedding.mix.shape == offline.shape
        assert float(np.abs(embedding.mix - offline).max()) <= 1e-5


def test_omit_layers_returns_only_the_mix(client):
    (embedding,) = client.embed([["pre", "tokenized", "input"]], task="pos_demo", omit_layers=True)
    assert embedding.layers is None and embedding.mix.shape == (3, 16)


def test_unknown_task_is_a_clear_error(client):
    with pytest.raises(RemoteError, match="unknown task 'nope'.*pos_demo") as caught:
        client.embed(TEXTS, task="nope")
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_feature_api_is_the_same_locally_and_remotely(served):
    server, directory = served
    sentences = TEXTS * 3  # more inputs than the test server accepts per request: the backend chunks them
    local = Features(model=directory, intra_op_threads=1)
    remote = Features(server=server.target)
    assert (remote.n_layers, remote.dim) == (local.n_layers, local.dim)
    for a, b in zip(local.layers(sentences), remote.layers(sentences)):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5
    for a, b in zip(local.mix(sentences, task="pos_demo"), remote.mix(sentences, task="pos_demo")):
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= 1e-5
    np.testing.assert_allclose(
        local.sentence_vectors(sentences, task="pos_demo", pooling="mean+max"),
        remote.sentence_vectors(sentences, task="pos_demo", pooling="mean+max"),
        atol=1e-5,
    )


def test_shipped_tasks_are_served_exactly():
    """models/default as shipped: every stored task, served by name, equals the offline mix of the same model."""
    from pathlib import Path

    model_dir = Path(__file__).resolve().parents[2] / "models" / "default"
    if not (model_dir / "onnx.json").is_file() or not TaskStore(model_dir).names():
        pytest.skip("models/default (with tasks) is not in this checkout")
    runtime = Embedder(model_dir, intra_op_threads=1)
    server = ServerThread({"": runtime}, limits=limits_with(max_response_bytes=1 << 20, max_message_bytes=1 << 20))
    try:
        server.warm_up()
        with EmbedderClient(server.target) as client:
            names = list(client.model_info().tasks)
            assert names == TaskStore(model_dir).names()
            for name in names:
                task = TaskStore(model_dir).get(name)
                for text, embedding in zip(TEXTS, client.embed(TEXTS[:3], task=name, omit_layers=True)):
                    offline = apply_task(runtime.embed_texts([text])[0], task)
                    assert float(np.abs(embedding.mix - offline).max()) <= 1e-5
    finally:
        server.stop()


def test_model_info_names_the_stale_tasks(tiny_model_dir, tmp_path):
    """Tasks carried over by `elmo adapt` (mark_tasks_stale) still answer, and GetModelInfo says they are stale."""
    from elmo.runtime.tasks import mark_tasks_stale

    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, Task("old_mix", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8))
    save_task(directory, Task("new_mix", "tagging", 3, 16, [0.0, 0.0, 0.0], 1.0))
    assert mark_tasks_stale(directory, "trained on earlier weights") == ["new_mix", "old_mix"]
    save_task(directory, Task("new_mix", "tagging", 3, 16, [0.1, 0.0, 0.0], 1.0))  # retrained: current again
    server = ServerThread({"": Embedder(directory, intra_op_threads=1)})
    server.warm_up()
    try:
        with EmbedderClient(server.target) as c:
            info = c.model_info()
            assert list(info.tasks) == ["new_mix", "old_mix"] and list(info.stale_tasks) == ["old_mix"]
            (embedding,) = c.embed(["a stale mix still answers"], task="old_mix")
            assert embedding.mix.shape == (5, 16)
    finally:
        server.stop()


def test_task_lookups_read_the_disk_only_on_refresh(tiny_model_dir, tmp_path):
    """A request's task lookup uses what was loaded; the folder is looked at again only once per refresh interval."""
    from elmo.service.models.tasks import ModelTasks

    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, Task("first", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8))
    cached = ModelTasks(directory, n_layers=3, dim=16, refresh_s=3600.0)
    fresh = ModelTasks(directory, n_layers=3, dim=16, refresh_s=0.0)
    assert cached.names() == fresh.names() == ["first"]
    loaded = cached.get("first")
    save_task(directory, Task("second", "tagging", 3, 16, [0.0, 0.0, 0.0], 1.0))
    save_task(directory, Task("first", "tagging", 3, 16, [1.0, 0.0, 0.0], 2.0))  # retrained in place
    assert cached.names() == ["first"] and cached.get("first") is loaded  # within the interval: no disk read
    assert fresh.names() == ["first", "second"] and fresh.get("first").gamma == 2.0  # refreshed: both changes seen
