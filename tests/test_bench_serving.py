"""Smoke tests of the served benches (bench.service: noisy, latency, memory, loadgen): each runs end to end
against a real `elmo serve` subprocess of the tiny model, for a second or so, and writes its JSON. Small limits keep
the abusers' requests small. Nothing here asserts a time: the benches measure, the tests only check that they run
and report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.kit.revision import REPO, revision_tree, tree_env
from bench.kit.texts import sentences
from bench.service import latency, loadgen, memory, noisy

SMALL_LIMITS = [
    "--serve-arg=--max-message-bytes=60000",
    "--serve-arg=--max-request-tokens=600",
    "--serve-arg=--max-sentence-tokens=100",
    "--serve-arg=--max-response-bytes=2000000",
    "--serve-arg=--max-pooled-inputs=16",
    "--serve-arg=--max-pooled-tokens=1200",
]


def test_noisy_measures_both_phases_and_the_abusers(tiny_model_dir, tmp_path):
    out = tmp_path / "noisy.json"
    argv = ["--model", str(tiny_model_dir), "--duration", "1.5", "--warmup", "0.3", "--threads", "1"]
    argv += ["--grpc-clients", "1", "--http-clients", "1", "--texts", "20", "--out", str(out), *SMALL_LIMITS]
    assert noisy.main(argv) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["server_exit_code"] == 0 and run["limits"]["max_message_bytes"] == 60000
    for phase in ("alone", "abused"):
        report = run["phases"][phase]
        assert report["well_behaved"]["grpc"]["n"] > 0 and report["well_behaved"]["http"]["n"] > 0
        assert report["health"]["http"]["n"] > 0 and report["health"]["grpc"]["n"] > 0
    abusers = run["phases"]["abused"]["abusers"]
    assert abusers and set(abusers) <= set(noisy.ABUSE_KINDS)
    # every abuser's request is one the server accepts: the largest of its kind (bench.service.noisy_load's fit)
    assert all(status == "200" for row in abusers.values() for status in row["statuses"]), abusers
    assert set(run["abuse_requests"]) == set(noisy.ABUSE_KINDS)
    assert {"p99_all", "health", "ok"} <= set(run["verdict"]) and "after" in result["summary"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_abusers_requests_stay_within_the_limits():
    limits = {"max_inputs": 8, "max_tokens_per_sentence": 100, "max_tokens_per_request": 600}
    limits |= {"max_message_bytes": 60000, "max_response_bytes": 2_000_000, "n_layers": 3, "dim": 16, "tasks": ["t"]}
    limits |= {"max_pooled_inputs": 16, "max_pooled_tokens": 1200}
    for item in noisy.abuse_requests(limits) + noisy.single_requests(limits):
        assert 0 < len(item["body"]) <= limits["max_message_bytes"], item["kind"]
        body = json.loads(item["body"])
        token_lists = body.get("inputs", [])
        if token_lists and isinstance(token_lists[0], list):
            assert len(token_lists) <= limits["max_inputs"]
            assert sum(map(len, token_lists)) <= limits["max_tokens_per_request"]


def test_noisy_single_requests(tiny_model_dir, tmp_path):
    out = tmp_path / "single.json"
    argv = ["--model", str(tiny_model_dir), "--single", "--idle", "0.2", "--pause", "0", "--threads", "1"]
    argv += ["--out", str(out), "--no-plot", *SMALL_LIMITS]
    assert noisy.main(argv) == 0
    (run,) = json.loads(out.read_text())["runs"]
    kinds = [row["kind"] for row in run["requests"]]
    assert kinds == ["embeddings-5.4MB", "tokenize-7MB", "window-8000", "embeddings-1MB"]
    assert all(row["status"][0] in "24" for row in run["requests"]) and run["idle_health"]["n"] > 0


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


def test_memory_windows(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.json"
    argv = ["--model", str(tiny_model_dir), "--window", "1", "--windows", "2", "--warmup", "0", "--concurrency", "2"]
    assert memory.main([*argv, "--threads", "1", "--out", str(out), "--no-plot"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert [w["window"] for w in run["windows"]] == [1, 2]
    assert all(w["requests"] > 0 and w["rss_end_mib"] > 0 for w in run["windows"])
    assert run["verdict"]["rss_end_mib"]["change_percent"] is not None and run["rss_series"]


def test_loadgen_over_http(tiny_model_dir, tmp_path):
    out = tmp_path / "loadgen.json"
    argv = ["--model", str(tiny_model_dir), "--protocol", "http", "--duration", "0.5", "--warmup", "0.2"]
    argv += ["--concurrency", "2", "--texts", "32", "--threads", "1", "--baseline", "--baseline-duration", "0.3"]
    assert loadgen.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (one,) = result["rounds"]
    assert one["served"]["protocol"] == "http" and one["served"]["requests"] > 0 and one["served"]["tokens"] > 0
    assert result["answer_check"]["after"]["http"]["ok"] and result["server_exit_code"] == 0
    assert result["summary"]["errors"] == 0 and result["summary"]["served_over_in_process"] > 0


def test_loadgen_before_and_after_over_both_protocols(tiny_model_dir, tmp_path):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "loadgen.json"
    argv = ["--model", str(tiny_model_dir), "--protocol", "both", "--before", "HEAD", "--duration", "0.4"]
    argv += ["--warmup", "0.1", "--concurrency", "2", "--texts", "32", "--threads", "1", "--baseline"]
    assert loadgen.main([*argv, "--baseline-duration", "0.2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (one,) = result["rounds"]
    for tree in ("before", "after"):
        assert result["server_exit_code"][tree] == 0
        for protocol in ("grpc", "http"):
            assert one["phases"][tree][protocol]["requests"] > 0 and result["answer_check"][tree][protocol]["ok"]
            assert result["summary"][tree][protocol]["served_over_in_process_min"] > 0
    assert set(result["summary"]["after_over_before"]) == {"grpc", "http"}
    assert result["summary"]["after_over_before"]["http"]["tokens_per_s"] > 0
    assert "after_served_over_in_process_at_least_0.9_every_round" in result["summary"]["issue_check"]["grpc"]


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


def test_door_cost_reads_thread_cpu_and_fits_per_request_and_per_token_cost():
    """bench.service.door_cost's two pieces of arithmetic: /proc CPU time (bench.kit.sample, of the process and of one
    thread) grows by the work done, and the least-squares line gives back the cost it was built from."""
    import os
    import time

    from bench.kit.sample import cpu_seconds
    from bench.service import door_cost

    pid = os.getpid()
    process, thread = cpu_seconds(pid), cpu_seconds(pid, pid)
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert cpu_seconds(pid) - process >= 0.2
    assert cpu_seconds(pid, pid) - thread >= 0.2  # the spinning ran on this (the main) thread
    line = door_cost.fit([(18, 500 + 4 * 18), (144, 500 + 4 * 144), (640, 500 + 4 * 640)])
    assert line["us_per_request"] == pytest.approx(500) and line["us_per_token"] == pytest.approx(4)


def test_door_cost_at_one_request_size_reports_the_whole_cost_and_no_slope():
    """``--sizes 8``: no line through one point (numpy warned of a poorly conditioned fit and gave a slope that
    meant nothing); the request's whole cost at that size, the mean of its runs, and no per-token figure."""
    import warnings

    from bench.service import door_cost

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        line = door_cost.fit([(144, 800.0), (144, 720.0)])
    assert line == {"us_per_request": pytest.approx(760.0), "us_per_token": None}
    assert door_cost.cost_line(line) == "760 us per request (one size)"


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


