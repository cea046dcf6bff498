"""A real multi-node Ray cluster on loopback, and the batch job's fault scenario on it.

``LoopbackCluster`` starts a head and worker nodes with ``ray start --block``, each its own process group with its own
raylet, object store and temp dir, as on separate machines; every node is 127.0.0.1 (its GCS and raylet listen on
127.0.0.1 only). Token authentication is on, as an operator runs it: a token file (mode 0600) named by
``RAY_AUTH_TOKEN_PATH`` and ``RAY_AUTH_MODE=token`` in every node's and the driver's environment (Ray 2.60 enables
token auth for a cluster whose head finds a token, and a node or driver without it is refused).

Ray rewrites a loopback address to the machine's network address (``--node-ip-address 127.0.0.1``, ``--address
127.0.0.1:P`` and ``ray.init(_node_ip_address=...)`` all become e.g. 192.0.2.2: ``resolve_ip_for_localhost``,
ray-project/ray#26293 by design, #59110 open). Nodes are therefore started through ``python -m
tests.batch.ray_cluster ray-start ...``: Ray's own CLI with that one rewrite turned off. The driver (``elmo
embed-file``, unchanged) keeps its 127.0.0.1 address with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's switch that
makes a process use the loopback address (it only forbids starting a *worker node*, which a driver never does).

``fault_scenario`` is the check itself, shared by the CI test (tests/batch/test_ray_cluster.py, small) and
scripts/ray-cluster-check.sh (the full form, with figures): the job's driver SIGKILLed mid-job, the same command run
again (it resumes), and a worker node lost (its raylet and workers SIGKILLed), if it can be caught so while one
of its actors runs a shard, known by freezing that worker first (``LoopbackCluster.lose_a_node_mid_task``); the
output must equal the local engine's, every shard committed once.

Every process started here is stopped by its process group (SIGKILL: ``ray start --block`` takes seconds to honour
SIGTERM), then any process left whose command line names this cluster's own temp dir; ``ray stop`` is never used (it
stops every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ACTOR_TITLE = b"ray::MapWorker"  # the proctitle of a Ray Data actor of the job (MapWorker(MapBatches(ShardEmbedder)))
# The GCS declares a node dead after this many missed health checks of this period (defaults 5 x 3 s; a test wants
# the death noticed in seconds). Operators keep Ray's defaults.
HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "3000",
    "RAY_health_check_failure_threshold": "3",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition: Callable[[], object], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def _signal(pid: int, number: int) -> bool:
    """Send ``number`` to ``pid``; False if it is gone."""
    try:
        os.kill(pid, number)
    except ProcessLookupError:
        return False
    return True


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every process readable in /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read()
        except OSError:
            continue
        found.append((int(entry), int(fields[1]), command))
    return found


@dataclass
class Node:
    name: str
    process: subprocess.Popen
    log: Path
    temp_dir: Path

    def started(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"ray start of {self.name} exited {self.process.returncode}:\n{self.tail()}")
        return "Ray runtime started" in self.log.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def group(self) -> list[tuple[int, bytes]]:
        """The node's processes: its `ray start` and every descendant (Ray's workers lead process groups of their
        own, so the tree, not the group, says which node a worker belongs to)."""
        table = _processes()
        members, found = {self.process.pid}, []
        for _ in range(6):  # ray start -> raylet -> worker: a few levels at most
            for pid, parent, _command in table:
                if parent in members and pid not in members:
                    members.add(pid)
        for pid, _, command in table:
            if pid in members:
                found.append((pid, command))
        return found

    def raylet(self) -> int | None:
        for pid, command in self.group():
            if command.split(b"\0")[0].endswith(b"/raylet"):
                return pid
        return None

    def actor_workers(self) -> list[int]:
        return [pid for pid, command in self.group() if command.startswith(ACTOR_TITLE)]

    def hosts_actor(self) -> bool:
        return bool(self.actor_workers())


def in_a_method(pid: int) -> bool:
    """Whether Ray's actor worker ``pid`` is inside one of its methods (a shard's task) right now: Ray titles the
    process ``ray::Class.method`` while a method runs and ``ray::Class`` between them (the class name may hold
    parentheses: ``ray::MapWorker(MapBatches(ShardEmbedder)).submit``). Its constructor is no task of a shard."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            title = handle.read().split(b"\0")[0]
    except OSError:
        return False
    method = title.rpartition(b")")[2] if b")" in title else title
    _, dot, name = method.partition(b".")
    return title.startswith(ACTOR_TITLE) and bool(dot) and not name.startswith(b"__")


