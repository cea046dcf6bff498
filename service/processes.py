"""``elmo serve --processes N``: N server processes share the ports, and this process starts, watches and stops them.

One process answers at most what its event loop and interpreter can handle (docs/runtime.md, "The front door's
cost"): with a model that costs little, that and not the cores is the limit. Here N copies of the same ``elmo
serve`` command listen on the same ports with SO_REUSEPORT (``--reuse-port``), and the kernel spreads connections
among them; each process has its own models, batcher, limits, health, drain and ``--threads``. This process only:

- reserves the ports (a bound, never listening SO_REUSEPORT socket: port 0 becomes one port for all, and nothing
  else takes a given one) and checks every address before any model loads;
- starts the N processes with the same command line (the first alone until it listens: a bad command line or model
  fails once, with its own line), each told its ports (the metrics port: ``--metrics-port`` + i,
  one ``/metrics`` per process) and, without ``--threads``, its share of the cores, in a process group of their
  own, so that a terminal's Ctrl-C reaches them once, through here;
- writes ``--port-file`` once all of them listen (a fourth line: every process's metrics port);
- hands every SIGTERM / SIGINT on to all of them (each drains as one server does; a second signal cuts
  ``--shutdown-delay`` short, as there), and exits 0 once all have;
- stops all of them when one ends unasked (a crash, a failed start), and exits with its code: a supervisor
  (systemd, Kubernetes) restarts the whole group, which never runs on fewer processes than it says.

Each process dies with this one (:func:`die_with_supervisor`): a killed supervisor leaves no server on the ports.
Limits hold per process: N processes admit N times ``--max-concurrent-rpcs`` and the rest, and a peer N times its
own share, i.e. the same fraction of the whole. The admin API (``--admin-token``) is refused: its calls would reach
one process; under ``--model-root`` every process follows the repository itself (``--poll-interval-s``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elmo.service.common.ports import bind_port

from elmo.errors import ConfigError
from elmo.runtime.host import usable_cores

log = logging.getLogger("service.processes")

POLL_S = 0.1  # how often the supervisor looks at its processes
STOP_MARGIN_S = 30.0  # beyond --shutdown-delay + --drain-seconds, how long a stopping process gets before a kill
_PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "ELMO_SERVE_SUPERVISOR"  # the supervisor's pid, in the environment of the processes it starts


def check_options(args: argparse.Namespace, admin_api: bool) -> None:
    """ConfigError for what N processes cannot do (``admin_api``: an admin token was given, by flag or env)."""
    if args.processes < 1:
        raise ConfigError(f"--processes {args.processes}: give 1 or more")
    if admin_api:
        raise ConfigError("the admin API (--admin-token, $ELMO_ADMIN_TOKEN) with --processes: an admin call would "
                          "change one process's models only; let every process follow the repository "
                          "(--model-root DIR --poll-interval-s S)")  # fmt: skip


def metrics_ports(first: int | None, processes: int) -> list[int | None]:
    """Process i's metrics port: ``--metrics-port`` + i (0: any free port each; None: no metrics)."""
    if first is None:
        return [None] * processes
    return [first + i if first else 0 for i in range(processes)]


def process_command(args: argparse.Namespace, grpc_port: int, http_port: int | None, metrics_port: int | None,
                    port_file: Path) -> list[str]:  # fmt: skip
    """The command line as given, then what makes it one of the group (argparse keeps a flag's last value)."""
    command = [sys.executable, "-m", "elmo.cli", *args.command_line, "--processes", "1", "--reuse-port"]
    command += ["--port", str(grpc_port), "--port-file", str(port_file)]
    if http_port is not None:
        command += ["--http-port", str(http_port)]
    if metrics_port is not None:
        command += ["--metrics-port", str(metrics_port)]
    if args.threads is None:  # onnxruntime's default is every core, in every process: N times too many threads
        command += ["--threads", str(threads_each(args.processes))]
    return command


