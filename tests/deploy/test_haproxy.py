"""deploy/haproxy.cfg as shipped, run by Debian's haproxy in front of three real `elmo serve` replicas on loopback:
gRPC (HTTP/2) and HTTP/JSON are balanced over all three, and a replica killed with SIGKILL leaves the rotation while
requests keep succeeding (the balancer's retries, elmo.client's retry policy, urllib3's Retry as docs/how-to/replicas.md
sets it). `make test` installs haproxy when it is missing (`make haproxy`); without it the test skips on a
developer's machine and fails in CI."""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter

import numpy as np
import pytest

from bench.service import replicas
from bench.service.replicas import HAPROXY_CFG, HTTP_RETRY, Balancer, parse_log, start_replicas
from elmo.client import EmbedderClient

pytestmark = pytest.mark.slow  # three replicas and a balancer: ~15 s on 2 busy cores

TEXTS = ["The apple fell .", "我买了一台苹果电脑。", "Shares rose today ."]


@pytest.fixture(scope="module")
def fleet(haproxy, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fleet")
    replicas = start_replicas(tiny_model_dir, workdir)
    balancer = Balancer(replicas, workdir)
    try:
        balancer.wait_states({r.name: "UP" for r in replicas})
        yield replicas, balancer
    finally:
        balancer.stop()
        for replica in replicas:
            replica.stop()


def post(pool, balancer: Balancer, texts: list[str]) -> list[list[float]]:
    reply = pool.request("POST", f"{balancer.http_url}/v1/embeddings", json={"model": "", "input": texts})
    assert reply.status == 200, reply.data[:300]
    return [item["embedding"] for item in json.loads(reply.data)["data"]]


def test_the_shipped_config_is_valid(haproxy):
    done = subprocess.run(
        [haproxy, "-c", "-f", str(HAPROXY_CFG)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"ELMO1_HOST": "127.0.0.1", "ELMO2_HOST": "127.0.0.1", "ELMO3_HOST": "127.0.0.1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_grpc_and_http_are_balanced_and_a_killed_replica_leaves_the_rotation(fleet):
    import urllib3

    replicas, balancer = fleet
    pool = urllib3.PoolManager(retries=urllib3.Retry(**HTTP_RETRY, raise_on_status=False), timeout=30)
    with EmbedderClient(f"127.0.0.1:{replicas[0].grpc_port}") as direct:
        expected = direct.embed_texts(TEXTS)
    with EmbedderClient(balancer.grpc_target, timeout=30) as client:
        for _ in range(6):  # the same vectors from every replica
            assert [a.tobytes() for a in client.embed_texts(TEXTS)] == [a.tobytes() for a in expected]
            vectors = post(pool, balancer, TEXTS)
            assert np.allclose(vectors[0], expected[0].mean(axis=(0, 1)), atol=1e-5)
        served = Counter((e["backend"], e["server"]) for e in parse_log(balancer.log_lines()))
        for backend in ("elmo_grpc", "elmo_http"):
            assert {s for b, s in served if b == backend} == {"elmo1", "elmo2", "elmo3"}, served

        replicas[0].signal(signal.SIGKILL)  # no drain: the connection is refused or reset from now on
        replicas[0].proc.wait(10)
        for _ in range(10):  # before and while the health check notices: every request still answered
            assert len(client.embed_texts(TEXTS)) == 3
            assert len(post(pool, balancer, TEXTS)) == 3
        balancer.wait_states({"elmo1": "DOWN", "elmo2": "UP", "elmo3": "UP"}, timeout=20)
        before = len(balancer.log_lines())
        for _ in range(6):
            assert len(client.embed_texts(TEXTS)) == 3
            assert len(post(pool, balancer, TEXTS)) == 3
    after = parse_log(balancer.log_lines()[before:])
    assert after and all(e["server"] in ("elmo2", "elmo3") and e["status"] == "200" for e in after), after


def test_the_replicas_bench_runs_and_reports_every_window(haproxy, tiny_model_dir, tmp_path):
    """bench/service/replicas.py end to end for a few seconds (one mode, 2 + 2 clients): it measures, times nothing."""
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dir), "--seconds", "4.5", "--window", "1", "--grpc-clients", "2"]
    argv += ["--http-clients", "2", "--mode", "no-balancer-retries", "--shutdown-delay-s", "0.5", "--out", str(out)]
    assert replicas.main(argv) == 0
    result = json.loads((out / "replicas-no-balancer-retries.json").read_text())
    assert list(result["windows"])[:3] == ["before", "sigterm elmo2", "sigkill elmo3"]
    assert result["total"]["requests"] > 0 and result["total"]["balancer_retries"] == 0  # ELMO_LB_RETRIES=0
    assert result["exit_codes"]["elmo2"] == 0 and result["exit_codes"]["elmo3"] == -signal.SIGKILL
    assert "| sigkill elmo3 |" in (out / "replicas-no-balancer-retries.md").read_text()
