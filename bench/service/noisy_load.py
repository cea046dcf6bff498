"""The load side of bench.service.noisy: the worst legal requests for a server's limits, and the three worker processes
(well-behaved clients, abusers, health prober) that send them and record every event with ``time.monotonic()``
(one clock for all processes on Linux). Workers are spawned, not forked, so no gRPC state crosses a fork.
"""

from __future__ import annotations

import json
import multiprocessing
import queue as queue_module
import random
import re
import threading
import time

from bench.kit.load import ClosedLoop, Http

PROBE_INTERVAL_S = 0.05
HEALTH_BAR_MS = 250.0
WINDOW_TOKENS = 8000
_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their its new said would more will if has can two language model word "
    "vectors river bank money apple company fruit market people government year time service network context layer"
).split()


# -- the requests ------------------------------------------------------------------------------------------------
def server_limits(target: str) -> dict:
    """The limits and shape the server reports (GetModelInfo): what the abusers size their requests by."""
    from elmo.client import EmbedderClient

    with EmbedderClient(target) as client:
        info = client.model_info()
    limits = info.limits
    return {
        "max_inputs": limits.max_inputs,
        "max_tokens_per_sentence": limits.max_tokens_per_sentence or info.max_tokens_per_sentence,
        "max_tokens_per_request": limits.max_tokens_per_request,
        "max_message_bytes": limits.max_message_bytes,
        "max_response_bytes": limits.max_response_bytes,
        "n_layers": info.n_layers,
        "dim": info.dim,
        "tasks": list(info.tasks),
        "max_pooled_inputs": limits.max_pooled_inputs,
        "max_pooled_tokens": limits.max_pooled_tokens,
    }


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return rng.choices(_WORDS, k=n)


def _repeated_body(prefix: str, unit: str, suffix: str, limit: int, count: int | None = None) -> tuple[bytes, int]:
    """prefix + unit * N + suffix, N = ``count`` or as many as keep the body under ``limit`` bytes (64 to spare)."""
    fits = (limit - len(prefix) - len(suffix) - 64) // len(unit)
    n = fits if count is None else min(count, fits)
    return (prefix + unit * n + suffix).encode(), n


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _token_lists(total: int, per_sentence: int, seed: int) -> list[list[str]]:
    words = _words(total, seed)
    return [words[i : i + per_sentence] for i in range(0, total, per_sentence)]


def _window_text(limits: dict) -> tuple[str, int]:
    tokens = min(WINDOW_TOKENS, limits["max_tokens_per_request"], _tokens_fitting(limits, limits["n_layers"]))
    return " ".join(_words(tokens, seed=3)), tokens


