"""A small load generator for the gRPC service: loopback only, bounded in count and time.

    python -m bench.loadgen --model models/default --concurrency 16 --duration 30 --baseline
    python -m bench.loadgen --server 127.0.0.1:50051 --concurrency 16 --duration 60 --server-pid PID

With ``--model`` it starts ``elmo serve`` itself on a free loopback port (same ``--threads``), drives it, and stops
it with SIGTERM; ``--baseline`` also measures the in-process runtime (``Embedder.embed_texts``) on the same texts
before and after the served run, so both figures come from the same machine state. Reports requests/s, tokens/s,
latency p50/p99, errors by status code, and the server's RSS (start of measurement, end, max), as one JSON object.
Requests are serialized once up front and responses are not decoded, so that the client spends little CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

MAX_DURATION_S = 600.0
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 256

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


def check_loopback(target: str) -> None:
    """Refuse anything but a loopback address: this tool must never load someone else's server."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise SystemExit(f"--server must be HOST:PORT, got {target!r}")
    addresses = {info[4][0] for info in socket.getaddrinfo(host, int(port))}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise SystemExit(f"loadgen drives loopback servers only; {host} resolves to {sorted(addresses)}")


def rss_mib(pid: int, field: str = "VmRSS") -> float | None:
    """A process's resident set (``VmRSS``) or its peak (``VmHWM``) in MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU time of a process (from /proc/PID/stat)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
                response = await calls[index](data, timeout=120, metadata=metadata)
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
        marks["rss_start"] = rss_mib(server_pid) if server_pid else None
        marks["cpu_start"] = cpu_seconds(server_pid) if server_pid else None
        marks["client_cpu_start"] = time.process_time()
        while time.monotonic() < window[1]:
            if server_pid and (value := rss_mib(server_pid)) is not None:
                rss.append(value)
            await asyncio.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
        marks["rss_end"] = rss_mib(server_pid) if server_pid else None
        marks["cpu_end"] = cpu_seconds(server_pid) if server_pid else None
        marks["client_cpu_end"] = time.process_time()

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
    cpu = None
    if marks.get("cpu_start") is not None and marks.get("cpu_end") is not None:
        cpu = round(marks["cpu_end"] - marks["cpu_start"], 2)
    seconds = duration
    return LoadResult(
        mode="served",
        concurrency=concurrency,
        seconds=round(seconds, 3),
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
    )


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
        results = embedder.embed_texts(chunk)
        latencies.append(time.perf_counter() - t0)
        n_tokens += sum(len(tokenized.tokens) for tokenized, _ in results)
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


# -- server process --------------------------------------------------------------------------------------------------
def spawn_server(
    model_dir: Path, threads: int | None, extra: list[str], timeout: float = 120.0, tree: Path | None = None
) -> tuple[subprocess.Popen, str, Path]:
    """``elmo serve`` on a free loopback port, SERVING -> (process, gRPC target, log path; the port file is beside
    it). ``tree``: serve the code of that checkout (a git worktree of an older revision, bench.worktree) instead."""
    workdir = Path(tempfile.mkdtemp(prefix="loadgen-"))
    port_file, log_path = workdir / "port", workdir / "server.log"
    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "serve",
        "--model",
        str(Path(model_dir).resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        *extra,
    ]
    if threads:
        command += ["--threads", str(threads)]
    options: dict = {}
    if tree is not None:
        from bench.worktree import tree_env

        options = {"cwd": tree, "env": tree_env(tree)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **options)
    deadline = time.monotonic() + timeout
    while not (port_file.is_file() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server did not start; log: {log_path}\n{log_path.read_text()[-2000:]}")
        time.sleep(0.1)
    target = f"127.0.0.1:{port_file.read_text().split()[0]}"
    _wait_serving(target, timeout)
    return proc, target, log_path


def _wait_serving(target: str, timeout: float = 120.0) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{target} did not become SERVING within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


# -- command line ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start `elmo serve --model DIR` on a free loopback port and drive it")
    where.add_argument("--server", help="HOST:PORT of a running server (loopback only)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --server: PID whose RSS to sample")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--duration", type=float, default=30.0, help=f"seconds of measured load (max {MAX_DURATION_S:.0f})"
    )
    parser.add_argument("--requests", type=int, default=MAX_REQUESTS, help="stop after this many requests")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured load first")
    parser.add_argument("--sentences-per-request", type=int, default=8)
    parser.add_argument("--texts", type=int, default=1024, help="size of the deterministic text pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", default="", help="comma-separated layers to request (default all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (server and baseline)")
    parser.add_argument("--baseline", action="store_true", help="with --model: also measure the in-process runtime")
    parser.add_argument("--baseline-batch", type=int, default=64, help="texts per in-process embed_texts call")
    parser.add_argument("--baseline-duration", type=float, default=None, help="seconds per in-process phase")
    parser.add_argument("--rounds", type=int, default=1, help="alternating (in-process, served) rounds; medians")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
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
    if args.baseline and args.model is None:
        parser.error("--baseline needs --model")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    texts = make_texts(args.texts, args.seed)
    layers = [int(v) for v in args.layers.split(",") if v.strip()]
    requests = build_requests(texts, args.sentences_per_request, layers, args.dtype)
    report: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "auth_token"}
    }
    baseline_s = args.baseline_duration or args.duration
    embedder = load_embedder(args.model, args.threads, texts, args.baseline_batch) if args.baseline else None
    proc = None
    if args.model is not None:
        proc, target, log_path = spawn_server(args.model, args.threads, args.serve_arg)
        pid = proc.pid
    else:
        target, pid = args.server, args.server_pid
    check_loopback(target)
    rounds: list[dict] = []
    try:
        for index in range(args.rounds):  # alternate in-process and served phases: same machine state for both
            one: dict = {}
            if embedder is not None:
                one["in_process"] = measure_in_process(embedder, texts, baseline_s, args.baseline_batch).to_dict()
            served = asyncio.run(
                drive(
                    target, requests, args.concurrency, args.duration, args.requests, args.auth_token, pid, args.warmup
                )
            )
            one["served"] = served.to_dict()
            rounds.append(one)
            print(json.dumps({"round": index, **{k: v["tokens_per_s"] for k, v in one.items()}}), file=sys.stderr)
    finally:
        if proc is not None:
            report["server_exit_code"] = stop_server(proc)
    report["rounds"] = rounds
    report["summary"] = summarize(rounds)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if report["summary"]["errors"] == 0 else 1


def summarize(rounds: list[dict]) -> dict:
    served = [r["served"] for r in rounds]
    out = {
        "served_tokens_per_s": _median(s["tokens_per_s"] for s in served),
        "served_requests_per_s": _median(s["requests_per_s"] for s in served),
        "served_latency_ms_p50": _median(s["latency_ms"].get("p50", 0) for s in served),
        "served_latency_ms_p99": _median(s["latency_ms"].get("p99", 0) for s in served),
        "served_tokens_per_server_cpu_s": _median(s["tokens_per_cpu_s"] or 0 for s in served),
        "errors": sum(sum(s["errors"].values()) for s in served),
        "server_rss_mib_first_start": served[0]["rss_mib"].get("start"),
        "server_rss_mib_last_end": served[-1]["rss_mib"].get("end"),
    }
    if all("in_process" in r for r in rounds):
        base = [r["in_process"] for r in rounds]
        out["in_process_tokens_per_s"] = _median(b["tokens_per_s"] for b in base)
        out["in_process_tokens_per_cpu_s"] = _median(b["tokens_per_cpu_s"] or 0 for b in base)
        out["served_over_in_process"] = round(out["served_tokens_per_s"] / out["in_process_tokens_per_s"], 3)
        out["served_over_in_process_per_round"] = [
            round(r["served"]["tokens_per_s"] / r["in_process"]["tokens_per_s"], 3) for r in rounds
        ]
        out["served_over_in_process_per_cpu_s"] = round(
            out["served_tokens_per_server_cpu_s"] / out["in_process_tokens_per_cpu_s"], 3
        )
    return out


def _median(values) -> float:
    return round(float(np.median(list(values))), 2)


if __name__ == "__main__":
    sys.exit(main())
