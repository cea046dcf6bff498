"""Memory of a serving process, for the sizing table in docs/operations.md.

    python scripts/serve_memory.py --model DIR [--max-batch-tokens 1024 4096 8192] [--providers CPUExecutionProvider]

For each --max-batch-tokens value N it starts ``elmo serve --max-batch-tokens N --runtime-batch-tokens N`` (N tokens
per call into the runtime, at most N padded tokens per onnxruntime run) on free loopback ports, waits for SERVING,
reads the process's resident memory (VmRSS: model loaded and warmed up), sends --requests requests that each fill
one batch (sentences of --sentence-tokens tokens, all layers, float32), reads VmRSS and the peak (VmHWM) again,
and stops the server with SIGTERM. Every token is distinct, so the char-CNN always runs and the token-vector cache
fills as fast as it can: the worst case for memory. Prints one JSON line per run. Torch-free: run it with the
serving environment (``.venv-serve/bin/python scripts/serve_memory.py ...``) to measure what production runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elmo.v1 import embedder_pb2 as pb  # noqa: E402
from elmo.v1 import embedder_pb2_grpc as pb_grpc  # noqa: E402

MIB = 1024 * 1024


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of a process, in KiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0])
    return values


def wait_serving(address: str, process: subprocess.Popen, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"elmo serve exited with {process.returncode} before SERVING")
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"not SERVING after {deadline_s} s")


def distinct_token_request(index: int, n_sentences: int, sentence_tokens: int) -> pb.EmbedRequest:
    """Every token new (r{index}s{sentence}t{token}): the token-vector cache never helps, the char-CNN always runs,
    and the cache fills as fast as it can (the worst case for memory)."""
    sentences = [[f"r{index}s{s}t{t}" for t in range(sentence_tokens)] for s in range(n_sentences)]
    return pb.EmbedRequest(inputs=[pb.Input(tokens=pb.Tokens(tokens=words)) for words in sentences])


def measure(args: argparse.Namespace, max_batch_tokens: int, work: Path) -> dict:
    port_file = work / f"ports-{max_batch_tokens}"
    sentence_tokens = min(args.sentence_tokens, max_batch_tokens)
    command = [
        sys.executable, "-m", "elmo.cli", "serve", "--log-level", "WARNING", "--model", str(args.model),
        "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
        "--max-batch-tokens", str(max_batch_tokens), "--runtime-batch-tokens", str(max_batch_tokens),
        "--max-tokens-per-sentence", str(sentence_tokens),
        "--max-tokens-per-request", str(max_batch_tokens), "--max-batch-sentences", str(max_batch_tokens),
        "--max-inputs", str(max_batch_tokens), "--max-queue-tokens", str(4 * max_batch_tokens),
        "--max-response-bytes", str(1024 * MIB),
    ]  # fmt: skip
    if args.providers:
        command += ["--providers", args.providers]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, cwd=REPO)
    try:
        while not port_file.is_file() or not port_file.read_text().strip():
            if process.poll() is not None:
                raise SystemExit(f"elmo serve exited with {process.returncode}")
            time.sleep(0.2)
        address = f"127.0.0.1:{port_file.read_text().split()[0]}"
        wait_serving(address, process, deadline_s=600)
        idle = memory_kib(process.pid)
        n_sentences = max_batch_tokens // sentence_tokens
        inference_ms = []
        options = [("grpc.max_receive_message_length", 1024 * MIB)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            for r in range(args.requests):
                reply = stub.Embed(distinct_token_request(r, n_sentences, sentence_tokens), timeout=1800)
                inference_ms.append(reply.timing.inference_ms)
        loaded = memory_kib(process.pid)
        return {
            "model": str(args.model),
            "dim": info.dim,
            "n_layers": info.n_layers,
            "provider": info.execution_provider,
            "onnx_mib": round(sum(p.stat().st_size for p in Path(args.model).glob("*.onnx*")) / MIB, 1),
            "max_batch_tokens": max_batch_tokens,
            "batch": f"{n_sentences} x {sentence_tokens} tokens",
            "distinct_tokens_sent": args.requests * n_sentences * sentence_tokens,
            "rss_idle_mib": round(idle["VmRSS"] / 1024),
            "rss_after_mib": round(loaded["VmRSS"] / 1024),
            "rss_peak_mib": round(loaded["VmHWM"] / 1024),
            "inference_ms": [round(ms, 1) for ms in inference_ms],
        }
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="model directory with model.onnx")
    parser.add_argument("--max-batch-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--sentence-tokens", type=int, default=32, help="tokens per sentence in the load")
    parser.add_argument("--requests", type=int, default=3, help="full-batch requests per run")
    parser.add_argument("--providers", default=os.environ.get("ELMO_PROVIDERS"), help="e.g. CPUExecutionProvider")
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        for max_batch_tokens in args.max_batch_tokens:
            print(json.dumps(measure(args, max_batch_tokens, Path(work))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
