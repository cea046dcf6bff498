"""Does a server's memory come back after a burst of the largest requests? Resident memory (VmRSS) of `elmo serve`
before a burst, right after it and after an idle wait, for each memory setting, and the burst's tokens/s, the
settings' bursts interleaved so that a loaded machine slows them alike:

    python -m bench.service.memory_after_burst --model models/default [--rounds 3] [--idle-s 60] [--json out.json]

Each setting is one server (``arena``: ``--cpu-memory-arena on --malloc-mmap-threshold-bytes 0
--memory-trim-interval-s 0``, onnxruntime's and glibc's own behaviour: the arena keeps its peak; ``no_arena``:
``--cpu-memory-arena off``, each tensor allocated on its own, glibc's heaps trimmed once idle; ``default``: the serve
defaults, the arena on and shrunk once idle), started together on free loopback ports, gRPC only, with --threads. A
burst is --requests of the largest request the default limits allow (16 sentences x 512 tokens: 8192 tokens,
--max-request-tokens), --clients at a time, real English words (the shipped word-sense sentences, cut
into 512-token sentences). Rounds alternate which setting goes first. After the last round both servers sit idle
for --idle-s, then VmRSS is read again. Prints one JSON object (per setting: RSS before / after each burst / after
idle in MiB, tokens/s of each burst, the 1-minute load average when each burst ended).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench.kit.sample import rss_mib
from bench.kit.serve import Server, start_server
from bench.kit.texts import sentences
from elmo.bench.figures import machine
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc

MIB = 1024 * 1024
SENTENCE_TOKENS = 512  # --max-sentence-tokens's default
REQUEST_SENTENCES = 16  # x 512 = --max-request-tokens's default, 8192: the largest legal request
SETTINGS = {
    "arena": ["--cpu-memory-arena", "on", "--malloc-mmap-threshold-bytes", "0", "--memory-trim-interval-s", "0"],
    "no_arena": ["--cpu-memory-arena", "off"],
    "default": [],
}


def largest_requests(n: int, seed: int = 0) -> list[pb.EmbedRequest]:
    """``n`` requests of 16 sentences x 512 tokens of real English words, all layers, float32."""
    found, _ = sentences(4000, seed=seed, min_words=5, max_words=40)
    words = [w for s in found for w in s.split()]
    per_request = REQUEST_SENTENCES * SENTENCE_TOKENS
    requests = []
    for r in range(n):
        start = (r * per_request) % max(1, len(words) - per_request)
        flat = (words * (1 + per_request // max(1, len(words)) + 1))[start : start + per_request]
        rows = [flat[i : i + SENTENCE_TOKENS] for i in range(0, per_request, SENTENCE_TOKENS)]
        requests.append(pb.EmbedRequest(inputs=[pb.Input(tokens=pb.Tokens(tokens=row)) for row in rows]))
    return requests


def burst(server: Server, requests: list[pb.EmbedRequest], clients: int) -> float:
    """Send ``requests``, ``clients`` at a time; tokens/s of the whole burst."""
    options = [("grpc.max_receive_message_length", 256 * MIB)]
    with grpc.insecure_channel(server.grpc_target, options=options) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(lambda request: stub.Embed(request, timeout=600), requests))
        seconds = time.perf_counter() - started
    return sum(len(e.tokens) for reply in replies for e in reply.embeddings) / seconds


def settle_rss(pid: int, seconds: float = 2.0) -> float:
    """VmRSS once the process has had ``seconds`` to hand back what it frees (MiB)."""
    time.sleep(seconds)
    return round(rss_mib(pid) or 0.0, 1)


def run(args: argparse.Namespace) -> dict:
    requests = largest_requests(args.requests)
    work = Path(tempfile.mkdtemp(prefix="elmo-memory-burst-"))
    servers = {
        name: start_server(
            args.model,
            threads=args.threads,
            serve_args=["--log-level", "WARNING", *flags],
            http=False,
            workdir=work,
            label=name,
            timeout=600,
        )
        for name, flags in SETTINGS.items()
    }
    try:
        report = {
            name: {
                "flags": " ".join(SETTINGS[name]) or "(defaults)",
                "rss_before_mib": settle_rss(s.pid),
                "rss_after_burst_mib": [],
                "tokens_per_s": [],
                "load_1min": [],
            }
            for name, s in servers.items()
        }
        order = list(servers)
        for round_ in range(args.rounds):
            for name in order if round_ % 2 == 0 else reversed(order):
                report[name]["tokens_per_s"].append(round(burst(servers[name], requests, args.clients)))
                report[name]["load_1min"].append(round(os.getloadavg()[0], 1))
                report[name]["rss_after_burst_mib"].append(settle_rss(servers[name].pid))
        time.sleep(args.idle_s)
        for name, server in servers.items():
            entry = report[name]
            entry["rss_after_idle_mib"] = settle_rss(server.pid, 0)
            entry["after_over_before"] = round(max(entry["rss_after_burst_mib"]) / entry["rss_before_mib"], 2)
            entry["idle_over_before"] = round(entry["rss_after_idle_mib"] / entry["rss_before_mib"], 2)
            speeds = entry["tokens_per_s"]
            entry["tokens_per_s_median"] = round(statistics.median(speeds))
            entry["tokens_per_s_spread"] = [min(speeds), max(speeds)]
    finally:
        for server in servers.values():
            server.stop()
    return {
        "command": "python -m bench.service.memory_after_burst " + " ".join(args.argv),
        **machine(),  # the CPU, its flags, cores, load (elmo.bench.figures)
        "model": str(args.model),
        "threads": args.threads,
        "burst": f"{args.requests} requests of {REQUEST_SENTENCES} x {SENTENCE_TOKENS} tokens, {args.clients} at once",
        "idle_s": args.idle_s,
        "settings": report,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/default"), help="model directory")
    parser.add_argument("--threads", type=int, default=2, help="each server's --threads (default 2)")
    parser.add_argument("--requests", type=int, default=6, help="largest requests per burst (default 6)")
    parser.add_argument("--clients", type=int, default=3, help="requests in flight at once (default 3)")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per setting, interleaved (default 3)")
    parser.add_argument("--idle-s", type=float, default=60.0, help="idle wait after the last burst (default 60)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
