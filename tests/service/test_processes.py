"""`elmo serve --processes N` on real processes: N servers share the gRPC and HTTP ports (the kernel spreads the
connections, so both answer) and one /metrics counts them all; a SIGTERM drains them all and the group exits 0; a
server process killed under load is started again while the other keeps serving, no call failing; a killed
supervisor leaves no server behind; what N processes cannot do is refused with one line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
from elmo.service.processes import process_command
from elmo.service.server import add_arguments

from elmo.client import EmbedderClient, RemoteError
from tests.conftest import REPO
from tests.serve_process import ServeProcess, serve_until_exit, wait_until
from tests.service_helpers import calling, metric_value, scrape

CALLS = 24  # per protocol, each on a connection of its own: all on one process has odds of 2 ** -23
DEFAULT_MODEL = REPO / "models" / "default"  # its warm-up takes seconds: long enough for a cold process to be seen
POLLS = 500


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ports(server: ServeProcess) -> tuple[int, int, list[int]]:
    """(gRPC port, HTTP port, every process's own metrics port) from the supervisor's port file."""
    grpc_port, _, http_port, metrics = server.port_file.read_text().split("\n")[:4]
    return int(grpc_port), int(http_port), [int(port) for port in metrics.split()]


def group_metrics_port(server: ServeProcess) -> int:
    """The group's one /metrics (the port file's second line)."""
    return int(server.port_file.read_text().split("\n")[1])


def answered(metrics_port: int) -> tuple[float, float]:
    """(gRPC Embed calls, HTTP /v1/embed requests) one process answered, from its own /metrics."""
    text = scrape(metrics_port)
    grpc_calls = metric_value(text, "elmo_requests_total", method="Embed", code="OK") or 0.0
    http_calls = metric_value(text, "elmo_requests_total", method="POST /v1/embed", code="200") or 0.0
    return grpc_calls, http_calls


def embed_over_http(port: int, text: str) -> list:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/embed",
        data=json.dumps({"inputs": [text]}).encode(),
        headers={"content-type": "application/json", "connection": "close"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["embeddings"]


@pytest.fixture
def two_processes(tiny_model_dir: Path, tmp_path: Path):
    args = ["--model", str(tiny_model_dir), "--processes", "2", "--http-port", "0", "--metrics-port", "0"]
    with ServeProcess(args, tmp_path / "serve") as server:
        server.wait_serving()
        grpc_port, http_port, metrics_ports = ports(server)
        for port in metrics_ports:  # both warmed up, not only the one the health check reached
            wait_until(lambda p=port: metric_value(scrape(p), "elmo_model_ready") == 1.0, 60, "both processes ready")
        yield server, grpc_port, http_port, metrics_ports


def test_both_processes_answer_on_the_shared_ports_and_stop_together(two_processes) -> None:
    server, grpc_port, http_port, metrics_ports = two_processes
    assert len(set(metrics_ports)) == 2
    processes = children(server.proc.pid)
    assert len(processes) == 2
    reference = None
    for i in range(CALLS):
        with EmbedderClient(f"127.0.0.1:{grpc_port}") as client:  # a new connection each time
            layers = client.embed_texts(["the same sentence"])[0]
        reference = layers if reference is None else reference
        assert layers.shape == reference.shape and (layers == reference).all()  # same model, same answer
        assert embed_over_http(http_port, f"sentence number {i}")[0]["tokens"] == ["sentence", "number", str(i)]
    counts = [answered(port) for port in metrics_ports]
    for protocol, per_process in zip(("gRPC", "HTTP"), zip(*counts)):
        assert sum(per_process) == CALLS, (protocol, counts)
        assert all(per_process), f"one process answered every {protocol} call: {counts}"
    # one scrape of the documented port counts every call of every process, and says which process is ready
    group = scrape(group_metrics_port(server))
    assert answered(group_metrics_port(server)) == (CALLS, CALLS), group
    assert metric_value(group, "elmo_group_processes") == 2.0
    assert metric_value(group, "elmo_model_ready", process="0") == metric_value(group, "elmo_model_ready", process="1")
    assert metric_value(group, "elmo_model_ready", process="1") == 1.0
    buckets = metric_value(group, "elmo_request_latency_seconds_count", method="Embed")
    assert buckets == CALLS  # histograms merged: every process's observations
    server.sigterm()
    assert server.wait() == 0
    assert not any(alive(pid) for pid in processes)
    assert "2 server processes listening" in server.stderr()


def _embed_once(client: EmbedderClient) -> str:
    client.embed_texts(["a call while a process is killed"])
    return "OK"


@pytest.mark.slow  # ~15 s on 2 cores: a process killed under load, started again and warmed up
def test_a_killed_process_is_started_again_while_the_other_keeps_serving(two_processes) -> None:
    server, grpc_port, _, _ = two_processes
    first, second = children(server.proc.pid)
    # through the documented client retry policy: a call in flight on the killed process's connection fails
    # UNAVAILABLE and is sent again
    with calling(f"127.0.0.1:{grpc_port}", _embed_once, threads=4) as outcomes:
        wait_until(lambda: len(outcomes) >= 20, 60, "calls answered before the kill")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: "is warm: it takes connections now" in server.stderr(), 120, "a process warm in its place")
        after_restart = len(outcomes)
        wait_until(lambda: len(outcomes) >= after_restart + 20, 60, "calls answered after the restart")
    failed = [outcome for outcome in outcomes if outcome != "OK"]
    assert not failed, f"{len(failed)} of {len(outcomes)} calls failed: {failed[:3]}"
    now = children(server.proc.pid)
    assert len(now) == 2 and second in now and first not in now  # the survivor kept serving, one took the place
    assert f"server process {first} ended with exit code -9: the other 1 keep serving" in server.stderr()
    group = scrape(group_metrics_port(server))
    assert metric_value(group, "elmo_group_processes") == 2.0
    assert metric_value(group, "elmo_group_process_restarts_total") == 1.0
    server.sigterm()
    assert server.wait() == 0


def test_with_no_restarts_a_process_that_dies_stops_the_group(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--process-restarts 0: the first process that ends takes the group down with its code, for a supervisor
    above to restart it whole."""
    args = ["--model", str(tiny_model_dir), "--processes", "2", "--process-restarts", "0"]
    with ServeProcess(args, tmp_path) as server:
        server.wait_serving()
        first, second = children(server.proc.pid)
        os.kill(first, signal.SIGKILL)
        assert server.wait() == 128 + signal.SIGKILL
    assert not alive(second)
    assert f"server process {first} ended with exit code -9, after 0 restarts within 600 s" in server.stderr()
    with pytest.raises(RemoteError, match="UNAVAILABLE"), EmbedderClient(server.target, timeout=5) as client:
        client.embed_texts(["nobody listens"])


