"""One model version for `elmo serve --processes 3 --model-root DIR` (service.models.group), on real processes: a
version published while clients call is swapped in by every process; once the group says so, no call names the old
version; the admin API, which reaches one process, moves all three and answers once they have moved."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from elmo.service.models.group import ModelGroup, ProcessStatus, describe

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime.repository import publish_copy
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.serve_process import ServeProcess, wait_until
from tests.service_helpers import calling, metric_value, scrape

ADMIN = "admin-secret"
FRESH_CALLS = 30  # each on a connection of its own: one process missed by all has odds of (2/3) ** 30
PROCESSES = 3


@pytest.fixture(scope="module")
def second_model(tmp_path_factory) -> Path:
    """Another tiny model (seed 1) to publish as version 2."""
    from elmo.bench.random_model import write_random_model

    directory = tmp_path_factory.mktemp("tiny_model_seed1")
    return write_random_model(directory, "tiny", seed=1, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)


def test_the_policy_is_changed_under_one_lock_and_the_group_settles_once_every_process_followed(tmp_path) -> None:
    supervisor = ModelGroup(tmp_path, 2)
    first, second = ModelGroup(tmp_path, 2, index=0), ModelGroup(tmp_path, 2, index=1)
    assert supervisor.policy().round == 0 and supervisor.settled(0) is None  # nobody reported yet
    first.report(ProcessStatus(0, {"default": 1}))
    second.report(ProcessStatus(0, {"default": 1}))
    assert describe(supervisor.settled(0)) == ({"default": 1}, None)
    changed = first.change(lambda policy: policy.excluded.setdefault("default", set()).add(2))
    assert changed.round == 1 and second.policy().excluded == {"default": {2}}  # what the other process reads
    assert second.change(lambda policy: policy.unwanted.add("other")).round == 2  # on top of the first change
    assert supervisor.policy().excluded == {"default": {2}} and supervisor.policy().unwanted == {"other"}
    first.report(ProcessStatus(2, {"default": 1}))
    assert supervisor.settled(2) is None  # the second process has not followed yet
    second.report(ProcessStatus(2, {"default": 3}))
    agreed, differing = describe(supervisor.settled(2))
    assert agreed == {} and differing == "default: process 0 @1, process 1 @3"
    supervisor.forget(1)  # replaced: its successor reports afresh
    assert supervisor.settled(0) is None


def versions_named(grpc_port: int, calls: int = FRESH_CALLS) -> set[int]:
    """The versions that computed ``calls`` answers, each on a fresh connection (so the kernel picks the process)."""
    named = set()
    for _ in range(calls):
        with EmbedderClient(f"127.0.0.1:{grpc_port}", timeout=30) as client:
            named.add(client.embed(["which version computed this"])[0].model_version)
    return named


def version_or_error(done: threading.Event) -> Callable[[EmbedderClient], tuple[bool, object]]:
    """A call that says whether it was sent after the group said the swap was done, and its version or error."""

    def call(client: EmbedderClient) -> tuple[bool, object]:
        after = done.is_set()
        try:
            return after, client.embed(["a call during the swap"])[0].model_version
        except RemoteError as error:
            return after, str(error)

    return call


@pytest.mark.slow  # ~40 s on 2 cores: three processes, two swaps each and an admin call
def test_every_process_swaps_to_the_same_version(tiny_model_dir: Path, second_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "models"
    publish_copy(tiny_model_dir, root, "tiny")
    args = [
        "--model-root",
        str(root),
        "--processes",
        str(PROCESSES),
        "--poll-interval-s",
        "0.5",
        "--admin-token",
        ADMIN,
        "--metrics-port",
        "0",
    ]
    with ServeProcess(args, tmp_path / "serve") as server:
        server.wait_serving(120)
        grpc_port, metrics_port = (int(line) for line in server.port_file.read_text().split("\n")[:2])
        wait_until(lambda: "every server process serves tiny@1" in server.stderr(), 60, "the group on version 1")
        assert versions_named(grpc_port) == {1}

        done = threading.Event()
        with calling(f"127.0.0.1:{grpc_port}", version_or_error(done), threads=3) as seen:
            publish_copy(second_model, root, "tiny")
            wait_until(lambda: "every server process serves tiny@2" in server.stderr(), 120, "the group on version 2")
            done.set()
            reported = len(seen)
            wait_until(lambda: len(seen) >= reported + 30, 60, "calls after the swap")
        assert all(answer in (1, 2) for _, answer in seen), [a for _, a in seen if a not in (1, 2)][:3]
        assert {answer for after, answer in seen if after} == {2}  # no call sent after "done" met version 1
        assert versions_named(grpc_port) == {2}
        group = scrape(metrics_port)
        assert metric_value(group, "elmo_group_model_version", model="tiny") == 2.0
        for process in range(PROCESSES):
            assert metric_value(group, "elmo_model_serving_version", model="tiny", process=str(process)) == 2.0

        # the admin API on the shared port: one process takes the call, all three follow before it is answered
        admin = [("authorization", f"Bearer {ADMIN}")]
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ModelAdminStub(channel)
            status = stub.UnloadModel(pb.UnloadModelRequest(name="tiny", version=2), metadata=admin, timeout=120)
        assert [v.version for v in status.versions if v.serving] == [1]
        assert versions_named(grpc_port) == {1}
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = pb_grpc.ModelAdminStub(channel)
            stub.LoadModel(pb.LoadModelRequest(name="tiny", version=2), metadata=admin, timeout=120)
        assert versions_named(grpc_port) == {2}
        server.sigterm()
        assert server.wait() == 0
