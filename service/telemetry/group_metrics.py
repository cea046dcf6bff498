"""One ``/metrics`` for an ``elmo serve --processes N`` group, served by the supervisor on ``--metrics-port``.

Each process serves its own metrics on a port of 127.0.0.1 only the supervisor reads; a scrape of the group's port
reads them all at that moment and merges them: counters and histograms summed (every process uses the same buckets),
gauges kept per process with a ``process`` label (0 .. N-1: a queue length or a version is a per-process fact, and a
sum of them would hide which process is stuck). A process that was replaced (service.processes restarts a crashed
one) leaves its last scraped counts behind, added to its successor's, so that the group's counters never go down
within the supervisor's life; the supervisor also reads every process every REMEMBER_EVERY_S between scrapes, so
what a killed process counted and nobody read is at most that much. The
supervisor's own figures (processes running, restarts, the version the whole group serves) come with them.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("service.metrics")

SCRAPE_TIMEOUT_S = 5.0
REMEMBER_EVERY_S = 5.0  # how often the supervisor reads its processes' counts between scrapes
SUMMED_TYPES = ("counter", "histogram", "summary")
PROCESS_LABEL = "process"

SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


@dataclass
class Family:
    name: str
    documentation: str
    type: str
    values: dict[SampleKey, float] = field(default_factory=dict)


def parse(text: str) -> dict[str, Family]:
    """A process's exposition text -> its families (``_created`` samples left out: a sum has no creation time)."""
    families: dict[str, Family] = {}
    for parsed in text_string_to_metric_families(text):
        family = families.setdefault(parsed.name, Family(parsed.name, parsed.documentation, parsed.type))
        for sample in parsed.samples:
            if sample.name.endswith("_created"):
                continue
            family.values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    # the text format has no _created: a counter's or histogram's comes back as a gauge family of its own
    created = [name for name in families if name.endswith("_created") and _summed(families.get(name[:-8]))]
    for name in created:
        del families[name]
    return families


def _summed(family: Family | None) -> bool:
    return family is not None and family.type in SUMMED_TYPES


def merge(per_process: dict[int, dict[str, Family]], retired: dict[str, Family]) -> dict[str, Family]:
    """Counters and histograms summed over the processes (and what replaced processes counted); gauges labelled
    with their process."""
    merged: dict[str, Family] = {}
    sources = [(None, retired)] + sorted(per_process.items())
    for index, families in sources:
        for family in families.values():
            into = merged.setdefault(family.name, Family(family.name, family.documentation, family.type))
            for (sample, labels), value in family.values.items():
                if family.type in SUMMED_TYPES:
                    key = (sample, labels)
                    into.values[key] = into.values.get(key, 0.0) + value
                elif index is not None:  # a replaced process's gauges say nothing about now
                    into.values[(sample, tuple(sorted((*labels, (PROCESS_LABEL, str(index))))))] = value
    return merged


def add_into(total: dict[str, Family], families: dict[str, Family]) -> None:
    """Fold a replaced process's last counts into ``total`` (its gauges are dropped)."""
    for family in families.values():
        if family.type not in SUMMED_TYPES:
            continue
        into = total.setdefault(family.name, Family(family.name, family.documentation, family.type))
        for key, value in family.values.items():
            into.values[key] = into.values.get(key, 0.0) + value


def to_metric(family: Family) -> Metric:
    metric = Metric(family.name, family.documentation, family.type)
    for (sample, labels), value in sorted(family.values.items()):
        metric.add_sample(sample, dict(labels), value)
    return metric


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as response:
        return response.read().decode()


class GroupCollector:
    """A prometheus_client collector: at every scrape, every process's metrics merged, then the supervisor's own.

    ``processes()`` gives, for every place in the group, (the pid of the process there, its metrics port) or None
    while no process there serves metrics; ``own()`` the supervisor's families."""

    def __init__(self, processes: Callable[[], list[tuple[int, int] | None]], own: Callable[[], Iterable[Metric]]):
        self.processes = processes
        self.own = own
        self.retired: dict[str, Family] = {}
        self._last: dict[int, tuple[int, dict[str, Family]]] = {}  # place -> (pid, its last read)
        self._lock = threading.Lock()  # scrapes come on the HTTP server's threads, remember() on the supervisor's

    def remember(self) -> None:
        """Read every process now (between scrapes), so that one killed later leaves recent counts behind."""
        self._read()

    def keep_remembering(self, every_s: float = REMEMBER_EVERY_S) -> threading.Event:
        """:meth:`remember` every ``every_s`` on a thread of its own, until the returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                self.remember()

        threading.Thread(target=loop, name="group-metrics", daemon=True).start()
        return stop

    def collect(self) -> Iterable[Metric]:
        read = self._read()
        with self._lock:
            per_process = dict(read)
            for index, (_pid, families) in self._last.items():  # one between two lives: its last counts still count
                if index not in per_process:
                    per_process[index] = {n: f for n, f in families.items() if f.type in SUMMED_TYPES}
            merged = [to_metric(family) for family in merge(per_process, self.retired).values()]
        yield from merged
        yield from self.own()

    def _read(self) -> dict[int, dict[str, Family]]:
        """Every process's families now (those that answer), remembered as their last."""
        found: dict[int, tuple[int, dict[str, Family]]] = {}
        for index, process in enumerate(self.processes()):
            if process is None:
                continue
            pid, port = process
            try:
                found[index] = (pid, parse(scrape_text(port)))
            except (OSError, ValueError) as error:  # restarting, or gone since: its counts come from its last read
                log.info("metrics of server process %d not read: %s", pid, error)
        with self._lock:
            for index, (pid, families) in found.items():
                self._replaced(index, pid)
                self._last[index] = (pid, families)
        return {index: families for index, (_pid, families) in found.items()}

    def _replaced(self, index: int, pid: int) -> None:
        """The process at ``index`` is now ``pid``: a predecessor's last counts join the retired ones."""
        last = self._last.get(index)
        if last is not None and last[0] != pid:
            add_into(self.retired, last[1])
            del self._last[index]


def serve_group_metrics(collector: GroupCollector, port: int, host: str) -> tuple[object, int]:
    """``/metrics`` of the group on ``host:port`` (0: any free port): (the HTTP server, its port)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_address[1]


__all__ = ["GroupCollector", "merge", "parse", "serve_group_metrics"]