def threads_each(processes: int) -> int:
    """Without ``--threads``: the cores this process may use, shared among the processes (at least one each)."""
    return max(1, usable_cores() // processes)


def die_with_supervisor() -> None:
    """In a server process started by a supervisor (SUPERVISOR_ENV names it): SIGTERM when the supervisor dies,
    however it dies (Linux's PR_SET_PDEATHSIG; set here, not between fork and exec, where the supervisor's native
    threads make Python unsafe); if it died already, now. No-op otherwise."""
    supervisor = os.environ.get(SUPERVISOR_ENV)
    if supervisor is None:
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(supervisor):  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


class ProcessGroup:
    """The ``elmo serve`` processes started so far, their port files, and the signals passed on to them."""

    def __init__(self, stop_timeout: float) -> None:
        self.stop_timeout = stop_timeout
        self.processes: list[subprocess.Popen] = []
        self.port_files: list[Path] = []
        self.asked_to_stop = False

    def start(self, command: list[str], port_file: Path) -> None:
        if self.asked_to_stop:  # a signal came before this process: it would never get it
            return
        environment = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        self.processes.append(subprocess.Popen(command, process_group=0, env=environment))
        self.port_files.append(port_file)

    def forward(self, signum: int, _frame=None) -> None:
        """A signal to this process goes to every server process: each drains (a second one cuts the delay)."""
        self.asked_to_stop = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def first_ended(self) -> subprocess.Popen | None:
        return next((p for p in self.processes if p.poll() is not None), None)

    def wait_listening(self) -> list[list[str]] | None:
        """Until all listen (their port files' lines); None if one ended first or a signal came."""
        while not self.asked_to_stop and self.first_ended() is None:
            contents = [path.read_text() if path.is_file() else "" for path in self.port_files]
            if all(contents):
                return [text.split("\n") for text in contents]
            time.sleep(POLL_S)
        return None

    def wait_first_end(self) -> subprocess.Popen:
        while (ended := self.first_ended()) is None:
            time.sleep(POLL_S)
        return ended

    def stop_all(self) -> list[int]:
        """Their exit codes, once all have ended: unless a signal already went to them, SIGTERM first (they
        drain); one still running ``stop_timeout`` later is killed."""
        if not self.asked_to_stop:
            self.forward(signal.SIGTERM)
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(self.stop_timeout))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes


def start_group(group: ProcessGroup, commands: list[list[str]], port_files: list[Path]) -> list[list[str]] | None:
    """The first process alone until it listens (a bad command line or model fails once, with its own one line),
    then the others at once. Every process's port file's lines, or None when one ended first or a signal came."""
    group.start(commands[0], port_files[0])
    if group.wait_listening() is None:
        return None
    for command, port_file in zip(commands[1:], port_files[1:]):
        group.start(command, port_file)
    return group.wait_listening()


def run_processes(args: argparse.Namespace, admin_api: bool) -> int:
    """``elmo serve --processes N``: see the module's docstring. Returns the exit code."""
    check_options(args, admin_api)
    host = args.host
    # bound, never listening: the processes bind beside it (the kernel hands connections only to listening sockets)
    reserved = [bind_port(host, args.port, reuse_port=True)]
    if args.http_port is not None:
        reserved.append(bind_port(host, args.http_port, " for HTTP", reuse_port=True))
    grpc_port = reserved[0].getsockname()[1]
    http_port = reserved[1].getsockname()[1] if args.http_port is not None else None
    metrics = metrics_ports(args.metrics_port, args.processes)
    group = ProcessGroup(stop_timeout=args.shutdown_delay + args.drain_seconds + STOP_MARGIN_S)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, group.forward)
    with tempfile.TemporaryDirectory(prefix="elmo-serve-") as work:
        port_files = [Path(work) / f"process-{i}.port" for i in range(args.processes)]
        commands = [process_command(args, grpc_port, http_port, metrics[i], port_files[i])
                    for i in range(args.processes)]  # fmt: skip
        ports = start_group(group, commands, port_files)
        for sock in reserved:  # all listen now (or will not): the port is theirs
            sock.close()
        if ports is not None:
            announce(args, grpc_port, http_port, [lines[1] for lines in ports])
            ended = group.wait_first_end()
        else:
            ended = group.first_ended()
        unasked = not group.asked_to_stop and ended is not None
        if unasked and len(group.processes) > 1:
            log.error("server process %d ended with exit code %s: stopping the other %d", ended.pid,
                      ended.returncode, len(group.processes) - 1)  # fmt: skip
        codes = group.stop_all()
    if unasked:
        return exit_code(ended.returncode) or 1
    return next((exit_code(code) for code in codes if code), 0)


def exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it: killed by signal S (-S) is 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def announce(args: argparse.Namespace, grpc_port: int, http_port: int | None, metrics: list[str]) -> None:
    """The log line and ``--port-file``: the shared gRPC port, the first process's metrics port, the shared HTTP
    port, then every process's metrics port."""
    log.info("%d server processes listening on %s:%d%s", args.processes, args.host, grpc_port,
             f" (HTTP {http_port})" if http_port is not None else "")  # fmt: skip
    if args.port_file is not None:
        every = " ".join(port for port in metrics if port)
        args.port_file.write_text(f"{grpc_port}\n{metrics[0]}\n{http_port or ''}\n{every}\n")


__all__ = ["ProcessGroup", "die_with_supervisor", "run_processes"]