@dataclass
class LoopbackCluster:
    """A head and ``workers`` worker nodes on 127.0.0.1, ``cpus`` CPUs each, token auth on. Use as a context manager
    (or call ``stop`` in a finalizer): every process is stopped even when start-up fails half-way."""

    workers: int = 2
    cpus: int = 1
    object_store_bytes: int = 100 * 10**6
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elmo-ray-", dir="/tmp")))  # short:
    # Ray's unix sockets live under each node's temp dir, and a socket path may not exceed 107 bytes
    nodes: list[Node] = field(default_factory=list)
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def token_file(self) -> Path:
        return self.root / "auth_token"

    def auth_env(self) -> dict[str, str]:
        """What every node and every driver of this cluster needs in its environment (the token's path, not the
        token itself, travels in the environment)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file)}

    def driver_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return env | self.auth_env() | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keep 127.0.0.1 (module doc)

    def _node_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return env | self.auth_env() | HEALTH_CHECK | {"RAY_USAGE_STATS_ENABLED": "0"}

    def start(self, timeout: float = 120.0) -> LoopbackCluster:
        self.token_file.write_text(secrets.token_hex(32))  # as `ray get-auth-token --generate` would, but not in ~
        self.token_file.chmod(0o600)
        self.port = free_port()
        self._start_node(
            "head",
            ["--head", "--port", str(self.port), "--include-dashboard", "false", "--dashboard-port", str(free_port())],
        )
        wait_until(self.nodes[0].started, "the head node", timeout)
        for index in range(self.workers):
            self._start_node(f"worker{index + 1}", ["--address", self.address])
        wait_until(lambda: all(node.started() for node in self.nodes), "the worker nodes", timeout)
        return self

    def _start_node(self, name: str, role: list[str]) -> None:
        temp_dir = self.root / name
        temp_dir.mkdir()
        command = [
            sys.executable,
            "-m",
            "tests.batch.ray_cluster",
            "ray-start",
            "--block",
            *role,
            "--node-ip-address",
            "127.0.0.1",
            "--num-cpus",
            str(self.cpus),
            "--num-gpus",
            "0",
            "--object-store-memory",
            str(self.object_store_bytes),
            "--temp-dir",
            str(temp_dir),
            "--dashboard-agent-listen-port",
            str(free_port()),
            "--ray-client-server-port",
            str(free_port()),
            "--disable-usage-stats",
        ]
        log = self.root / f"{name}.log"
        with open(log, "wb") as sink:
            process = subprocess.Popen(
                command, cwd=REPO, env=self._node_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.nodes.append(Node(name, process, log, temp_dir))

    @property
    def worker_nodes(self) -> list[Node]:
        return self.nodes[1:]

    def kill_raylet(self, node: Node) -> int:
        """SIGKILL the node's raylet: the node is lost as a machine would be (its `ray start --block` then stops the
        node's other processes, the actors' workers exit with their raylet)."""
        pid = node.raylet()
        assert pid is not None, f"{node.name} has no raylet"
        os.kill(pid, signal.SIGKILL)
        return pid

    def lose_a_node_mid_task(self, within_s: float = 1.0) -> Node | None:
        """Lose a worker node while one of its actors runs a task, or none (None: the caller tries again). The
        actor workers' titles are watched for ``within_s``; one seen inside a method is frozen (SIGSTOP) and read
        again: a frozen worker can neither finish its task nor report it, so one still inside a method then holds
        that task when its node goes (the raylet SIGKILLed, then the node's workers, which a frozen one could not
        exit with). A worker done by then is thawed and goes on as if nothing happened."""
        workers = {pid: node for node in self.worker_nodes for pid in node.actor_workers()}
        until = time.monotonic() + within_s
        while workers and time.monotonic() < until:
            for pid, node in workers.items():
                if in_a_method(pid) and _signal(pid, signal.SIGSTOP):
                    if in_a_method(pid):
                        # listed before the raylet goes: its orphaned workers are no longer found under it, and a
                        # frozen one left behind would stay stopped for ever
                        doomed = {pid, *node.actor_workers()}
                        self.kill_raylet(node)
                        for worker in doomed:
                            _signal(worker, signal.SIGKILL)
                        return node
                    _signal(pid, signal.SIGCONT)
            time.sleep(0.001)
        return None

    def driver_core_logs(self) -> str:
        """The core-worker logs of the drivers attached to the head (Ray writes its retries there)."""
        logs = sorted({p.resolve() for p in (self.root / "head").glob("session_*/logs/python-core-driver-*.log")})
        return "\n".join(path.read_text(errors="replace") for path in logs)

    def gcs_log(self) -> str:
        logs = sorted((self.root / "head").glob("session_*/logs/gcs_server.out"))
        return logs[-1].read_text(errors="replace") if logs else ""

    def stop(self) -> None:
        strays = [pid for node in self.nodes for pid, _ in node.group() if pid != node.process.pid]
        for node in self.nodes:
            try:
                os.killpg(node.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in self.nodes:
            try:
                node.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        marker = str(self.root).encode()
        alive = {pid: command for pid, _, command in _processes()}
        # the nodes' workers (process groups of their own) and anything else naming this cluster's temp dir
        for pid in strays + [pid for pid, command in alive.items() if marker in command]:
            if pid in alive and pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LoopbackCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


# -- the scenario ----------------------------------------------------------------------------------------------------
def committed(output: Path) -> list[dict]:
    log = output.with_name(output.name + ".partial") / "_manifest.jsonl"
    try:
        text = log.read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


@dataclass
class FaultReport:
    lines: int
    shards: int
    seconds_reference: float = 0.0  # the local engine, in process
    seconds_killed_driver: float = 0.0  # first run, until its SIGKILL
    seconds_resumed: float = 0.0  # the second run, start to exit
    seconds_after_node_kill: float = 0.0  # from the raylet's SIGKILL to the job's exit
    committed_before_driver_kill: int = 0
    committed_at_node_kill: int = 0
    killed_node: str = ""
    killed_mid_task: bool = False  # one of its actors was known to be inside a shard's task when the node was lost
    actor_failures: list[str] = field(default_factory=list)  # the GCS's "Actor is failed" lines, restarts left
    tasks_resubmitted: int = 0  # shards' tasks that Ray resubmitted (the driver's core-worker log)
    resubmissions: int = 0  # their attempts in all (backing off 100 ms, 200 ms, ... while the actor restarts)
    duplicate_commits: int = 0
    equal: bool = False
    nodes_logged: str = ""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fault_scenario(
    cluster: LoopbackCluster,
    work: Path,
    model: Path,
    lines: list[str],
    shard_lines: int,
    output_format: str = "parquet",
    driver_kill_after: int = 2,
    node_kill_after: int = 3,
    timeout: float = 240.0,
) -> tuple[FaultReport, str]:
    """The whole check; returns the figures and the resumed run's stderr. Raises AssertionError on any failure."""
    from tests.batch.test_job import assert_same_output, embed_file, write_lines

    source = write_lines(work / "in.txt", lines, final_newline=True)
    suffix = ".parquet" if output_format == "parquet" else ".h5"
    reference, output = work / f"local{suffix}", work / f"cluster{suffix}"
    report = FaultReport(lines=len(lines), shards=-(-len(lines) // shard_lines))
    began = time.perf_counter()
    assert embed_file(source, reference, "--model", model, "--shard-lines", shard_lines) == 0
    report.seconds_reference = time.perf_counter() - began

    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "embed-file",
        str(source),
        str(output),
        "--model",
        str(model),
        "--shard-lines",
        str(shard_lines),
        "--engine",
        "ray",
        "--ray-address",
        cluster.address,
        "--ray-actors",
        str(cluster.workers),
        "--threads",
        "1",
        "--no-progress",
    ]
    env = cluster.driver_env()

    # 1. the driver SIGKILLed once shards are committed
    began = time.perf_counter()
    with open(work / "driver-killed.log", "wb") as sink:
        driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_until(
                lambda: len(committed(output)) >= driver_kill_after or driver.poll() is not None,
                f"{driver_kill_after} commits",
                timeout,
            )
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait(30)
    report.seconds_killed_driver = time.perf_counter() - began
    first_log = (work / "driver-killed.log").read_text(errors="replace")
    assert driver.returncode == -signal.SIGKILL, f"the driver ended before its kill:\n{first_log[-3000:]}"
    assert not output.exists(), "killed mid-job: OUTPUT must not exist yet"
    kept = committed(output)
    report.committed_before_driver_kill = len(kept)
    partial = output.with_name(output.name + ".partial")
    identity = {entry["file"]: _identity(partial / entry["file"]) for entry in kept}  # kept as they are on resume
    assert driver_kill_after <= len(kept) < report.shards, len(kept)

    # 2. the same command again: it resumes; a worker node is lost while one of its actors runs a shard
    began = time.perf_counter()
    seen: Counter[int] = Counter()
    with open(work / "driver-resumed.log", "wb") as sink:
        driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:

            def ready() -> bool:
                entries = committed(output)
                seen.update(entry["shard"] for entry in entries[sum(seen.values()) :])
                if driver.poll() is not None:
                    return True
                enough = len(entries) >= len(kept) + node_kill_after
                return enough and any(node.hosts_actor() for node in cluster.worker_nodes)

            wait_until(ready, "resumed commits with an actor on a worker node", timeout)

            # Tasks of a small job are short: a worker is caught inside one for certain only by chance. Half of what
            # is left is given to that; then a node hosting an actor is lost whatever it runs (an idle actor holds no
            # task, and Ray then has nothing to retry: the report says which it was).
            first = len(kept) + node_kill_after
            give_up_at = first + (report.shards - first) // 2
            victim = None
            while victim is None and driver.poll() is None and len(committed(output)) < give_up_at:
                ready()  # counts the commits so far
                victim = cluster.lose_a_node_mid_task(within_s=0.5)
            report.killed_mid_task = victim is not None
            if victim is None:
                assert ready() and driver.poll() is None, "the resumed run ended before a node could be lost"
                victim = next(node for node in cluster.worker_nodes if node.hosts_actor())
                cluster.kill_raylet(victim)
            killed_at = time.perf_counter()
            report.committed_at_node_kill = len(committed(output))
            report.killed_node = victim.name
            while driver.poll() is None:
                ready()
                if time.perf_counter() - killed_at > timeout:
                    raise AssertionError("the job did not finish after the node was lost")
                time.sleep(0.05)
            report.seconds_after_node_kill = time.perf_counter() - killed_at
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait(30)
    report.seconds_resumed = time.perf_counter() - began
    log = (work / "driver-resumed.log").read_text(errors="replace")
    assert driver.returncode == 0, log[-4000:]

    # 3. what it left
    report.actor_failures = [
        re.sub(r".*?(Actor is failed).*?(need_reschedule = \d+).*?(remaining_restarts = \d+).*", r"\1: \2, \3", line)
        for line in cluster.gcs_log().splitlines()
        if "Actor is failed" in line
    ]
    resubmit = r"Attempting to resubmit task (\w+) for attempt number: (\d+)"
    attempts = set(re.findall(resubmit, cluster.driver_core_logs()))
    report.tasks_resubmitted, report.resubmissions = len({task for task, _ in attempts}), len(attempts)
    nodes = re.search(r"ray: \d+ shards on \d+ actors.*?; (\d+ nodes: [^\n]*)", log)
    report.nodes_logged = nodes[1] if nodes else ""
    report.duplicate_commits = sum(count - 1 for count in seen.values() if count > 1) + log.count("came back a second")
    resumed = sum(entry["n_lines"] for entry in kept)
    assert f"{resumed} resumed from an earlier run" in log, log[-3000:]
    manifest = json.loads((output / "_manifest.json").read_text()) if output_format == "parquet" else None
    if manifest is not None:
        assert {name: _identity(output / name) for name in identity} == identity, "a committed shard was rewritten"
        files = [entry["file"] for entry in manifest["shards"]]
        expected = [f"part-{number:06d}.parquet" for number in range(report.shards)]
        assert sorted(files) == expected and sorted(p.name for p in output.glob("part-*")) == expected, files
    assert report.duplicate_commits == 0, seen
    assert_same_output(output, reference, output_format)  # every vector, bit for bit
    report.equal = True
    return report, log


# -- `python -m tests.batch.ray_cluster ...` ---------------------------------------------------------------------------
def _ray_start(argv: list[str]) -> int:
    """Ray's own `ray start`, keeping a loopback --node-ip-address / --address as given (module doc)."""
    import ray._private.services as services

    services.resolve_ip_for_localhost = lambda host: host
    from ray.scripts.scripts import main

    sys.argv = ["ray", "start", *argv]
    return main()


def _check(argv: list[str]) -> int:
    """The full form (scripts/ray-cluster-check.sh): a bigger input, figures as JSON."""
    import argparse

    parser = argparse.ArgumentParser(prog="ray-cluster-check")
    parser.add_argument("--model", type=Path, default=None, help="default: a tiny random model built here")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--shard-lines", type=int, default=20)
    parser.add_argument("--format", choices=["parquet", "hdf5"], default="parquet")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here too (JSON)")
    args = parser.parse_args(argv)
    from tests.batch.test_job import corpus

    work = Path(tempfile.mkdtemp(prefix="elmo-ray-check-"))
    began = time.perf_counter()
    try:
        model = args.model
        if model is None:
            from elmo.bench.random_model import write_random_model

            model = write_random_model(
                work / "model", "tiny", seed=0, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5
            )
        with LoopbackCluster() as cluster:
            started = time.perf_counter() - began
            report, _ = fault_scenario(
                cluster,
                work,
                model.resolve(),
                corpus(args.lines),
                args.shard_lines,
                args.format,
                driver_kill_after=3,
                node_kill_after=5,
            )
        figures = report.as_dict() | {
            "model": str(args.model or "tiny random"),
            "format": args.format,
            "seconds_cluster_start": round(started, 1),
            "seconds_total": round(time.perf_counter() - began, 1),
        }
        text = json.dumps(figures, indent=1, default=str)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ray-start"]:
        sys.exit(_ray_start(sys.argv[2:]))
    if sys.argv[1:2] == ["check"]:
        sys.exit(_check(sys.argv[2:]))
    sys.exit("usage: python -m tests.batch.ray_cluster ray-start ARGS... | check [--lines N ...]")
