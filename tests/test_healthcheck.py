"""scripts/healthcheck.py against real gRPC servers on 127.0.0.1 (the standard health servicer)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "healthcheck.py"
TOKEN = "s3cret-token"


def load_probe():
    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = load_probe()


class RequireBearer(grpc.ServerInterceptor):
    """A server that demands the bearer token even on health checks (the probe must be able to send it)."""

    def intercept_service(self, continuation, details):
        if ("authorization", f"Bearer {TOKEN}") in (details.invocation_metadata or ()):
            return continuation(details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bearer token required")

        return grpc.unary_unary_rpc_method_handler(deny)


def start_server(
    interceptors=(), credentials: grpc.ServerCredentials | None = None
) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=list(interceptors))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, servicer, port


@pytest.fixture
def plain_server() -> Iterator[tuple[health.HealthServicer, str]]:
    server, servicer, port = start_server()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def set_status(servicer: health.HealthServicer, status: int, service: str = "") -> None:
    servicer.set(service, status)


def test_serving_server_is_healthy_as_docker_runs_it(plain_server) -> None:
    servicer, address = plain_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
    done = subprocess.run([sys.executable, str(SCRIPT), address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{address}: SERVING"


def test_not_serving_server_is_unhealthy_as_docker_runs_it(plain_server) -> None:
    servicer, address = plain_server
    set_status(servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    done = subprocess.run([sys.executable, str(SCRIPT), address], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "NOT_SERVING" in done.stderr


def test_named_service_and_unknown_service(plain_server, capsys) -> None:
    servicer, address = plain_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING, "elmo.v1.Embedder")
    assert probe.main([address, "--service", "elmo.v1.Embedder"]) == 0
    assert probe.main([address, "--service", "no.such.Service"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_address_from_the_environment(plain_server, monkeypatch) -> None:
    servicer, address = plain_server
    set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.setenv("ELMO_HEALTH_ADDRESS", address)
    assert probe.main([]) == 0


def test_no_server_is_unhealthy(capsys) -> None:
    with socket.socket() as sock:  # a port that was free a moment ago and has no listener now
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert probe.main([f"127.0.0.1:{port}", "--timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err or "DEADLINE_EXCEEDED" in err, err


def test_bearer_token_is_sent_when_given(monkeypatch, capsys) -> None:
    server, servicer, port = start_server(interceptors=[RequireBearer()])
    try:
        set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        assert probe.main([address]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert probe.main([address, "--token", TOKEN]) == 0
        monkeypatch.setenv("ELMO_HEALTH_TOKEN", TOKEN)
        assert probe.main([address]) == 0
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[bytes, bytes, Path]:
    """(key PEM, certificate PEM, certificate file) for CN=elmo.test, made with the openssl command line."""
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=elmo.test",
            "-addext",
            "subjectAltName=DNS:elmo.test",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return key.read_bytes(), cert.read_bytes(), cert


def test_tls_with_the_servers_ca(self_signed, capsys) -> None:
    key, cert, cert_file = self_signed
    server, servicer, port = start_server(credentials=grpc.ssl_server_credentials([(key, cert)]))
    try:
        set_status(servicer, health_pb2.HealthCheckResponse.SERVING)
        address = f"127.0.0.1:{port}"
        assert probe.main([address, "--timeout", "2"]) == 1  # plaintext against a TLS port
        capsys.readouterr()
        ok = probe.main([address, "--tls-ca", str(cert_file), "--tls-server-name", "elmo.test"])
        assert ok == 0, capsys.readouterr().err
        assert probe.main([address, "--tls-ca", str(cert_file), "--tls-server-name", "wrong.name"]) == 1
        assert probe.main([address, "--tls-ca", "/nonexistent/ca.pem"]) == 1
    finally:
        server.stop(None)
