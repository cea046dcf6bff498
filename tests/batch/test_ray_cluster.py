"""`elmo embed-file --engine ray` on a real multi-node Ray cluster, under faults (docs/how-to/batch.md).

A head and two worker nodes, each `ray start` in its own process group (its own raylet), all on 127.0.0.1, token
authentication on (tests/batch/ray_cluster.py). The job's driver is SIGKILLed mid-job, the same command resumes, and
a worker node hosting an actor is lost: Ray restarts the lost actor on another node
(elmo.batch.ray_engine.restart_policy), the job finishes, its output equals the local engine's bit for bit, every
shard is committed once and the resumed shards are not written again. Where the node was caught while its actor was
inside a shard's task (seen inside a method, frozen, seen there still, then the node's raylet and workers
SIGKILLed), Ray must also have retried that shard; an actor idle at that moment held no task, and there is nothing
to retry. This is the CI-sized form; scripts/ray-cluster-check.sh runs the same scenario on a bigger input and
prints its figures.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.batch.ray_cluster import LoopbackCluster, fault_scenario
from tests.batch.test_job import corpus, write_lines
from tests.conftest import REPO

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    with LoopbackCluster(workers=2, cpus=1) as started:
        yield started


def test_job_survives_a_lost_node_and_a_killed_driver(cluster, tmp_path, tiny_model_dir):
    report, log = fault_scenario(cluster, tmp_path, tiny_model_dir, corpus(120), shard_lines=3)
    assert report.nodes_logged.startswith("3 nodes: max_restarts=3, max_task_retries=-1"), log[-3000:]
    assert report.equal and report.duplicate_commits == 0
    restarted = [line for line in report.actor_failures if "need_reschedule = 1" in line]
    assert restarted, (report.actor_failures, log[-3000:])  # Ray's own restart, not a job-level rerun
    if report.killed_mid_task:  # the lost actor was inside a shard's task: Ray's own retry of that shard
        assert report.tasks_resubmitted >= 1, report
    assert "a Ray actor died" not in log


def test_a_driver_without_the_clusters_token_is_refused_in_one_line(cluster, tmp_path, tiny_model_dir):
    """Token auth is on: a driver whose environment lacks RAY_AUTH_MODE=token and the token is refused by the
    cluster, and says so in one line with the way out (not Ray's two chained tracebacks); no shard is written."""
    source = write_lines(tmp_path / "in.txt", corpus(6))
    env = {k: v for k, v in cluster.driver_env().items() if k not in cluster.auth_env()}
    env["RAY_gcs_server_port_wait_time_s"] = "2"  # Ray retries the refused connection for 20 s by default
    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "embed-file",
        str(source),
        str(tmp_path / "out.parquet"),
        "--model",
        str(tiny_model_dir),
        "--engine",
        "ray",
        "--ray-address",
        cluster.address,
        "--no-progress",
    ]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("elmo embed-file: error: ")]
    assert len(errors) == 1 and "RAY_AUTH_MODE=token" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out.parquet").exists()
    assert not list((tmp_path / "out.parquet.partial").glob("part-*"))
