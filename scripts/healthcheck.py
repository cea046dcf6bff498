"""gRPC health probe for the Docker HEALTHCHECK and Kubernetes exec probes.

    python scripts/healthcheck.py [ADDRESS] [--service NAME] [--timeout S] [--tls-ca FILE] [--token TOKEN]

Calls the standard ``grpc.health.v1.Health/Check`` of the server at ADDRESS (default ``127.0.0.1:50051``) and
exits 0 when the answer is SERVING, 1 otherwise (Docker reads 0 as healthy and 1 as unhealthy), printing one line.
Every option also reads an environment variable, so a container that turns TLS or a bearer token on can keep the
image's HEALTHCHECK line and set ``ELMO_HEALTH_TLS_CA`` / ``ELMO_HEALTH_TOKEN`` instead.

It imports only grpcio and grpcio-health-checking (no torch, not even the elmo package): it runs every few seconds
and must start fast and use little memory.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

HEALTHY, UNHEALTHY = 0, 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="grpc.health.v1 probe: exit 0 when SERVING, 1 otherwise")
    parser.add_argument(
        "address", nargs="?", default=env("ELMO_HEALTH_ADDRESS", "127.0.0.1:50051"), help="HOST:PORT of the server"
    )
    parser.add_argument(
        "--service",
        default=env("ELMO_HEALTH_SERVICE", ""),
        help="service name to ask about; '' (default) = the whole server",
    )
    parser.add_argument("--timeout", type=float, default=float(env("ELMO_HEALTH_TIMEOUT", "3")), help="seconds")
    parser.add_argument(
        "--tls-ca",
        default=env("ELMO_HEALTH_TLS_CA", ""),
        help="PEM CA bundle: connect with TLS and verify the server against it",
    )
    parser.add_argument(
        "--tls-server-name",
        default=env("ELMO_HEALTH_TLS_SERVER_NAME", ""),
        help="name the server certificate must carry when it differs from HOST (e.g. probing 127.0.0.1)",
    )
    parser.add_argument(
        "--token", default=env("ELMO_HEALTH_TOKEN", ""), help="bearer token sent as 'authorization: Bearer TOKEN'"
    )
    return parser.parse_args(argv)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(args.address)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(args.tls_ca).read_bytes())
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.address, credentials, options=options)


def check(args: argparse.Namespace) -> tuple[int, str]:
    """One Health/Check call -> (exit code, one-line explanation)."""
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        with open_channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout, metadata=metadata
            )
    except grpc.RpcError as exc:
        return UNHEALTHY, f"{args.address}: {exc.code().name}: {exc.details()}"
    except OSError as exc:  # unreadable CA file
        return UNHEALTHY, f"{args.address}: {exc}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    code = HEALTHY if reply.status == health_pb2.HealthCheckResponse.SERVING else UNHEALTHY
    return code, f"{args.address}: {status}"


def main(argv: list[str] | None = None) -> int:
    code, line = check(parse_args(argv))
    print(line, file=sys.stdout if code == HEALTHY else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
