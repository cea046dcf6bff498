"""``elmo serve``: the gRPC embedding server.

    elmo serve --model DIR [--model NAME=DIR ...] --port 50051 [--http-port 8080] [--metrics-port 9090]
               [--tls-cert FILE --tls-key FILE] [--auth-token TOKEN | env ELMO_AUTH_TOKEN] [limits flags]
    elmo serve --model-root DIR [--poll-interval-s 5] [--keep-versions 1] [--max-model-memory-bytes 8GiB]
               [--admin-token TOKEN | env ELMO_ADMIN_TOKEN] ...

``--model-root DIR`` serves a model repository (``DIR/NAME/VERSION/``) whose versions change while serving
(service.models.versions; the admin API in service.grpc.admin and on HTTP under /admin/).

``--http-port`` adds the HTTP/JSON API and the web page (service.http) on the same event loop, sharing models,
batchers, limits, token, TLS, metrics and drain.

Lifecycle: models load -> the port opens with grpc.health.v1 NOT_SERVING (reflection and GetModelInfo answer,
Embed answers UNAVAILABLE "warming up") -> each model runs a real warm-up forward pass through its batcher ->
SERVING. On SIGTERM/SIGINT: health NOT_SERVING; with ``--shutdown-delay-s S`` requests are still answered for S
seconds (a balancer's checks take the replica out meanwhile; a second signal cuts it short); then new RPCs get
UNAVAILABLE, RPCs in flight (streams included) get ``--drain-timeout-s`` to finish, the batchers stop and the process
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from elmo.service.common.errors import ServiceError
from elmo.service.common.limits import Limits, add_limit_arguments, grpc_server_settings
from elmo.service.common.ports import check_port_free
from elmo.service.config import (
    ADMIN_TOKEN_ENV,
    AUTH_TOKEN_ENV,
    DEFAULT_HOST,
    HELP_ORDER,  # elmo.cli shows --help's groups in this order
    add_serve_arguments,
    serve_config,
)
from elmo.service.core.requests import RequestCore
from elmo.service.grpc.admin import (
    ADMIN_PREFIX,
    ADMIN_SERVICE_NAME,
    ModelAdminServicer,
    admin_auth_interceptor,
    admin_handler,
)
from elmo.service.grpc.disconnects import log_client_disconnects_as_info
from elmo.service.grpc.health import (
    HealthLimits,
    HealthServicer,
    add_health_arguments,
    health_handler,
)
from elmo.service.grpc.interceptors import HEALTH_PREFIX, AuthInterceptor, CallGate, ObserverInterceptor
from elmo.service.grpc.servicer import SERVICE_NAME, EmbedderServicer, embedder_handler
from elmo.service.models.registry import ModelRegistry, ServedModel, parse_alias, serve_model
from elmo.service.models.versions import FixedModels, ModelManager, parse_bytes
from elmo.service.processes import add_restart_arguments, die_with_supervisor, run_processes, wait_for_the_group
from elmo.service.telemetry.metrics import ServiceMetrics
from elmo.service.telemetry.observe import RequestObserver
from elmo.service.telemetry.tracing import (
    add_tracing_arguments,
    configure_tracing,
    grpc_interceptors,
    tracing_from_args,
)
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from elmo.errors import ConfigError, ElmoError
from elmo.runtime.memory import add_memory_arguments, configure_memory, memory_from_args

log = logging.getLogger("service.server")


@dataclass(frozen=True)
class RepositoryOptions:
    """``--model-root`` and its flags (service.models.versions.ModelManager's arguments)."""

    root: Path
    open_runtime: Callable[[Path], Any]
    poll_interval_s: float = 0.0
    keep_versions: int = 1
    max_memory: int | None = None
    release_timeout_s: float = 60.0


HEALTH_SERVICES = ("", SERVICE_NAME)  # "" = the whole server
STOP_GRACE_S = 1.0  # the drain's end: calls still open get this long (at most what is left of it), then cancelled


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        for path in (self.cert, self.key):
            if not path.is_file():
                raise ConfigError(f"{path}: TLS file not found")
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate for the HTTP port."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context


class ElmoServer:
    """The gRPC server around a set of served models. ``start`` -> ``warm_up`` -> ``wait`` / ``drain``."""

    def __init__(
        self,
        models: list[ServedModel],
        limits: Limits,
        metrics: ServiceMetrics,
        host: str = DEFAULT_HOST,
        port: int = 50051,
        tls: TlsFiles | None = None,
        auth_token: str | None = None,
        http_port: int | None = None,
        aliases: dict[str, tuple[str, str]] | None = None,
        normalize: bool = False,
        repository: RepositoryOptions | None = None,
        admin_token: str | None = None,
        reuse_port: bool = False,
        health_limits: HealthLimits | None = None,
    ):
        self.registry = ModelRegistry(models, aliases, allow_empty=repository is not None)
        self.limits = limits
        self.metrics = metrics
        self.host, self.port, self.tls = host, port, tls
        self.reuse_port = reuse_port  # --reuse-port: the ports are shared with sibling processes (--processes)
        self._warmed = False  # warm_up done: from then on health follows what is loaded (_health_follows_models)
        self._working = False  # the batchers started (_start_work)
        self.repository: ModelManager | FixedModels = FixedModels(self.registry)
        if repository is not None:
            self.repository = ModelManager(
                repository.root,
                self.registry,
                limits,
                metrics,
                repository.open_runtime,
                poll_interval_s=repository.poll_interval_s,
                keep_versions=repository.keep_versions,
                max_memory=repository.max_memory,
                release_timeout_s=repository.release_timeout_s,
                on_change=self._health_follows_models,
            )
        swappable = isinstance(self.repository, ModelManager)
        if admin_token and not swappable:
            raise ConfigError("--admin-token controls a model repository: serve one with --model-root DIR")
        self.core = RequestCore(self.registry, limits, self.repository)
        self.state = self.core.state  # the drain below sets the core's switch
        self.health = HealthServicer(health_limits, limits.grpc_message_timeout)
        observer = RequestObserver(metrics)
        interceptors: list[grpc.aio.ServerInterceptor] = [*grpc_interceptors(), ObserverInterceptor(observer)]
        if auth_token:  # the clients' token: not on health checks, nor on the admin API (its own token)
            interceptors.append(AuthInterceptor(auth_token, exempt_prefixes=(HEALTH_PREFIX, ADMIN_PREFIX)))
        if admin_token:
            interceptors.append(admin_auth_interceptor(admin_token))
        interceptors.append(CallGate.for_limits(limits))
        log_client_disconnects_as_info()  # grpc.aio's own ERROR for an answer nobody was there to take
        self.server = grpc.aio.server(interceptors=interceptors, **self._grpc_settings(reuse_port))
        self.servicer = EmbedderServicer(self.core)
        self.server.add_generic_rpc_handlers((embedder_handler(self.servicer),))
        services = [SERVICE_NAME]
        if admin_token and swappable:
            self.server.add_generic_rpc_handlers((admin_handler(ModelAdminServicer(self.repository)),))
            services.append(ADMIN_SERVICE_NAME)
        self.http_port = http_port
        self.http = None
        if http_port is not None:
            from elmo.service.http.app import HttpFrontend  # aiohttp is only needed with --http-port

            self.http = HttpFrontend(
                self.core,
                observer,
                auth_token,
                self._serving,
                normalize=normalize,
                admin_token=admin_token if swappable else None,
            )
            self.http.guard.health_connections = self.health.limits.http_connections  # GET /health beyond the cap
        self.server.add_generic_rpc_handlers((health_handler(self.health),))
        reflection.enable_server_reflection(
            (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        self._stopped = asyncio.Event()
        self._draining_task: asyncio.Task | None = None
        self._cut_delay = asyncio.Event()  # a second SIGTERM/SIGINT during --shutdown-delay-s

    def _grpc_settings(self, reuse_port: bool) -> dict:
        """grpc.aio.server's arguments: gRPC's own cap on open calls holds the call gate's calls and refusals
        (service.common.limits) plus every health call the health shares allow (service.grpc.health), so that no
        kind of call can keep another out (docs/how-to/deploy.md, "Health checks")."""
        settings = grpc_server_settings(self.limits, reuse_port)
        settings["maximum_concurrent_rpcs"] += self.health.limits.calls
        return settings

    def _serving(self) -> bool:
        """Ready to take requests: at least one model loaded (a repository may have none) and each warmed up."""
        return bool(self.registry.models) and all(model.ready for model in self.registry)

    def _health_follows_models(self) -> None:
        """After warm-up, a version loaded or released under --model-root flips gRPC health to what is loaded now:
        NOT_SERVING while no model is, SERVING again once one is (the drain and --shutdown-delay-s keep theirs)."""
        if not self._warmed or not self.core.taking_requests:
            return
        answer = health_pb2.HealthCheckResponse
        self._set_health(answer.SERVING if self._serving() else answer.NOT_SERVING)

    def _set_health(self, status: int) -> None:
        """Every health service's status; the watchers are woken, none is waited for (service.grpc.health)."""
        for service in HEALTH_SERVICES:
            self.health.set(service, status)

    def _start_work(self) -> None:
        """The batchers, once: before :meth:`warm_up`, which may come first (serve())."""
        if self._working:
            return
        self._working = True
        for model in self.registry:
            model.batcher.start()

    async def start(self) -> int:
        """Open the port (health NOT_SERVING until :meth:`warm_up`, unless that came first); returns the bound
        port."""
        if not self._warmed:
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{self.host}:{self.port}"
        check_port_free(self.host, self.port, reuse_port=self.reuse_port)
        try:
            if self.tls is not None:
                self.port = self.server.add_secure_port(address, self.tls.credentials())
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc raises a bare RuntimeError("Failed to bind ...")
            raise ConfigError(f"cannot listen on {address}: {exc} (port in use?)") from None
        if self.port == 0:
            raise ConfigError(f"cannot listen on {address} (port in use?)")
        self._start_work()
        await self.server.start()
        log.info(
            "listening on %s:%d (%s), models: %s",
            self.host,
            self.port,
            "TLS" if self.tls else "plaintext",
            ", ".join(m.name for m in self.registry),
        )
        if self.http is not None:
            try:
                self.http_port = await self.http.start(
                    self.host, self.http_port, self.tls.ssl_context() if self.tls else None, self.reuse_port
                )
            except ConfigError:
                await self.server.stop(0)
                raise
            scheme = "https" if self.tls else "http"
            log.info("HTTP API and page on %s://%s:%d/", scheme, self.host, self.http_port)
        return self.port

    async def warm_up(self) -> None:
        """A real forward pass per model through its batcher (under --model-root: the latest complete version of
        every model loaded, checked and warmed up, then polling starts); then SERVING, or NOT_SERVING while a
        repository has no model loaded (health then follows the versions as they load: _health_follows_models)."""
        self._start_work()
        await self.repository.start()
        for model in self.registry:
            if not model.ready:
                await model.warm_up()
            self.metrics.ready.labels(model.name).set(1)
        self._warmed = True
        if not self.registry.models:  # a repository with nothing loadable: up (admin API, polling), not healthy
            log.warning(
                "no model version under %s could be loaded: health NOT_SERVING until one is published or "
                "loaded through the admin API",
                self.repository.root,
            )
            return
        if not self.core.taking_requests:  # a signal came during the warm-up: health keeps the NOT_SERVING it set
            return
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("SERVING")

    def request_drain(self) -> None:
        """Signal-handler entry point: leave the rotation (--shutdown-delay-s), then drain; a second signal during
        the delay ends it early."""
        if self._draining_task is None:
            self._draining_task = asyncio.get_running_loop().create_task(self.leave_then_drain())
        else:
            self._cut_delay.set()

    async def leave_then_drain(self) -> None:
        """Health NOT_SERVING while requests are still answered, for ``--shutdown-delay-s`` seconds, so that a load
        balancer's health checks take this replica out before it refuses anything; then :meth:`drain`."""
        delay = self.limits.shutdown_delay
        if delay > 0:
            log.info(
                "leaving: health NOT_SERVING, requests still answered for %.1f s (--shutdown-delay-s), then the drain",
                delay,
            )
            self.state.leaving = True
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cut_delay.wait(), timeout=delay)
        await self.drain()

    async def drain(self, grace: float | None = None) -> None:
        """NOT_SERVING, refuse new RPCs, let in-flight RPCs finish within ``grace`` seconds, stop everything."""
        grace = self.limits.drain_seconds if grace is None else grace
        log.info("draining: new RPCs get UNAVAILABLE, in-flight RPCs have %.0f s to finish", grace)
        self.state.draining = True
        self.health.enter_graceful_shutdown()  # every Watch is sent NOT_SERVING and ends
        ends_at = asyncio.get_running_loop().time() + grace
        if self.state.active:  # (wait_for with timeout 0 times out even when there is nothing to wait for)
            try:
                await asyncio.wait_for(self.state.wait_idle(), timeout=grace)
            except TimeoutError:
                log.warning("drain: %d RPCs still in flight after %.0f s; cancelling them", self.state.active, grace)
        # what is still open (a Watch or an answer whose client does not read) gets what is left of the grace, 1 s
        # at most, then is cancelled; both doors close at once: the process is gone soon after --drain-timeout-s,
        # whatever clients hold
        left = max(0.0, ends_at - asyncio.get_running_loop().time())
        await asyncio.gather(self.server.stop(min(STOP_GRACE_S, left)), self._stop_http())
        await self.repository.close()
        self.core.close()
        self.metrics.close()
        log.info("drained and stopped")
        self._stopped.set()

    async def _stop_http(self) -> None:
        if self.http is not None:
            await self.http.stop()

    async def wait(self) -> None:
        await self._stopped.wait()


# -- command line ------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``elmo serve``, grouped for --help (service.config); each one also ELMO_<NAME> and a --config
    key (elmo.flags)."""
    add_serve_arguments(parser)  # the essentials, more models, network, security, runtime tuning, operations
    add_limit_arguments(parser)
    add_health_arguments(parser)
    add_restart_arguments(parser)
    add_memory_arguments(parser)
    add_tracing_arguments(parser)


def _model_specs(values: list[str]) -> list[tuple[str, Path]]:
    specs = []
    for value in values:
        name, sep, path = value.partition("=")
        if sep and not Path(value).exists():
            specs.append((name, Path(path)))
        else:
            specs.append(("", Path(value)))
    return specs


def runtime_opener(args: argparse.Namespace, limits: Limits) -> Callable[[Path], Any]:
    """``open(directory)`` -> an elmo.runtime.Embedder with the command line's runtime flags."""
    from elmo.runtime import Embedder

    providers = [p.strip() for p in args.providers.split(",")] if args.providers else None
    runtime_options = {} if args.token_cache is None else {"cache_size": args.token_cache}
    if args.runtime_batch_tokens is not None:
        runtime_options["max_batch_tokens"] = args.runtime_batch_tokens

    def open_runtime(directory: Path) -> Any:
        return Embedder(
            directory,
            **runtime_options,
            providers=providers,
            intra_op_threads=args.threads,
            max_tokens_per_sentence=limits.max_tokens_per_sentence,
            check_on_load=False,  # the warm-up runs it, the port open and health NOT_SERVING (ServedModel.warm_up)
        )

    return open_runtime


def load_models(args: argparse.Namespace, limits: Limits, metrics: ServiceMetrics) -> list[ServedModel]:
    open_runtime = runtime_opener(args, limits)
    models = []
    for name, directory in _model_specs(args.model or []):
        runtime = open_runtime(directory)
        served_name = name or runtime.info.name
        models.append(serve_model(runtime, directory, limits, metrics.observer(served_name), name=served_name))
    return models


def _repository_from_args(args: argparse.Namespace, limits: Limits) -> RepositoryOptions | None:
    if bool(args.model) == (args.model_root is not None):
        raise ConfigError("serve either --model DIR (repeatable) or --model-root DIR (a model repository)")
    if args.model_root is None:
        for flag, default in (
            ("max_model_memory_bytes", None),
            ("admin_token", None),
            ("poll_interval_s", 0.0),
            ("keep_versions", 1),
        ):
            if getattr(args, flag, None) not in (default, None):
                raise ConfigError(f"--{flag.replace('_', '-')} goes with --model-root DIR")
        return None
    return RepositoryOptions(
        args.model_root,
        runtime_opener(args, limits),
        poll_interval_s=args.poll_interval_s,
        keep_versions=args.keep_versions,
        max_memory=parse_bytes(args.max_model_memory_bytes) if args.max_model_memory_bytes else None,
        release_timeout_s=args.release_timeout_s,
    )


def _tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    return TlsFiles(args.tls_cert, args.tls_key) if args.tls_cert else None


def token_from(flag: str | None, env: str, name: str) -> str | None:
    """The flag's token, else the environment's; None when neither is set. An empty or blank one is refused: it is
    what an unset shell variable gives (``--auth-token "$TOKEN"``), and serving open then would be silent."""
    source, value = (name, flag) if flag is not None else (f"${env}", os.environ.get(env))
    if value is None:
        return None
    if not value.strip():
        raise ConfigError(
            f"{source} is empty (an unset variable?): give a token, or leave it out to serve "
            f"{'without the admin API' if 'admin' in name else 'open'}"
        )
    return value


def _source(args: argparse.Namespace, dest: str) -> str:
    """Where a flag's value came from, as a message names it: ``--auth-token``, or ``$ELMO_AUTH_TOKEN``."""
    return getattr(args, "flag_sources", {}).get(dest, "--" + dest.replace("_", "-"))


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def warn_open_to_the_network(host: str, auth_token: str | None) -> None:
    """Beyond this machine and with no token, anyone who reaches the ports may embed, and read the page and the
    metrics: said once at start (a container does this on purpose, behind its published ports)."""
    if auth_token is None and host not in LOOPBACK_HOSTS:
        log.warning(
            "listening on %s with no --auth-token: every address that reaches the ports may call the API "
            "(set ELMO_AUTH_TOKEN, or --host 127.0.0.1 for this machine only)",
            host,
        )


def warn_plaintext_admin(host: str, admin_token: str | None, tls: TlsFiles | None) -> None:
    """The admin token loads and unloads models: sent in clear text to a non-loopback address, anyone on the path
    can read it. Said once at start (the operator may have a TLS proxy in front)."""
    if admin_token and tls is None and host not in LOOPBACK_HOSTS:
        log.warning(
            "--admin-token on %s over plaintext: the admin token crosses the network in clear text; serve "
            "with --tls-cert/--tls-key, bind 127.0.0.1, or put a TLS proxy in front",
            host,
        )


async def serve(args: argparse.Namespace) -> int:
    config = serve_config(args)  # flags, ELMO_* variables and --config, one typed object (service.config)
    limits, net = config.limits, config.network
    tls = _tls_from_args(args)
    aliases = dict(parse_alias(value) for value in config.models.model_alias)
    metrics = ServiceMetrics()
    auth_token = token_from(config.security.auth_token, AUTH_TOKEN_ENV, _source(args, "auth_token"))
    admin_token = token_from(config.security.admin_token, ADMIN_TOKEN_ENV, _source(args, "admin_token"))
    warn_plaintext_admin(net.host, admin_token, tls)
    warn_open_to_the_network(net.host, auth_token)
    # before the models load: a taken port fails in a second, and with one line (see check_port_free)
    check_port_free(net.host, net.port, reuse_port=net.reuse_port)
    check_port_free(net.host, net.http_port, " for HTTP", reuse_port=net.reuse_port)
    check_port_free(net.metrics_host or net.host, net.metrics_port, " for metrics")
    repository = _repository_from_args(args, limits)
    configure_memory(memory_from_args(args))  # before the sessions open: the arena is chosen per session
    configure_tracing(tracing_from_args(args))  # before the server: its interceptors follow it
    models = load_models(args, limits, metrics)
    server = ElmoServer(
        models,
        limits,
        metrics,
        host=net.host,
        port=net.port,
        tls=tls,
        auth_token=auth_token,
        http_port=net.http_port,
        aliases=aliases,
        normalize=config.models.normalize,
        repository=repository,
        admin_token=admin_token,
        reuse_port=net.reuse_port,
        health_limits=config.health,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_drain)
    # the ports shared with sibling processes (--processes): a connection may reach this one, so it opens them warm,
    # and in a group once all are (service.processes)
    listen_warm = net.reuse_port
    if listen_warm and not (await _warm_up_or_fail(server) and await wait_for_the_group(server.wait)):
        await server.wait()  # a signal before listening: it drains without ever listening
        return 0
    port = await server.start()
    metrics_port = None
    if net.metrics_port is not None:
        try:
            metrics_port = metrics.serve_http(net.metrics_port, net.metrics_host or net.host)
        except OSError as exc:  # taken since the check above
            await server.drain(grace=0)
            raise ConfigError(f"cannot listen for metrics on port {net.metrics_port}: {exc.strerror}") from None
        log.info("metrics on http://%s:%d/metrics", net.metrics_host or net.host, metrics_port)
    if config.operations.port_file is not None:
        config.operations.port_file.write_text(f"{port}\n{metrics_port or ''}\n{server.http_port or ''}\n")
    if not listen_warm:
        await _warm_up_or_fail(server)
    await server.wait()
    return 0


async def _warm_up_or_fail(server: ElmoServer) -> bool:
    """:meth:`ElmoServer.warm_up`; False when a signal came meanwhile (the server drains), ElmoError when a model
    is broken (the server stopped: one line says why)."""
    try:
        await server.warm_up()
    except ServiceError as exc:
        if not server.state.draining:  # a broken model: stop cleanly and say why in one line
            await server.drain(grace=0)
            raise ElmoError(f"warm-up failed: {exc.message}") from None
    return not server.state.draining


def run(args: argparse.Namespace) -> int:
    if args.processes != 1:
        return run_processes(args)
    die_with_supervisor()
    return asyncio.run(serve(args))


__all__ = ["HELP_ORDER", "ElmoServer", "RepositoryOptions", "TlsFiles", "add_arguments", "run", "serve"]
