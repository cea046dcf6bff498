"""Client load against a served model: requests built once up front (gRPC messages, HTTP/JSON bodies),
``concurrency`` gRPC clients sending back to back through a warm-up and a measured window, the server's RSS and CPU
at the window's edges (and RSS every second inside it), and the same figures (:class:`LoadResult`) for the in-process
runtime; :class:`ClosedLoop`, client threads whose every call is kept; :class:`Http`, one kept-alive connection.

    requests = build_requests(make_texts(1024), 8, [], "float32")
    result = asyncio.run(drive(server.grpc_target, requests, 16, 30.0, MAX_REQUESTS, server_pid=server.pid))
    result.tokens_per_s, result.latency_ms["p99"]

A request counts when it answers (gRPC OK, a non-empty body) inside the window, with the tokens this
checkout's tokenizer finds in its texts; errors (gRPC status codes) are counted, never raised.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.kit.sample import cpu_seconds, rss_mib
from bench.kit.serve import REQUEST_TIMEOUT_S
from elmo.bench.figures import percentiles_ms

MAX_REQUESTS = 1_000_000
EMBED_METHOD = "/elmo.v1.Embedder/Embed"


@dataclass
class LoadResult:
    mode: str
    concurrency: int
    seconds: float
    requests: int
    sentences: int
    tokens: int
    errors: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    rss_mib: dict = field(default_factory=dict)
    cpu_s: float | None = None  # CPU seconds spent by the embedding process (server, or this one in-process)
    client_cpu_s: float | None = None  # CPU seconds of the load generator's clients (served runs)
    protocol: str | None = None  # "grpc" or "http" (served runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_s"] = round(self.tokens_per_s, 1)
        out["requests_per_s"] = round(self.requests_per_s, 2)
        out["tokens_per_cpu_s"] = round(self.tokens / self.cpu_s, 1) if self.cpu_s else None
        return out


def auth_metadata(auth_token: str | None) -> tuple | None:
    return (("authorization", f"Bearer {auth_token}"),) if auth_token else None


# -- requests --------------------------------------------------------------------------------------------------------
def build_requests(texts: list[str], per_request: int, layers: list[int], dtype: str) -> list[tuple[bytes, int, int]]:
    """(serialized EmbedRequest, sentences, tokens) for consecutive groups of texts."""
    from elmo.text.tokenize import tokenize
    from elmo.v1 import embedder_pb2 as pb
    from elmo.wire import DTYPE_NAMES

    out = []
    for start in range(0, len(texts) - per_request + 1, per_request):
        group = texts[start : start + per_request]
        request = pb.EmbedRequest(inputs=[pb.Input(text=t) for t in group], layers=layers, dtype=DTYPE_NAMES[dtype])
        out.append((request.SerializeToString(), len(group), sum(len(tokenize(t).tokens) for t in group)))
    return out


def build_http_requests(
    texts: list[str], per_request: int, layers: list[int], dtype: str
) -> list[tuple[bytes, int, int]]:
    """(``POST /v1/embed`` JSON body, sentences, tokens) for the same groups of texts as :func:`build_requests`,
    with the same layers and dtype, ``"encoding": "base64"`` (the vectors' bytes, as on the gRPC wire)."""
    from elmo.text.tokenize import tokenize

    out = []
    for start in range(0, len(texts) - per_request + 1, per_request):
        group = texts[start : start + per_request]
        body: dict = {"inputs": group, "dtype": dtype, "encoding": "base64"}
        if layers:
            body["layers"] = layers
        data = json.dumps(body, ensure_ascii=False).encode()
        out.append((data, len(group), sum(len(tokenize(t).tokens) for t in group)))
    return out


# -- HTTP ------------------------------------------------------------------------------------------------------------
class Http:
    """One kept-alive HTTP/1.1 connection that reconnects after an error or a ``Connection: close``."""

    def __init__(self, host: str, port: int, timeout: float = REQUEST_TIMEOUT_S, headers: dict | None = None):
        self.host, self.port, self.timeout = host, port, timeout
        self.headers = dict(headers or {})
        self.conn: http.client.HTTPConnection | None = None

    def connect(self) -> bool:
        """Open the connection now (so that a measured window sees no handshake); False if refused."""
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            self.conn.connect()
        except OSError:
            self.close()
            return False
        return True

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[str, bytes]:
        """-> (status as a string, body); a transport failure is ('conn:<ExceptionName>', b'')."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            headers = self.headers | ({"Content-Type": "application/json"} if body is not None else {})
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            data = response.read()
            if response.will_close:
                self.close()
            return str(response.status), data
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return f"conn:{type(exc).__name__}", b""

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# -- client threads --------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One call of a client thread: who, when (monotonic and wall clock), how long, what it returned or raised."""

    client: int
    turn: int
    started: float  # time.monotonic()
    wall: float  # time.time(), to line up with other processes' logs
    seconds: float
    value: object = None
    error: BaseException | None = None


class ClosedLoop:
    """One thread per step: thread i calls ``steps[i](turn)`` back to back (turn 0, 1, ...) until :meth:`stop` or
    ``seconds`` have passed; every call timed and kept as a :class:`Record` with what it returned or the exception
    it raised (counted, never raised). The benches and tests whose clients check each answer
    (bench.service.replicas, tests/service/test_http.py) run their calls through it; :func:`drive` is the
    pure-throughput loop.

        loop = ClosedLoop([grpc_call, http_call], seconds=60).run()      # or .start() ... .stop()
        [r.seconds for r in loop.records if r.error is None]"""

    def __init__(self, steps, seconds: float | None = None):
        self.steps = list(steps)
        self.seconds = seconds
        self.deadline: float | None = None  # set by start()
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True, name=f"client-{i}")
            for i in range(len(self.steps))
        ]

    def running(self) -> bool:
        return not self._stop.is_set() and (self.deadline is None or time.monotonic() < self.deadline)

    def _client(self, index: int) -> None:
        step, turn = self.steps[index], 0
        while self.running():
            started, wall, t0 = time.monotonic(), time.time(), time.perf_counter()
            try:
                value, error = step(turn), None
            except Exception as exc:  # noqa: BLE001 - every failure is a finding, recorded
                value, error = None, exc
            record = Record(index, turn, started, wall, time.perf_counter() - t0, value, error)
            with self.lock:
                self.records.append(record)
            turn += 1

    def start(self) -> ClosedLoop:
        if self.seconds is not None:
            self.deadline = time.monotonic() + self.seconds
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 300.0) -> list[Record]:
        """Stop the clients (each finishes its call in flight) and return the records."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        return self.records

    def run(self, timeout: float = 300.0) -> ClosedLoop:
        """Start, wait for ``seconds``, stop."""
        assert self.seconds is not None, "run() needs seconds"
        self.start()
        for thread in self._threads:
            thread.join(max(0.0, self.deadline - time.monotonic()) + timeout)
        self.stop(0)
        return self


# -- served load -----------------------------------------------------------------------------------------------------
class Window:
    """A measured window after ``warmup_s``, and the server's RSS / CPU and the clients' CPU at its edges."""

    def __init__(self, duration: float, warmup_s: float, server_pid: int | None):
        self.start = time.monotonic() + warmup_s
        self.end = self.start + duration
        self.duration, self.server_pid = duration, server_pid
        self.marks: dict[str, float | None] = {}
        self.rss: list[float] = []

    def inside(self) -> bool:
        return self.start <= time.monotonic() <= self.end

    def mark(self, edge: str) -> None:
        """Server RSS and CPU and this process's CPU at the window's ``edge`` ("start" or "end")."""
        pid = self.server_pid
        self.marks[f"rss_{edge}"] = rss_mib(pid) if pid else None
        self.marks[f"cpu_{edge}"] = cpu_seconds(pid) if pid else None
        self.marks[f"client_cpu_{edge}"] = time.process_time()

    def sample(self) -> float:
        """Take the server's RSS; the seconds to sleep until the next sample (at most 1)."""
        if self.server_pid and (value := rss_mib(self.server_pid)) is not None:
            self.rss.append(value)
        return min(1.0, max(0.0, self.end - time.monotonic()))

    def result(self, protocol: str, concurrency: int, counts: dict, errors: dict, latencies: list) -> LoadResult:
        """One served phase's figures, the same for both protocols."""
        marks, rss, cpu = self.marks, self.rss, None
        if marks.get("cpu_start") is not None and marks.get("cpu_end") is not None:
            cpu = round(marks["cpu_end"] - marks["cpu_start"], 2)
        return LoadResult(
            mode="served",
            concurrency=concurrency,
            seconds=round(self.duration, 3),
            requests=counts["requests"],
            sentences=counts["sentences"],
            tokens=counts["tokens"],
            errors=errors,
            latency_ms=percentiles_ms(latencies),
            rss_mib={
                "start": marks.get("rss_start"),
                "end": marks.get("rss_end"),
                "max": max(rss, default=None),
                "every_10s": [round(v, 1) for v in rss[::10]],
            },
            cpu_s=cpu,
            client_cpu_s=round(marks["client_cpu_end"] - marks["client_cpu_start"], 2),
            protocol=protocol,
        )


