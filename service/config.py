"""``elmo serve``'s configuration: its flags, grouped the way ``--help`` shows them (the essentials first: model,
network, security; then batching and limits, runtime tuning, operations), and :class:`ServeConfig`, the typed
object the parsed flags fill and the server reads.

Every flag can also be set from the environment (``ELMO_<NAME>``) and from a TOML file (``--config FILE``); a flag
on the command line wins over its variable, the variable over the file, the file over the default
(elmo.flags). ``elmo serve --print-config`` prints the effective configuration as such a file, tokens left out.

Each concern owns its flags as a frozen dataclass with an ``add_<x>_arguments(parser)`` / ``<x>_from_args(args)``
pair (service.common.limits, service.grpc.health, elmo.runtime.memory, service.telemetry.tracing): the environment,
the file and ``--print-config`` work on the parser, so every such group is covered without being listed here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from elmo.service.common.limits import Limits, limits_from_args
from elmo.service.grpc.health import HealthLimits, health_limits_from_args

from elmo.errors import ConfigError
from elmo.flags import add_alias

AUTH_TOKEN_ENV = "ELMO_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "ELMO_ADMIN_TOKEN"
DEFAULT_HOST = "127.0.0.1"  # only this machine: the container passes --host 0.0.0.0 (and says so)
DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 8080
OFF = "off"

USAGE = "elmo serve --model DIR [--host ADDRESS] [--port PORT] [--http-port PORT|off] [--auth-token TOKEN] [options]"
DESCRIPTION = (
    f"Serve a model over gRPC (port {DEFAULT_PORT}) and HTTP/JSON with the web page (port {DEFAULT_HTTP_PORT}), on "
    f"{DEFAULT_HOST} unless --host says otherwise. Every flag can also be set as ELMO_<NAME> or in --config FILE; "
    "a flag wins over its variable, the variable over the file."
)

# --help's groups in this order; a group another module adds goes before "operations"
ESSENTIALS, MODELS, NETWORK, SECURITY = "model, network and security", "more models", "network", "security"
RUNTIME, OPERATIONS = "runtime tuning", "operations"
HELP_ORDER = (ESSENTIALS, MODELS, NETWORK, SECURITY, "batching and limits", "connections", RUNTIME, "runtime memory")


def port_or_off(value: str) -> int | None:
    """``--http-port``: a port number (0 = any free port), or ``off`` for no HTTP."""
    if value.strip().lower() in (OFF, "none", ""):
        return None
    port = int(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"{value}: a port is 0..65535")
    return port


port_or_off.__name__ = "port number or 'off'"  # how argparse names the type in its error
port_or_off.none_text = OFF  # how --print-config writes None (elmo.flags)


@dataclass(frozen=True)
class ModelOptions:
    """What is served: model directories (``--model [NAME=]DIR``) or a repository (``--model-root``)."""

    model: tuple[str, ...] = ()
    model_root: Path | None = None
    poll_interval_s: float = 0.0
    keep_versions: int = 1
    max_model_memory_bytes: str | None = None  # a size as written (2GiB, 512MiB): service.models.versions
    release_timeout_s: float = 60.0
    model_alias: tuple[str, ...] = ()
    normalize: bool = False


@dataclass(frozen=True)
class NetworkOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    http_port: int | None = DEFAULT_HTTP_PORT  # None: no HTTP
    metrics_port: int | None = None
    metrics_host: str | None = None
    reuse_port: bool = False


@dataclass(frozen=True)
class SecurityOptions:
    auth_token: str | None = None  # the flag's, else $ELMO_AUTH_TOKEN's (elmo.flags)
    admin_token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __repr__(self) -> str:  # tokens never reach a log line through a repr
        auth, admin = ("<set>" if token else None for token in (self.auth_token, self.admin_token))
        return (
            f"SecurityOptions(auth_token={auth}, admin_token={admin}, tls_cert={self.tls_cert}, tls_key={self.tls_key})"
        )


@dataclass(frozen=True)
class RuntimeOptions:
    """onnxruntime's session options for every model served."""

    threads: int | None = None
    runtime_batch_tokens: int | None = None
    token_cache: int | None = None
    providers: str | None = None


@dataclass(frozen=True)
class OperationsOptions:
    processes: int = 1
    port_file: Path | None = None


@dataclass(frozen=True)
class ServeConfig:
    """Everything ``elmo serve`` was configured with (flags, ``ELMO_*`` variables, ``--config``), one typed object."""

    models: ModelOptions
    network: NetworkOptions
    security: SecurityOptions
    limits: Limits
    health: HealthLimits
    runtime: RuntimeOptions
    operations: OperationsOptions


def _filled(cls: type, args: argparse.Namespace) -> object:
    """``cls`` with each field from the flag of the same name (lists as tuples)."""
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The parsed flags as a :class:`ServeConfig` (each group validated)."""
    config = ServeConfig(
        models=_filled(ModelOptions, args),
        network=_filled(NetworkOptions, args),
        security=_filled(SecurityOptions, args),
        limits=limits_from_args(args),
        health=health_limits_from_args(args),
        runtime=_filled(RuntimeOptions, args),
        operations=_filled(OperationsOptions, args),
    )
    if config.operations.processes < 1:
        raise ConfigError(f"--processes {config.operations.processes}: give 1 or more")
    return config


# -- the flags -----------------------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The essentials, more models, network, security, runtime tuning and operations flags (the limits and the
    other concerns add their own groups)."""
    parser.usage, parser.description = USAGE, DESCRIPTION
    _add_essentials(parser.add_argument_group(ESSENTIALS))
    _add_models(parser.add_argument_group(MODELS))
    _add_network(parser.add_argument_group(NETWORK))
    _add_security(parser.add_argument_group(SECURITY))
    _add_runtime(parser.add_argument_group(RUNTIME))
    parser._optionals.title = OPERATIONS  # --help, --log-level, --log-format: the flags every command shares
    _add_operations(parser)


