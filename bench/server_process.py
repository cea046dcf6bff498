"""``elmo serve`` as a child process for the benchmarks: start it on a free loopback port (this checkout's code or a
git worktree's), wait for SERVING, read its memory and CPU time, stop it; and refuse any address but loopback.
Used by bench.loadgen, bench.serving (noisy, latency, memory), bench.mixed_load and bench.published_chain."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REQUEST_TIMEOUT_S = 120.0


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` too) -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_loopback(target: str) -> None:
    """Refuse anything but a loopback address: this tool must never load someone else's server."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if not host or not (port.isascii() and port.isdigit()):
        raise SystemExit(f"--server must be HOST:PORT, got {target!r}")
    addresses = {info[4][0] for info in socket.getaddrinfo(host, int(port))}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"loadgen drives loopback servers only; {host} resolves to {sorted(addresses)}")


def rss_mib(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident set (``VmRSS``) or its peak (``VmHWM``) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class RssSampler:
    """VmRSS of ``pid`` every ``interval`` s in a thread: [(monotonic time, MiB)]."""

    def __init__(self, pid: int, interval: float = 1.0):
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = rss_mib(self.pid)
            if value is not None:
                self.samples.append((time.monotonic(), value))
            self._stop.wait(self.interval)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU time of a process (from /proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn_server(
    model_dir: Path,
    threads: int | None,
    extra: list[str],
    timeout: float = 120.0,
    tree: Path | None = None,
    own_session: bool = False,
) -> tuple[subprocess.Popen, str, Path]:
    """``elmo serve`` on a free loopback port, SERVING -> (process, gRPC target, log path; the port file is beside
    it). ``tree``: serve the code of that checkout (a git worktree of an older revision, bench.worktree) instead.
    ``own_session``: in a session of its own, as systemd or a container starts it (with the kernel's autogroup, its
    threads then share the CPU among themselves, not with the benchmark's clients thread by thread)."""
    workdir = Path(tempfile.mkdtemp(prefix="loadgen-"))
    port_file, log_path = workdir / "port", workdir / "server.log"
    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "serve",
        "--model",
        str(Path(model_dir).resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *extra,
    ]
    if threads:
        command += ["--threads", str(threads)]
    options: dict = {}
    if tree is not None:
        from elmo.bench.worktree import tree_env

        options = {"cwd": tree, "env": tree_env(tree)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=own_session, **options)
    deadline = time.monotonic() + timeout
    while not (port_file.is_file() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start; log: {log_path}\n{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    target = f"127.0.0.1:{port_file.read_text().split()[0]}"
    _wait_serving(target, timeout)
    return proc, target, log_path


def _wait_serving(target: str, timeout: float = 120.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{target} did not become SERVING within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


@dataclass
class Endpoint:
    """One server to drive: its gRPC target, its HTTP HOST:PORT (when started with one), its PID, its process."""

    label: str
    grpc_target: str
    http_address: str | None
    pid: int | None
    proc: subprocess.Popen | None = None
    log_path: Path | None = None


def start_endpoint(args: argparse.Namespace, label: str, tree: Path | None, with_http: bool) -> Endpoint:
    """``elmo serve`` of ``tree``'s code (this checkout's when None) with this checkout's model directory, an absolute
    path, and ``--http-port 0`` when HTTP is driven; its port file: gRPC port, metrics port, HTTP port."""
    extra = list(args.serve_arg)
    if with_http and not any(a.split("=")[0] == "--http-port" for a in extra):
        extra = ["--http-port", "0", *extra]
    own_session = getattr(args, "server_session", "shared") == "own"
    proc, target, log_path = spawn_server(args.model.resolve(), args.threads, extra, tree=tree, own_session=own_session)
    http_address = None
    if with_http:
        lines = (log_path.parent / "port").read_text().split("\n")
        if len(lines) < 3 or not lines[2].strip():
            stop_server(proc)
            raise SystemExit(f"{label}: the server wrote no HTTP port to its port file (log: {log_path})")
        http_address = f"127.0.0.1:{lines[2].strip()}"
    print(f"{label}: elmo serve pid {proc.pid}, gRPC {target}, HTTP {http_address or '-'}", file=sys.stderr)
    return Endpoint(label, target, http_address, proc.pid, proc, log_path)