def _tokens_fitting(limits: dict, vectors_per_token: int) -> int:
    """The most tokens whose float32 answer stays under --max-response-bytes (the server's own estimate adds the
    token strings and a little framing: 64 bytes a token is plenty)."""
    per_token = vectors_per_token * limits["dim"] * 4 + 64
    return max(1, (limits["max_response_bytes"] - 4096) // per_token)


# -- the abusers' requests: the largest of each kind that the server *accepts* -------------------------------------
# Each builder makes its kind's request for a token count; the upper bound is what the limits allow on paper, and
# fit_abuse_sizes shrinks it while the server refuses it (413), so that every abuser's request is one the server
# takes and computes (issue 39: three of five kinds had only been refused).
def _pooled(limits: dict, tokens: int) -> dict:
    """POST /v1/embeddings: --max-pooled-inputs texts, ``tokens`` tokens in all (one pooled vector each)."""
    n = max(1, min(limits["max_pooled_inputs"], tokens))
    words = _words(tokens, seed=4)
    inputs = [" ".join(words[i * tokens // n : (i + 1) * tokens // n]) for i in range(n)]  # as even as can be
    what = f"{len(inputs):,} inputs, {tokens:,} tokens, pooled"
    return {"path": "/v1/embeddings", "body": _json({"input": inputs}), "what": what}


def _most_tokens(limits: dict, tokens: int) -> dict:
    """POST /v1/embed: --max-inputs sentences, ``tokens`` tokens in all, every layer, base64."""
    inputs = _token_lists(tokens, max(1, -(-tokens // limits["max_inputs"])), seed=1)
    what = f"{len(inputs)} sentences, {tokens:,} tokens, base64"
    return {"path": "/v1/embed", "body": _json({"inputs": inputs, "encoding": "base64"}), "what": what}


def _window(limits: dict, tokens: int) -> dict:
    """POST /v1/embed: one text of ``tokens`` tokens under overflow "window" (overlapping windows), base64."""
    body = _json({"inputs": [" ".join(_words(tokens, seed=3))], "overflow": "window", "encoding": "base64"})
    return {"path": "/v1/embed", "body": body, "what": f"one text of {tokens:,} tokens, window, base64"}


def _tokenize(limits: dict, tokens: int) -> dict:
    """POST /v1/tokenize: ``tokens`` tokens of words as long as fill the body limit (the tokenizer's work grows
    with the characters, the token limit with the tokens)."""
    length = max(1, (limits["max_message_bytes"] - 256) // max(1, tokens) - 1)
    word = ("apple" * (length // 5 + 1))[:length]
    body = _json({"text": " ".join([word] * tokens)})
    return {"path": "/v1/tokenize", "body": body, "what": f"{tokens:,} tokens of {length:,} characters"}


def _largest_json(limits: dict, tokens: int) -> dict:
    """POST /v1/embed, JSON numbers, every layer and a task's mix (the largest answer to encode as text)."""
    task = limits["tasks"][0] if limits["tasks"] else ""
    inputs = _token_lists(tokens, min(limits["max_tokens_per_sentence"], tokens), seed=2)
    request = {"inputs": inputs, "encoding": "float"} | ({"task": task} if task else {})
    what = f"{len(inputs)} sentences, {tokens:,} tokens, all layers{' + ' + task if task else ''}, float"
    return {"path": "/v1/embed", "body": _json(request), "what": what}


def _upper_bounds(limits: dict) -> dict[str, int]:
    """Each kind's token count as the limits allow it on paper."""
    per_request = limits["max_tokens_per_request"]
    task_vectors = limits["n_layers"] + (1 if limits["tasks"] else 0)
    return {
        "largest-pooled": limits["max_pooled_tokens"],
        "most-tokens": min(
            per_request,
            limits["max_inputs"] * limits["max_tokens_per_sentence"],
            _tokens_fitting(limits, limits["n_layers"]),
        ),
        "largest-window": per_request,
        "largest-tokenize": per_request,
        "largest-json": min(per_request, _tokens_fitting(limits, task_vectors)),
    }


BUILDERS = {
    "largest-pooled": _pooled,
    "most-tokens": _most_tokens,
    "largest-window": _window,
    "largest-tokenize": _tokenize,
    "largest-json": _largest_json,
}
ABUSE_KINDS = tuple(BUILDERS)


def abuse_request(limits: dict, kind: str, tokens: int | None = None) -> dict:
    """One kind's request: {kind, path, body, what}, at the fitted size (or ``tokens``, or the upper bound)."""
    fitted = limits.get("fitted", {})
    n = tokens or fitted.get(kind) or _upper_bounds(limits)[kind]
    item = {"kind": kind, **BUILDERS[kind](limits, n), "tokens": n}
    item["what"] += f" ({len(item['body']) / 1e6:.2f} MB body)"
    return item


def abuse_requests(limits: dict) -> list[dict]:
    """The worst accepted requests for these limits, one per kind (bodies built once, sent many times)."""
    return [abuse_request(limits, kind) for kind in ABUSE_KINDS]


_SIZE = re.compile(r"([0-9.]+) (bytes|KiB|MiB|GiB)")
_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}
_COUNT = re.compile(r"(?:has|of|would be) (?:more than )?([0-9,]+) tokens?.*?(?:limit of|over) ([0-9,]+)")


def _shrink(tokens: int, refusal: str) -> int:
    """The next try after a 413: scaled by limit / size where the refusal names both (bytes or tokens), 2 % under;
    halved where it names none."""
    sizes = [float(n) * _UNITS[unit] for n, unit in _SIZE.findall(refusal)]
    if len(sizes) >= 2 and sizes[0] > sizes[1] > 0:
        return max(1, int(tokens * 0.98 * sizes[1] / sizes[0]))
    counts = _COUNT.search(refusal)
    if counts:
        have, limit = (int(x.replace(",", "")) for x in counts.groups())
        if have > limit > 0:
            return max(1, min(tokens - 1, int(tokens * limit / have)))
    return max(1, tokens // 2)


def fit_abuse_sizes(http_url: str, limits: dict, tries: int = 8) -> tuple[dict[str, int], dict[str, list]]:
    """Each kind's largest token count that this server takes: from the upper bound, shrunk while refused (413).
    The one request accepted at the end is computed, before the measured phases.
    -> ({kind: tokens}, {kind: [(tokens, status)]})."""
    host, port = http_url.split("//", 1)[1].rsplit(":", 1)
    sizes, tried = {}, {}
    for kind in ABUSE_KINDS:
        tokens, tried[kind] = _upper_bounds(limits)[kind], []
        for _ in range(tries):
            item = abuse_request(limits, kind, tokens)
            conn = Http(host, int(port), 600)
            status, data = conn.call("POST", item["path"], item["body"])
            conn.close()
            tried[kind].append((tokens, status))
            if status != "413" or tokens <= 1:
                break
            tokens = _shrink(tokens, data.decode("utf-8", "replace"))
        sizes[kind] = tokens
    return sizes, tried


def single_requests(limits: dict) -> list[dict]:
    """The issue's four worst single requests, each capped at the body limit."""
    limit = limits["max_message_bytes"]
    out = []
    body, n = _repeated_body('{"input":"', "apple ", '"}', limit, 900_000)
    out.append({"kind": "embeddings-5.4MB", "path": "/v1/embeddings", "body": body, "what": f'"apple " x {n:,}'})
    body, n = _repeated_body('{"text":"', "apple pie ", '"}', limit, 700_000)
    out.append({"kind": "tokenize-7MB", "path": "/v1/tokenize", "body": body, "what": f'"apple pie " x {n:,}'})
    text, n = _window_text(limits)
    body = _json({"inputs": [text], "overflow": "window", "encoding": "float"})
    out.append({"kind": "window-8000", "path": "/v1/embed", "body": body, "what": f"{n:,} tokens, window, float"})
    body, n = _repeated_body('{"input":"', "apple ", '"}', min(limit, 1_000_000 + 64 + 12))
    out.append({"kind": "embeddings-1MB", "path": "/v1/embeddings", "body": body, "what": f'"apple " x {n:,}'})
    for item in out:
        item["what"] += f" ({len(item['body']) / 1e6:.2f} MB body)"
    return out


# -- worker processes (spawned: no gRPC state crosses a fork) -------------------------------------------------------
def clients_process(grpc_target, http_url, texts, n_grpc, n_http, ready, stop, out) -> None:
    """``n_grpc`` EmbedderClient clients and ``n_http`` /v1/embeddings clients (bench.kit.load.ClosedLoop), one
    sentence per request, back to back until ``stop``; each connected and warm first. Events: (protocol, start,
    end, status)."""
    from elmo.client import EmbedderClient, RemoteError

    host, port = http_url.split("//", 1)[1].rsplit(":", 1)

    def grpc_step(index: int):
        rng = random.Random(index)
        client = EmbedderClient(grpc_target, timeout=120)
        client.wait_ready(30)
        client.embed([texts[0]])
        closers.append(client.close)

        def step(turn: int) -> str:
            try:
                (result,) = client.embed([texts[rng.randrange(len(texts))]])
                return "OK" if result.layers is not None else "EMPTY"
            except RemoteError as exc:
                return exc.code.name

        return step

    def http_step(index: int):
        rng = random.Random(1000 + index)
        conn = Http(host, int(port), 120)
        conn.call("POST", "/v1/embeddings", json.dumps({"input": texts[0]}).encode())
        closers.append(conn.close)

        def step(turn: int) -> str:
            body = json.dumps({"input": texts[rng.randrange(len(texts))]}).encode()
            status, data = conn.call("POST", "/v1/embeddings", body)
            return "WRONG" if status == "200" and len(json.loads(data)["data"]) != 1 else status

        return step

    closers: list = []
    steps = [grpc_step(i) for i in range(n_grpc)] + [http_step(i) for i in range(n_http)]
    kinds = ["grpc"] * n_grpc + ["http"] * n_http
    loop = ClosedLoop(steps).start()
    ready.put("clients")
    stop.wait()
    records = loop.stop()
    for close in closers:
        close()
    events = [(kinds[r.client], r.started, r.started + r.seconds, _status(r)) for r in records]
    out.put(("clients", events))


def abusers_process(http_url, limits, n_abusers, ready, go, stop, out) -> None:
    """``n_abusers`` clients (bench.kit.load.ClosedLoop), each rotating through the kinds back to back from its own
    starting kind, from ``go`` until ``stop`` (the request in flight at ``stop`` completes). Events: (kind, start,
    end, status, answer bytes, refusal message)."""
    host, port = http_url.split("//", 1)[1].rsplit(":", 1)
    requests = abuse_requests(limits)
    conns = [Http(host, int(port), 600) for _ in range(n_abusers)]

    def abuser(index: int):
        first = index * max(1, len(requests) // max(1, n_abusers))  # the abusers start on different kinds

        def step(turn: int) -> tuple:
            item = requests[(first + turn) % len(requests)]
            status, data = conns[index].call("POST", item["path"], item["body"])
            message = data[:300].decode("utf-8", "replace") if not status.startswith("2") else ""
            return item["kind"], status, len(data), message

        return step

    ready.put("abusers")
    go.wait()
    loop = ClosedLoop([abuser(i) for i in range(n_abusers)]).start()
    stop.wait()
    records = loop.stop()
    for conn in conns:
        conn.close()
    events = []
    for r in records:
        kind, status, size, message = r.value if r.error is None else ("?", _status(r), 0, str(r.error)[:300])
        events.append((kind, r.started, r.started + r.seconds, status, size, message))
    out.put(("abusers", events))


def _status(record) -> str:
    """A client call's status: what its step returned, or the exception it did not expect."""
    return record.value if record.error is None else f"error:{type(record.error).__name__}"


def prober_process(grpc_target, http_url, interval, ready, stop, out) -> None:
    """HTTP GET /health and gRPC Health/Check, each every ``interval`` s (the next one at once after a slow one).
    Events: (probe, start, wait seconds, status)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host, port = http_url.split("//", 1)[1].rsplit(":", 1)
    events: list[tuple] = []
    lock = threading.Lock()

    def loop(name: str, probe) -> None:
        probe()  # connect first
        barrier.wait()
        tick = time.monotonic()
        while not stop.is_set():
            started = time.monotonic()
            status = probe()
            done = time.monotonic()
            with lock:
                events.append((name, started, done - started, status))
            tick += interval
            if tick < done:
                tick = done
            time.sleep(max(0.0, tick - time.monotonic()))

    conn = Http(host, int(port), 30)

    def http_probe() -> str:
        return conn.call("GET", "/health")[0]

    channel = grpc.insecure_channel(grpc_target)
    stub = health_pb2_grpc.HealthStub(channel)

    def grpc_probe() -> str:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as exc:
            return exc.code().name

    barrier = threading.Barrier(3)
    threads = [
        threading.Thread(target=loop, args=("http", http_probe), daemon=True),
        threading.Thread(target=loop, args=("grpc", grpc_probe), daemon=True),
    ]
    for thread in threads:
        thread.start()
    barrier.wait(60)
    ready.put("prober")
    for thread in threads:
        thread.join()
    channel.close()
    out.put(("prober", events))


class Workers:
    """The worker processes of one run, and their events once stopped."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.ready = self.context.Queue()
        self.out = self.context.Queue()
        self.stop_event = self.context.Event()
        self.go = self.context.Event()
        self.processes: list = []

    def start(self, target, *args) -> None:
        process = self.context.Process(target=target, args=(*args,), daemon=True)
        process.start()
        self.processes.append(process)

    def wait_ready(self, timeout: float = 180.0) -> None:
        for _ in self.processes:
            try:
                self.ready.get(timeout=timeout)
            except queue_module.Empty:
                raise SystemExit("a bench worker did not start (see its traceback above)") from None

    def stop(self, timeout: float = 600.0) -> dict[str, list]:
        """Stop, wait for the requests in flight, collect every worker's events."""
        self.stop_event.set()
        self.go.set()  # an abuser still waiting for its start goes straight to the stop
        events: dict[str, list] = {}
        deadline = time.monotonic() + timeout
        while len(events) < len(self.processes):
            try:
                name, items = self.out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                break
            events[name] = items
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
        return events
