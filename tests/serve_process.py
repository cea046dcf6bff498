"""`elmo serve` as a real subprocess on 127.0.0.1 (``--port 0 --port-file``), for the tests of the process itself:
command-line errors, warm-up failure, SIGTERM drains, the health-check script.

Nothing is faked: the process is the one `elmo serve` starts in production, with its own signal handling, logging
and exit code. Waits are bounded only as a guard against hanging (a broken server fails the test, it does not stall
the run); no test decides anything from how long something took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO

SERVE = (sys.executable, "-m", "elmo.cli", "serve")
HEALTH_SCRIPT = REPO / "scripts" / "healthcheck.py"
AUTH_ENV = "ELMO_AUTH_TOKEN"


def wait_until(condition: Callable[[], bool], timeout: float = 60.0, what: str = "condition") -> None:
    """Poll ``condition``; the timeout only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(0.02)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test process's environment without ELMO_AUTH_TOKEN (so a developer's shell cannot change a result)."""
    env = {key: value for key, value in os.environ.items() if key != AUTH_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def health_status(target: str, service: str = "") -> str:
    """grpc.health.v1 Check -> SERVING / NOT_SERVING / ..., or the call's error code (UNAVAILABLE when nothing
    listens). Health needs no token: the server exempts probes from auth."""
    try:
        with grpc.insecure_channel(target) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
    except grpc.RpcError as error:
        return error.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class ServeProcess:
    """One `elmo serve --host 127.0.0.1 --port 0 --threads 1 ARGS...`; stdout and stderr are kept in files."""

    def __init__(self, args: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = workdir / "serve.port"
        self.stdout_path, self.stderr_path = workdir / "serve.stdout", workdir / "serve.stderr"
        self.command = [
            *SERVE,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            "--threads",
            "1",
            "--http-port",  # HTTP only where a test asks for it (its own --http-port comes later and wins)
            "off",
            *args,
        ]
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(self.command, cwd=REPO, stdout=out, stderr=err, env=clean_env(env))
        self.target: str | None = None

    # -- observing ------------------------------------------------------------------------------------------------
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def _port(self) -> str:
        return self.port_file.read_text().split()[0] if self.port_file.is_file() and self.port_file.read_text() else ""

    def wait_listening(self, timeout: float = 60.0) -> str | None:
        """The target once the port is open, or None when the process exited first."""
        wait_until(lambda: self.exited() or bool(self._port()), timeout, "elmo serve listening or exited")
        if not self._port():
            return None
        self.target = f"127.0.0.1:{self._port()}"
        return self.target

    def wait_serving(self, timeout: float = 60.0) -> str:
        target = self.wait_listening(timeout)
        assert target is not None, f"elmo serve exited with {self.proc.returncode}:\n{self.stderr()}"
        wait_until(lambda: self.exited() or health_status(target) == "SERVING", timeout, "health SERVING")
        assert not self.exited(), f"elmo serve exited with {self.proc.returncode}:\n{self.stderr()}"
        return target

    def wait_exit_without_serving(self, timeout: float = 60.0) -> int:
        """For a start that must fail: its exit code. Fails the test if the server got to SERVING instead."""
        target = self.wait_listening(timeout)
        if target is not None:
            wait_until(lambda: self.exited() or health_status(target) == "SERVING", timeout, "exit or SERVING")
            assert self.exited(), f"elmo serve reached SERVING instead of exiting:\n{self.stderr()}"
        return self.proc.wait(10)

    # -- controlling ----------------------------------------------------------------------------------------------
    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"elmo serve still running {timeout:.0f} s later:\n{self.stderr()}") from None

    def close(self) -> None:
        if not self.exited():
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str

    def error_lines(self) -> list[str]:
        """The lines the command itself printed as its error (`elmo serve: error: ...`), not log lines."""
        return [line for line in self.stderr.splitlines() if line.startswith("elmo serve:")]


def serve_until_exit(args: Sequence[str], workdir: Path, env: Mapping[str, str] | None = None) -> Finished:
    """Run an `elmo serve` that must fail on its own; fails the test if it reaches SERVING."""
    with ServeProcess(args, workdir, env) as server:
        code = server.wait_exit_without_serving()
        return Finished(code, server.stdout(), server.stderr())
