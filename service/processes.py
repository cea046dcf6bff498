"""``elmo serve --processes N``: N server processes share the ports, and this process starts, watches and stops them.

One process answers at most what its event loop and interpreter can handle (docs/explanation/runtime.md, "The
front door's cost"): with a model that costs little, that and not the cores is the limit. Here N copies of the same
``elmo serve`` command listen on the same ports with SO_REUSEPORT (``--reuse-port``), and the kernel spreads
connections among them; each process has its own models, batcher, limits, health, drain and ``--threads``. This
process only:

- reserves the ports (a bound, never listening SO_REUSEPORT socket: port 0 becomes one port for all, and nothing
  else takes a given one) and checks every address before any model loads;
- starts the N processes with the same command line (the first alone until it is warm: a bad command line or
  model fails once, with its own line), each told its ports and, without ``--threads``, its share of the cores, in
  a process group of their own, so that a terminal's Ctrl-C reaches them once, through here;
- lets them listen only once all of them are warm: each loads its models and runs its warm-up (the load-time check
  included) without listening, says so in its warm file (:func:`wait_for_the_group`) and waits; once every one has,
  this process tells them all (GROUP_WARM_SIGNAL) and they open the shared ports. So no connection ever reaches a
  process that is not warm, and health on the shared port says SERVING only once the whole group is;
- serves the group's one ``/metrics`` on ``--metrics-port`` (service.telemetry.group_metrics): each process serves
  its own on a port of 127.0.0.1, merged here at every scrape;
- under ``--model-root``, keeps one model version for the group (service.models.group): it watches the repository
  (``--poll-interval-s``; the processes do not poll on their own) and tells every process to reconcile when it or
  the admin API's choices changed, and logs once all have ("every server process serves NAME@VERSION");
- writes ``--port-file`` once all of them listen (a fourth line: every process's own metrics port);
- restarts a process that ends unasked (a crash, a kill, the memory killer) while the others keep serving: after
  RESTART_FIRST_S, doubling with each restart in the last ``--process-restart-window-s`` up to RESTART_MAX_S; the
  new process warms up, then listens (GROUP_WARM_SIGNAL). Past ``--process-restarts`` restarts within the window
  (0: at the first end) the group stops instead, and this process exits with the code of the one that ended, for
  a supervisor above it (systemd, Kubernetes) to act on. A process that ends before the group first listened
  stops the group the same way (a bad command line or model would only fail again);
- hands every SIGTERM / SIGINT on to all of them (each drains as one server does; a second signal cuts
  ``--shutdown-delay-s`` short, as there), and exits 0 once all have.

Each process dies with this one (:func:`die_with_supervisor`): a killed supervisor leaves no server on the ports.
Limits hold per process: N processes admit N times ``--max-concurrent-rpcs`` and the rest, and a peer N times its
own share, i.e. the same fraction of the whole. The admin API (``--admin-token``) reaches whichever process took
the call; that process changes the group's policy, and answers once every process has followed it.
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
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from elmo.service.common.ports import bind_port
from elmo.service.models.group import RECONCILE_SIGNAL, ModelGroup, describe
from elmo.service.telemetry.group_metrics import GroupCollector, serve_group_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from elmo.errors import ConfigError
from elmo.flags import add_fields_as_flags, fields_from_args
from elmo.runtime.host import usable_cores
from elmo.runtime.repository import scan, version_dir

log = logging.getLogger("service.processes")

POLL_S = 0.1  # how often the supervisor looks at its processes
STOP_MARGIN_S = 30.0  # beyond --shutdown-delay-s + --drain-timeout-s, how long a stopping process gets before a kill
RESTART_FIRST_S = 1.0  # a process that ended unasked is started again after this long, doubled for each restart
RESTART_MAX_S = 30.0  # in the window, up to this long
PROCESS_METRICS_HOST = "127.0.0.1"  # each process's own /metrics: read by the supervisor only
_PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "ELMO_SERVE_SUPERVISOR"  # the supervisor's pid, in the environment of the processes it starts
WARM_FILE_ENV = "ELMO_SERVE_WARM_FILE"  # where a process of the group says it is warm (wait_for_the_group)
GROUP_WARM_SIGNAL = signal.SIGUSR1  # from the supervisor: every process of the group is warm, listen now


@dataclass(frozen=True)
class RestartPolicy:
    """What the supervisor does when a process of the group ends unasked (the ``--process-restart*`` flags)."""

    restarts: int = 5  # restarts within the window; the next end stops the group (0: the first end does)
    window_s: float = 600.0

    def validate(self) -> RestartPolicy:
        if self.restarts < 0:
            raise ConfigError(f"--process-restarts {self.restarts}: 0 (stop the group at the first end) or more")
        if self.window_s <= 0:
            raise ConfigError(f"--process-restart-window-s {self.window_s}: give a number of seconds over 0")
        return self


_RESTART_FLAGS = {"restarts": "process-restarts", "window_s": "process-restart-window-s"}
_RESTART_HELP = {
    "restarts": "with --processes: a process that ends unasked (a crash, a kill) is started again while the others "
    "serve, up to this many times within --process-restart-window-s; one more end stops the group, which exits with "
    "that process's code (0: stop the group at the first end, for a supervisor above to restart it whole)",
    "window_s": "the window --process-restarts counts restarts in",
}


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields_as_flags(parser, RestartPolicy(), _RESTART_HELP, _RESTART_FLAGS.__getitem__)


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    return fields_from_args(RestartPolicy, args, _RESTART_FLAGS.__getitem__).validate()


def check_options(args: argparse.Namespace) -> None:
    """ConfigError for what N processes cannot do."""
    if args.processes < 1:
        raise ConfigError(f"--processes {args.processes}: give 1 or more")


def process_command(args: argparse.Namespace, grpc_port: int, http_port: int | None, port_file: Path) -> list[str]:
    """The command line as given, then what makes it one of the group (argparse keeps a flag's last value)."""
    command = [sys.executable, "-m", "elmo.cli", *args.command_line, "--processes", "1", "--reuse-port"]
    command += ["--port", str(grpc_port), "--port-file", str(port_file)]
    command += ["--http-port", str(http_port) if http_port is not None else "off"]
    if args.metrics_port is not None:  # its own, for the supervisor to merge
        command += ["--metrics-port", "0", "--metrics-host", PROCESS_METRICS_HOST]
    if args.model_root is not None:  # the supervisor watches the repository for all of them
        command += ["--poll-interval-s", "0"]
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


@dataclass
class Slot:
    """One place in the group: its command (the same ports for every process ever started there) and files."""

    index: int
    command: list[str]
    warm_file: Path
    port_file: Path
    process: subprocess.Popen | None = None
    told_warm: bool = False  # GROUP_WARM_SIGNAL sent: it listens (or is about to)
    restart_at: float | None = None  # ended unasked: started again at this time
    signalled_round: int = -1  # the model policy's round it was last told to follow

    def metrics_port(self) -> int | None:
        """The port of its own /metrics, once it listens."""
        try:
            lines = self.port_file.read_text().split("\n")
        except OSError:
            return None
        return int(lines[1]) if len(lines) > 1 and lines[1].strip() else None


class ProcessGroup:
    """The places of the group, the ``elmo serve`` processes in them, and the signals passed on to them."""

    def __init__(
        self,
        slots: list[Slot],
        stop_timeout: float,
        models: ModelGroup | None = None,
        restart: RestartPolicy = RestartPolicy(),
    ) -> None:
        self.slots = slots
        self.restart = restart
        self.stop_timeout = stop_timeout
        self.models = models
        self.asked_to_stop = False
        self.restarts: deque[float] = deque()  # when each restart within the window was decided
        self.restart_count = 0

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [slot.process for slot in self.slots if slot.process is not None]

    def start(self, slot: Slot) -> None:
        if self.asked_to_stop:  # a signal came before this process: it would never get it
            return
        for path in (slot.warm_file, slot.port_file):
            path.unlink(missing_ok=True)
        environment = {**os.environ, SUPERVISOR_ENV: str(os.getpid()), WARM_FILE_ENV: str(slot.warm_file)}
        if self.models is not None:
            self.models.forget(slot.index)
            environment |= self.models.environment(slot.index)
        slot.process = subprocess.Popen(slot.command, process_group=0, env=environment)
        slot.told_warm, slot.restart_at, slot.signalled_round = False, None, -1

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
        started = [slot for slot in self.slots if slot.process is not None]
        return self.wait_written([slot.warm_file for slot in started]) is not None

    def wait_listening(self) -> list[list[str]] | None:
        """Until all listen (their port files' lines); None if one ended first or a signal came."""
        return self.wait_written([slot.port_file for slot in self.slots])

    def tell_warm(self, slot: Slot) -> None:
        assert slot.process is not None
        slot.process.send_signal(GROUP_WARM_SIGNAL)
        slot.told_warm = True

    # -- while serving -----------------------------------------------------------------------------------------
    def look_after(self, now: float) -> subprocess.Popen | None:
        """One look at every place: a process that ended unasked is started again (after its back-off), a restarted
        one that is warm is told to listen. The process that ended when no restart is left (the group stops)."""
        for slot in self.slots:
            process = slot.process
            if process is not None and process.poll() is not None and not self.asked_to_stop:
                if not self.may_restart(now):
                    log.error(
                        "server process %d ended with exit code %s, after %d restarts within %.0f s "
                        "(--process-restarts): stopping the other %d",
                        process.pid,
                        process.returncode,
                        len(self.restarts),
                        self.restart.window_s,
                        len(self.slots) - 1,
                    )
                    return process
                delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (len(self.restarts) - 1))
                log.error(
                    "server process %d ended with exit code %s: the other %d keep serving; starting another in %.0f s",
                    process.pid,
                    process.returncode,
                    len(self.slots) - 1,
                    delay,
                )
                slot.process, slot.restart_at = None, now + delay
                if self.models is not None:
                    self.models.forget(slot.index)
            if slot.process is None and slot.restart_at is not None and now >= slot.restart_at:
                self.start(slot)
                self.restart_count += 1
            elif slot.process is not None and not slot.told_warm and _written(slot.warm_file):
                self.tell_warm(slot)
                log.info(
                    "server process %d (replacing one that ended) is warm: it takes connections now", slot.process.pid
                )
        return None

    def may_restart(self, now: float) -> bool:
        while self.restarts and self.restarts[0] < now - self.restart.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.restart.restarts:
            return False
        self.restarts.append(now)
        return True

    def serving(self) -> int:
        """Processes that are warm and running (those that take connections)."""
        return sum(1 for s in self.slots if s.process is not None and s.process.poll() is None and s.told_warm)

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


