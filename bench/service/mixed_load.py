"""HTTP and gRPC clients at once against one server, every answer checked: loopback only, bounded in time.

    python -m bench.service.mixed_load --model models/default --clients 16 --seconds 60
    python -m bench.service.mixed_load --grpc 127.0.0.1:50051 --http http://127.0.0.1:8080 --clients 16 --seconds 60

Half the clients speak gRPC (Embed), half HTTP (alternating OpenAI's /v1/embeddings and /v1/embed with base64).
Every answer is compared with the vectors gRPC gave for the same text alone before the run (the pooled vector for
/v1/embeddings): a wrong answer counts as an error just like a failed call. Prints one JSON object: requests and
latency percentiles per protocol, tokens/s, and every error (the run passes with none).
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from bench.kit.load import ClosedLoop
from bench.kit.serve import check_loopback, start_server
from bench.kit.texts import make_texts
from elmo.bench.figures import machine, percentiles_ms

TOLERANCE = 1e-5  # a sentence batched with others may differ from the same sentence alone by float rounding
MAX_SECONDS = 600.0


@dataclass
class MixedReport:
    seconds: float
    requests: dict[str, int] = field(default_factory=lambda: {"http": 0, "grpc": 0})
    tokens: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"http": [], "grpc": []})
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        def pct(values: list[float]) -> dict:
            figures = percentiles_ms(values, (50, 99))
            return {f"p{q}_ms": figures[f"p{q}"] for q in (50, 99)} if values else {}

        return {
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "tokens_per_s": round(self.tokens / self.seconds, 1),
            "latency": {kind: pct(values) for kind, values in self.latencies.items()},
            "errors": len(self.errors),
            "error_samples": self.errors[:10],
        }


def _post(url: str, body: dict, token: str | None) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}")
    worst = float(np.abs(got - want).max())
    if worst > TOLERANCE:
        raise AssertionError(f"{what}: differs by {worst:.2e} from the reference")


def run_mixed_load(
    grpc_target: str,
    http_url: str,
    clients: int = 16,
    seconds: float = 60.0,
    texts: list[str] | None = None,
    token: str | None = None,
    seed: int = 0,
) -> MixedReport:
    from elmo.client import EmbedderClient

    check_loopback(grpc_target)
    check_loopback(http_url.split("//", 1)[-1].split("/", 1)[0])
    texts = texts or make_texts(200, seed=seed)
    seconds = min(seconds, MAX_SECONDS)
    with EmbedderClient(grpc_target, auth_token=token) as client:
        reference = [embedding.layers for embedding in (client.embed([text])[0] for text in texts)]
        report = MixedReport(seconds)

        def one_call(kind: str, rng: random.Random, turn: int) -> int:
            picked = rng.sample(range(len(texts)), k=rng.randint(1, 4))
            batch = [texts[i] for i in picked]
            if kind == "grpc":
                for i, embedding in zip(picked, client.embed(batch)):
                    _close(embedding.layers, reference[i], f"gRPC Embed of text {i}")
            elif turn % 2:
                answer = _post(f"{http_url}/v1/embeddings", {"input": batch}, token)
                for i, item in zip(picked, answer["data"]):
                    pooled = reference[i].astype(np.float64).mean(axis=(0, 1))
                    _close(np.asarray(item["embedding"]), pooled, f"/v1/embeddings of text {i}")
            else:
                answer = _post(f"{http_url}/v1/embed", {"inputs": batch, "encoding": "base64"}, token)
                for i, item in zip(picked, answer["embeddings"]):
                    tensor = item["layers"]
                    layers = np.frombuffer(base64.b64decode(tensor["data"]), "<f4").reshape(tensor["shape"])
                    _close(layers, reference[i], f"/v1/embed of text {i}")
            return sum(reference[i].shape[1] for i in picked)

        kinds = ["grpc" if index % 2 else "http" for index in range(clients)]
        steps = [partial(one_call, kind, random.Random(seed * 1000 + index)) for index, kind in enumerate(kinds)]
        started = time.monotonic()
        loop = ClosedLoop(steps, seconds).run()
        report.seconds = time.monotonic() - started
    for record in loop.records:  # every failure is a finding, reported, never raised
        kind, exc = kinds[record.client], record.error
        if exc is not None:
            detail = exc.read().decode()[:300] if isinstance(exc, urllib.error.HTTPError) else str(exc)
            report.errors.append(f"{kind}: {type(exc).__name__}: {detail}")
        else:
            report.requests[kind] += 1
            report.tokens += record.value
            report.latencies[kind].append(record.seconds)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.mixed_load", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start `elmo serve --model DIR --http-port 0` on loopback")
    where.add_argument("--grpc", help="a running server's gRPC address (loopback), with --http")
    parser.add_argument("--http", help="the running server's HTTP base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=None, help="server onnxruntime threads (with --model)")
    parser.add_argument("--token", default=None, help="bearer token of the running server")
    args = parser.parse_args(argv)
    server = None
    if args.model:
        server = start_server(args.model, threads=args.threads)
        grpc_target, http_url = server.grpc_target, server.http_url
    else:
        if not args.http:
            parser.error("--grpc needs --http")
        grpc_target, http_url = args.grpc, args.http.rstrip("/")
    try:
        report = run_mixed_load(grpc_target, http_url, args.clients, args.seconds, token=args.token)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({"clients": args.clients, **report.to_dict(), **machine()}, ensure_ascii=False))
    return 0 if not report.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
