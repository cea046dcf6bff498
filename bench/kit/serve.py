"""``elmo serve`` as a child process, for every bench that drives a real server: one (:func:`start_server`) or N
replicas (:func:`start_replicas`), of this checkout's code or of a git revision's (``tree``: bench.kit.revision), on
free loopback ports; wait until it is SERVING, stop it.

    server = start_server(Path("models/default"), threads=2)            # gRPC, metrics and HTTP on free ports
    server.grpc_target, server.http_url, server.pid                       # '127.0.0.1:PORT', 'http://127.0.0.1:PORT'
    server.stop()                                                         # SIGTERM, its exit code
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.kit.revision import tree_env

REQUEST_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(0.05)


@dataclass
class Server:
    """One running ``elmo serve`` child process; its ports come from its ``--port-file`` (gRPC, metrics, HTTP)."""

    label: str  # "after" (this checkout), "before" (a --before revision), "elmo1".. (a replica)
    proc: subprocess.Popen
    port_file: Path
    log_path: Path
    grpc_port: int = 0
    http_port: int | None = None
    metrics_port: int | None = None  # with ``--metrics-port`` among its flags
    process_metrics_ports: list[int] = field(default_factory=list)  # every process's, with ``--processes N``

    @property
    def name(self) -> str:
        return self.label

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def grpc_target(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_address(self) -> str | None:
        return None if self.http_port is None else f"{LOOPBACK}:{self.http_port}"

    @property
    def http_url(self) -> str | None:
        return None if self.http_port is None else f"http://{LOOPBACK}:{self.http_port}"

    @property
    def http_host_port(self) -> tuple[str, int]:
        assert self.http_port is not None, f"{self.label} serves no HTTP"
        return LOOPBACK, self.http_port

    def read_ports(self, http: bool = True) -> bool:
        """True once the port file holds the gRPC port (and the HTTP one when ``http``)."""
        lines = self.port_file.read_text().split("\n") if self.port_file.is_file() else []
        if not lines or not lines[0].strip() or (http and (len(lines) < 3 or not lines[2].strip())):
            return False
        self.grpc_port = int(lines[0])
        self.metrics_port = int(lines[1]) if len(lines) >= 2 and lines[1].strip() else None
        self.http_port = int(lines[2]) if len(lines) >= 3 and lines[2].strip() else None
        self.process_metrics_ports = [int(port) for port in lines[3].split()] if len(lines) >= 4 else []
        return True

    def wait_ready(self, http: bool = True, timeout: float = 120.0) -> Server:
        """Until the ports are written and gRPC health says SERVING; SystemExit (with the log's tail) if it dies."""
        deadline = time.monotonic() + timeout
        while not self.read_ports(http):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"{self.label}: server did not start; log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.1)
        wait_serving(self.grpc_target, max(1.0, deadline - time.monotonic()))
        # With --processes N the shared port's health is one process's: the others may still be warming up, and a
        # connection the kernel hands one of them is refused (503, UNAVAILABLE). Each process's own /metrics says.
        for port in self.process_metrics_ports:
            wait_until(
                lambda port=port: models_ready(port),
                max(1.0, deadline - time.monotonic()),
                f"{self.label}: the process of metrics port {port} warmed up",
            )
        return self

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self, cut_delay: bool = False) -> int:
        """SIGTERM and its exit code (killed after 60 s). ``cut_delay``: a second SIGTERM after 0.5 s, which cuts a
        ``--shutdown-delay-s`` short (nothing is sent to the server any more)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if cut_delay:
                try:
                    self.proc.wait(0.5)
                except subprocess.TimeoutExpired:
                    self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def serve_command(
    model: Path | None,
    port_file: Path,
    threads: int | None,
    serve_args: Sequence[str],
    http: bool,
    older: bool = False,
) -> list[str]:
    """``python -m elmo.cli serve`` on loopback port 0 (and, when not already given, ``--http-port 0`` when ``http``,
    else ``--http-port off``: HTTP is on by default, except in an ``older`` revision; ``--metrics-port 0`` with
    ``--processes``)."""
    command = [sys.executable, "-m", "elmo.cli", "serve"]
    if model is not None:
        command += ["--model", str(Path(model).resolve())]
    command += ["--host", LOOPBACK, "--port", "0", "--port-file", str(port_file)]
    given = {a.split("=")[0] for a in serve_args}
    if "--http-port" not in given and (http or not older):  # an older revision's HTTP is off unless asked for
        command += ["--http-port", "0" if http else "off"]
    if "--processes" in given and "--metrics-port" not in given:
        # every process's own /metrics (the port file's fourth line): Server.wait_ready waits until each is warm
        command += ["--metrics-port", "0"]
    command += list(serve_args)
    if threads:
        command += ["--threads", str(threads)]
    return command


def launch(
    model: Path | None = None,
    *,
    threads: int | None = None,
    serve_args: Sequence[str] = (),
    http: bool = True,
    tree: Path | None = None,
    env: dict[str, str] | None = None,
    workdir: Path | None = None,
    label: str = "after",
) -> Server:
    """Start ``elmo serve`` (not waited for: :meth:`Server.wait_ready`). ``tree``: serve that checkout's code (a
    worktree of an older revision) with this model. Log and port file go to ``workdir`` (default: a fresh temporary
    folder)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="elmo-serve-"))
    port_file, log_path = workdir / f"{label}.port", workdir / f"{label}.log"
    command = serve_command(model, port_file, threads, serve_args, http, older=tree is not None)
    environment = dict(os.environ if env is None else env)
    options: dict = {}
    if tree is not None:
        options = {"cwd": tree}
        environment = tree_env(tree, environment)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, **options)
    return Server(label, proc, port_file, log_path)