def _written(path: Path) -> bool:
    return path.is_file() and bool(path.read_text())


class VersionKeeper:
    """Under ``--model-root``: one model version for the group (service.models.group), from the supervisor's side."""

    def __init__(self, group: ProcessGroup, models: ModelGroup, root: Path, poll_interval_s: float) -> None:
        self.group = group
        self.models = models
        self.root = root
        self.poll_interval_s = poll_interval_s
        self.next_scan = 0.0
        self.on_disk: dict | None = None
        self.reported_round = -1
        self.agreed: dict[str, int] = {}  # the version every process serves, per model (once they agree)

    def look(self, now: float) -> None:
        if self.poll_interval_s > 0 and now >= self.next_scan:
            self.next_scan = now + self.poll_interval_s
            self.watch_disk()
        round_ = self.models.policy().round
        for slot in self.group.slots:
            process = slot.process
            if process is None or process.poll() is not None or not slot.told_warm:
                continue  # a starting process reads the policy when its models load
            status = self.models.status(slot.index)
            if (status is None or status.round < round_) and slot.signalled_round < round_:
                process.send_signal(RECONCILE_SIGNAL)
                slot.signalled_round = round_
        if round_ > self.reported_round and (statuses := self.models.settled(round_)) is not None:
            self.reported_round = round_
            self.agreed, differing = describe(statuses)
            if differing:
                log.warning("the server processes serve different model versions: %s", differing)
            else:
                served = ", ".join(f"{name}@{version}" for name, version in sorted(self.agreed.items()))
                log.info("every server process serves %s", served or "no model")

    def watch_disk(self) -> None:
        """The repository's complete versions (and their folders' times): a change starts a round."""
        try:
            found = scan(self.root)
            seen = {
                name: [(v, version_dir(self.root, name, v).stat().st_mtime_ns) for v in versions]
                for name, versions in found.items()
            }
        except Exception as error:  # noqa: BLE001 - a bad moment on disk: look again next time
            log.warning("looking at %s failed: %s; trying again in %.1f s", self.root, error, self.poll_interval_s)
            return
        if self.on_disk is not None and seen != self.on_disk:
            log.info("%s changed: every server process reconciles", self.root)
            self.models.change(lambda policy: None)
        self.on_disk = seen


