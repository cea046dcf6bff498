"""``elmo serve --processes N``: N server processes share the ports, and this process starts, watches and stops them.

One process answers at most what its event loop and interpreter can handle (docs/runtime.md, "The front door's
cost"): with a model that costs little, that and not the cores is the limit. Here N copies of the same ``elmo
serve`` command listen on the same ports with SO_REUSEPORT (``--reuse-port``), and the kernel spreads connections
among them; each process has its own models, batcher, limits, health, drain and ``--threads``. This process only:

- reserves the ports (a bound, never listening SO_REUSEPORT socket: port 0 becomes one port for all, and nothing
  else takes a given one) and checks every address before any model loads;
- starts the N processes with the same command line (the first alone until it is warm: a bad command line or
  model fails once, with its own line), each told its ports (the metrics port: ``--metrics-port`` + i,
  one ``/metrics`` per process) and, without ``--threads``, its share of the cores, in a process group of their
  own, so that a terminal's Ctrl-C reaches them once, through here;
- lets them listen only once all of them are warm: each loads its models and runs its warm-up (the load-time check
  included) without listening, says so in its warm file (:func:`wait_for_the_group`) and waits; once every one has,
  this process tells them all (GROUP_WARM_SIGNAL) and they open the shared ports. So no connection ever reaches a
  process that is not warm, and health on the shared port says SERVING only once the whole group is;
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
import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from elmo.service.common.ports import bind_port

from elmo.errors import ConfigError
from elmo.runtime.host import usable_cores

log = logging.getLogger("service.processes")

POLL_S = 0.1  # how often the supervisor looks at its processes
STOP_MARGIN_S = 30.0  # beyond --shutdown-delay + --drain-seconds, how long a stopping process gets before a kill
_PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "ELMO_SERVE_SUPERVISOR"  # the supervisor's pid, in the environment of the processes it starts
WARM_FILE_ENV = "ELMO_SERVE_WARM_FILE"  # where a process of the group says it is warm (wait_for_the_group)
GROUP_WARM_SIGNAL = signal.SIGUSR1  # from the supervisor: every process of the group is warm, listen now


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


async def wait_for_the_group(stopped: Callable[[], Awaitable[None]]) -> bool:
    """In a process of a group (``WARM_FILE_ENV`` names its warm file), once its models are warm and before it
    listens: write the warm file, then wait for GROUP_WARM_SIGNAL, sent once every process of the group is warm.
    True then (and at once outside a group); False when ``stopped()`` ends first (a signal came: the process drains
    without ever listening)."""
    warm_file = os.environ.get(WARM_FILE_ENV)
    if warm_file is None:
        return True
    group_warm = asyncio.Event()
    # the handler before the file: the supervisor may answer at once, and the signal's default action is to end
    asyncio.get_running_loop().add_signal_handler(GROUP_WARM_SIGNAL, group_warm.set)
    Path(warm_file).write_text(f"{os.getpid()}\n")
    waits = [asyncio.ensure_future(group_warm.wait()), asyncio.ensure_future(stopped())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    return group_warm.is_set()


class ProcessGroup:
    """The ``elmo serve`` processes started so far, their warm and port files, and the signals passed on to them."""

    def __init__(self, stop_timeout: float) -> None:
        self.stop_timeout = stop_timeout
        self.processes: list[subprocess.Popen] = []
        self.warm_files: list[Path] = []
        self.port_files: list[Path] = []
        self.asked_to_stop = False

    def start(self, command: list[str], warm_file: Path, port_file: Path) -> None:
        if self.asked_to_stop:  # a signal came before this process: it would never get it
            return
        environment = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), WARM_FILE_ENV: str(warm_file)}
        self.processes.append(subprocess.Popen(command, process_group=0, env=environment))
        self.warm_files.append(warm_file)
        self.port_files.append(port_file)

    def forward(self, signum: int, _frame=None) -> None:
        """A signal to this process goes to every server process: each drains (a second one cuts the delay)."""
        self.asked_to_stop = True
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signum)

    def first_ended(self) -> subprocess.Popen | None:
        return next((p for p in self.processes if p.poll() is not None), None)

    def wait_written(self, files: list[Path]) -> list[list[str]] | None:
        """Until every one of ``files`` is written (their lines); None if a process ended first or a signal came."""
        while not self.asked_to_stop and self.first_ended() is None:
            contents = [path.read_text() if path.is_file() else "" for path in files]
            if all(contents):
                return [text.split("\n") for text in contents]
            time.sleep(POLL_S)
        return None

    def wait_warm(self) -> bool:
        return self.wait_written(self.warm_files) is not None

    def wait_listening(self) -> list[list[str]] | None:
        """Until all listen (their port files' lines); None if one ended first or a signal came."""
        return self.wait_written(self.port_files)

    def tell_all_warm(self) -> None:
        for process in self.processes:
            process.send_signal(GROUP_WARM_SIGNAL)

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
    """The first process alone until it is warm (a bad command line or model fails once, with its own one line),
    then the others at once; once all are warm, all listen. Every process's port file's lines, or None when one
    ended first or a signal came."""
    for i, (command, port_file) in enumerate(zip(commands, port_files)):
        group.start(command, port_file.with_suffix(".warm"), port_file)
        if i == 0 and not group.wait_warm():
            return None
    if not group.wait_warm():
        return None
    group.tell_all_warm()
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
    return next((exit_code(code) for code in codes if code and not stopped_before_serving(code)), 0)


def stopped_before_serving(returncode: int) -> bool:
    """Ended by the SIGTERM / SIGINT passed on to it before it could take one (still starting up): it held no
    request, so that is a clean stop, like a drain."""
    return returncode in (-signal.SIGTERM, -signal.SIGINT)


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


__all__ = ["ProcessGroup", "die_with_supervisor", "run_processes", "wait_for_the_group"]
