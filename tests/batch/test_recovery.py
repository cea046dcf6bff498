"""The batch job riding out a server's refusals, and resuming in remote and Ray modes (docs/how-to/batch.md).

Every server is the real one (service.server.ElmoServer on 127.0.0.1, tests/service_helpers.py) and every refusal
is its own: UNAVAILABLE 'server is shutting down' from a real drain (kept open, when a test needs it, by another
client's EmbedStream, which a drain waits for), then a closed port, then a new server on the same port;
RESOURCE_EXHAUSTED 'overloaded' from the real batcher queue, filled to ``--max-queue-tokens`` by a second client
while the model's worker is held. Outputs are compared array for array with a clean run. Waits poll on observable
state (the commit log, the batcher, the server's metrics); no assertion is about time.

The retry budget (10 attempts, 0.1 s doubling to 10 s: about 33 s per request) is checked with the ``time`` of
RemoteBackend's module swapped for one whose ``sleep`` records each delay and returns at once, so that exhausting
it takes a second. The overload test that must be survived uses the real back-off; the restart test parks the
job's RPC threads in that ``sleep`` while the server restarts, then lets them sleep the real delay.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from elmo.backends import IN_FLIGHT as REMOTE_IN_FLIGHT
from elmo.backends import RemoteBackend
from elmo.client import EmbedderClient
from elmo.runtime import CPU, Embedder
from tests.batch.test_job import assert_same_output, corpus, embed_file, error_lines, write_lines
from tests.conftest import REPO
from tests.service_helpers import ServerThread, limits_with, metric_value, scrape

# EDGE_LIMITS (8 sentences, 20 tokens per sentence, 60 per request) with room for 4 full requests in the queue:
# the job (4 requests in flight) never overloads the server by itself, so every RESOURCE_EXHAUSTED it meets comes
# from the queue that a test fills on purpose. 64 KiB responses: a filler request of 60 tokens fits.
LIMITS = limits_with(max_queue_tokens=240, max_response_bytes=64 * 1024)
FILLER = [["w"] * 20] * 3  # one full request: 60 tokens
FILLERS = 1 + LIMITS.max_queue_tokens // 60  # one at the held worker, the rest fill the queue
SHARD_LINES = 10
N_LINES = 400  # 40 shards
DOCS = REPO / "docs" / "how-to" / "batch.md"
EMBED_REFUSED = {"method": "Embed", "code": "RESOURCE_EXHAUSTED"}


def documented_backoff() -> list[float]:
    """The delays between the attempts of one request, as docs/how-to/batch.md states them."""
    text = " ".join(DOCS.read_text(encoding="utf-8").split())
    match = re.search(
        r"retries UNAVAILABLE / RESOURCE_EXHAUSTED with backoff "
        r"\(([\d.]+) s doubling to ([\d.]+) s, (\d+) attempts[^)]*\)",
        text,
    )
    assert match, "docs/how-to/batch.md no longer states the remote retry schedule"
    first, cap, attempts = float(match[1]), float(match[2]), int(match[3])
    return [min(first * 2**i, cap) for i in range(attempts - 1)]


# -- servers -------------------------------------------------------------------------------------------------------
class PortServer(ServerThread):
    """ServerThread on a chosen port: a restart comes back where the job's channel points."""

    def __init__(self, runtimes: dict, limits=LIMITS, port: int = 0, metrics_port: int | None = None) -> None:
        self._fixed_port = port
        super().__init__(runtimes, limits, metrics_port=metrics_port)

    async def _create(self, runtimes, limits, tls, auth_token, http_port, options):
        server = await super()._create(runtimes, limits, tls, auth_token, http_port, options)
        server.port = self._fixed_port
        return server

    @property
    def batcher(self):
        return self.model().batcher

    def begin_drain(self) -> Future:
        """Start a real drain (health NOT_SERVING, new RPCs UNAVAILABLE, then stop); returns when it has begun."""
        drained = asyncio.run_coroutine_threadsafe(self.server.drain(grace=30.0), self.loop)
        wait_until(lambda: self.server.state.draining, "the server to start draining")
        return drained

    def close(self) -> None:
        if self.server.state.draining:  # drained by the test: only the loop is left
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        else:
            self.stop()


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Poll an observable condition; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def hold_worker(server: PortServer) -> threading.Event:
    """Occupy the model's runtime thread until the returned event is set (batches wait behind it)."""
    release, started = threading.Event(), threading.Event()

    def occupy() -> None:
        started.set()
        release.wait(60)

    server.batcher.executor.submit(occupy)
    assert started.wait(10)
    return release