def test_door_cost_reads_the_runtime_calls_a_server_counted(tiny_model_dir):
    """A server started by the benches with ``--metrics-port 0``: its histogram of sentences per runtime call is read
    from its own /metrics (bench.kit.serve), and door_cost turns the counts around a run into calls a request and
    sentences a call."""
    from bench.kit.serve import start_server
    from bench.service import door_cost
    from elmo.client import EmbedderClient

    texts, _ = sentences(6, min_words=4, max_words=12)
    server = start_server(tiny_model_dir, threads=1, http=False, serve_args=["--metrics-port", "0"])
    try:
        _, batches_at_start = server.histogram(door_cost.BATCH_SENTENCES)  # the warm-up's call
        with EmbedderClient(server.grpc_target) as client:

            def four_requests() -> dict:
                for _ in range(4):
                    client.embed_texts(texts[:3])
                return {"requests": 4, "seconds": 1.0}

            run = door_cost.measured(server, four_requests)
    finally:
        server.stop()
    assert batches_at_start >= 1
    assert run["batched_sentences"] == 12  # one request at a time: each is one call of its 3 sentences
    assert run["batches"] == 4
    assert door_cost.batch_shape(run) == {"batches_per_request": 1.0, "sentences_per_batch": 3.0}
    assert run["process_cpu_s"] >= run["event_loop_cpu_s"] >= 0


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
        args = SimpleNamespace(duration=0.2, batch=8, protocols=["grpc", "http"])

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
