r"""A small load generator for the service, gRPC or HTTP/JSON: loopback only, bounded in count and time.

    python -m bench.loadgen --model models/default --concurrency 16 --duration 30 --baseline
    python -m bench.loadgen --server 127.0.0.1:50051 --concurrency 16 --duration 60 --server-pid PID
    python -m bench.loadgen --model models/default --protocol http --duration 30 --baseline

Issue 28's check (served throughput and p50 at 16 clients not worse than before the change, gRPC and HTTP, served ÷
in-process at least 0.9 in every round), before and after alternating in one run:

    python -m bench.loadgen --model models/default --concurrency 16 --duration 20 --rounds 3 --baseline \
        --threads 2 --protocol both --before 71af429 --json bench/results/loadgen-issue28.json

With ``--model`` it starts ``elmo serve`` itself on a free loopback port (same ``--threads``; ``--http-port 0`` too
when HTTP is driven), drives it, and stops it with SIGTERM; ``--baseline`` also measures the in-process runtime
(this checkout's ``Embedder.embed_texts``) on the same texts once per round, before the round's served runs, so that
both figures come from the same machine state. Reports requests/s, tokens/s, latency p50/p99, errors by status code,
and the server's RSS (start of measurement, end, max) and CPU, as one JSON object on stdout (and ``--json``).

Protocols (``--protocol``): ``grpc`` (default) sends ``Embed`` calls, one channel per client, serialized once up
front and not decoded. ``http`` sends the same requests (same texts, sentences per request, layers and dtype) as
``POST /v1/embed`` JSON bodies with ``"encoding": "base64"`` (the closest to the gRPC wire bytes), one kept-alive
HTTP/1.1 connection per client (``http.client``, a thread each), bodies encoded once up front and answers read but
not decoded. Either way a request counts when it answers (gRPC OK / HTTP 200, a non-empty body) inside the
measured window, with the tokens this checkout's tokenizer finds in its texts; before the runs one answer per server
and protocol is decoded and its token count checked against that (``answer_check``). Errors (gRPC status codes,
HTTP statuses, ``conn:<exception>``) are counted, never raised. ``both``: gRPC and HTTP phases in each round.

``--before REV`` (with ``--model``): also serve git revision REV's code from a worktree (bench.worktree), with the
same model directory, the same serve arguments and the same client code (this checkout's); both servers are up for
the whole run and take turns, each round: in-process, before-grpc, after-grpc, before-http, after-http. Reported
per round and as medians over rounds: tokens/s, p50/p99 and served ÷ in-process for each tree and protocol, and the
after ÷ before ratios of throughput and p50 (``summary.after_over_before``, ``summary.issue_check``); a table on
stderr. Without ``--before`` and with one protocol the JSON keeps its old shape (``rounds[i].served``). The exit
status is 1 when any request failed or an answer check did not match.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from elmo.bench.loadgen_report import check_answers, print_table, summarize, summarize_phases
from elmo.bench.server_process import (
    REQUEST_TIMEOUT_S,
    Endpoint,
    check_loopback,
    cpu_seconds,
    rss_mib,
    split_address,
    start_endpoint,
    stop_server,
)

MAX_DURATION_S = 600.0
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 256
PROTOCOLS = ("grpc", "http")

_WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which but have an they "
    "you were her she there been one all we their its new said would more will if has can two language model word "
    "vectors river bank money apple company fruit market people government year time service network context layer"
).split()
_CJK = "苹果公司发布了新手机我们今天去市场买很好吃的水果银行河岸经济人民政府时间语言模型"


def make_texts(n: int, seed: int = 0, min_tokens: int = 4, max_tokens: int = 40) -> list[str]:
    """Deterministic sentences, 4-40 tokens, about one in five Chinese (every CJK character is a token)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = rng.randint(min_tokens, max_tokens)
        if rng.random() < 0.2:
            texts.append("".join(rng.choices(_CJK, k=length - 1)) + "。")
        else:
            words = rng.choices(_WORDS, k=length - 1)
            texts.append(" ".join([words[0].capitalize(), *words[1:]]) + " .")
    return texts


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


def _percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {}
    values = np.asarray(latencies) * 1000
    return {name: round(float(np.percentile(values, q)), 2) for name, q in (("p50", 50), ("p90", 90), ("p99", 99))} | {
        "max": round(float(values.max()), 2)
    }


# -- served load ---------------------------------------------------------------------------------------------------
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