class Overload:
    """Concurrent load from a second client: the worker held, the queue filled to exactly --max-queue-tokens, so
    that the server answers every further Embed with RESOURCE_EXHAUSTED 'overloaded' until :meth:`end`."""

    def __init__(self, server: PortServer) -> None:
        self.server = server
        self.release = hold_worker(server)
        self.client = EmbedderClient(server.target)
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="filler")
        before = server.batcher.batches_started
        self.fillers = [self.pool.submit(self.client.embed_tokens, FILLER)]
        wait_until(lambda: server.batcher.batches_started > before, "the first filler to reach the held worker")
        self.fillers += [self.pool.submit(self.client.embed_tokens, FILLER) for _ in range(FILLERS - 1)]
        wait_until(lambda: server.queued_tokens() == LIMITS.max_queue_tokens, "the queue to fill up")

    def end(self) -> None:
        """Release the worker; the fillers complete (each one must succeed)."""
        self.release.set()
        try:
            for filler in self.fillers:
                assert len(filler.result(60)) == len(FILLER)
        finally:
            self.pool.shutdown()
            self.client.close()


class OpenStream:
    """Another client's EmbedStream, open and idle: an RPC in flight. A drain waits for it (up to its grace), so the
    server keeps its port open and refuses every new RPC with UNAVAILABLE until :meth:`end`."""

    def __init__(self, server: PortServer) -> None:
        self.client = EmbedderClient(server.target)
        self.finish = threading.Event()
        self.results: list[list] = []

        def requests():
            self.finish.wait(120)
            yield from ()

        def run() -> None:
            self.results.append(list(self.client.embed_stream(requests(), timeout=180)))

        self.thread = threading.Thread(target=run, name="open-stream", daemon=True)
        self.thread.start()
        wait_until(lambda: server.server.state.active == 1, "the stream to be admitted")

    def end(self) -> None:
        self.finish.set()
        self.thread.join(60)
        self.client.close()
        assert self.results == [[]], "the stream must end cleanly"


REAL_SLEEP = time.sleep


class BackoffRecorder:
    """Stands in for the ``time`` module of elmo.batch's RemoteBackend (everything else is the real ``time``):
    ``sleep`` records each back-off delay per thread, then returns at once; or, given ``hold``, waits until the test
    sets it and then sleeps the real delay (the job's RPC threads parked while the test restarts the server)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: threading.Event | None = None) -> None:
        self.lock = threading.Lock()
        self.delays: dict[int, list[float]] = defaultdict(list)
        self.hold = hold
        self.asleep = 0
        fake = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
        fake.sleep = self.sleep
        monkeypatch.setattr(sys.modules[RemoteBackend.__module__], "time", fake)

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.delays[threading.get_ident()].append(seconds)
            self.asleep += 1
        try:
            if self.hold is not None:
                assert self.hold.wait(120), "the test never ended the outage"
                REAL_SLEEP(seconds)
        finally:
            with self.lock:
                self.asleep -= 1

    def requests(self, schedule: list[float]) -> list[list[float]]:
        """Per request that was refused, the delays it slept: each must be the start of the documented schedule
        (a thread's requests follow each other; each request's delays start again at the first one)."""
        runs = []
        for delays in self.delays.values():
            for delay in delays:
                if delay == pytest.approx(schedule[0]) or not runs:
                    runs.append([])
                runs[-1].append(delay)
        for run in runs:
            assert run == pytest.approx(schedule[: len(run)]), run
        return runs


# -- fixtures ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runtimes(tiny_model_dir) -> dict:
    return {"tiny": Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, runtimes) -> tuple[Path, Path]:
    """(input, output of an uninterrupted remote run): what every recovered run must equal."""
    directory = tmp_path_factory.mktemp("clean")
    source = write_lines(directory / "in.txt", corpus(N_LINES), final_newline=True)
    output = directory / "clean.parquet"
    server = PortServer(runtimes)
    try:
        server.warm_up()
        assert embed_file(source, output, "--server", server.target, "--shard-lines", SHARD_LINES) == 0
    finally:
        server.close()
    return source, output


@pytest.fixture
def server(runtimes):
    server = PortServer(runtimes)
    server.warm_up()
    yield server
    server.close()


def job_args(server: ServerThread, shard_lines: int = SHARD_LINES) -> list:
    return ["--server", server.target, "--shard-lines", shard_lines]


def committed(output: Path) -> list[dict]:
    log = output.with_name(output.name + ".partial") / "_manifest.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def file_identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


def run_beside(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    """Run the test's side of a scenario in a thread while the job runs in this one; errors are kept."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test after the job
            errors.append(exc)

    thread = threading.Thread(target=body, name="scenario", daemon=True)
    thread.start()
    return thread, errors


