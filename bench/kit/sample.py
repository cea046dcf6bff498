"""What a process costs, read the same way by every bench (Linux): resident memory (``VmRSS``) and its peak
(``VmHWM``) from /proc/PID/status; CPU time from /proc/PID/stat, and this process's by thread; and a child command's
wall time, peak memory and CPU time from its own rusage (``os.wait4``)."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def rss_mib(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident set (``VmRSS``) or its peak (``VmHWM``) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (``VmHWM``) in MiB, since it started."""
    return rss_mib(pid, "VmHWM")


def cpu_seconds(pid: int, thread: int | None = None) -> float | None:
    """user + system CPU time of a process (all its threads, those that ended included), or of one of its threads;
    None once it is gone. In nanoseconds where Linux offers it, so that a process and its threads are read alike and
    a thread's few milliseconds count: the process's CPU-time clock (what clock_getcpuclockid(3) names; a process's
    schedstat would be its first thread's alone), a thread's /proc/PID/task/THREAD/schedstat. Else in clock ticks
    (10 ms) from .../stat."""
    try:
        if thread:
            return int(Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0]) / 1e9
        return time.clock_gettime(_process_cpu_clock(pid))
    except (OSError, ValueError, IndexError):
        pass
    base = f"/proc/{pid}/task/{thread}" if thread else f"/proc/{pid}"
    try:
        fields = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu_clock(pid: int) -> int:
    """Linux's clock id for a process's CPU time, all threads (glibc's clock_getcpuclockid: ``(~pid << 3) |
    CPUCLOCK_SCHED``), which Python's time module does not name."""
    return ((~pid) << 3) | 2


NATIVE = "native"  # threads that Python did not start (onnxruntime's own pool, for one)


class ThreadCpuSampler:
    """This process's CPU seconds by thread from :meth:`start` to :meth:`stop`, read from /proc/self/task every
    ``interval`` s, summed by Python thread name with a pool's trailing ``_N`` dropped (``elmo-run_0`` and
    ``elmo-run_1`` are ``elmo-run``); threads Python did not start are :data:`NATIVE`. A thread that ends between
    two readings loses at most one interval of its time; the sampler's own thread is left out.

    sampler = ThreadCpuSampler().start(); ...; seconds_by_name = sampler.stop()"""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="thread-cpu-sampler")
        self._before: dict[int, float] = {}  # CPU of the threads alive at start(), not counted
        self._last: dict[int, tuple[str, float]] = {}  # thread id -> (its name, its CPU at the last reading)

    def _readings(self) -> dict[int, float]:
        out = {}
        for task in os.listdir("/proc/self/task"):
            seconds = cpu_seconds(os.getpid(), int(task))
            if seconds is not None:
                out[int(task)] = seconds
        return out

    def sample(self) -> None:
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        for tid, seconds in self._readings().items():
            known = self._last.get(tid, (NATIVE, 0.0))[0]
            self._last[tid] = (names.get(tid, known), seconds)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def start(self) -> ThreadCpuSampler:
        self._before = self._readings()
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.sample()
        totals: dict[str, float] = {}
        for tid, (name, seconds) in self._last.items():
            if tid == self._thread.native_id:
                continue
            group = re.sub(r"_\d+$", "", name)
            totals[group] = totals.get(group, 0.0) + seconds - self._before.get(tid, 0.0)
        return {name: round(seconds, 3) for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1])}


@dataclass
class Measured:
    """A finished child command: exit code, wall seconds, its peak resident set (MiB) and CPU seconds."""

    returncode: int
    seconds: float
    peak_rss_mib: float
    cpu_s: float


def run_measured(command: list[str], **popen) -> Measured:
    """Run ``command`` to its end; its figures from its own rusage (``os.wait4``: this child only, not the bench's
    other children). ``popen``: subprocess.Popen's keywords (stdout, cwd, env)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, **popen)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    # ru_maxrss is in KiB on Linux
    return Measured(proc.returncode, seconds, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime)
