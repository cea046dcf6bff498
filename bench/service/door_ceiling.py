"""The ceiling of any Python door on this machine (issue 42): what served ÷ in-process can reach at best when the
door is built on grpc.aio (or aiohttp) and shares the machine's cores with the runtime and the load generator.

Two bare servers answer every request with the service's own answer bytes for that request, prebuilt: no parsing,
no checks, no tokenizing, no batching, no answer building, no thread hop. Under the same compiled load generators
as the service (bench.service.compiled_load), the machine's CPU per answered request (server, generator and kernel
together, from /proc/stat) is the least that a door on that stack costs here. The runtime in process costs its own
CPU per request (``measure_in_process``'s process time). Both share the same cores, so a served rate is at most
``cores / (compute + door)`` requests a second, and

    served ÷ in-process  <=  cores / ((compute + echo) × in-process rate)

whatever the process layout (one process or several behind SO_REUSEPORT): more interpreters lift the GIL's limit,
not the cores'. ``compiled_load --ceiling`` measures it in the same rounds as the service:

    python -m bench.service.compiled_load --ceiling --rounds 3 --duration 8

The servers run as child processes of this module (``--serve grpc|http --answer FILE``) on a free loopback port,
which they print. ``--plumbing settings,observer,gate`` puts the service's own gRPC plumbing in front of the echo
(:data:`PLUMBING`; bench.service.door_plumbing prices each layer).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bench.kit.serve import start_child_server

T = TypeVar("T")


def grpc_answer(target: str, body: bytes) -> bytes:
    """The service's own ``EmbedResponse`` bytes to the serialized ``EmbedRequest`` ``body``."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        return channel.unary_unary("/elmo.v1.Embedder/Embed")(body, timeout=60)


def service_answers(grpc_target: str, http_address: str, grpc_body: bytes, http_body: bytes) -> tuple[bytes, bytes]:
    """The service's own answer bytes to the load's two requests (gRPC ``EmbedResponse``, HTTP JSON body)."""
    answer = grpc_answer(grpc_target, grpc_body)
    request = urllib.request.Request(f"http://{http_address}/v1/embed", method="POST", data=http_body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as reply:
        return answer, reply.read()


# The service's gRPC plumbing, layer by layer, as service.server puts it in front of its servicer (default limits):
#   settings  grpc_server_settings: message and stream bounds, idle and age limits, grpc.aio's own count of calls
#   observer  ObserverInterceptor: every call timed, counted and its status code worked out (metrics, log line)
#   gate      CallGate: every call counted in the per-peer shares, its request message read against a clock
PLUMBING = ("settings", "observer", "gate")


def start_echo(
    protocol: str, answer: bytes, work: Path, plumbing: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int]:
    """A bare ``protocol`` server (grpc or http) that answers every request with ``answer``: (process, port).
    ``plumbing``: layers of :data:`PLUMBING` in front of it (grpc only)."""
    label = "-".join(("echo", protocol, *plumbing))
    path = work / f"{label}.bin"
    path.write_bytes(answer)
    argv = ["bench.service.door_ceiling", "--serve", protocol, "--answer", str(path)]
    if plumbing:
        argv += ["--plumbing", ",".join(plumbing)]
    return start_child_server(argv, f"the {label} server")


def machine_cpus() -> int:
    """The CPUs /proc/stat counts: the cores :func:`busy_cores` and the ceiling share out."""
    return sum(line.startswith("cpu") and line[3].isdigit() for line in open("/proc/stat"))


def busy_cores(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and the machine's busy cores meanwhile (every CPU's non-idle time over the wall time)."""

    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        return sum(fields[:8]) - fields[3] - fields[4], sum(fields[:8])  # busy (less idle, iowait), all

    busy0, all0 = ticks()
    result = run()
    busy1, all1 = ticks()
    return result, machine_cpus() * (busy1 - busy0) / max(1, all1 - all0)


def ceiling(in_process_rps: float, compute_s: float, door_s: float, cores: int) -> float:
    """The best served ÷ in-process when each request costs ``compute_s`` CPU seconds of runtime and ``door_s`` of
    door (and generator) on ``cores`` cores."""
    return cores / ((compute_s + door_s) * in_process_rps)


def serve(protocol: str, answer: bytes, plumbing: tuple[str, ...] = ()) -> None:
    asyncio.run(_serve_grpc(answer, plumbing) if protocol == "grpc" else _serve_http(answer))


def check_plumbing(layers: tuple[str, ...]) -> None:
    unknown = sorted(set(layers) - set(PLUMBING))
    if unknown:
        raise ValueError(f"unknown plumbing {unknown}: choose from {', '.join(PLUMBING)}")


def grpc_plumbing(layers: tuple[str, ...]) -> tuple[dict, list]:
    """``grpc.aio.server``'s keyword arguments and interceptors for ``layers`` of :data:`PLUMBING`, built as
    service.server builds them, with the default limits."""
    from elmo.service.common.limits import Limits, grpc_server_settings
    from elmo.service.grpc.interceptors import CallGate, ObserverInterceptor
    from elmo.service.telemetry.metrics import ServiceMetrics
    from elmo.service.telemetry.observe import RequestObserver

    check_plumbing(layers)
    limits = Limits()
    settings = grpc_server_settings(limits) if "settings" in layers else {}
    interceptors = []
    if "observer" in layers:
        interceptors.append(ObserverInterceptor(RequestObserver(ServiceMetrics())))
    if "gate" in layers:  # last, as in the service
        interceptors.append(CallGate.for_limits(limits))
    return settings, interceptors


async def _serve_grpc(answer: bytes, plumbing: tuple[str, ...] = ()) -> None:
    import grpc
    import grpc.aio

    async def embed(request: bytes, context) -> bytes:
        return answer

    settings, interceptors = grpc_plumbing(plumbing)
    server = grpc.aio.server(interceptors=interceptors, **settings)
    handler = grpc.unary_unary_rpc_method_handler(embed)  # no (de)serializers: bytes in, the prebuilt bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("elmo.v1.Embedder", {"Embed": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _serve_http(answer: bytes) -> None:
    from aiohttp import web

    async def embed(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/v1/embed", embed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    listener = socket.create_server(("127.0.0.1", 0))  # bound here: its port known without aiohttp's internals
    await web.SockSite(runner, listener).start()
    print(listener.getsockname()[1], flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.service.door_ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--serve", choices=["grpc", "http"], required=True, help="run one bare server (a child)")
    parser.add_argument("--answer", type=Path, required=True, help="the bytes every request is answered with")
    parser.add_argument("--plumbing", default="", help=f"grpc: comma-separated layers of {', '.join(PLUMBING)}")
    args = parser.parse_args(argv)
    plumbing = tuple(layer for layer in args.plumbing.split(",") if layer)
    if plumbing and args.serve != "grpc":
        parser.error("--plumbing is the gRPC door's")
    try:
        check_plumbing(plumbing)  # refused before the server starts (its parent waits for a port line)
    except ValueError as exc:
        parser.error(str(exc))
    serve(args.serve, args.answer.read_bytes(), plumbing)


if __name__ == "__main__":
    main()
