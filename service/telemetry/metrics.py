"""Prometheus metrics of the service, served on their own HTTP port (``--metrics-port``).

One registry per server instance (tests run several servers in one process). Names follow Prometheus
conventions; the list with meanings is in docs/reference/metrics.md.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Protocol

from elmo.service.telemetry.hooks import BatcherObserver
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
THROUGHPUT_WINDOW_S = 10.0


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "elmo_requests", "RPCs finished, by method and status code", ["method", "code"], registry=r
        )
        self.latency = Histogram(
            "elmo_request_latency_seconds",
            "RPC latency as seen by the server",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("elmo_requests_in_flight", "RPCs being handled", registry=r)
        # kept apart from the API's requests: probes, reflection, and HTTP requests that matched no route
        self.other_requests = Counter(
            "elmo_other_requests",
            "health checks, gRPC reflection and HTTP requests to no route, by kind, method and status code",
            ["kind", "method", "code"],
            registry=r,
        )
        self.queue_sentences = Gauge("elmo_queue_sentences", "sentences waiting to be batched", ["model"], registry=r)
        self.queue_tokens = Gauge("elmo_queue_tokens", "tokens waiting to be batched", ["model"], registry=r)
        self.batch_tokens = Histogram(
            "elmo_batch_tokens", "real tokens per runtime call", ["model"], buckets=TOKEN_BUCKETS, registry=r
        )
        # The buckets of elmo_batch_tokens, so that the two read side by side; 1 - their _sum ratio is the padding
        # waste (docs/reference/metrics.md).
        self.batch_padded_tokens = Histogram(
            "elmo_batch_padded_tokens",
            "positions the runtime ran per call: per onnxruntime run rows x (longest + 2), padding and <S>/</S> "
            "included",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_sentences = Histogram(
            "elmo_batch_sentences", "sentences per runtime call", ["model"], buckets=TOKEN_BUCKETS, registry=r
        )
        self.inference = Histogram(
            "elmo_inference_seconds", "runtime time per batch", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens = Counter("elmo_embedded_tokens", "tokens embedded", ["model"], registry=r)
        self.dropped = Counter(
            "elmo_dropped_sentences",
            "sentences not computed, by reason (overloaded, deadline, cancelled)",
            ["model", "reason"],
            registry=r,
        )
        self.ready = Gauge("elmo_model_ready", "1 once the model passed its warm-up forward", ["model"], registry=r)
        # --model-root (service.models.versions): versions loaded, refused and released while serving
        self.model_loads = Counter("elmo_model_loads", "model versions loaded and serving", ["model"], registry=r)
        self.load_failures = Counter(
            "elmo_model_load_failures",
            "model versions refused (failed to load, failed checks, memory)",
            ["model"],
            registry=r,
        )
        self.model_unloads = Counter("elmo_model_unloads", "model versions released", ["model"], registry=r)
        self.serving_version = Gauge(
            "elmo_model_serving_version",
            "the version that takes new requests (0: none, or --model DIR)",
            ["model"],
            registry=r,
        )
        self.tokens_per_second = Gauge(
            "elmo_tokens_per_second",
            f"tokens embedded per second over the last {THROUGHPUT_WINDOW_S:.0f} s",
            registry=r,
        )
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.tokens_per_second.set_function(self._throughput)
        self._http = None

    def serve_http(self, port: int, host: str = "0.0.0.0") -> int:
        """Expose /metrics on ``port`` (0 = any free port); returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def watch_connections(self, guard: ConnectionCounts) -> None:
        """Export an HTTP connection guard's counts (service.http.connections) at every scrape."""
        self.registry.register(_ConnectionCollector(guard))

    def observer(self, model: str) -> BatcherObserver:
        return _ModelObserver(self, model)

    def record_tokens(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def _throughput(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S


class ConnectionCounts(Protocol):
    open_connections: int
    closed_for: dict[str, int]


class _ConnectionCollector:
    def __init__(self, guard: ConnectionCounts):
        self.guard = guard

    def collect(self):
        yield GaugeMetricFamily("elmo_http_connections", "open HTTP connections", value=self.guard.open_connections)
        closed = CounterMetricFamily(
            "elmo_http_connections_closed",
            "HTTP connections the server closed, by reason (header_timeout, idle_timeout, over_capacity)",
            labels=["reason"],
        )
        for reason, count in self.guard.closed_for.items():
            closed.add_metric([reason], count)
        yield closed


class _ModelObserver(BatcherObserver):
    """One model's batcher metrics. Its label children are looked up once, here: ``labels()`` takes a lock and
    builds a key on every call, and these are called for every batch and every queue change."""

    def __init__(self, metrics: ServiceMetrics, model: str):
        self.m = metrics
        self.model = model
        self._queue_sentences = metrics.queue_sentences.labels(model)
        self._queue_tokens = metrics.queue_tokens.labels(model)
        self._batch_sentences = metrics.batch_sentences.labels(model)
        self._batch_tokens = metrics.batch_tokens.labels(model)
        self._batch_padded_tokens = metrics.batch_padded_tokens.labels(model)
        self._inference = metrics.inference.labels(model)
        self._tokens = metrics.tokens.labels(model)

    def queue_changed(self, sentences: int, tokens: int) -> None:
        self._queue_sentences.set(sentences)
        self._queue_tokens.set(tokens)

    def batch_done(self, sentences: int, tokens: int, padded_tokens: int, seconds: float) -> None:
        self._batch_sentences.observe(sentences)
        self._batch_tokens.observe(tokens)
        self._batch_padded_tokens.observe(padded_tokens)
        self._inference.observe(seconds)
        self._tokens.inc(tokens)
        self.m.record_tokens(tokens)

    def dropped(self, reason: str, count: int) -> None:
        self.m.dropped.labels(self.model, reason).inc(count)


__all__ = ["ServiceMetrics"]
