"""Memory of a serving process, for the sizing table in docs/how-to/deploy.md.

    python -m bench.service.serve_memory --model DIR [--max-batch-tokens 1024 4096] [--providers CPUExecutionProvider]

For each --max-batch-tokens value N it starts ``elmo serve --max-batch-tokens N --runtime-batch-tokens N`` (N tokens
per call into the runtime, at most N padded tokens per onnxruntime run) on free loopback ports, waits for SERVING,
reads the process's resident memory (VmRSS: model loaded and warmed up), sends --requests requests that each fill
one batch (sentences of --sentence-tokens tokens, all layers, float32), reads VmRSS and the peak (VmHWM) again,
and stops the server with SIGTERM. Every token is distinct, so the char-CNN always runs and the token-vector cache
fills as fast as it can: the worst case for memory. Prints one JSON line per run. Torch-free: run it with the
serving environment (``.venv-serve/bin/python -m bench.service.serve_memory ...``) to measure what production runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import grpc

from bench.kit.sample import peak_rss_mib, rss_mib
from bench.kit.serve import start_server
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc

MIB = 1024 * 1024


def distinct_token_request(index: int, n_sentences: int, sentence_tokens: int) -> pb.EmbedRequest:
    """Every token new (r{index}s{sentence}t{token}): the token-vector cache never helps, the char-CNN always runs,
    and the cache fills as fast as it can (the worst case for memory)."""
    sentences = [[f"r{index}s{s}t{t}" for t in range(sentence_tokens)] for s in range(n_sentences)]
    return pb.EmbedRequest(inputs=[pb.Input(tokens=pb.Tokens(tokens=words)) for words in sentences])


def measure(args: argparse.Namespace, max_batch_tokens: int, work: Path) -> dict:
    sentence_tokens = min(args.sentence_tokens, max_batch_tokens)
    serve_args = [
        "--log-level",
        "WARNING",
        "--max-batch-tokens",
        str(max_batch_tokens),
        "--runtime-batch-tokens",
        str(max_batch_tokens),
        "--max-sentence-tokens",
        str(sentence_tokens),
        "--max-request-tokens",
        str(max_batch_tokens),
        "--max-batch-sentences",
        str(max_batch_tokens),
        "--max-inputs",
        str(max_batch_tokens),
        "--max-queue-tokens",
        str(4 * max_batch_tokens),
        "--max-response-bytes",
        str(1024 * MIB),
    ]
    if args.providers:
        serve_args += ["--providers", args.providers]
    server = start_server(
        args.model,
        threads=args.threads,
        serve_args=serve_args,
        http=False,
        workdir=work,
        label=f"serve-{max_batch_tokens}",
        timeout=600,
    )
    try:
        address = server.grpc_target
        idle_mib = rss_mib(server.pid)
        n_sentences = max_batch_tokens // sentence_tokens
        inference_ms = []
        options = [("grpc.max_receive_message_length", 1024 * MIB)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            for r in range(args.requests):
                reply = stub.Embed(distinct_token_request(r, n_sentences, sentence_tokens), timeout=1800)
                inference_ms.append(reply.timing.inference_ms)
        loaded_mib, peak_mib = rss_mib(server.pid), peak_rss_mib(server.pid)
        return {
            "model": str(args.model),
            "dim": info.dim,
            "n_layers": info.n_layers,
            "provider": info.execution_provider,
            "onnx_mib": round(sum(p.stat().st_size for p in Path(args.model).glob("*.onnx*")) / MIB, 1),
            "max_batch_tokens": max_batch_tokens,
            "batch": f"{n_sentences} x {sentence_tokens} tokens",
            "distinct_tokens_sent": args.requests * n_sentences * sentence_tokens,
            "rss_idle_mib": round(idle_mib),
            "rss_after_mib": round(loaded_mib),
            "rss_peak_mib": round(peak_mib),
            "inference_ms": [round(ms, 1) for ms in inference_ms],
        }
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.serve_memory", description=__doc__.splitlines()[0])
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