def test_a_killed_supervisor_leaves_no_server_behind(two_processes) -> None:
    server, grpc_port, _, _ = two_processes
    processes = children(server.proc.pid)
    server.proc.kill()
    server.proc.wait(10)
    wait_until(lambda: not any(alive(pid) for pid in processes), 60, "the server processes gone")
    probe = socket.socket()
    probe.bind(("127.0.0.1", grpc_port))  # nothing holds the port any more
    probe.close()


def test_a_sigterm_while_the_group_starts_stops_it_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM once the first process is warm, while the second is still starting (before it could take a signal)
    or warming up: every process ends, none listened, and the group exits 0, as a drain does."""
    with ServeProcess(["--model", str(tiny_model_dir), "--processes", "2"], tmp_path) as server:
        wait_until(lambda: "warmed up" in server.stderr() or server.exited(), 60, "the first process warm")
        wait_until(lambda: len(children(server.proc.pid)) == 2 or server.exited(), 60, "the second one started")
        processes = children(server.proc.pid)
        server.sigterm()
        assert server.wait() == 0, server.stderr()
    assert not any(alive(pid) for pid in processes)
    assert not server.port_file.exists() or not server.port_file.read_text()  # the group never said it listened
    assert "listening on" not in server.stderr()


@pytest.mark.parametrize(
    "extra, env, error",
    [
        (["--processes", "0"], {}, "elmo serve: error: --processes 0: give 1 or more"),
        (["--processes", "2", "--process-restarts", "-1"], {}, "elmo serve: error: --process-restarts -1: 0 (stop"),
        (["--processes", "2", "--admin-token", "s3cret"], {}, "elmo serve: error: --admin-token goes with --model-"),
    ],
)
def test_what_processes_cannot_do_is_refused(tiny_model_dir: Path, tmp_path: Path, extra, env, error) -> None:
    finished = serve_until_exit(["--model", str(tiny_model_dir), *extra], tmp_path, env)
    assert finished.returncode == 2
    assert len(finished.error_lines()) == 1 and finished.error_lines()[0].startswith(error), finished.stderr
    assert "Traceback" not in finished.stderr


def test_a_port_taken_without_sharing_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        finished = serve_until_exit(["--model", str(tiny_model_dir), "--processes", "2", "--port", str(port)], tmp_path)
    assert finished.returncode == 2
    assert finished.error_lines() == [
        f"elmo serve: error: cannot listen on 127.0.0.1:{port}: the port is in use (stop what listens there or pick "
        "another port)"
    ]
    assert "onnxruntime provider" not in finished.stderr  # refused before any model loads, not after


CORES_EACH = max(1, len(os.sched_getaffinity(0)) // 2)


@pytest.mark.parametrize("threads, expected", [([], CORES_EACH), (["--threads", "3"], 3)])
def test_each_process_runs_the_command_as_given_with_its_ports_and_share_of_the_cores(threads, expected) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = ["--model", "m", "--processes", "2", "--port", "0", "--http-port", "0", "--port-file", "f", *threads]
    args = parser.parse_args(given)
    args.command_line = ["serve", *given]
    command = process_command(args, 50123, 8123, Path("process-1.port"))
    assert command[3] == "serve"
    one = parser.parse_args(command[4:])  # what the process parses: the last value of a flag wins
    assert (one.processes, one.reuse_port, one.port, one.http_port, one.metrics_port) == (1, True, 50123, 8123, None)
    assert (one.port_file, one.threads, one.model) == (Path("process-1.port"), expected, ["m"])


def test_each_process_serves_its_metrics_to_the_supervisor_and_leaves_the_repository_to_it() -> None:
    """With --metrics-port, a process's own /metrics is on a free port of 127.0.0.1 (the supervisor serves the
    group's on the given one); under --model-root it does not poll (the supervisor watches for the group)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    given = [
        "--model-root",
        "r",
        "--processes",
        "2",
        "--metrics-port",
        "9090",
        "--metrics-host",
        "0.0.0.0",
        "--poll-interval-s",
        "5",
    ]
    args = parser.parse_args(given)
    args.command_line = ["serve", *given]
    one = parser.parse_args(process_command(args, 50123, None, Path("process-0.port"))[4:])
    assert (one.metrics_port, one.metrics_host, one.poll_interval_s, one.model_root) == (0, "127.0.0.1", 0.0, Path("r"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def poll(target: str) -> tuple[str, str | None]:
    """On a connection of its own, no retries: (health, then Embed's code when SERVING, else None). A refused
    connection is health UNAVAILABLE, as a probe sees it."""
    with EmbedderClient(target, timeout=30, retry_policy=None) as client:
        try:
            health = client.health()
        except RemoteError as error:
            return error.code.name, None
        if health != "SERVING":
            return health, None
        try:
            client.embed_texts(["is every process warm"])
        except RemoteError as error:
            return health, str(error)
        return health, "OK"


@pytest.mark.slow  # ~10 s on 2 cores: two warm-ups of models/default and 500 polls that embed
def test_every_process_is_warm_before_it_takes_a_connection(tmp_path: Path) -> None:
    """Polled from the start on fresh connections: once one answer says SERVING, every later health check says
    SERVING and every Embed is answered, while the other process starts and after the group's port file says all
    are ready. (When a process listened before its warm-up, the connections it took got NOT_SERVING, and Embed
    UNAVAILABLE "warming up", after another had said SERVING.)"""
    port = free_port()
    target = f"127.0.0.1:{port}"
    polls: list[tuple[str, str | None]] = []
    first_serving: int | None = None
    ready_at: int | None = None  # the poll at which the supervisor's port file appeared
    with ServeProcess(["--model", str(DEFAULT_MODEL), "--processes", "2", "--port", str(port)], tmp_path) as server:
        while first_serving is None or ready_at is None or len(polls) - first_serving < POLLS:
            assert not server.exited(), f"elmo serve exited with {server.proc.returncode}:\n{server.stderr()}"
            assert len(polls) < 50 * POLLS, f"the group not ready after {len(polls)} polls:\n{server.stderr()}"
            if ready_at is None and server.port_file.is_file() and server.port_file.read_text():
                ready_at = len(polls)
            polls.append(poll(target))
            if first_serving is None and polls[-1][0] == "SERVING":
                first_serving = len(polls) - 1
        server.sigterm()
        assert server.wait() == 0
    assert first_serving <= ready_at, "the group's port file came before any process said SERVING"
    after = polls[first_serving:]
    bad = [(first_serving + i, answer) for i, answer in enumerate(after) if answer != ("SERVING", "OK")]
    assert not bad, f"{len(bad)} of {len(after)} polls after the first SERVING were not answered: {bad[:5]}"
    # before it, nothing listened (a refused connection), rather than a cold process answering NOT_SERVING
    assert {health for health, _ in polls[:first_serving]} <= {"UNAVAILABLE"}, polls[:first_serving]
    # and the shared port opened only once both processes were warm (their log lines, in the order written)
    lines = server.stderr().splitlines()
    warmed = [i for i, line in enumerate(lines) if "model default warmed up" in line]
    listening = [i for i, line in enumerate(lines) if f"listening on 127.0.0.1:{port} (plaintext)" in line]
    assert len(warmed) == len(listening) == 2 and max(warmed) < min(listening), "\n".join(lines)