def _served_result(protocol, concurrency, duration, counts, errors, latencies, marks, rss) -> LoadResult:
    """One served phase's figures, the same for both protocols."""
    cpu = None
    if marks.get("cpu_start") is not None and marks.get("cpu_end") is not None:
        cpu = round(marks["cpu_end"] - marks["cpu_start"], 2)
    return LoadResult(
        mode="served",
        concurrency=concurrency,
        seconds=round(duration, 3),
        requests=counts["requests"],
        sentences=counts["sentences"],
        tokens=counts["tokens"],
        errors=errors,
        latency_ms=_percentiles(latencies),
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
    """``concurrency`` clients (one channel each) send requests back to back until ``duration`` or ``max_requests``."""
    import grpc
    import grpc.aio

    metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else None
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(concurrency)]
    calls = [
        c.unary_unary("/elmo.v1.Embedder/Embed", request_serializer=None, response_deserializer=None) for c in channels
    ]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counts = {"requests": 0, "sentences": 0, "tokens": 0}
    issued = 0
    rss: list[float] = []
    marks: dict[str, float | None] = {}

    async def client(index: int, window: tuple[float, float]) -> None:
        """Send back to back until the window closes; count the requests that complete inside the window."""
        nonlocal issued
        rng = random.Random(index)
        while time.monotonic() < window[1] and issued < max_requests:
            issued += 1
            data, n_sentences, n_tokens = requests[rng.randrange(len(requests))]
            started = time.perf_counter()
            try:
                response = await calls[index](data, timeout=REQUEST_TIMEOUT_S, metadata=metadata)
                ok = len(response) > 0
            except grpc.aio.AioRpcError as exc:  # every error counts, in the warm-up and the tail too
                errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                ok = False
            if ok and window[0] <= time.monotonic() <= window[1]:
                latencies.append(time.perf_counter() - started)
                counts["requests"] += 1
                counts["sentences"] += n_sentences
                counts["tokens"] += n_tokens

    async def sampler(window: tuple[float, float]) -> None:
        """Server RSS / CPU and client CPU at the window's edges, RSS every second inside it."""
        await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
        _mark_edge(marks, "start", server_pid)
        while time.monotonic() < window[1]:
            if server_pid and (value := rss_mib(server_pid)) is not None:
                rss.append(value)
            await asyncio.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
        _mark_edge(marks, "end", server_pid)

    try:
        for channel in channels:
            await asyncio.wait_for(channel.channel_ready(), timeout=30)
        # Clients run through warm-up, window and tail without a pause, so the window sees a steady state.
        window_start = time.monotonic() + warmup_s
        window = (window_start, window_start + duration)
        await asyncio.gather(sampler(window), *(client(i, window) for i in range(concurrency)))
    finally:
        for channel in channels:
            await channel.close()
    return _served_result("grpc", concurrency, duration, counts, errors, latencies, marks, rss)


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


def drive_http(
    address: str,
    requests: list[tuple[bytes, int, int]],
    concurrency: int,
    duration: float,
    max_requests: int,
    auth_token: str | None = None,
    server_pid: int | None = None,
    warmup_s: float = 0.0,
) -> LoadResult:
    """:func:`drive` over HTTP: ``concurrency`` clients, a thread and one kept-alive ``http.client`` connection each,
    ``POST /v1/embed`` back to back until ``duration`` or ``max_requests``; the answers are read, not decoded. A
    transport failure is counted as ``conn:<exception>`` and the client reconnects."""
    host, port = split_address(address)
    headers = {"Content-Type": "application/json"}
    if auth_token:
        headers["Authorization"] = f"Bearer {auth_token}"
    lock = threading.Lock()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    counts = {"requests": 0, "sentences": 0, "tokens": 0, "issued": 0}
    rss: list[float] = []
    marks: dict[str, float | None] = {}
    connections: list[http.client.HTTPConnection | None] = []
    for _ in range(concurrency):  # connect first, as drive waits for its channels: the window sees no handshakes
        conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.connect()
        except OSError:
            conn.close()
            conn = None  # the client retries, and counts the failure
        connections.append(conn)

    def client(index: int, window: tuple[float, float]) -> None:
        rng = random.Random(index)
        conn = connections[index]
        while time.monotonic() < window[1]:
            with lock:
                if counts["issued"] >= max_requests:
                    break
                counts["issued"] += 1
            body, n_sentences, n_tokens = requests[rng.randrange(len(requests))]
            started = time.perf_counter()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
                conn.request("POST", "/v1/embed", body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                status = str(response.status)
                if response.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as exc:
                status, data = f"conn:{type(exc).__name__}", b""
                if conn is not None:
                    conn.close()
                    conn = None
            elapsed = time.perf_counter() - started
            with lock:
                if status != "200":  # every error counts, in the warm-up and the tail too
                    errors[status] = errors.get(status, 0) + 1
                elif data and window[0] <= time.monotonic() <= window[1]:
                    latencies.append(elapsed)
                    counts["requests"] += 1
                    counts["sentences"] += n_sentences
                    counts["tokens"] += n_tokens
            if status.startswith("conn:"):
                time.sleep(0.01)  # a server that is gone: no busy loop of refused connections
        if conn is not None:
            conn.close()

    window_start = time.monotonic() + warmup_s
    window = (window_start, window_start + duration)
    threads = [threading.Thread(target=client, args=(i, window), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, window[0] - time.monotonic()))
    _mark_edge(marks, "start", server_pid)
    while time.monotonic() < window[1]:
        if server_pid and (value := rss_mib(server_pid)) is not None:
            rss.append(value)
        time.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
    _mark_edge(marks, "end", server_pid)
    for thread in threads:
        thread.join()
    return _served_result("http", concurrency, duration, counts, errors, latencies, marks, rss)


def _mark_edge(marks: dict, edge: str, server_pid: int | None) -> None:
    """Server RSS and CPU and this process's CPU at the window's ``edge`` ("start" or "end")."""
    marks[f"rss_{edge}"] = rss_mib(server_pid) if server_pid else None
    marks[f"cpu_{edge}"] = cpu_seconds(server_pid) if server_pid else None
    marks[f"client_cpu_{edge}"] = time.process_time()


# -- in-process baseline ---------------------------------------------------------------------------------------------
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
        latency_ms=_percentiles(latencies),
        cpu_s=round(cpu, 2),
    )