def embedded_tokens(server: PortServer) -> float:
    """The server's own count of tokens it embedded, read from its /metrics endpoint."""
    return metric_value(scrape(server.metrics_port), "elmo_embedded_tokens_total", model="tiny") or 0.0


# -- 1. transient refusals: the job rides them out --------------------------------------------------------------------
def test_job_rides_out_a_drain_and_a_restart_on_the_same_port(tmp_path, runtimes, clean_run, capsys, monkeypatch):
    """Mid-job the server drains (UNAVAILABLE 'server is shutting down'), stops, and a new server comes up on the
    same port: the job carries on and writes what a clean run writes.

    To keep the restart deterministic, the job's RPC threads are parked in their back-off sleep while the server
    stops and restarts (the drain is held open by another client's stream until all of them are refused), and then
    sleep their real delay; so no request of the job lands in the instant the port closes (a request that does gets
    CANCELLED, which the job retries as an outage)."""
    source, reference = clean_run
    first = PortServer(runtimes)
    first.warm_up()
    stream = OpenStream(first)
    restarted: list[PortServer] = []
    outage_over = threading.Event()
    release = hold_worker(first)  # the job's first requests wait here: the drain surely starts mid-job
    before = first.batcher.batches_started
    output = tmp_path / "out.parquet"
    job_done = threading.Event()
    with monkeypatch.context() as patch:
        recorder = BackoffRecorder(patch, hold=outage_over)

        def outage() -> None:
            try:
                wait_until(lambda: first.batcher.batches_started > before, "the job's first batch at the held worker")
                drained = first.begin_drain()  # from here on, every new Embed is refused
            finally:
                release.set()  # the requests already admitted complete; the next ones are refused
            # 200-line shards: the first window holds more than 2 * REMOTE_IN_FLIGHT requests, so every RPC thread
            # ends up refused and asleep, and nothing of the job is in flight
            wait_until(lambda: recorder.asleep == REMOTE_IN_FLIGHT or job_done.is_set(), "every RPC thread refused")
            if job_done.is_set():
                return  # the job did not wait for the server: the test fails on its exit code
            stream.end()
            drained.result(60)  # stopped: the port is closed
            second = PortServer(runtimes, port=first.port)
            restarted.append(second)
            second.warm_up()
            outage_over.set()

        scenario, errors = run_beside(outage)
        try:
            capsys.readouterr()
            try:
                code = embed_file(source, output, *job_args(first, shard_lines=200))
            finally:
                job_done.set()
            captured = capsys.readouterr()
            scenario.join(60)
        finally:
            release.set()
            outage_over.set()
            scenario.join(60)
            stream.finish.set()
            first.close()
            for second in restarted:
                second.close()
    assert not errors, errors
    assert code == 0, captured.err[-3000:]
    refused = first.metric("elmo_requests_total", method="Embed", code="UNAVAILABLE")
    assert refused == REMOTE_IN_FLIGHT  # one refusal per parked thread; their retries reached the new server
    assert len(recorder.requests(documented_backoff())) == REMOTE_IN_FLIGHT
    retries = [line for line in captured.err.splitlines() if "retrying in" in line]
    assert len(retries) == REMOTE_IN_FLIGHT and all("UNAVAILABLE: server is shutting down" in r for r in retries)
    assert restarted[0].metric("elmo_requests_total", method="Embed", code="OK") > 0  # finished on the new one
    assert_same_output(output, reference, "parquet")


def test_job_rides_out_an_overloaded_queue(tmp_path, server, clean_run, capsys):
    """Another client fills the queue (--max-queue-tokens): the job's requests get RESOURCE_EXHAUSTED until the
    queue drains, retry on the real back-off and the output equals a clean run."""
    source, reference = clean_run
    overload = Overload(server)
    refusals = 3
    job_done = threading.Event()

    def relieve() -> None:
        try:
            wait_until(
                lambda: server.metric("elmo_requests_total", **EMBED_REFUSED) >= refusals or job_done.is_set(),
                "refusals",
            )
        finally:
            overload.end()

    scenario, errors = run_beside(relieve)
    output = tmp_path / "out.parquet"
    try:
        capsys.readouterr()
        try:
            code = embed_file(source, output, *job_args(server))
        finally:
            job_done.set()
        captured = capsys.readouterr()
    finally:
        overload.release.set()
        scenario.join(60)
    assert not errors, errors
    assert code == 0, captured.err[-3000:]
    assert server.metric("elmo_requests_total", **EMBED_REFUSED) >= refusals
    retries = [line for line in captured.err.splitlines() if "retrying in" in line]
    assert len(retries) >= refusals and all("RESOURCE_EXHAUSTED" in line and "overloaded" in line for line in retries)
    assert_same_output(output, reference, "parquet")


