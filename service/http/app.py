"""The HTTP/JSON front door of ``elmo serve --http-port N``: aiohttp on the gRPC server's own event loop.

A thin adapter over the request core (service.core.requests), as the gRPC servicer is: the models and their
batchers, the limits, the bearer-token check, TLS, per-request observation and the drain are the same objects.
Requests are translated into the gRPC contract's messages (service.http.schema) and run through the core's public
operations with the encoding their answer is sent in (service.http.encodings) and a function that builds it, so both
APIs answer the same vectors under the same rules, from one resolved version. Parsing large bodies, building and
encoding large answers run on the core's workers; the event loop only moves bytes. Connections are guarded
(service.http.connections): header, body and idle timeouts and a cap on open connections.

    POST /v1/embeddings   OpenAI's schema: one pooled vector per input
    POST /v1/embed        per-token, per-layer vectors and task mixes (JSON numbers or base64)
    POST /v1/tokenize     the service's tokens and offsets
    GET  /v1/models       served models (with their loaded versions), and one ``model:task`` entry per task mix
    GET  /admin/models                  (--model-root, --admin-token: only then served, and documented)
    POST /admin/models/{name}/load      load a version ({"version": N}; none = the latest)
    POST /admin/models/{name}/unload    unload a version ({"version": N}; none = every version)
    GET  /health          200 SERVING / 503 NOT_SERVING (no token needed)
    GET  /openapi.json    this API's OpenAPI description
    GET  /                the layer explorer page (service/http/page/index.html)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from elmo.service.common.errors import Kind, ServiceError, clip, http_status, invalid
from elmo.service.common.limits import human_bytes
from elmo.service.common.tokens import AdminToken, BearerToken
from elmo.service.core.answers import EmbedResult, PooledResult, PreparedEmbed
from elmo.service.core.budget import RETRY_AFTER_S, AnswerBudgetFull, AnswerClaim
from elmo.service.core.requests import RequestCore
from elmo.service.http import schema
from elmo.service.http.connections import (
    COMMON_HEADERS,
    HANDLER_OPTIONS,
    ClientGone,
    ConnectionGuard,
    read_body,
    reset,
)
from elmo.service.http.encode import encode_json_parts
from elmo.service.http.encodings import ENCODINGS
from elmo.service.http.openapi import openapi_document
from elmo.service.models.registry import ServedModel
from elmo.service.models.tasks import Task
from elmo.service.telemetry.observe import API, CLIENT_GONE, HEALTH, UNMATCHED, RequestObserver
from elmo.service.telemetry.tracing import http_middlewares

from elmo.v1 import embedder_pb2 as pb

log = logging.getLogger("service.http")

PAGE = Path(__file__).resolve().parent / "page" / "index.html"
OPEN_PATHS = ("/", "/health", "/openapi.json")  # no token: the page holds no data, probes carry no secrets
ADMIN_PATH = "/admin/"  # the admin token (--admin-token) instead of the clients' token
MODEL_HEADER = "X-Elmo-Model"  # every embedding answer: the model and version that computed it, "default@3"
STALE_HEADER = "X-Elmo-Task-Stale"  # an answer that applied a stale task mix: the mix's name
JSON_TYPE = "application/json"
SEND_PIECE_BYTES = 256 * 1024  # larger answers are written in pieces of this size
CLIENT_GONE_STATUS = 499  # nginx's "client closed request": never sent (nobody is there), counted as CLIENT_GONE
INLINE_BODY_BYTES = 16 * 1024  # a body this small is parsed and tokenized in place (cheaper than a thread hop)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")
R = TypeVar("R")

# Every answer: no MIME sniffing (COMMON_HEADERS, from the connection guard, which answers some requests itself).
# The page: only its own inline script and style block (by hash), calls to this origin, never framed, no referrer
# leaks. (Style attributes stay allowed: the page colours its heat map with them.)


def page_headers(html: str) -> dict[str, str]:
    """The page's security headers, its Content-Security-Policy pinned to the hashes of its inline blocks."""
    scripts = " ".join(_inline_hashes(html, "script"))
    styles = " ".join(_inline_hashes(html, "style"))
    policy = (
        f"default-src 'none'; script-src {scripts}; style-src-elem {styles}; style-src-attr 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


def _inline_hashes(html: str, tag: str) -> list[str]:
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    return [f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in blocks] or ["'none'"]


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error shape, which its clients and most HTTP tooling read: {"error": {"message", "type", ...}}."""
    body = {"error": {"message": message, "type": kind.replace(" ", "_"), "code": status}}
    headers = dict(headers or {})
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return web.json_response(body, status=status, headers=headers or None)


async def send_in_pieces(
    request: web.Request, parts: list[bytes], headers: dict[str, str] | None = None, write_timeout: float = 30.0
) -> web.StreamResponse:
    """A large body written a piece at a time, each after the last has drained: the event loop never copies or holds
    the whole answer in one step (asyncio's transport would buffer tens of MB in one call), and the answer is
    never joined into one buffer. A piece the client does not take within ``write_timeout`` seconds closes the
    connection (:class:`ClientGone`): a client that stops reading frees the answer's memory."""
    response = web.StreamResponse(headers={**COMMON_HEADERS, **(headers or {}), "Content-Type": JSON_TYPE})
    response.content_length = sum(map(len, parts))
    await response.prepare(request)
    for piece in _pieces(parts, SEND_PIECE_BYTES):
        await _write_within(request, response.write(piece), write_timeout)
        await asyncio.sleep(0)  # a socket that takes each piece at once never pushes back: let the others in
    await _write_within(request, response.write_eof(), write_timeout)
    return response


async def _write_within(request: web.Request, write: Awaitable[None], timeout: float) -> None:
    """``write`` (which waits until the client has taken what was buffered), or the connection reset after
    ``timeout`` seconds (:func:`~service.http.connections.reset`)."""
    try:
        async with asyncio.timeout(timeout):
            await write
    except TimeoutError:
        if request.transport is not None:
            reset(request.transport)
        message = f"the client did not take its answer within {timeout:g} s (--answer-write-timeout-s)"
        raise ClientGone(message) from None


def _pieces(parts: list[bytes], size: int) -> Iterator[bytes | memoryview]:
    """``parts`` regrouped into pieces of about ``size`` bytes: small parts joined (thousands of small writes kept
    the event loop busy ~250 ms on one pooled answer), large ones cut."""
    pending: list[bytes] = []
    pending_bytes = 0
    for part in parts:
        if len(part) >= size:
            if pending:
                yield b"".join(pending)
                pending, pending_bytes = [], 0
            view = memoryview(part)
            for start in range(0, len(view), size):
                yield view[start : start + size]
            continue
        pending.append(part)
        pending_bytes += len(part)
        if pending_bytes >= size:
            yield b"".join(pending)
            pending, pending_bytes = [], 0
    if pending:
        yield b"".join(pending)


def _is_json(content_type: str) -> bool:
    return content_type == JSON_TYPE or content_type.endswith("+json")


@dataclass(frozen=True)
class JsonAnswer:
    """An answer encoded as JSON pieces (service.http.encode), and the headers that name the version behind it."""

    parts: list[bytes]
    headers: dict[str, str] | None = None


class HttpFrontend:
    def __init__(
        self,
        core: RequestCore,
        observer: RequestObserver,
        auth_token: str | None,
        is_serving: Callable[[], bool],
        normalize: bool = False,
        admin_token: str | None = None,
    ):
        self.core, self.limits = core, core.limits
        self.normalize = normalize  # /v1/embeddings' default when a request does not say
        self.observer = observer
        self._token = BearerToken(auth_token) if auth_token else None
        self._is_serving = is_serving
        self._admin = None
        if admin_token:
            self._admin = AdminToken(admin_token)
        self.guard = ConnectionGuard(core.limits)
        observer.metrics.watch_connections(self.guard)
        self.app = web.Application(
            client_max_size=core.limits.max_message_bytes,
            middlewares=[*http_middlewares(), self._observe, self.guard.middleware, self._guard],
        )
        self.app.add_routes(
            [
                web.post("/v1/embeddings", self.embeddings, expect_handler=self._expect),
                web.post("/v1/embed", self.embed, expect_handler=self._expect),
                web.post("/v1/tokenize", self.tokenize, expect_handler=self._expect),
                web.get("/v1/models", self.models, expect_handler=self._expect),
                web.get("/v1/models/{model_id}", self.one_model, expect_handler=self._expect),
                web.get("/health", self.health, expect_handler=self._expect),
                web.get("/openapi.json", self.openapi, expect_handler=self._expect),
                web.get("/", self.page, expect_handler=self._expect),
            ]
        )
        if self._admin is not None:
            self.app.add_routes(
                [
                    web.get("/admin/models", self.admin_index, expect_handler=self._expect),
                    web.post("/admin/models/{name}/load", self.admin_load, expect_handler=self._expect),
                    web.post("/admin/models/{name}/unload", self.admin_unload, expect_handler=self._expect),
                ]
            )
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, reuse_port: bool = False
    ) -> int:
        """Listen on host:port (0 = any free port; ``reuse_port``: shared with sibling processes); returns the bound
        port."""
        # (no keepalive_timeout here: the guard owns idle connections, and counts what it closes)
        self._runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=1.0, **HANDLER_OPTIONS)
        await self._runner.setup()
        try:
            self.port = await self.guard.listen(self._runner, host, port, ssl_context, reuse_port)
        except BaseException:
            await self._runner.cleanup()
            raise
        return self.port

    async def stop(self) -> None:
        await self.guard.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- middlewares ---------------------------------------------------------------------------------------------
    @web.middleware
    async def _observe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Errors as JSON with the right status, a client that went away as such; the shared observation."""
        seen = self.observer.start(*observed_as(request))
        outcome, server_fault = CLIENT_GONE, False
        try:
            response = await self._respond(request, handler)
            if response.status != CLIENT_GONE_STATUS:
                outcome, server_fault = str(response.status), response.status >= 500
            if not response.prepared:  # (an answer sent in pieces carries them already)
                response.headers.update(COMMON_HEADERS)
            return response
        finally:
            seen.finish(
                outcome,
                server_fault=server_fault,
                describe=lambda: (str(request.remote), request.headers.get("X-Request-Id", "-")[:64], ""),
            )

    async def _respond(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except AnswerBudgetFull as exc:  # answers in flight fill the budget: the server's room, not the request
            return error_response(503, exc.message, exc.kind.value, {"Retry-After": str(RETRY_AFTER_S)})
        except ServiceError as exc:
            return error_response(http_status(exc.kind), exc.message, exc.kind.value)
        except web.HTTPException as exc:  # aiohttp's own (no route, wrong method, body too large), and 408
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            kind = "timeout" if exc.status == 408 else "invalid input"
            response = error_response(exc.status, self._explain(exc), kind, allow)
            if exc.keep_alive is False:  # the rest of the body will not come: this connection is done
                response.force_close()
            return response
        except (ClientGone, ConnectionError) as exc:
            # Nobody to answer; aiohttp drops what is written to a closed connection quietly (a re-raise would log
            # an ERROR with a traceback for every client that hangs up). The client's doing, not the server's fault.
            log.info(
                "client disconnect: %s %s from %s: %s",
                request.method,
                request.path,
                request.remote,
                exc or type(exc).__name__,
            )
            return web.Response(status=CLIENT_GONE_STATUS)
        except Exception:  # a bug: answer 500, keep serving
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, "internal error (logged on the server)", Kind.INTERNAL.value)

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
        """Bearer token (as on gRPC), then the drain switch, for everything but the open paths; a POST must be JSON
        (so that no web page can start work with a plain form)."""
        self._check_token(request)
        if request.path not in OPEN_PATHS:
            self.core.check_open()
        routed = getattr(request.match_info, "http_exception", None) is None
        if routed and request.method == "POST" and not _is_json(request.content_type):
            sent = request.headers.get("Content-Type", "none")[:64]
            raise ServiceError(Kind.UNSUPPORTED_MEDIA, f"Content-Type must be {JSON_TYPE}, not {sent}")
        return await handler(request)

    def _check_token(self, request: web.Request) -> None:
        """ServiceError (401/403) unless the request carries the token its path needs (none for the open paths)."""
        if request.path.startswith(ADMIN_PATH) and self._admin is not None:
            self._admin.check(request.headers.get("Authorization"), "header")
        elif request.path not in OPEN_PATHS and self._token is not None:
            self._token.check(request.headers.get("Authorization"), "header")

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the client waits to be told to send its body, so the size and the token are
        checked first (aiohttp's own handler says "100 Continue" to anything, a 10 GB body without a token
        included). A refusal is the final answer, and the connection closes: the body is never read."""
        try:
            if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
                raise ServiceError(Kind.INVALID_INPUT, f"Expect: {clip(request.headers[hdrs.EXPECT])} is not supported")
            declared = request.content_length
            if declared is not None and declared > self.limits.max_message_bytes:
                raise ServiceError(
                    Kind.TOO_LARGE,
                    self._explain(
                        web.HTTPRequestEntityTooLarge(max_size=self.limits.max_message_bytes, actual_size=declared)
                    ),
                )
            self._check_token(request)
        except ServiceError as exc:
            status, message = (417 if exc.kind is Kind.INVALID_INPUT else http_status(exc.kind)), exc.message
            seen = self.observer.start(*observed_as(request))
            seen.finish(str(status), server_fault=False, describe=lambda: (str(request.remote), "-", message))
            response = error_response(status, message, exc.kind.value)
            response.headers.update(COMMON_HEADERS)
            response.force_close()
            return response
        if request.version >= HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the interim answer is not the answer: an error may still follow
        return None

    # -- helpers ---------------------------------------------------------------------------------------------------
    async def _read(self, request: web.Request) -> bytes:
        return await read_body(request, self.limits)

    async def _send(self, request: web.Request, answer: JsonAnswer) -> web.StreamResponse:
        """A built answer: in one write when small, in pieces when large."""
        if sum(map(len, answer.parts)) <= SEND_PIECE_BYTES:
            return web.Response(body=b"".join(answer.parts), content_type=JSON_TYPE, headers=answer.headers)
        return await send_in_pieces(request, answer.parts, answer.headers, self.limits.answer_write_timeout_s)

    def _claim(self, request: web.Request) -> AnswerClaim:
        """The answer's place in the budget of answer bytes in flight, counted for the client's address; the
        endpoint releases it once the answer was written or the connection closed."""
        return self.core.answers.claim(request.remote or "")

    async def _parse(self, body: bytes, parse: Callable[[dict], T]) -> T:
        """``parse(json object)`` for a request body, on a worker when the body is large."""
        return await self.core.run(lambda: parse(schema.parse_json(body)), heavy=len(body) > INLINE_BODY_BYTES)

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's /v1/embeddings: parsed here, checked (``dimensions`` too) and embedded by the core against the
        one version the model name resolves to, which also names the answer."""
        body = await self._read(request)
        request_id = request.headers.get("X-Request-Id", "")
        aliases = self.core.models.aliases
        parsed = await self._parse(body, lambda value: schema.parse_openai(value, request_id, aliases))
        normalize = self.normalize if parsed.normalize is None else parsed.normalize

        def check(model: ServedModel, task: Task | None) -> None:
            if parsed.dimensions is not None and parsed.dimensions != model.dim:
                raise invalid(f"'dimensions' is {parsed.dimensions}, but model '{clip(model.name)}' has {model.dim}")

        def answer(result: PooledResult) -> JsonAnswer:
            prepared = result.prepared
            if parsed.embed.model in aliases:
                model_id = parsed.embed.model  # the name the client asked for
            else:
                model_id = f"{prepared.model.name}:{prepared.task.name}" if prepared.task else prepared.model.name
            payload = schema.openai_answer(
                parsed, result.vectors, prepared.n_tokens, model_id, prepared.model.number, prepared.task_stale
            )
            return JsonAnswer(encode_json_parts(payload), answer_headers(prepared))

        encoding = ENCODINGS[parsed.encoding]
        claim = self._claim(request)
        try:
            built = await self.core.embed_pooled(parsed.embed, encoding, answer, normalize, check, claim=claim)
            return await self._send(request, built)
        finally:
            claim.release()

    async def embed(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        request_id = request.headers.get("X-Request-Id", "")
        call = await self._parse(body, lambda value: schema.parse_embed(value, request_id))

        def answer(result: EmbedResult) -> JsonAnswer:
            payload = schema.embed_answer(result, call.encoding, call.embed.request_id)
            return JsonAnswer(encode_json_parts(payload), answer_headers(result.prepared))

        claim = self._claim(request)
        try:
            built = await self.core.embed(call.embed, ENCODINGS[call.encoding], answer, claim=claim)
            return await self._send(request, built)
        finally:
            claim.release()

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        tokenize_request: pb.TokenizeRequest = await self._parse(body, schema.parse_tokenize)

        # The answer holds every token and its offsets: about the body's size again (8 MB of text: 8.6 MB of JSON,
        # which json_response would encode on the event loop while health checks wait a second)
        def answer(response: pb.TokenizeResponse) -> JsonAnswer:
            return JsonAnswer(encode_json_parts(schema.tokenize_answer(response)))

        claim = self._claim(request)
        try:
            built = await self.core.tokenize(tokenize_request, answer, claim, lambda made: sum(map(len, made.parts)))
            return await self._send(request, built)
        finally:
            claim.release()

    async def models(self, request: web.Request) -> web.Response:
        statuses = {status.name: status for status in self.core.statuses()}
        entries = [
            e
            for m in self.core.models
            for e in schema.model_entries(self.core.model_info(m.name), statuses.get(m.name))
        ]
        entries += [schema.alias_entry(alias, *target) for alias, target in self.core.models.aliases.items()]
        return web.json_response({"object": "list", "data": entries})

    async def one_model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id in self.core.models.aliases:
            return web.json_response(schema.alias_entry(model_id, *self.core.models.aliases[model_id]))
        model, task = schema.split_model(model_id)
        entries = schema.model_entries(self.core.model_info(model))
        if "@" in model and not task:  # a pinned version: the model's entry, with that version's model_version
            return web.json_response(entries[0])
        for entry in entries:
            if entry["id"] == model_id or (not model and entry.get("task") == task):
                return web.json_response(entry)
        raise ServiceError(Kind.NOT_FOUND, f"unknown task '{clip(task)}' of model '{clip(entries[0]['id'])}'")

    # -- admin (--model-root with --admin-token) -------------------------------------------------------------------
    async def admin_index(self, request: web.Request) -> web.Response:
        return web.json_response({"models": [schema.status_json(status) for status in self.core.versions.index()]})

    async def _admin_version(self, request: web.Request) -> int:
        body = await self._read(request)
        value = schema.parse_json(body) if body.strip() else {}
        version = value.get("version", 0) if isinstance(value, dict) else None
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise invalid('the body is {"version": N} (a whole number; 0 or none = the latest, or every version)')
        return version

    async def admin_load(self, request: web.Request) -> web.Response:
        version = await self._admin_version(request)
        status = await self.core.versions.load(request.match_info["name"], version)
        return web.json_response(schema.status_json(status))

    async def admin_unload(self, request: web.Request) -> web.Response:
        version = await self._admin_version(request)
        status = await self.core.versions.unload(request.match_info["name"], version)
        return web.json_response(schema.status_json(status))

    async def health(self, request: web.Request) -> web.Response:
        serving = self._is_serving() and self.core.taking_requests
        return web.json_response({"status": "SERVING" if serving else "NOT_SERVING"}, status=200 if serving else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        # the routes this server serves, and the bearer scheme only where it asks for a token
        return web.json_response(openapi_document(admin=self._admin is not None, bearer=self._token is not None))

    async def page(self, request: web.Request) -> web.Response:
        html = PAGE.read_text(encoding="utf-8")  # read per request: the page can be edited while serving
        return web.Response(text=html, content_type="text/html", charset="utf-8", headers=page_headers(html))


def observed_as(request: web.Request) -> tuple[str, str]:
    """(method, kind) of a request for the metrics: ``GET /v1/models/{model_id}`` (the route, never the path a client
    sent); health checks and requests that matched no route (a browser's /favicon.ico) are counted apart."""
    route = request.match_info.route.resource
    if route is None:
        return request.method, UNMATCHED
    return f"{request.method} {route.canonical}", HEALTH if route.canonical == "/health" else API


def answer_headers(prepared: PreparedEmbed) -> dict[str, str]:
    """What weights computed the answer (``X-Elmo-Model: default@3``), and the stale task mix it applied, if so."""
    headers = {MODEL_HEADER: prepared.model.ref}
    if prepared.task_stale:
        headers[STALE_HEADER] = prepared.task.name  # type: ignore[union-attr]
    return headers


__all__ = ["HttpFrontend", "answer_headers", "error_response"]
