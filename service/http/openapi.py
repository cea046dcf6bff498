"""The OpenAPI 3.1 description of the HTTP API as a server runs it, served at ``GET /openapi.json``: its routes
(the admin routes only where the server serves them), the statuses each can answer and the security of each (the
bearer scheme and its 401 answers only where the server has a token), assembled from the schema pieces of
service.http.openapi_schemas.

It describes what each route really serves: every status it can answer, the error shape of every error, and schemas
that the real answers conform to. tests/service/test_openapi.py validates it with openapi-spec-validator, and
tests/service/test_fuzz.py drives a real server from it with Schemathesis (no 5xx; every answer's status, content
type and body as documented).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from elmo.service.http.openapi_schemas import (
    ADMIN_SCHEMAS,
    JSON,
    SCHEMAS,
    error_response,
    errors,
    ref,
)

# What each kind of route can answer besides 200 (every route: 500 on a bug, 503 past the connection cap).
# The clients' routes answer 401 only where the server has a token (--auth-token): _api_paths adds it then.
_POST_EMBED_ERRORS = ("400", "404", "408", "413", "415", "429", "500", "503", "504")
_POST_TOKENIZE_ERRORS = ("400", "404", "408", "413", "415", "500", "503")
_GET_API_ERRORS = ("500", "503")
_GET_MODEL_ERRORS = ("404", "500", "503")
_ADMIN_ERRORS = ("400", "401", "403", "404", "408", "409", "413", "415", "500", "503")
_OPEN_ERRORS = ("500", "503")


def _content(schema: dict, media_type: str = JSON) -> dict:
    return {media_type: {"schema": schema}}


_REQUEST_ID = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "description": "echoed back as request_id (a body's request_id wins), and logged",
    "schema": {"type": "string"},
}


def _post(operation_id: str, summary: str, request: str, response: str, statuses: tuple[str, ...]) -> dict:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "requestBody": {"required": True, "content": _content(ref(request))},
        "responses": {"200": {"description": summary, "content": _content(ref(response))}, **errors(*sorted(statuses))},
    }
    if request != "TokenizeRequest":
        operation["parameters"] = [_REQUEST_ID]
    return {"post": operation}


def _get(operation_id: str, summary: str, responses: dict, open_path: bool = False) -> dict:
    operation: dict[str, Any] = {"operationId": operation_id, "summary": summary, "responses": responses}
    if open_path:
        operation["security"] = []  # no token: probes carry no secret, the page and this document hold no data
    return {"get": operation}


def _admin(operation_id: str, summary: str, method: str) -> dict:
    """One admin operation: only with --admin-token (and --model-root), authorised by the admin token alone."""
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": f"{summary} (admin API: --model-root with --admin-token)",
        "security": [{"admin": []}],
        "responses": {
            "200": {"description": summary, "content": _content(ref("ModelStatus"))},
            **errors(*_ADMIN_ERRORS),
        },
        "parameters": [
            {
                "name": "name",
                "in": "path",
                "required": True,
                "description": "a model of the repository",
                "schema": {"type": "string"},
            }
        ],
    }
    if method == "post":
        operation["requestBody"] = {"required": False, "content": _content(ref("VersionRequest"))}
    return {method: operation}


def _health(status: str) -> dict:
    return {"allOf": [ref("Health"), {"properties": {"status": {"const": status}}}]}


def _ok(description: str, schema: dict, media_type: str = JSON) -> dict:
    return {"200": {"description": description, "content": _content(schema, media_type)}}


@cache
def openapi_document(admin: bool = False, bearer: bool = False) -> dict:
    """The document of the server as it runs: with the admin API (``admin``: --admin-token with --model-root) or
    without it, with a clients' token (``bearer``: --auth-token) or without one. The admin routes, their schemas and
    their security scheme are listed only where they are served; the bearer scheme, the requirement of it and the
    401 answers of the clients' routes only where a token is asked for."""
    paths = {**_api_paths(bearer), **(_admin_paths() if admin else {})}
    statuses = sorted(_referenced_errors(paths), key=int)
    security_schemes = {**({"bearer": _BEARER} if bearer else {}), **({"admin": _ADMIN_TOKEN} if admin else {})}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": _INFO,
        "components": {
            "schemas": {**SCHEMAS, **(ADMIN_SCHEMAS if admin else {})},
            "responses": {f"Error{status}": error_response(status) for status in statuses},
        },
        "paths": paths,
    }
    if security_schemes:
        document["components"]["securitySchemes"] = security_schemes
    if bearer:
        document["security"] = [{"bearer": []}]
    return document


def _referenced_errors(node: Any) -> set[str]:
    """The statuses of the shared error answers that ``node`` refers to (``#/components/responses/ErrorNNN``)."""
    if isinstance(node, dict):
        found = set().union(*(_referenced_errors(value) for value in node.values())) if node else set()
        target = node.get("$ref", "")
        if isinstance(target, str) and target.startswith("#/components/responses/Error"):
            found.add(target.removeprefix("#/components/responses/Error"))
        return found
    if isinstance(node, list):
        return set().union(*(_referenced_errors(item) for item in node)) if node else set()
    return set()