# -- 2. refusals beyond the budget: one line, nothing claimed complete ---------------------------------------------
def test_overload_beyond_the_retry_budget_stops_the_job(tmp_path, server, clean_run, capsys, monkeypatch):
    """A queue that stays full: each request is tried exactly as often as documented, with the documented delays,
    then the job stops with one error line and no output; once the load is gone the same command completes."""
    source, reference = clean_run
    schedule = documented_backoff()
    output = tmp_path / "out.parquet"
    overload = Overload(server)
    try:
        with monkeypatch.context() as patch:
            recorder = BackoffRecorder(patch)
            capsys.readouterr()
            code = embed_file(source, output, *job_args(server))
    finally:
        overload.end()
    (line,) = error_lines(capsys.readouterr().err)
    assert code == 2
    assert line.startswith("elmo embed-file: error: RESOURCE_EXHAUSTED: overloaded")
    requests = recorder.requests(schedule)
    assert requests and all(len(delays) == len(schedule) for delays in requests)  # every one gave up
    attempts = len(requests) * (len(schedule) + 1)  # documented: 10 attempts per request
    wait_until(lambda: server.metric("elmo_requests_total", **EMBED_REFUSED) >= attempts, "the server's count")
    assert server.metric("elmo_requests_total", **EMBED_REFUSED) == attempts
    served = {"method": "Embed", "code": "OK"}
    wait_until(lambda: server.metric("elmo_requests_total", **served) >= FILLERS, "the fillers' count")
    assert server.metric("elmo_requests_total", **served) == FILLERS  # none of the job's requests got through
    assert not output.exists()
    # a job that failed before committing anything leaves nothing behind: no OUTPUT.partial either
    assert not output.with_name(output.name + ".partial").exists()

    assert embed_file(source, output, *job_args(server)) == 0
    assert_same_output(output, reference, "parquet")


# -- 3. resume: remote ---------------------------------------------------------------------------------------------
def test_remote_job_stopped_mid_way_resumes_without_recomputing(tmp_path, runtimes, clean_run, capsys, monkeypatch):
    """After some shards were committed the server starts draining and never serves again (another client's
    stream keeps the drain open): each request is refused its 10 attempts, and the job stops with one line and no
    OUTPUT. A server comes back on the same port; the same command finishes the job, that server embeds exactly
    the tokens of the shards not committed (its /metrics), the committed shard files are kept as they were, and
    the output equals a clean run's."""
    source, reference = clean_run
    schedule = documented_backoff()
    output = tmp_path / "out.parquet"
    first = PortServer(runtimes)
    first.warm_up()
    stream = OpenStream(first)
    second = None
    drains: list[Future] = []
    job_done = threading.Event()

    def outage() -> None:
        wait_until(lambda: len(committed(output)) >= 2 or job_done.is_set(), "two committed shards")
        if not job_done.is_set():
            drains.append(first.begin_drain())

    try:
        with monkeypatch.context() as patch:
            recorder = BackoffRecorder(patch)
            scenario, errors = run_beside(outage)
            capsys.readouterr()
            try:
                code = embed_file(source, output, *job_args(first))
            finally:
                job_done.set()
            scenario.join(60)
        assert not errors, errors
        (line,) = error_lines(capsys.readouterr().err)
        assert code == 2 and line.startswith("elmo embed-file: error: UNAVAILABLE: server is shutting down")
        requests = recorder.requests(schedule)
        assert requests and all(len(delays) == len(schedule) for delays in requests)
        attempts = len(requests) * (len(schedule) + 1)
        refused = {"method": "Embed", "code": "UNAVAILABLE"}
        wait_until(lambda: first.metric("elmo_requests_total", **refused) >= attempts, "the server's count")
        assert first.metric("elmo_requests_total", **refused) == attempts
        assert not output.exists()
        entries = committed(output)
        assert 2 <= len(entries) < N_LINES // SHARD_LINES
        partial = output.with_name(output.name + ".partial")
        kept = {entry["file"]: file_identity(partial / entry["file"]) for entry in entries}
        stream.end()
        drains[0].result(60)

        second = PortServer(runtimes, port=first.port, metrics_port=0)
        second.warm_up()
        tokens_before = embedded_tokens(second)
        capsys.readouterr()
        assert embed_file(source, output, *job_args(first)) == 0  # the same command
        summary = capsys.readouterr().out
        tokens_after = embedded_tokens(second)
    finally:
        stream.finish.set()
        first.close()
        if second is not None:
            second.close()
    manifest = json.loads((output / "_manifest.json").read_text())
    resumed_lines = sum(entry["n_lines"] for entry in entries)
    assert tokens_after - tokens_before == manifest["tokens"] - sum(entry["tokens"] for entry in entries)
    assert f"this run embedded {N_LINES - resumed_lines} sentences" in summary
    assert f"{resumed_lines} resumed from an earlier run" in summary
    assert {name: file_identity(output / name) for name in kept} == kept  # the same files, never rewritten
    assert_same_output(output, reference, "parquet")