# -- command line ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.loadgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start `elmo serve --model DIR` on a free loopback port and drive it")
    where.add_argument("--server", help="HOST:PORT of a running server's gRPC (loopback only)")
    parser.add_argument("--http-server", help="with --server and --protocol http|both: its HTTP HOST:PORT (loopback)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --server: PID whose RSS and CPU to sample")
    parser.add_argument(
        "--protocol",
        choices=["grpc", "http", "both"],
        default="grpc",
        help="gRPC Embed calls, HTTP POST /v1/embed (base64, one kept-alive connection per client), or both in "
        "each round (default grpc)",
    )
    parser.add_argument(
        "--before",
        metavar="REV",
        help="with --model: also serve git revision REV's code (a worktree; same model, serve arguments and clients), "
        "before and after taking turns in every round; reports the after / before ratios",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument(
        "--duration", type=float, default=30.0, help=f"seconds of measured load per phase (max {MAX_DURATION_S:.0f})"
    )
    parser.add_argument("--requests", type=int, default=MAX_REQUESTS, help="stop a phase after this many requests")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured load before each phase")
    parser.add_argument("--sentences-per-request", type=int, default=8)
    parser.add_argument("--texts", type=int, default=1024, help="size of the deterministic text pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", default="", help="comma-separated layers to request (default all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (server and baseline)")
    parser.add_argument(
        "--baseline", action="store_true", help="with --model: also measure the in-process runtime, once per round"
    )
    parser.add_argument("--baseline-batch", type=int, default=64, help="texts per in-process embed_texts call")
    parser.add_argument("--baseline-duration", type=float, default=None, help="seconds per in-process phase")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of (in-process, then each served phase: before and after per protocol); medians over rounds",
    )
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
    parser.add_argument("--server-session", choices=("shared", "own"), default="shared",
                        help="with --model: the server in this run's session, or in its own (as under systemd)")
    parser.add_argument("--auth-token", default=os.environ.get("ELMO_AUTH_TOKEN"))
    parser.add_argument("--json", type=Path, default=None, help="also write the result JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= MAX_DURATION_S:
        parser.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}]")
    if not 0 < args.requests <= MAX_REQUESTS:
        parser.error(f"--requests must be in (0, {MAX_REQUESTS}]")
    if not 0 < args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be in (0, {MAX_CONCURRENCY}]")
    if not 0 < args.rounds <= 20 or args.duration * args.rounds > MAX_DURATION_S:
        parser.error(f"--rounds must be in (0, 20] and rounds x duration <= {MAX_DURATION_S:.0f} s")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.baseline and args.model is None:
        parser.error("--baseline needs --model")
    if args.before and args.model is None:
        parser.error("--before needs --model (it starts both servers)")
    if args.server and args.protocol != "grpc" and not args.http_server:
        parser.error("--protocol http|both with --server needs --http-server HOST:PORT")
    if args.http_server and not args.server:
        parser.error("--http-server goes with --server (with --model the HTTP port is the server's own)")
    return args


