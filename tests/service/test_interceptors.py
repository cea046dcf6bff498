"""The gRPC interceptors' observation of calls that are not the API's: grpcio-reflection's own client listing the
services, and health checks, on a real server on 127.0.0.1, are answered and counted apart (never as errors of
``elmo_requests_total``, never a WARNING); and a streaming call whose handler is left at a ``yield`` when the client
cancels is CANCELLED, not UNKNOWN."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

import grpc
import grpc.aio
import pytest
from elmo.service.common.limits import Limits
from elmo.service.grpc.interceptors import ObserverInterceptor, call_kind
from elmo.service.telemetry.metrics import ServiceMetrics
from elmo.service.telemetry.observe import RequestObserver
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from elmo.runtime import Embedder
from tests.service_helpers import ServerThread

REQUESTS_LOG = "service.requests"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = ServerThread({"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}, Limits(drain_seconds=1.0))
    srv.warm_up()
    yield srv
    srv.stop()


def list_services(target: str) -> list[str]:
    """What `grpcurl list` does, with grpcio-reflection's client: the services, then each one's file."""
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(database)
        services = list(database.get_services())
        for name in services:
            pool.FindServiceByName(name)
    return services


def test_reflection_listings_are_no_errors_and_log_no_warning(server, caplog):
    caplog.set_level(logging.DEBUG, logger=REQUESTS_LOG)
    for _ in range(5):
        assert "elmo.v1.Embedder" in list_services(server.target)
    with grpc.insecure_channel(server.target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    gc.collect()  # a stream's handler left at a yield ends when it is collected: let that happen before looking
    wait_for(lambda: server.metric("elmo_other_requests_total", kind="health", method="Check", code="OK") == 1)
    reflection = [
        server.metric("elmo_other_requests_total", kind="reflection", method="ServerReflectionInfo", code=code)
        for code in ("OK", "CANCELLED")
    ]
    assert sum(reflection) >= 5  # one stream per listing at least: counted, apart from the API's requests
    for code in ("UNKNOWN", "OK", "CANCELLED"):
        assert server.metric("elmo_requests_total", method="ServerReflectionInfo", code=code) == 0
    unknown = {"kind": "reflection", "method": "ServerReflectionInfo", "code": "UNKNOWN"}
    assert server.metric("elmo_other_requests_total", **unknown) == 0
    assert server.metric("elmo_requests_total", method="Check", code="OK") == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == REQUESTS_LOG and r.levelno >= logging.WARNING]
    assert warnings == []


def wait_for(condition, timeout: float = 30.0) -> None:
    """Poll ``condition`` (a guard against a hang, not a timing check)."""
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("not reached")


def test_call_kinds():
    assert call_kind("/grpc.health.v1.Health/Check") == "health"
    assert call_kind("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == "reflection"
    assert call_kind("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo") == "reflection"
    assert call_kind("/elmo.v1.Embedder/Embed") == ""


def test_a_stream_cancelled_while_its_handler_waits_at_a_yield_is_cancelled_not_unknown(caplog):
    """The handler never awaits between answers: when the client cancels, it sits at a ``yield`` and is closed
    there (GeneratorExit), the way a reflection stream can be when its client closes during an answer."""
    caplog.set_level(logging.DEBUG, logger=REQUESTS_LOG)
    metrics = ServiceMetrics()

    async def endless(request, context):
        while True:
            yield b"answer"

    handler = grpc.method_handlers_generic_handler(
        "test.Endless", {"Stream": grpc.unary_stream_rpc_method_handler(endless)}
    )

    async def scenario() -> None:
        server = grpc.aio.server(interceptors=[ObserverInterceptor(RequestObserver(metrics))])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.unary_stream("/test.Endless/Stream")(b"")
                for _ in range(3):
                    assert await call.read() == b"answer"
                call.cancel()
            for _ in range(600):  # until the server has seen the call end (a guard against a hang only)
                gc.collect()
                if metrics.registry.get_sample_value("elmo_requests_in_flight") == 0:
                    break
                await asyncio.sleep(0.05)
        finally:
            await server.stop(None)

    asyncio.run(scenario())
    counted = {
        code: metrics.registry.get_sample_value("elmo_requests_total", {"method": "Stream", "code": code})
        for code in ("CANCELLED", "UNKNOWN")
    }
    assert counted == {"CANCELLED": 1.0, "UNKNOWN": None}
    assert [r for r in caplog.records if r.name == REQUESTS_LOG and r.levelno >= logging.WARNING] == []