def start_server(model: Path | None = None, *, timeout: float = 120.0, http: bool = True, **options) -> Server:
    """:func:`launch`, then wait until it is SERVING (a port file, gRPC health). ``http=False``: gRPC only."""
    return launch(model, http=http, **options).wait_ready(http, timeout)


def start_replicas(model: Path, workdir: Path, n: int = 3, threads: int = 1, extra: Sequence[str] = ()) -> list[Server]:
    """``n`` replicas ``elmo1``..``elmoN`` (deploy/haproxy.cfg's names) started at once, without the caller's
    ELMO_AUTH_TOKEN; returned once every one is SERVING (all killed if one is not)."""
    env = {k: v for k, v in os.environ.items() if k != "ELMO_AUTH_TOKEN"}
    replicas = [
        launch(model, threads=threads, serve_args=extra, env=env, workdir=workdir, label=f"elmo{i}")
        for i in range(1, n + 1)
    ]
    try:
        for replica in replicas:
            replica.wait_ready(http=True)
    except BaseException:
        for replica in replicas:
            replica.proc.kill()
        raise
    return replicas


def metric_samples(metrics_port: int, name: str) -> list:
    """The samples of the metric family ``name`` on a server process's ``/metrics`` (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{LOOPBACK}:{metrics_port}/metrics", timeout=REQUEST_TIMEOUT_S) as reply:
        text = reply.read().decode()
    return [
        sample for family in text_string_to_metric_families(text) if family.name == name for sample in family.samples
    ]


def models_ready(metrics_port: int) -> bool:
    """True once a server process's ``/metrics`` shows every model it serves warmed up (``elmo_model_ready`` 1)."""
    try:
        ready = metric_samples(metrics_port, "elmo_model_ready")
    except OSError:
        return False
    return bool(ready) and all(sample.value == 1 for sample in ready)


def wait_serving(target: str, timeout: float = 120.0) -> None:
    """Until gRPC health at ``target`` says SERVING; SystemExit after ``timeout`` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{target} did not become SERVING within {timeout:.0f} s")