def run_phase(
    args: argparse.Namespace, endpoint: Endpoint, protocol: str, grpc_requests: list, http_requests: list
) -> LoadResult:
    """One served phase: warm-up, then ``--duration`` seconds measured, on one server over one protocol."""
    if protocol == "grpc":
        return asyncio.run(
            drive(
                endpoint.grpc_target,
                grpc_requests,
                args.concurrency,
                args.duration,
                args.requests,
                args.auth_token,
                endpoint.pid,
                args.warmup,
            )
        )
    assert endpoint.http_address is not None
    return drive_http(
        endpoint.http_address,
        http_requests,
        args.concurrency,
        args.duration,
        args.requests,
        args.auth_token,
        endpoint.pid,
        args.warmup,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    from elmo.bench.serving import code_trees, machine, revision_info

    protocols = list(PROTOCOLS) if args.protocol == "both" else [args.protocol]
    with_http = "http" in protocols
    texts = make_texts(args.texts, args.seed)
    layers = [int(v) for v in args.layers.split(",") if v.strip()]
    grpc_requests = build_requests(texts, args.sentences_per_request, layers, args.dtype)
    http_requests = build_http_requests(texts, args.sentences_per_request, layers, args.dtype) if with_http else []
    report: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "auth_token"}
    }
    if args.model is not None:
        report["revisions"] = revision_info(args.before)
    baseline_s = args.baseline_duration or args.duration
    embedder = load_embedder(args.model, args.threads, texts, args.baseline_batch) if args.baseline else None
    label = "after" if args.model is not None else "server"
    rounds: list[dict] = []
    endpoints: dict[str, Endpoint] = {}
    with code_trees(args.before if args.model is not None else None, label) as trees:
        labels = [tree_label for tree_label, _ in trees]
        try:
            if args.model is not None:
                for tree_label, tree in trees:
                    endpoints[tree_label] = start_endpoint(args, tree_label, tree, with_http)
            else:
                check_loopback(args.server)
                if args.http_server:
                    check_loopback(args.http_server)
                endpoints[label] = Endpoint(label, args.server, args.http_server, args.server_pid)
            report["answer_check"] = {}
            for tree_label, endpoint in endpoints.items():
                check = check_answers(
                    endpoint.grpc_target if "grpc" in protocols else None,
                    endpoint.http_address if with_http else None,
                    grpc_requests[0],
                    http_requests[0] if with_http else grpc_requests[0],
                    args.auth_token,
                )
                report["answer_check"][tree_label] = check
                for protocol, row in check.items():
                    if not row["ok"]:
                        print(f"WARNING: {tree_label} {protocol}: answer check failed: {row}", file=sys.stderr)
            checks_ok = all(row["ok"] for check in report["answer_check"].values() for row in check.values())
            for index in range(args.rounds):  # in-process first, then before/after per protocol, in turn
                one: dict = {"round": index + 1}
                if embedder is not None:
                    one["in_process"] = measure_in_process(embedder, texts, baseline_s, args.baseline_batch).to_dict()
                    print(
                        f"round {index + 1} in-process: {one['in_process']['tokens_per_s']:,.0f} tokens/s",
                        file=sys.stderr,
                    )
                phases: dict = {}
                for protocol in protocols:
                    for tree_label in labels:
                        result = run_phase(args, endpoints[tree_label], protocol, grpc_requests, http_requests)
                        phases.setdefault(tree_label, {})[protocol] = result.to_dict()
                        print(f"round {index + 1} {_phase_line(tree_label, protocol, result, one)}", file=sys.stderr)
                one["phases"] = phases
                rounds.append(one)
        finally:
            exit_codes = {name: stop_server(e.proc) for name, e in endpoints.items() if e.proc is not None}
    if exit_codes:
        report["server_exit_code"] = exit_codes[label] if len(exit_codes) == 1 else exit_codes
    report |= machine(load_at_start)
    if len(labels) == 1 and len(protocols) == 1:  # the old shape: rounds[i] = {in_process, served}
        (only,) = protocols
        flat = [
            {k: v for k, v in r.items() if k == "in_process"} | {"served": r["phases"][label][only]} for r in rounds
        ]
        report["rounds"] = flat
        report["summary"] = summarize(flat)
    else:
        report["rounds"] = rounds
        report["summary"] = summarize_phases(rounds, labels, protocols)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print_table(rounds, labels, protocols, report["summary"], file=sys.stderr)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if report["summary"]["errors"] == 0 and checks_ok else 1


def _phase_line(tree_label: str, protocol: str, result: LoadResult, one: dict) -> str:
    ratio = ""
    if "in_process" in one and one["in_process"]["tokens_per_s"]:
        ratio = f", served / in-process {result.tokens_per_s / one['in_process']['tokens_per_s']:.3f}"
    lat = result.latency_ms
    return (
        f"{tree_label} {protocol}: {result.tokens_per_s:,.0f} tokens/s, {result.requests} requests, "
        f"p50 {lat.get('p50', float('nan')):.1f} ms, p99 {lat.get('p99', float('nan')):.1f} ms{ratio}, "
        f"errors {sum(result.errors.values())}"
    )


if __name__ == "__main__":
    sys.exit(main())