# -- 3. resume: Ray ------------------------------------------------------------------------------------------------
def test_ray_job_killed_mid_way_resumes_without_recomputing(tmp_path, tiny_model_dir):
    """A Ray driver (a real `elmo embed-file --engine ray` process on this test's Ray instance) is SIGKILLed once
    shards are committed; the same command again, on Ray, keeps the committed shard files as they were, embeds
    only the rest and gives the local engine's output."""
    ray = pytest.importorskip("ray")
    source = write_lines(tmp_path / "in.txt", corpus(120), final_newline=True)
    args = ["--model", tiny_model_dir, "--shard-lines", "4", "--engine", "ray"]
    reference = tmp_path / "local.parquet"
    assert embed_file(source, reference, *args[:4]) == 0
    output = tmp_path / "ray.parquet"

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        address = ray.get_runtime_context().gcs_address
        command = [sys.executable, "-m", "elmo.cli", "embed-file", str(source), str(output), *map(str, args)]
        command += ["--ray-address", address, "--no-progress", "--threads", "1"]
        log = tmp_path / "killed.log"  # a file, not a pipe: a full pipe would stall the driver
        with open(log, "wb") as sink:
            process = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
            try:
                wait_until(lambda: len(committed(output)) >= 2 or process.poll() is not None, "two commits", 180)
            finally:
                if process.poll() is None:
                    os.kill(process.pid, signal.SIGKILL)
                process.wait(60)
        assert process.returncode == -signal.SIGKILL, log.read_text(errors="replace")[-3000:]
        assert not output.exists(), "killed mid-run: the output must not exist yet"
        entries = committed(output)
        assert 2 <= len(entries) < 30
        partial = output.with_name(output.name + ".partial")
        kept = {entry["file"]: file_identity(partial / entry["file"]) for entry in entries}

        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)  # the same command
    finally:
        ray.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "core_worker.cc" not in result.stderr, result.stderr[-3000:]  # Ray's E line came on every job
    assert f"ray: connecting to {address} ..." in result.stderr  # said before the seconds ray.init takes
    resumed_lines = sum(entry["n_lines"] for entry in entries)
    assert f"this run embedded {120 - resumed_lines} sentences" in result.stdout
    assert f"{resumed_lines} resumed from an earlier run" in result.stdout
    assert {name: file_identity(output / name) for name in kept} == kept
    assert_same_output(output, reference, "parquet")


# -- requests within the server's message limit ------------------------------------------------------------------------
def test_requests_are_cut_to_the_servers_message_limit(tmp_path, runtimes, tiny_model_dir, monkeypatch):
    """Long tokens (URLs, base64 in a web corpus): each sentence fits the server's 16 KiB request limit, eight of
    them do not. The server advertises the limit in GetModelInfo; the job must cut its requests to it (as it does
    for sentences, tokens and response bytes, whose limit here is large, as the defaults' 64 MiB is against 8 MiB)."""
    lines = [f"{chr(97 + i) * 3000} {chr(98 + i) * 3000}" for i in range(8)]  # ~6 KB a line
    source = write_lines(tmp_path / "in.txt", lines)
    assert embed_file(source, tmp_path / "local.parquet", "--model", tiny_model_dir) == 0
    server = PortServer(runtimes, limits_with(max_queue_tokens=240, max_response_bytes=1 << 20))
    try:
        server.warm_up()
        with monkeypatch.context() as patch:
            BackoffRecorder(patch)  # today's failure takes seconds, not the real 33 s of back-off
            code = embed_file(source, tmp_path / "remote.parquet", "--server", server.target)
    finally:
        server.close()
    assert code == 0
    # the server runs the separate context graph, the local job the in_step one: the same sums in another order
    assert_same_output(tmp_path / "remote.parquet", tmp_path / "local.parquet", "parquet", atol=1e-6)