_INFO = {
    "title": "ELMo embedding service",
    "version": "1",
    "description": "HTTP/JSON beside the gRPC API (proto/elmo/v1/embedder.proto): the same models, limits and token, "
    "and the same field names (the texts are 'input' on every route, as in OpenAI's API; the proto's JSON name of "
    "its 'inputs'). Send 'Authorization: Bearer TOKEN' when the server has one (every route but /, /health and "
    "/openapi.json). POST bodies are JSON (application/json, UTF-8). Every error is JSON, "
    '{"error": {"message", "type", "code"}}. A method a path does not serve gets 405 with an Allow header naming '
    "the ones it does; an unknown path gets 404. A field that cannot take effect (layers with omit_layers) is "
    "refused with 400, never ignored.",
}
_BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "the server's --auth-token (or ELMO_AUTH_TOKEN); a server started without one needs no token",
}
_ADMIN_TOKEN = {
    "type": "http",
    "scheme": "bearer",
    "description": "the server's --admin-token (or ELMO_ADMIN_TOKEN): the /admin/ routes only",
}


def _api_paths(bearer: bool) -> dict:
    """The clients' routes; with a token (``bearer``) the ones that ask for it answer 401 too, and the open paths
    say that they need none."""
    token = ("401",) if bearer else ()
    health_503 = {
        "description": "NOT_SERVING: warming up or draining (or, as an error, too many connections are open)",
        "content": _content({"oneOf": [_health("NOT_SERVING"), ref("Error")]}),
    }
    return {
        "/v1/embeddings": _post(
            "createEmbeddings",
            "OpenAI-compatible pooled embeddings: one vector per input",
            "EmbeddingsRequest",
            "EmbeddingsResponse",
            _POST_EMBED_ERRORS + token,
        ),
        "/v1/embed": _post(
            "embed",
            "Per-token, per-layer vectors and task mixes (the gRPC EmbedRequest as JSON)",
            "EmbedRequest",
            "EmbedResponse",
            _POST_EMBED_ERRORS + token,
        ),
        "/v1/tokenize": _post(
            "tokenize",
            "The service's tokens and code-point offsets (runs no model)",
            "TokenizeRequest",
            "TokenizeResponse",
            _POST_TOKENIZE_ERRORS + token,
        ),
        "/v1/models": _get(
            "listModels",
            "Served models and one MODEL:TASK entry per task mix (OpenAI's list)",
            {**_ok("the models", ref("ModelList")), **errors(*sorted(_GET_API_ERRORS + token))},
        ),
        "/v1/models/{model_id}": {
            **_get(
                "getModel",
                "One model or MODEL:TASK entry",
                {
                    **_ok("the entry", {"oneOf": [ref("Model"), ref("TaskModel")]}),
                    **errors(*sorted(_GET_MODEL_ERRORS + token)),
                },
            ),
            "parameters": [
                {
                    "name": "model_id",
                    "in": "path",
                    "required": True,
                    "description": "MODEL, MODEL:TASK, or :TASK for a task of the default model",
                    "schema": {"type": "string"},
                }
            ],
        },
        "/health": _get(
            "health",
            "SERVING once every model is warmed up; no token needed",
            {
                **_ok("SERVING", _health("SERVING")),
                "500": {"$ref": "#/components/responses/Error500"},
                "503": health_503,
            },
            open_path=bearer,
        ),
        "/openapi.json": _get(
            "openapi",
            "This document (OpenAPI 3.1)",
            {
                **_ok("this document", {"type": "object", "required": ["openapi", "info", "paths"]}),
                **errors(*_OPEN_ERRORS),
            },
            open_path=bearer,
        ),
        "/": _get(
            "page",
            "The layer explorer page: one self-contained HTML file (it calls the API with the token typed in it)",
            {**_ok("the page", {"type": "string"}, "text/html"), **errors(*_OPEN_ERRORS)},
            open_path=bearer,
        ),
    }


def _admin_paths() -> dict:
    """The admin routes (--model-root with --admin-token), authorised by the admin token alone."""
    return {
        "/admin/models": {
            "get": {
                "operationId": "repositoryIndex",
                "summary": "Every model of the repository and its versions (admin API: --model-root with "
                "--admin-token)",
                "security": [{"admin": []}],
                "responses": {
                    **_ok("the repository", ref("RepositoryIndex")),
                    **errors("401", "403", "500", "503"),
                },
            }
        },
        "/admin/models/{name}/load": _admin("loadModel", "Load a version (0: the latest) and serve it", "post"),
        "/admin/models/{name}/unload": _admin("unloadModel", "Stop serving a version (0: every one)", "post"),
    }


__all__ = ["openapi_document"]
