"""OpenTelemetry traces of requests, exported over OTLP/gRPC: optional (the ``otel`` extra), off by default.

Turned on by ``elmo serve --otlp-endpoint http://HOST:4317`` or, without the flag, by the standard
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT. Each gRPC call and HTTP request is one SERVER
span, the child of the caller's W3C ``traceparent`` (gRPC metadata, HTTP header; OTEL_PROPAGATORS may choose
others), with a child span per step of an embedding request:

    elmo.admission     admission, the version, the checks and tokenizing, the answer's place in the byte budget
    elmo.queue_wait    queued until the request's first batch went to a worker
    elmo.batch         one batch the request rode in: handed to a worker until its runtime call ended
      elmo.runtime_call  the runtime call itself (char-CNN, biLSTM runs), inside its batch
    elmo.answer        building the answer (encoding the vectors)

Spans are batched and exported off the event loop (the SDK's BatchSpanProcessor: OTEL_BSP_* tune it); what is
still queued is exported when the server stops. The SDK's own variables hold (OTEL_SERVICE_NAME, default ``elmo``;
OTEL_TRACES_SAMPLER; OTEL_EXPORTER_OTLP_HEADERS, ...). Without an endpoint nothing here imports OpenTelemetry, and
the serving path's cost is one global lookup per step.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from elmo.service.common.handlers import WrappingInterceptor, wrap_handler

from elmo.errors import ConfigError
from elmo.flags import add_fields_as_flags, fields_from_args

log = logging.getLogger("service.tracing")

EXTRA_HINT = "install the `otel` extra: pip install 'elmo-service[serve,otel]'"
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_SERVICE_NAME = "elmo"


@dataclass(frozen=True)
class TracingOptions:
    """Where traces go (``elmo serve --otlp-endpoint``)."""

    otlp_endpoint: str = ""  # empty: the OTEL_EXPORTER_OTLP_* variables, else no tracing

    def endpoint(self, environ: Mapping[str, str]) -> tuple[str, str]:
        """(endpoint, where it was given); ("", "") when tracing is off."""
        if self.otlp_endpoint:
            return self.otlp_endpoint, "--otlp-endpoint"
        for name in ENDPOINT_ENV:
            if environ.get(name, "").strip():
                return environ[name].strip(), f"${name}"
        return "", ""


_HELP = {
    "otlp_endpoint": "export OpenTelemetry traces of every request over OTLP/gRPC to this collector, e.g. "
    "http://127.0.0.1:4317 (http:// plaintext, https:// TLS); empty: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
    "$OTEL_EXPORTER_OTLP_ENDPOINT if set, else no traces. Needs the `otel` extra",
}


def add_tracing_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tracing (OpenTelemetry)")
    add_fields_as_flags(group, TracingOptions(), _HELP, metavars={"otlp_endpoint": "URL"})


def tracing_from_args(args: argparse.Namespace) -> TracingOptions:
    return fields_from_args(TracingOptions, args)


# -- the process's tracer ------------------------------------------------------------------------------------------
_tracer: Any = None  # an opentelemetry Tracer once configure_tracing() turned tracing on; None: every hook does nothing
_provider: Any = None
_NOTHING = contextlib.nullcontext()  # reusable: what phase() gives while tracing is off


def configure_tracing(options: TracingOptions, environ: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on when an endpoint is given; True if it is on. The flag without the extra installed is a
    ConfigError; an endpoint from the environment without it is one warning (the fleet's variables need not fit
    every program)."""
    global _tracer, _provider
    environ = os.environ if environ is None else environ
    endpoint, source = options.endpoint(environ)
    if not endpoint:
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        if source == "--otlp-endpoint":
            raise ConfigError(f"--otlp-endpoint needs OpenTelemetry ({exc.name} is missing): {EXTRA_HINT}") from None
        log.warning("%s is set but OpenTelemetry is not installed (%s): no traces; %s", source, exc.name, EXTRA_HINT)
        return False
    service = environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))  # shuts down (flushes) at exit
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _tracer = provider, provider.get_tracer("elmo.service")
    trace.set_tracer_provider(provider)  # once per process; the global one, for libraries that trace too
    log.info("traces go to %s over OTLP/gRPC (%s), service.name=%s", endpoint, source, service)
    return True


