"""The transport floor of one gRPC call (issue 28): what a bare ``grpc.aio`` server, with no code of this project in
its path, adds to a call whose handler works for as long as the runtime takes on one sentence.

    python -m bench.service.grpc_floor                     # 4.5 ms of work, an answer the size of one sentence's layers
    python -m bench.service.grpc_floor --work-ms 0 --layers 0

The server (a child process, 127.0.0.1) answers ``elmo.v1.Embedder/Embed`` with a prebuilt ``EmbedResponse`` of
``--tokens`` tokens x ``--layers`` layers x ``--dim`` floats, after spinning ``--work-ms`` ms on a worker thread
(``--hop``, the default, as the service's runtime call does) or on the event loop; it reports the handler's own
time in ``timing.total_ms``. The client is ``elmo.client``'s: a blocking stub on one channel, the answer decoded to
numpy. Reported: the client-observed latency and observed - handler time (the transport: serialization, HTTP/2,
the event loop's and the client's wake-ups), p50 over ``--calls`` calls after ``--warmup``.

``--model DIR`` (what bench.service.latency and bench.service.compiled_load run beside the service,
:func:`start_floor_server`): the handler runs the real runtime (``Embedder.embed`` on the request's texts, one call
per request, ``--threads`` intra-op threads, on one worker thread) and answers their tokens and layers, an
``EmbedResponse`` built with protobuf's own API: a plain grpc.aio server in front of the same runtime, with none of
the service's code (limits, batching across requests, interceptors) in its path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.kit.revision import REPO
from bench.kit.serve import start_child_server
from elmo.bench.figures import machine, percentiles


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def serve(args: argparse.Namespace) -> None:
    import grpc
    import grpc.aio

    from elmo.v1 import embedder_pb2 as pb
    from elmo.wire import to_tensor

    answer = pb.EmbedResponse(model="bare")
    embedding = answer.embeddings.add()
    embedding.tokens.extend(["word"] * args.tokens)
    if args.layers:
        to_tensor(np.ones((args.layers, args.tokens, args.dim), np.float32), pb.FLOAT32, out=embedding.layers)
    pool = ThreadPoolExecutor(1)
    runtime = None
    if args.model is not None:
        from elmo.runtime import Embedder

        runtime = Embedder(args.model, intra_op_threads=args.threads)
        runtime.warmup()

    def embedded(texts: list[str]) -> pb.EmbedResponse:
        """The runtime's answer for the texts, built field by field (what a plain server would write)."""
        response = pb.EmbedResponse(model="bare")
        for embedding in runtime.embed(texts):
            to_tensor(embedding.layers, pb.FLOAT32, out=response.embeddings.add(tokens=embedding.tokens).layers)
        return response

    async def embed_runtime(request, context):
        began = time.perf_counter()
        texts = [item.text for item in request.inputs]
        response = await asyncio.get_running_loop().run_in_executor(pool, embedded, texts)
        response.timing.total_ms = 1000 * (time.perf_counter() - began)
        return response

    async def embed(request, context):
        began = time.perf_counter()
        if args.hop:
            await asyncio.get_running_loop().run_in_executor(pool, _spin, args.work_ms)
        else:
            _spin(args.work_ms)
        response = pb.EmbedResponse()
        response.CopyFrom(answer)
        response.timing.total_ms = 1000 * (time.perf_counter() - began)
        return response

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            embed if runtime is None else embed_runtime,
            request_deserializer=pb.EmbedRequest.FromString,
            response_serializer=pb.EmbedResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("elmo.v1.Embedder", {"Embed": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def measure(args: argparse.Namespace, port: int) -> dict:
    from elmo.client import EmbedderClient, decode_response

    with EmbedderClient(f"127.0.0.1:{port}", timeout=30) as client:
        request = client.request(["The quick brown fox jumps over the lazy dog near the river bank today ."])
        observed, transport = [], []
        for i in range(args.warmup + args.calls):
            began = time.perf_counter()
            response = client.stub.Embed(request, timeout=30)
            decode_response(response)
            ms = 1000 * (time.perf_counter() - began)
            if i >= args.warmup:
                observed.append(ms)
                transport.append(ms - response.timing.total_ms)
    observed_ms, transport_ms = percentiles(observed, (50,), digits=3), percentiles(transport, (50,), digits=3)
    return {
        "answer_bytes": response.ByteSize(),
        "observed_p50_ms": observed_ms["p50"],
        "transport_p50_ms": transport_ms["p50"],
        "transport_mean_ms": transport_ms["mean"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.service.grpc_floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--work-ms", type=float, default=4.5, help="the handler's work per call (default 4.5)")
    parser.add_argument("--tokens", type=int, default=22)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--no-hop", dest="hop", action="store_false", help="work on the event loop, not a thread")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--model", type=Path, default=None, help="answer with this model's runtime (see above)")
    parser.add_argument("--threads", type=int, default=2, help="with --model: onnxruntime intra-op threads")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    return parser.parse_args(argv)


def start_floor_server(model: Path, threads: int) -> tuple[subprocess.Popen, int]:
    """A bare grpc.aio server in front of ``model``'s runtime (``--serve --model``), on a free loopback port:
    (the process, its port)."""
    argv = ["bench.service.grpc_floor", "--serve", "--model", str(model), "--threads", str(threads)]
    return start_child_server(argv, "the floor server")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    child = [sys.executable, "-m", "bench.service.grpc_floor", "--serve", *(argv if argv is not None else sys.argv[1:])]
    # a bare grpc.aio server (this module with --serve), not `elmo serve`: the transport alone
    server = subprocess.Popen(child, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        port = int(server.stdout.readline())
        result = {"config": {k: v for k, v in vars(args).items() if k != "serve"}, **measure(args, port)}
    finally:
        server.terminate()
        server.wait(10)
    result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