def start_group(group: ProcessGroup) -> list[list[str]] | None:
    """The first process alone until it is warm (a bad command line or model fails once, with its own one line),
    then the others at once; once all are warm, all listen. Every process's port file's lines, or None when one
    ended first or a signal came."""
    for i, slot in enumerate(group.slots):
        group.start(slot)
        if i == 0 and not group.wait_warm():
            return None
    if not group.wait_warm():
        return None
    for slot in group.slots:
        group.tell_warm(slot)
    return group.wait_listening()


def supervise(group: ProcessGroup, keeper: VersionKeeper | None) -> subprocess.Popen | None:
    """While the group serves: restarts, the model version. The process that ended with no restart left, or None
    once a signal came."""
    while not group.asked_to_stop:
        now = time.monotonic()
        ended = group.look_after(now)
        if ended is not None:
            return ended
        if keeper is not None:
            keeper.look(now)
        time.sleep(POLL_S)
    return None


def own_metrics(group: ProcessGroup, keeper: VersionKeeper | None) -> Callable[[], Iterable]:
    def collect() -> Iterable:
        yield GaugeMetricFamily(
            "elmo_group_processes", "server processes warm and taking connections", value=group.serving()
        )
        yield CounterMetricFamily(
            "elmo_group_process_restarts",
            "server processes started again after one ended unasked",
            value=group.restart_count,
        )
        if keeper is not None:
            version = GaugeMetricFamily(
                "elmo_group_model_version",
                "the model version every server process serves (reported once all followed the last change)",
                labels=["model"],
            )
            for name, number in sorted(keeper.agreed.items()):
                version.add_metric([name], number)
            yield version

    return collect