def _add_essentials(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="[NAME=]DIR",
        help="model directory to serve (repeat for several; the first is the default)",
    )
    group.add_argument(
        "--host",
        default=DEFAULT_HOST,
        metavar="ADDRESS",
        help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0 = every "
        "interface, which the container uses)",
    )
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT}; 0 = any)")
    group.add_argument(
        "--http-port",
        type=port_or_off,
        default=DEFAULT_HTTP_PORT,
        metavar="PORT|off",
        help=f"HTTP/JSON API and web page (default {DEFAULT_HTTP_PORT}; 0 = any; off = no HTTP)",
    )
    group.add_argument(
        "--auth-token",
        default=None,
        metavar="TOKEN",
        help="require 'authorization: Bearer TOKEN' on gRPC and HTTP (default: none, open)",
    )


def _add_models(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--model-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="instead of --model: serve a model repository, DIR/NAME/VERSION/ exported model "
        "directories: the latest complete version of every NAME; versions change while serving "
        "(--poll-interval-s, the admin API); see docs/how-to/models.md",
    )
    group.add_argument(
        "--poll-interval-s",
        type=float,
        default=0.0,
        help="with --model-root: look for new, removed and repaired versions this often (default 0 = "
        "never: only the admin API changes what is loaded)",
    )
    group.add_argument(
        "--keep-versions",
        type=int,
        default=1,
        help="with --model-root: keep the N highest complete versions of every model loaded, each one "
        "pinnable as NAME@VERSION (default 1: the latest; new requests always go to the "
        "highest)",
    )
    memory = group.add_argument(
        "--max-model-memory-bytes",
        default=None,
        metavar="SIZE",
        help="with --model-root: refuse a load that would take the models' memory over SIZE "
        "(2GiB, 512MiB, 4GB or bytes; estimated from the model files, see "
        "docs/how-to/models.md; default no limit)",
    )
    add_alias(group, "--max-model-memory", memory)
    group.add_argument(
        "--release-timeout-s",
        type=float,
        default=60.0,
        help="with --model-root: a version taken out of service is released once its requests are "
        "done, or after this long at most (default 60)",
    )
    group.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME=MODEL[:TASK]",
        help="answer requests for model NAME with MODEL (or its TASK mix), e.g. "
        "text-embedding-3-small=default for clients that cannot change the name they send "
        "(repeatable; none by default)",
    )
    group.add_argument(
        "--normalize",
        action="store_true",
        help='POST /v1/embeddings answers unit-length vectors unless a request says "normalize": '
        "false (then dot product = cosine; the default answers the raw mean, as /v1/embed's "
        "layers are)",
    )


def _add_network(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port (default none)")
    group.add_argument("--metrics-host", default=None, metavar="ADDRESS", help="address for /metrics (default: --host)")
    group.add_argument(
        "--reuse-port",
        action="store_true",
        help="listen with SO_REUSEPORT, so that other servers started with it may share the ports "
        "(what each of --processes does; for running them yourself, e.g. one systemd unit per "
        "process); the ports open only once the models are warm, since a connection may reach "
        "any of the servers",
    )


def _add_security(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--tls-cert",
        type=Path,
        default=None,
        metavar="FILE",
        help="PEM certificate chain (with --tls-key): gRPC and HTTP over TLS",
    )
    group.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="PEM private key (with --tls-cert)")
    group.add_argument(
        "--admin-token",
        default=None,
        metavar="TOKEN",
        help="with --model-root: serve the admin API (gRPC elmo.v1.ModelAdmin, HTTP /admin/...) to "
        "callers with 'authorization: Bearer TOKEN' (default: none = no admin API)",
    )


def _add_runtime(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="onnxruntime intra-op threads per model (default: onnxruntime's, every core)",
    )
    group.add_argument(
        "--runtime-batch-tokens",
        type=int,
        default=None,
        help="rows x longest sentence per onnxruntime run inside one batch (default: the runtime's, "
        "4096 on CPU, 16384 on CUDA)",
    )
    token_cache = group.add_argument(
        "--token-cache-entries",
        type=int,
        default=None,
        dest="token_cache",
        metavar="ENTRIES",
        help="entries in the runtime's LRU of token-encoder vectors (default: the runtime's; 0 = off)",
    )
    add_alias(group, "--token-cache", token_cache)
    group.add_argument(
        "--providers",
        default=None,
        help="comma-separated onnxruntime providers (default: CUDA then CPU if a GPU is visible, else CPU)",
    )


def _add_operations(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="server processes sharing the ports (SO_REUSEPORT; the kernel spreads connections among "
        "them), each with its own copy of the models, batcher, limits and --threads (default: "
        "the cores / N): for models cheap enough (or a backend fast enough) that one process's "
        "request handling is the limit (docs/how-to/replicas.md) (default 1)",
    )
    parser.add_argument(
        "--port-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the bound gRPC port, metrics port and HTTP port here, one per line, once "
        "listening (for port 0); with --processes, a fourth line lists every process's metrics "
        "port",
    )


__all__ = [
    "ADMIN_TOKEN_ENV",
    "AUTH_TOKEN_ENV",
    "HELP_ORDER",
    "ModelOptions",
    "NetworkOptions",
    "OperationsOptions",
    "RuntimeOptions",
    "SecurityOptions",
    "ServeConfig",
    "add_serve_arguments",
    "port_or_off",
    "serve_config",
]
