"""A real gRPC server on 127.0.0.1 in a background thread (its own event loop), for the service tests.

No mocks: the server, the batcher, the onnxruntime session and the sockets are the real ones. The worker thread of
a model's batcher can be held (:meth:`ServerThread.hold_worker`) to make queueing, overload and deadline tests
deterministic without sleeping on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from elmo.service.common.limits import Limits
from elmo.service.models.registry import serve_model
from elmo.service.server import ElmoServer, TlsFiles
from elmo.service.telemetry.metrics import ServiceMetrics

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime.tasks import Task, save_task

# Small limits so that every hard edge is cheap to reach with the tiny model (dim 16, 3 layers: 192 B per token).
EDGE_LIMITS = Limits(
    max_inputs=8,
    max_tokens_per_sentence=20,
    max_tokens_per_request=60,
    max_message_bytes=16 * 1024,
    max_response_bytes=8 * 1024,
    max_pooled_inputs=16,  # /v1/embeddings: more than one chunk of max_inputs / max_tokens_per_request
    max_pooled_tokens=120,
    max_queue_tokens=64,
    max_batch_tokens=64,
    max_batch_sentences=16,
    max_delay_ms=1.0,
    express_tokens=0,  # one runtime worker: what queues and what runs is exact (test_batcher covers the express one)
    drain_seconds=2.0,
).validate()


class ServerThread:
    def __init__(
        self,
        runtimes: dict[str, object],
        limits: Limits = EDGE_LIMITS,
        tls: TlsFiles | None = None,
        auth_token: str | None = None,
        metrics_port: int | None = None,
        http: bool = False,
        **server_options,
    ):
        """``server_options``: more ElmoServer keywords (aliases, normalize)."""
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-server", daemon=True)
        self.thread.start()
        self.metrics = ServiceMetrics()
        self.server: ElmoServer = self.call(
            self._create(runtimes, limits, tls, auth_token, 0 if http else None, server_options)
        )
        self.port = self.call(self.server.start())
        scheme = "https" if tls else "http"
        self.http_url = f"{scheme}://127.0.0.1:{self.server.http_port}" if http else None
        self.metrics_port = (
            self.metrics.serve_http(metrics_port or 0, "127.0.0.1") if metrics_port is not None else None
        )
        self.target = f"127.0.0.1:{self.port}"

    async def _create(self, runtimes, limits, tls, auth_token, http_port, options) -> ElmoServer:
        models = [
            serve_model(runtime, Path(runtime.info.model_dir), limits, self.metrics.observer(name), name=name)
            for name, runtime in runtimes.items()
        ]
        return ElmoServer(
            models,
            limits,
            self.metrics,
            host="127.0.0.1",
            port=0,
            tls=tls,
            auth_token=auth_token,
            http_port=http_port,
            **options,
        )

    def call(self, coro, timeout: float = 60.0):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def warm_up(self) -> None:
        self.call(self.server.warm_up())

    def model(self, name: str = ""):
        return self.server.registry.get(name)

    @contextlib.contextmanager
    def hold_worker(self, name: str = ""):
        """Occupy the model's runtime threads (the express and background ones too): batches queue up behind them
        until the block exits."""
        batcher = self.model(name).batcher
        release = threading.Event()
        started = threading.Semaphore(0)

        def occupy() -> None:
            started.release()
            release.wait(60)

        futures = [batcher.executor.submit(occupy) for _ in range(batcher.threads)]
        if batcher.background is not None:
            futures += [batcher.background.submit(occupy) for _ in range(batcher.workers)]
        for _ in futures:
            started.acquire(timeout=10)
        try:
            yield
        finally:
            release.set()
            for future in futures:
                future.result(10)

    def queued_tokens(self, name: str = "") -> int:
        return self.model(name).batcher.queued_tokens

    def metric(self, name: str, **labels) -> float:
        """Current value of one sample in the server's registry (0 when absent)."""
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def stop(self) -> None:
        try:
            self.call(self.server.drain(grace=1.0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@contextlib.contextmanager
def calling(target: str, call: Callable[[EmbedderClient], object], threads: int) -> Iterator[list]:
    """``threads`` caller threads, each on a connection of its own to ``target``, making ``call(client)`` again and
    again while the block runs: the list it gives holds every outcome as it comes, the call's result or, where the
    client gave up (after its documented retries), the error's text. The callers finish their call in flight and
    are joined when the block ends, whatever ended it."""
    stop, outcomes = threading.Event(), []

    def call_until_stopped() -> None:
        with EmbedderClient(target, timeout=30) as client:
            while not stop.is_set():
                try:
                    outcomes.append(call(client))
                except RemoteError as error:
                    outcomes.append(str(error))

    callers = [threading.Thread(target=call_until_stopped, name=f"test-caller-{i}") for i in range(threads)]
    for caller in callers:
        caller.start()
    try:
        yield outcomes
    finally:
        stop.set()
        for caller in callers:
            caller.join(60)


def limits_with(**changes) -> Limits:
    return replace(EDGE_LIMITS, **changes).validate()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape_until(port: int, name: str, wait_s: float = 10.0, **labels) -> str:
    """Scrapes until ``name{labels}`` appears: grpc sends an aborted RPC's status to the client *before* the
    observer's ``finally`` counts it, so a scrape right after the client sees the error can miss it."""
    deadline = time.monotonic() + wait_s
    while True:
        text = scrape(port)
        if metric_value(text, name, **labels) is not None or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def metric_value(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    return None


def self_signed_cert(directory: Path) -> TlsFiles:
    """A throwaway certificate for 127.0.0.1 / localhost made with the openssl CLI."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return TlsFiles(cert, key)


def call(url: str, path: str, body=None, *, raw: bytes | None = None, headers=None, method=None, context=None):
    """(status, parsed JSON body) for one request; HTTP errors are answers too."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"}, method=method)
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


POS_DEMO = Task("pos_demo", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8, layer_norm=True)  # a fixed, uneven mix


def model_with_pos_demo(tiny_model_dir: Path, folder: Path) -> Path:
    """A copy of the tiny model in ``folder``/model with one stored task mix, POS_DEMO."""
    directory = folder / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, POS_DEMO)
    return directory