async def drive(
    target: str,
    requests: list[tuple[bytes, int, int]],
    concurrency: int,
    duration: float,
    max_requests: int,
    auth_token: str | None = None,
    server_pid: int | None = None,
    warmup_s: float = 0.0,
) -> LoadResult:
    """``concurrency`` clients (one channel each) send requests back to back until ``duration`` or ``max_requests``;
    serialized once up front, answers not decoded."""
    import grpc
    import grpc.aio

    metadata = auth_metadata(auth_token)
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(concurrency)]
    calls = [c.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=None) for c in channels]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counts = {"requests": 0, "sentences": 0, "tokens": 0}
    issued = 0

    async def client(index: int, window: Window) -> None:
        """Send back to back until the window closes; count the requests that complete inside the window."""
        nonlocal issued
        rng = random.Random(index)
        while time.monotonic() < window.end and issued < max_requests:
            issued += 1
            data, n_sentences, n_tokens = requests[rng.randrange(len(requests))]
            started = time.perf_counter()
            try:
                response = await calls[index](data, timeout=REQUEST_TIMEOUT_S, metadata=metadata)
                ok = len(response) > 0
            except grpc.aio.AioRpcError as exc:  # every error counts, in the warm-up and the tail too
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                ok = False
            if ok and window.inside():
                latencies.append(time.perf_counter() - started)
                counts["requests"] += 1
                counts["sentences"] += n_sentences
                counts["tokens"] += n_tokens

    async def sampler(window: Window) -> None:
        await asyncio.sleep(max(0.0, window.start - time.monotonic()))
        window.mark("start")
        while time.monotonic() < window.end:
            await asyncio.sleep(window.sample())
        window.mark("end")

    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
        # Clients run through warm-up, window and tail without a pause, so the window sees a steady state.
        window = Window(duration, warmup_s, server_pid)
        await asyncio.gather(sampler(window), *(client(i, window) for i in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return window.result("grpc", concurrency, counts, errors, latencies)


# -- in-process baseline -----------------------------------------------------------------------------------------------
def load_embedder(model_dir: Path, threads: int | None, texts: list[str], batch: int):
    from elmo.runtime import Embedder

    embedder = Embedder(model_dir, intra_op_threads=threads)
    embedder.warmup()
    embedder.embed_texts(texts[:batch])
    return embedder


def measure_in_process(embedder, texts: list[str], duration: float, batch: int) -> LoadResult:
    """Embedder.embed_texts on the same texts, ``batch`` texts per call, back to back for ``duration`` seconds."""
    latencies, n_tokens, n_texts, calls = [], 0, 0, 0
    cpu_start = time.process_time()
    started = time.monotonic()
    position = 0
    while time.monotonic() - started < duration:
        chunk = texts[position : position + batch] or texts[:batch]
        position = (position + batch) % len(texts)
        t0 = time.perf_counter()
        results = embedder.embed(chunk)
        latencies.append(time.perf_counter() - t0)
        n_tokens += sum(len(result.tokens) for result in results)
        n_texts += len(chunk)
        calls += 1
    seconds = time.monotonic() - started
    cpu = time.process_time() - cpu_start
    return LoadResult(
        "in-process",
        1,
        round(seconds, 3),
        calls,
        n_texts,
        n_tokens,
        latency_ms=percentiles_ms(latencies),
        cpu_s=round(cpu, 2),
    )
