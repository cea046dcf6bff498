"""The transport floor of one gRPC call: a bare ``grpc.aio`` server in front of the same runtime, with none of the
service's code (limits, batching across requests, interceptors) in its path, beside which bench.service.latency
measures ``elmo serve`` (:func:`start_floor_server`).

The server (a child process, ``python -m bench.service.grpc_floor --model DIR``, 127.0.0.1) answers
``elmo.v1.Embedder/Embed`` with the runtime's vectors (``Embedder.embed`` on the request's texts, one call per request,
``--threads`` intra-op threads, on one worker thread), an ``EmbedResponse`` built with protobuf's own API, the
handler's own time in ``timing.total_ms``; it prints its port as its first line.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.kit.revision import REPO


def serve(model: Path, threads: int) -> None:
    import grpc
    import grpc.aio

    from elmo.runtime import Embedder
    from elmo.v1 import embedder_pb2 as pb
    from elmo.wire import to_tensor

    pool = ThreadPoolExecutor(1)
    runtime = Embedder(model, intra_op_threads=threads)
    runtime.warmup()

    def embedded(texts: list[str]) -> pb.EmbedResponse:
        """The runtime's answer for the texts, built field by field (what a plain server would write)."""
        response = pb.EmbedResponse(model="bare")
        for embedding in runtime.embed(texts):
            to_tensor(embedding.layers, pb.FLOAT32, out=response.embeddings.add(tokens=embedding.tokens).layers)
        return response

    async def embed(request, context):
        began = time.perf_counter()
        texts = [item.text for item in request.inputs]
        response = await asyncio.get_running_loop().run_in_executor(pool, embedded, texts)
        response.timing.total_ms = 1000 * (time.perf_counter() - began)
        return response

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(
            embed,
            request_deserializer=pb.EmbedRequest.FromString,
            response_serializer=pb.EmbedResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("elmo.v1.Embedder", {"Embed": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def start_floor_server(model: Path, threads: int) -> tuple[subprocess.Popen, int]:
    """The floor server in front of ``model``'s runtime on a free loopback port: (the process, its port); the process
    is killed and RuntimeError raised if it prints anything but its port."""
    argv = [sys.executable, "-m", "bench.service.grpc_floor", "--model", str(model), "--threads", str(threads)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO)
    line = server.stdout.readline()
    if not line.strip().isdigit():
        server.kill()
        raise RuntimeError(f"the floor server did not start (it printed {line!r})")
    return server, int(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.grpc_floor", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="answer with this model's runtime")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args(argv)
    serve(args.model, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
