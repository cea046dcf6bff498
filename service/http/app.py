"""The HTTP/JSON front door of ``elmo serve --http-port N``: aiohttp on the gRPC server's own event loop.

It shares everything with gRPC: the models and their batchers, the limits, the bearer token, TLS, the metrics and the
drain (requests are admitted through the same :class:`service.servicer.ServerState`). Requests are translated into
the gRPC contract's messages (service.http.schema) and run through :meth:`EmbedderServicer.embed_request`, so both
APIs answer the same vectors under the same rules.

    POST /v1/embeddings   OpenAI's schema: one pooled vector per input
    POST /v1/embed        per-token, per-layer vectors and task mixes (JSON numbers or base64)
    POST /v1/tokenize     the service's tokens and offsets
    GET  /v1/models       served models, and one ``model:task`` entry per task mix
    GET  /health          200 SERVING / 503 NOT_SERVING (no token needed)
    GET  /openapi.json    this API's OpenAPI description
    GET  /                the layer explorer page (service/http/page/index.html)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from elmo.errors import ConfigError
from elmo.v1 import embedder_pb2 as pb
from service.errors import Kind, ServiceError, http_status, invalid
from service.http import schema
from service.http.openapi import openapi_document
from service.limits import Limits
from service.metrics import ServiceMetrics
from service.servicer import EmbedderServicer, ServerState, human_bytes

log = logging.getLogger("service.http")

PAGE = Path(__file__).resolve().parent / "page" / "index.html"
OPEN_PATHS = ("/", "/health", "/openapi.json")  # no token: the page holds no data, probes carry no secrets
JSON_TYPE = "application/json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, kind: str) -> web.Response:
    """OpenAI's error shape, which its clients and most HTTP tooling read: {"error": {"message", "type", ...}}."""
    body = {"error": {"message": message, "type": kind.replace(" ", "_"), "code": status}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


class HttpFrontend:
    def __init__(
        self,
        servicer: EmbedderServicer,
        state: ServerState,
        limits: Limits,
        metrics: ServiceMetrics,
        auth_token: str | None,
        is_serving: Callable[[], bool],
    ):
        self.servicer, self.state, self.limits, self.metrics = servicer, state, limits, metrics
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        self._is_serving = is_serving
        self.app = web.Application(
            client_max_size=limits.max_message_bytes, middlewares=[self._observe, self._guard]
        )
        self.app.add_routes(
            [
                web.post("/v1/embeddings", self.embeddings),
                web.post("/v1/embed", self.embed),
                web.post("/v1/tokenize", self.tokenize),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model_id}", self.one_model),
                web.get("/health", self.health),
                web.get("/openapi.json", self.openapi),
                web.get("/", self.page),
            ]
        )
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0 = any free port); returns the bound port."""
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror} (port in use?)") from None
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middlewares ---------------------------------------------------------------------------------------------
    @web.middleware
    async def _observe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Errors as JSON with the right status; metrics and a log line per request, like the gRPC observer."""
        started = time.perf_counter()
        self.metrics.in_flight.inc()
        route = request.match_info.route.resource
        name = f"{request.method} {route.canonical if route is not None else 'unmatched'}"
        response = None
        try:
            response = await handler(request)
        except ServiceError as exc:
            response = error_response(http_status(exc.kind), exc.message, exc.kind.value)
        except web.HTTPException as exc:  # aiohttp's own: no route, wrong method, body over client_max_size
            response = error_response(exc.status, self._explain(exc), "invalid input")
        except Exception:  # a bug: answer 500, keep serving
            log.exception("%s failed", name)
            response = error_response(500, "internal error (logged on the server)", Kind.INTERNAL.value)
        finally:
            seconds = time.perf_counter() - started
            status = response.status if response is not None else 499  # cancelled: the client went away
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(name, str(status)).inc()
            self.metrics.latency.labels(name).observe(seconds)
            level = logging.DEBUG if status < 500 else logging.WARNING
            log.log(level, "%s %d %.1fms peer=%s", name, status, 1000 * seconds, request.remote)
        return response

    def _explain(self, exc: web.HTTPException) -> str:
        if exc.status == 413:
            return (
                f"request body over the {human_bytes(self.limits.max_message_bytes)} limit "
                "(--max-message-bytes); split the request"
            )
        if exc.status == 404:
            return "no such endpoint; see GET /openapi.json"
        if exc.status == 405:
            return f"method not allowed here (allowed: {exc.headers.get('Allow', '?')})"
        return exc.reason

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Bearer token (as on gRPC), then the drain switch, for everything but the open paths."""
        if request.path not in OPEN_PATHS:
            if self._expected is not None:
                presented = request.headers.get("Authorization")
                if presented is None:
                    raise ServiceError(Kind.UNAUTHENTICATED, "missing 'Authorization: Bearer <token>' header")
                if not hmac.compare_digest(presented.encode(), self._expected):
                    raise ServiceError(Kind.UNAUTHENTICATED, "invalid bearer token")
            self.state.check_open()
        return await handler(request)

    # -- helpers ---------------------------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        return schema.parse_json(await request.read())

    async def _run(self, embed: pb.EmbedRequest) -> pb.EmbedResponse:
        with self.state.admit():
            return await self.servicer.embed_request(embed)

    @staticmethod
    async def _json(payload: Callable[[], Any]) -> web.Response:
        """Build and serialize a large answer off the event loop (gRPC and other requests keep being served)."""
        text = await asyncio.to_thread(lambda: json.dumps(payload(), separators=(",", ":"), ensure_ascii=False))
        return web.Response(text=text, content_type=JSON_TYPE)

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.Response:
        parsed = schema.parse_openai(await self._body(request), request.headers.get("X-Request-Id", ""))
        model = self.servicer.models.get(parsed.embed.model)
        if parsed.embed.task:
            model.tasks.get(parsed.embed.task)  # an unknown task is a 404 before any work
        if parsed.dimensions is not None and parsed.dimensions != model.dim:
            raise invalid(f"'dimensions' is {parsed.dimensions}, but model '{model.name}' has {model.dim}")
        response = await self._run(parsed.embed)
        model_id = f"{model.name}:{parsed.embed.task}" if parsed.embed.task else model.name
        return await self._json(lambda: schema.openai_answer(parsed, response, model_id))

    async def embed(self, request: web.Request) -> web.Response:
        call = schema.parse_embed(await self._body(request), request.headers.get("X-Request-Id", ""))
        response = await self._run(call.embed)
        return await self._json(lambda: schema.embed_answer(response, call.encoding))

    async def tokenize(self, request: web.Request) -> web.Response:
        response = self.servicer.tokenize_request(schema.parse_tokenize(await self._body(request)))
        return web.json_response(schema.tokenize_answer(response))

    async def models(self, request: web.Request) -> web.Response:
        entries = [e for m in self.servicer.models for e in schema.model_entries(self.servicer.model_info(m.name))]
        return web.json_response({"object": "list", "data": entries})

    async def one_model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        model, task = schema.split_model(model_id)
        entries = schema.model_entries(self.servicer.model_info(model))
        for entry in entries:
            if entry["id"] == model_id or (not model and entry.get("task") == task):
                return web.json_response(entry)
        raise ServiceError(Kind.NOT_FOUND, f"unknown task '{task}' of model '{entries[0]['id']}'")

    async def health(self, request: web.Request) -> web.Response:
        serving = self._is_serving() and not self.state.draining
        return web.json_response({"status": "SERVING" if serving else "NOT_SERVING"}, status=200 if serving else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8")


__all__ = ["HttpFrontend", "error_response"]