def run_processes(args: argparse.Namespace) -> int:
    """``elmo serve --processes N``: see the module's docstring. Returns the exit code."""
    check_options(args)
    restart = restart_policy_from_args(args)
    host = args.host
    # bound, never listening: the processes bind beside it (the kernel hands connections only to listening sockets)
    reserved = [bind_port(host, args.port, reuse_port=True)]
    if args.http_port is not None:
        reserved.append(bind_port(host, args.http_port, " for HTTP", reuse_port=True))
    grpc_port = reserved[0].getsockname()[1]
    http_port = reserved[1].getsockname()[1] if args.http_port is not None else None
    stop_timeout = args.shutdown_delay + args.drain_seconds + STOP_MARGIN_S
    with tempfile.TemporaryDirectory(prefix="elmo-serve-") as work:
        slots = []
        for i in range(args.processes):
            port_file = Path(work) / f"process-{i}.port"
            command = process_command(args, grpc_port, http_port, port_file)
            slots.append(Slot(i, command, port_file.with_suffix(".warm"), port_file))
        models = ModelGroup(Path(work), args.processes) if args.model_root is not None else None
        group = ProcessGroup(slots, stop_timeout, models, restart)
        keeper = VersionKeeper(group, models, args.model_root, args.poll_interval_s) if models else None
        metrics_server, metrics_port, collector = None, None, None
        if args.metrics_port is not None:
            collector = GroupCollector(lambda: _metrics_of(group), own_metrics(group, keeper))
            metrics_server, metrics_port = _serve_metrics(collector, args)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, group.forward)
        ports = start_group(group)
        for sock in reserved:  # all listen now (or will not): the port is theirs
            sock.close()
        if ports is not None:
            announce(args, grpc_port, metrics_port, http_port, [lines[1] for lines in ports])
            remembering = collector.keep_remembering() if collector is not None else None
            ended = supervise(group, keeper)
            if remembering is not None:
                remembering.set()
        else:
            ended = group.first_ended()
            if ended is not None and not group.asked_to_stop and len(group.processes) > 1:
                log.error(
                    "server process %d ended with exit code %s before the group listened: stopping the other %d",
                    ended.pid,
                    ended.returncode,
                    len(group.processes) - 1,
                )
        unasked = not group.asked_to_stop and ended is not None
        codes = group.stop_all()
        if metrics_server is not None:
            metrics_server.shutdown()
    if unasked:
        return exit_code(ended.returncode) or 1
    return next((exit_code(code) for code in codes if code and not stopped_before_serving(code)), 0)


def _metrics_of(group: ProcessGroup) -> list[tuple[int, int] | None]:
    found: list[tuple[int, int] | None] = []
    for slot in group.slots:
        port = slot.metrics_port() if slot.process is not None else None
        found.append((slot.process.pid, port) if slot.process is not None and port else None)
    return found


def _serve_metrics(collector: GroupCollector, args: argparse.Namespace) -> tuple[object, int]:
    try:
        return serve_group_metrics(collector, args.metrics_port, args.metrics_host or args.host)
    except OSError as exc:
        raise ConfigError(f"cannot listen for metrics on port {args.metrics_port}: {exc.strerror}") from None


def stopped_before_serving(returncode: int) -> bool:
    """Ended by the SIGTERM / SIGINT passed on to it before it could take one (still starting up): it held no
    request, so that is a clean stop, like a drain."""
    return returncode in (-signal.SIGTERM, -signal.SIGINT)


def exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it: killed by signal S (-S) is 128 + S."""
    return 128 - returncode if returncode < 0 else returncode


def announce(
    args: argparse.Namespace, grpc_port: int, metrics_port: int | None, http_port: int | None, metrics: list[str]
) -> None:
    """The log lines and ``--port-file``: the shared gRPC port, the group's metrics port, the shared HTTP port, then
    every process's own metrics port."""
    log.info(
        "%d server processes listening on %s:%d%s",
        args.processes,
        args.host,
        grpc_port,
        f" (HTTP {http_port})" if http_port is not None else "",
    )
    if metrics_port is not None:
        log.info("metrics of the group on http://%s:%d/metrics", args.metrics_host or args.host, metrics_port)
    if args.port_file is not None:
        every = " ".join(port for port in metrics if port)
        args.port_file.write_text(f"{grpc_port}\n{metrics_port or ''}\n{http_port or ''}\n{every}\n")


__all__ = ["ProcessGroup", "die_with_supervisor", "run_processes", "wait_for_the_group"]
