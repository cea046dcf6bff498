"""Smoke tests of the served benches (bench.service: latency, compiled_load) and the kit under them: each runs end to
end against a real `elmo serve` subprocess of the tiny model, for a second or so, and writes its JSON. Nothing here
asserts a time: the benches measure, the tests only check that they run and report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.kit.revision import REPO, revision_tree, tree_env
from bench.kit.texts import sentences
from bench.service import latency


def test_latency_compares_served_and_in_process(tiny_model_dir, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["--model", str(tiny_model_dir), "--sentences", "6", "--block", "2", "--warmup", "1", "--threads", "1"]
    assert latency.main([*argv, "--out", str(out)]) == 0
    host = json.loads(out.read_text())["host"]  # the machine in every figure (elmo.runtime.host)
    assert host["cpu"] and "AVX-512 VNNI" in host["cpu_flags"] and host["cores"] >= 1
    (run,) = json.loads(out.read_text())["runs"]
    assert [run["latency_ms"][path]["n"] for path in latency.PATHS] == [6, 6, 6, 6]  # the floor's server answered
    for protocol in ("grpc", "http"):
        parts = run["breakdown_ms"][protocol]
        assert parts["batch wait (queue_ms)"]["median"] >= 0 and "transport" in " ".join(parts)
    over = run["p50_over_in_process_ms"]
    assert run["bar_ms"] == pytest.approx(over["floor"] + latency.BAR_OVER_FLOOR_MS, abs=1e-3)
    assert run["within_bar"] == {name: over[name] <= run["bar_ms"] for name in ("grpc", "http")}
    assert out.with_suffix(".png").stat().st_size > 0


def test_sentences_are_real_and_in_range():
    texts, source = sentences(50, seed=0)
    assert len(texts) == 50 and texts == sentences(50, seed=0)[0]
    assert all(15 <= len(t.split()) <= 25 for t in texts) and "distinct" in source


def test_a_revision_tree_serves_its_own_code():
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    with revision_tree("HEAD") as tree:
        code = "import service.server, elmo.client; print(service.server.__file__); print(elmo.client.__file__)"
        found = subprocess.run(
            [sys.executable, "-c", code], cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=True
        )
        assert all(line.startswith(str(tree)) for line in found.stdout.split())
    assert not tree.exists()


def test_cpu_seconds_reads_the_process_and_one_thread():
    """/proc CPU time (bench.kit.sample), of the process and of one thread, grows by the work done."""
    import os
    import time

    from bench.kit.sample import cpu_seconds

    pid = os.getpid()
    process, thread = cpu_seconds(pid), cpu_seconds(pid, pid)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert cpu_seconds(pid) - process >= 0.2
    assert cpu_seconds(pid, pid) - thread >= 0.2  # the spinning ran on this (the main) thread


def test_a_server_of_several_processes_is_ready_once_every_process_is_warm(tiny_model_dir, monkeypatch):
    """``elmo serve --processes 2``: the shared port's health is one process's, so the benches give each process its
    own /metrics (its port file's fourth line) and wait on every one before they load it (bench.kit.serve)."""
    from bench.kit import serve

    asked: list[int] = []
    real = serve.models_ready

    def recorded(port: int) -> bool:
        asked.append(port)
        return real(port)

    monkeypatch.setattr(serve, "models_ready", recorded)
    server = serve.start_server(tiny_model_dir, threads=2, http=False, serve_args=["--processes", "2"])
    try:
        ports = server.process_metrics_ports
        ready = [real(port) for port in ports]
    finally:
        server.stop()
    assert len(set(ports)) == 2 and set(asked) == set(ports)  # both processes asked, each on its own port
    assert ready == [True, True]


def test_compiled_load_rounds_take_the_servers_in_turn_both_ways(tiny_model_dir):
    """bench.service.compiled_load: every other round measures the servers in the opposite order (no tree is always
    first), each run's rate set against the in-process runs just before and after it. The generators are stood in
    for here (h2load and wrk are Debian packages the bench installs itself); the in-process runtime is the real one."""
    from types import SimpleNamespace

    from bench.kit.load import load_embedder
    from bench.service import compiled_load

    texts, _ = sentences(16, min_words=15, max_words=25)
    calls: list[tuple[str, str]] = []

    class Loads:
        args = SimpleNamespace(duration=0.2, batch=8, protocols=["grpc", "http"], one_sentence_s=0)

        def grpc(self, target):
            calls.append(("grpc", target))
            return {"requests": 10, "failed": 0, "seconds": 2.0}

        def http(self, address):
            calls.append(("http", address))
            return {"requests": 30, "failed": 0, "seconds": 2.0}

    servers = {
        label: SimpleNamespace(grpc_target=f"{label}:g", http_address=f"{label}:h") for label in ("before", "after")
    }
    embedder = load_embedder(tiny_model_dir, 1, texts, 8)
    try:
        rounds = [compiled_load.measure_round(Loads(), embedder, texts, 150, servers, i) for i in range(2)]
    finally:
        embedder.close()
    assert [r["order"] for r in rounds] == [["before", "after"], ["after", "before"]]
    assert calls == [
        ("grpc", "before:g"),
        ("http", "before:h"),
        ("grpc", "after:g"),
        ("http", "after:h"),
        ("grpc", "after:g"),
        ("http", "after:h"),
        ("grpc", "before:g"),
        ("http", "before:h"),
    ]
    for entry in rounds:
        assert entry["after_grpc"]["requests_per_s"] == 5.0 and entry["before_http"]["requests_per_s"] == 15.0
        rates = entry["in_process_runs_requests_per_s"]  # one before the first load run, one after each
        assert len(rates) == 5 and entry["in_process_requests_per_s"] == pytest.approx(sum(rates) / 5)
        for k, label in enumerate(f"{tree}_{protocol}" for tree in entry["order"] for protocol in ("grpc", "http")):
            bracket = (rates[k] + rates[k + 1]) / 2
            assert entry[label]["in_process_requests_per_s"] == pytest.approx(bracket)
            assert entry[label]["served_over_in_process"] == pytest.approx(entry[label]["requests_per_s"] / bracket)


def test_compiled_load_serves_each_tree_with_its_own_process_counts(monkeypatch):
    """``--processes`` for this checkout, ``--before-processes`` for REV: each server labelled by its count, the
    runtime threads split among its processes, ``--serve-args`` for this checkout's servers only."""
    from bench.service import compiled_load

    started = []

    def start_server(model, *, threads, tree, label, serve_args):
        started.append((label, tree, threads, serve_args))
        return label

    monkeypatch.setattr(compiled_load, "start_server", start_server)
    args = compiled_load.build_parser().parse_args(
        ["--before", "REV", "--processes", "1", "2", "--before-processes", "2", "--serve-args=--max-delay-ms 5"]
    )
    trees = [("after", None), ("before", "/worktree")]
    servers = compiled_load.start_servers(args, "model", trees)
    assert list(servers) == ["after", "after_2p", "before_2p"]
    assert started == [
        ("after", None, 2, ["--max-delay-ms", "5"]),
        ("after_2p", None, 1, ["--processes", "2", "--max-delay-ms", "5"]),
        ("before_2p", "/worktree", 1, ["--processes", "2"]),
    ]
    assert compiled_load.build_parser().parse_args([]).before_processes == [1]  # REV as one process unless asked
