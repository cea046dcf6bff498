"""The group's one /metrics (service.telemetry.group_metrics): each process's real ServiceMetrics served on its own
port, merged at every scrape of the group's: counters and histograms summed, gauges per process, a replaced
process's last counts kept, and the exposition a Prometheus parser reads."""

from __future__ import annotations

import pytest
from elmo.service.telemetry.group_metrics import GroupCollector, serve_group_metrics
from elmo.service.telemetry.metrics import ServiceMetrics
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from tests.service_helpers import metric_value, scrape


def process_metrics(calls: int, latency_s: float, queue: int) -> ServiceMetrics:
    metrics = ServiceMetrics()
    for _ in range(calls):
        metrics.requests.labels("Embed", "OK").inc()
        metrics.latency.labels("Embed").observe(latency_s)
    metrics.queue_sentences.labels("default").set(queue)
    return metrics


@pytest.fixture
def group():
    """Two processes' metrics on their ports, and the group's /metrics over them (pids 100 and 101)."""
    processes = [process_metrics(3, 0.002, 5), process_metrics(4, 0.2, 7)]
    places: list[tuple[int, int] | None] = [(100 + i, m.serve_http(0, "127.0.0.1")) for i, m in enumerate(processes)]

    def own():
        yield GaugeMetricFamily("elmo_group_processes", "server processes warm", value=len(places))

    collector = GroupCollector(lambda: places, own)
    server, port = serve_group_metrics(collector, 0, "127.0.0.1")
    yield processes, places, port, collector
    server.shutdown()
    for metrics in processes:
        metrics.close()


def test_counters_and_histograms_are_summed_gauges_kept_per_process(group) -> None:
    _, _, port, _ = group
    text = scrape(port)
    assert metric_value(text, "elmo_requests_total", method="Embed", code="OK") == 7.0
    assert metric_value(text, "elmo_request_latency_seconds_count", method="Embed") == 7.0
    assert metric_value(text, "elmo_request_latency_seconds_bucket", method="Embed", le="0.0025") == 3.0
    assert metric_value(text, "elmo_request_latency_seconds_bucket", method="Embed", le="+Inf") == 7.0
    assert metric_value(text, "elmo_request_latency_seconds_sum", method="Embed") == pytest.approx(3 * 0.002 + 0.8)
    assert metric_value(text, "elmo_queue_sentences", model="default", process="0") == 5.0
    assert metric_value(text, "elmo_queue_sentences", model="default", process="1") == 7.0
    assert metric_value(text, "elmo_group_processes") == 2.0
    families = {family.name: family for family in text_string_to_metric_families(text)}  # what Prometheus reads
    assert families["elmo_requests"].type == "counter"
    assert families["elmo_request_latency_seconds"].type == "histogram"
    assert "_created" not in text  # a sum has no single creation time


def test_a_replaced_process_leaves_its_counts_and_not_its_gauges(group) -> None:
    processes, places, port, _ = group
    assert metric_value(scrape(port), "elmo_requests_total", method="Embed", code="OK") == 7.0
    processes[0].close()
    places[0] = None  # gone: its last scraped counts still count
    text = scrape(port)
    assert metric_value(text, "elmo_requests_total", method="Embed", code="OK") == 7.0
    assert metric_value(text, "elmo_queue_sentences", model="default", process="0") is None
    successor = process_metrics(2, 0.002, 0)
    processes[0] = successor
    places[0] = (200, successor.serve_http(0, "127.0.0.1"))  # another pid in the same place: counts start at 0
    text = scrape(port)
    assert metric_value(text, "elmo_requests_total", method="Embed", code="OK") == 3.0 + 4.0 + 2.0
    assert metric_value(text, "elmo_request_latency_seconds_bucket", method="Embed", le="0.0025") == 3.0 + 2.0
    assert metric_value(text, "elmo_queue_sentences", model="default", process="0") == 0.0
    successor.requests.labels("Embed", "OK").inc()
    assert metric_value(scrape(port), "elmo_requests_total", method="Embed", code="OK") == 10.0


def test_counts_read_between_scrapes_outlive_a_killed_process(group) -> None:
    """The supervisor reads its processes between scrapes (remember): what a process counted before its last read
    still counts once it is gone, though no scrape came in between."""
    processes, places, port, collector = group
    processes[1].requests.labels("Embed", "OK").inc(5)
    collector.remember()
    processes[1].close()
    places[1] = None
    assert metric_value(scrape(port), "elmo_requests_total", method="Embed", code="OK") == 3.0 + 4.0 + 5.0