def shutdown() -> None:
    """Export what is still queued and stop (also done at exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


# -- the steps of a request ----------------------------------------------------------------------------------------
def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request's span around a step (``admission``, ``answer``) run on the event loop:
    it covers the awaits inside it. Nothing while tracing is off."""
    if _tracer is None:
        return _NOTHING
    return _tracer.start_as_current_span(f"elmo.{name}")


def batch_spans(queued: float, stats: Iterable[Any]) -> None:
    """The queue wait, batches and runtime calls of one request's sentences, after the fact from the batcher's
    timings (service.models.batcher.BatchStats; ``queued``: time.monotonic() when the request was queued). Several
    batches when the request's sentences were cut among them."""
    if _tracer is None:
        return
    batches = list({id(s): s for s in stats}.values())
    if not batches:
        return
    to_ns = _clock_to_ns()
    first = min(b.queue_s for b in batches)
    _tracer.start_span("elmo.queue_wait", start_time=to_ns(queued), attributes={"elmo.batches": len(batches)}).end(
        end_time=to_ns(queued + first)
    )
    from opentelemetry import trace

    for b in batches:
        started, ended = queued + b.queue_s, queued + b.queue_s + b.inference_s
        attributes = {
            "elmo.batch.sentences": b.sentences,
            "elmo.batch.tokens": b.tokens,
            "elmo.batch.padded_tokens": b.padded_tokens,
        }
        batch = _tracer.start_span("elmo.batch", start_time=to_ns(started), attributes=attributes)
        within = trace.set_span_in_context(batch)
        runtime_started = ended - (b.runtime_s or b.inference_s)
        _tracer.start_span("elmo.runtime_call", context=within, start_time=to_ns(runtime_started)).end(
            end_time=to_ns(ended)
        )
        batch.end(end_time=to_ns(ended))


def _clock_to_ns() -> Any:
    """time.monotonic() seconds -> Unix nanoseconds, as the spans need them (one reading of both clocks)."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda seconds: int(seconds * 1e9) + offset


# -- the doors: one SERVER span per call, parented to the caller's traceparent -------------------------------------
@contextlib.contextmanager
def _server_span(name: str, carrier: Mapping[str, str], attributes: dict[str, Any]) -> Iterator[Any]:
    from opentelemetry import propagate, trace

    parent = propagate.extract(carrier)
    with _tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes) as span:
        yield span


def grpc_interceptors() -> list[Any]:
    """The gRPC server's tracing interceptor (first in the list: its span covers the others), or none when off."""
    return [_GrpcTracing()] if _tracer is not None else []


def http_middlewares() -> list[Any]:
    """The HTTP app's tracing middleware (first: its span covers the others), or none when off."""
    if _tracer is None:
        return []
    from aiohttp import web

    @web.middleware
    async def traced(request: web.Request, handler: Any) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        attributes = {"http.request.method": request.method, "http.route": route, "url.path": request.path}
        with _server_span(f"{request.method} {route}", request.headers, attributes) as span:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                _http_status(span, exc.status)
                raise
            _http_status(span, response.status)
            return response

    return [traced]


def _http_status(span: Any, status: int) -> None:
    from opentelemetry.trace import StatusCode

    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR)


def _grpc_metadata(context: Any) -> dict[str, str]:
    return {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}


def _grpc_status(span: Any, context: Any, error: BaseException | None) -> None:
    from opentelemetry.trace import StatusCode

    code = context.code()
    if code is None:
        code = grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code not in (
            grpc.StatusCode.OK,
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.UNAUTHENTICATED,
        ):
            span.set_status(StatusCode.ERROR, code.name)


class _GrpcTracing(WrappingInterceptor):
    """Each call in a SERVER span named by its method, parented to the caller's traceparent."""

    def wrap(self, method: str, handler: Any) -> Any:
        service, _, name = method.lstrip("/").rpartition("/")
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
        span_name = method.lstrip("/")

        def enter(context: Any) -> tuple[Any, Any]:
            opened = _server_span(span_name, _grpc_metadata(context), attributes)
            return opened, opened.__enter__()

        def leave(state: tuple[Any, Any], context: Any, error: BaseException | None) -> None:
            opened, span = state
            _grpc_status(span, context, error)
            opened.__exit__(type(error) if error else None, error, error.__traceback__ if error else None)

        return wrap_handler(handler, enter, leave)


__all__ = [
    "TracingOptions",
    "add_tracing_arguments",
    "batch_spans",
    "configure_tracing",
    "enabled",
    "grpc_interceptors",
    "http_middlewares",
    "phase",
    "shutdown",
    "tracing_from_args",
]
