"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

It describes what each route really serves: every status it can answer, the error shape of every error, and schemas
that the real answers conform to. tests/service/test_openapi.py validates it with openapi-spec-validator, and
tests/service/test_fuzz.py drives a real server from it with Schemathesis (no 5xx; every answer's status, content
type and body as documented).
"""

from __future__ import annotations

from functools import cache
from typing import Any

from elmo.service.http.encodings import ENCODINGS

INT32_MAX = 2**31 - 1
JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(properties: dict, required: tuple[str, ...] = (), closed: bool = True, **extra: Any) -> dict:
    """A JSON object; ``closed``: no other fields (answers are checked field by field)."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return {**schema, **extra}


def _array(items: dict, **extra: Any) -> dict:
    return {"type": "array", "items": items, **extra}


_STRING = {"type": "string"}
_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_NUMBERS = _array({"type": "number"})
_STRINGS = _array(_STRING)
_LIMIT_NAMES = (
    "max_inputs",
    "max_tokens_per_sentence",
    "max_tokens_per_request",
    "max_message_bytes",
    "max_response_bytes",
    "max_pooled_inputs",
    "max_pooled_tokens",
)

# -- errors ------------------------------------------------------------------------------------------------------
# Every error is OpenAI's shape, {"error": {message, type, code}}, with the HTTP status again in ``code``.
_ERROR_STATUSES: dict[str, str] = {
    "400": "invalid input: the body is not JSON, not UTF-8 or not an object; a string holds a lone surrogate; a field "
    "has the wrong type or is out of range; an input is empty; an unknown field (/v1/embed, /v1/tokenize); a layer "
    "index the model does not have",
    "401": "missing or wrong bearer token (only when the server has one: --auth-token or ELMO_AUTH_TOKEN)",
    "404": "unknown model or task",
    "408": "the request body stalled: no bytes for longer than --http-body-timeout",
    "413": "over a size limit: too many inputs, tokens per sentence (overflow 'reject') or per request, an answer "
    "over --max-response-bytes, or a body over --max-message-bytes",
    "415": "the request body is not sent as JSON (Content-Type must be application/json)",
    "429": "overloaded: too many tokens queued (--max-queue-tokens); retry with backoff",
    "500": "internal error: a bug or a broken model (logged on the server with a traceback)",
    "503": "unavailable: the model is warming up, the server is draining after SIGTERM, or too many connections are "
    "open (--max-connections); retry shortly or on another replica",
    "504": "the request's deadline passed while it was queued (its work was dropped, never computed)",
    "403": "admin API: a token was sent, but not the admin token (--admin-token)",
    "409": "admin API: the version was refused (it failed to load or its checks, or it is over --max-model-memory)",
    "417": "an Expect header other than 100-continue",
}
_ERROR_TYPES = [  # service.core.errors.Kind, spaces as underscores; and "timeout" for a stalled body (408)
    "invalid_input",
    "too_large",
    "not_found",
    "overloaded",
    "deadline_exceeded",
    "unavailable",
    "unauthenticated",
    "unsupported_media_type",
    "permission_denied",
    "refused",
    "internal",
    "timeout",
]
_ERROR = _obj(
    {
        "error": _obj(
            {
                "message": {"type": "string", "description": "what is wrong, naming the field or the limit"},
                "type": {"type": "string", "description": "the kind of error", "examples": _ERROR_TYPES},
                "code": {"type": "integer", "minimum": 400, "maximum": 599, "description": "the HTTP status again"},
            },
            required=("message", "type", "code"),
        )
    },
    required=("error",),
    description="OpenAI's error shape, which its clients and most HTTP tooling read",
)
_UNAUTHORIZED_HEADERS = {
    "WWW-Authenticate": {
        "description": "the scheme to authenticate with",
        "required": True,
        "schema": {"type": "string", "const": "Bearer"},
    }
}


def _error_response(status: str) -> dict:
    # the body's ``code`` is this status: the shared Error schema, with ``code`` pinned
    schema = {"allOf": [_ref("Error"), {"properties": {"error": {"properties": {"code": {"const": int(status)}}}}}]}
    response: dict[str, Any] = {"description": _ERROR_STATUSES[status], "content": {JSON: {"schema": schema}}}
    if status == "401":
        response["headers"] = _UNAUTHORIZED_HEADERS
    return response


def _errors(*statuses: str) -> dict:
    return {status: {"$ref": f"#/components/responses/Error{status}"} for status in statuses}


# What each kind of route can answer besides 200 (every route: 500 on a bug, 503 past the connection cap).
_POST_EMBED_ERRORS = ("400", "401", "404", "408", "413", "415", "429", "500", "503", "504")
_POST_TOKENIZE_ERRORS = ("400", "401", "404", "408", "413", "415", "500", "503")
_GET_API_ERRORS = ("401", "500", "503")
_ADMIN_ERRORS = ("400", "401", "403", "404", "408", "409", "413", "415", "500", "503")
_OPEN_ERRORS = ("500", "503")

# -- requests and answers ----------------------------------------------------------------------------------------
_OVERFLOW = {
    "enum": ["reject", "truncate", "window"],
    "description": "sentences over max_tokens_per_sentence: refuse (413), keep the first tokens, or embed "
    "overlapping windows stitched back; default: the server's --overflow",
}
_MODEL_VERSION = {
    "type": "integer",
    "minimum": 0,
    "description": "the version (folder number under --model-root) of the model that computed the answer; 0 for a "
    "model served with --model DIR. The X-Elmo-Model header says the same: MODEL@VERSION",
}
_TASK_STALE = {
    "type": "boolean",
    "description": "the task mix applied was carried over from earlier weights by `elmo adapt` and not retrained "
    "(the X-Elmo-Task-Stale header names it): run `elmo mix train` again",
}
_VERSION = {
    "type": "object",
    "description": "a loaded version: state loading, ready, unloading, unloaded or failed (with a reason)",
}
_USAGE = _obj({"prompt_tokens": _COUNT, "total_tokens": _COUNT}, required=("prompt_tokens", "total_tokens"))


def _tensor(rank: int, what: str) -> dict:
    nested: dict = _NUMBERS
    for _ in range(rank - 1):
        nested = _array(nested)
    return {
        "description": f"{what}: nested lists of numbers (encoding=float), or the little-endian bytes of the "
        "requested dtype in base64 (encoding=base64), row-major in the given shape",
        "oneOf": [
            nested,
            _obj(
                {
                    "dtype": {"enum": ["float32", "float16"]},
                    "shape": _array(_COUNT, minItems=rank, maxItems=rank),
                    "data": {"type": "string", "contentEncoding": "base64"},
                },
                required=("dtype", "shape", "data"),
            ),
        ],
    }


_SPAN = _array(_COUNT, minItems=2, maxItems=2, description="[start, end) in code points of the text sent")

_SCHEMAS: dict[str, dict] = {
    "Error": _ERROR,
    "EmbeddingsRequest": _obj(
        {
            "input": {
                "description": "the texts: one string or a list of them",
                "oneOf": [_STRING, _array(_STRING, minItems=1)],
            },
            "model": {"type": "string", "description": "served model, MODEL:TASK for a task's mix; empty: default"},
            "encoding_format": {"enum": list(ENCODINGS), "default": "float"},
            "dimensions": {
                "type": "integer",
                "minimum": 1,
                "maximum": INT32_MAX,
                "description": "must equal the model's dim if given",
            },
            "overflow": _OVERFLOW,
            "normalize": {
                "type": "boolean",
                "description": "unit-length vectors (dot product = cosine); default: the server's --normalize",
            },
            "user": {"type": "string", "description": "accepted and ignored, as by OpenAI-compatible servers"},
        },
        required=("input",),
        closed=False,  # unknown fields are ignored, as OpenAI-compatible servers do
        examples=[
            {"input": ["苹果很好吃", "The apple fell ."]},
            {"input": "Apple shares rose .", "encoding_format": "base64"},
        ],
    ),
    "EmbeddingsResponse": _obj(
        {
            "object": {"const": "list"},
            "model": {"type": "string", "description": "MODEL, or MODEL:TASK when a task's mix was pooled"},
            "model_version": _MODEL_VERSION,
            "task_stale": _TASK_STALE,
            "usage": _USAGE,
            "data": _array(
                _obj(
                    {
                        "object": {"const": "embedding"},
                        "index": _COUNT,
                        "embedding": {
                            "description": "mean over the input's tokens of the mean of its layers (or of the "
                            "task's mix); float32 little-endian in base64 when encoding_format=base64",
                            "oneOf": [_NUMBERS, {"type": "string", "contentEncoding": "base64"}],
                        },
                    },
                    required=("object", "index", "embedding"),
                )
            ),
        },
        required=("object", "data", "model", "model_version", "task_stale", "usage"),
    ),
    "EmbedRequest": _obj(
        {
            "inputs": _array(
                {
                    "oneOf": [
                        {"type": "string", "description": "raw text, tokenized by the service"},
                        _array(_STRING, description="tokens, as given"),
                        _obj({"text": _STRING}, required=("text",)),
                        _obj({"tokens": _STRINGS}, required=("tokens",)),
                    ]
                },
                minItems=1,
            ),
            "layers": _array(
                {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
                description="layer indices (0..n_layers-1, GET /v1/models), in the order wanted; default: all",
            ),
            "task": {"type": "string", "description": "a task mix of the model (GET /v1/models)"},
            "omit_layers": {"type": "boolean", "description": "only the task's mix (needs a task)"},
            "dtype": {"enum": ["float32", "float16"], "default": "float32"},
            "encoding": {"enum": list(ENCODINGS), "default": "float"},
            "model": {"type": "string", "description": "served model; empty: the default"},
            "request_id": {"type": "string", "description": "echoed back (default: the X-Request-Id header)"},
            "overflow": _OVERFLOW,
        },
        required=("inputs",),  # unknown fields are refused with 400: a typo is not silently ignored
        examples=[
            {"inputs": ["The cat sat on the mat ."]},
            {
                "inputs": [["pre", "tokenized"], {"text": "苹果"}],
                "layers": [2, 0],
                "dtype": "float16",
                "encoding": "base64",
            },
        ],
    ),
    "EmbedResponse": _obj(
        {
            "object": {"const": "embed"},
            "model": _STRING,
            "model_version": _MODEL_VERSION,
            "task_stale": _TASK_STALE,
            "layers": _array(_COUNT, description="the layer indices returned, in order"),
            "request_id": _STRING,
            "usage": _USAGE,
            "embeddings": _array(
                _obj(
                    {
                        "index": _COUNT,
                        "tokens": _STRINGS,
                        "offsets": _array(_SPAN, description="text inputs only"),
                        "truncated_tokens": {
                            "type": "integer",
                            "minimum": 1,
                            "description": "tokens cut off the end (overflow 'truncate'); absent when none",
                        },
                        "layers": _tensor(3, "[n_layers, n_tokens, dim]; absent with omit_layers"),
                        "mix": _tensor(2, "the task's mix, [n_tokens, dim]; absent without a task"),
                    },
                    required=("index", "tokens"),
                )
            ),
            "timing": _obj(
                {
                    "queue_ms": {"type": "number", "minimum": 0},
                    "inference_ms": {"type": "number", "minimum": 0},
                    "total_ms": {"type": "number", "minimum": 0},
                    "batch_sentences": _COUNT,
                    "batch_tokens": _COUNT,
                },
                required=("queue_ms", "inference_ms", "total_ms", "batch_sentences", "batch_tokens"),
            ),
        },
        required=(
            "object",
            "model",
            "model_version",
            "task_stale",
            "layers",
            "request_id",
            "usage",
            "embeddings",
            "timing",
        ),  # fmt: skip
    ),
    "TokenizeRequest": _obj(
        {
            "text": _STRING,
            "texts": _array(_STRING, minItems=1),
            "model": {"type": "string", "description": "served model; empty: the default"},
        },
        oneOf=[{"required": ["text"]}, {"required": ["texts"]}],
        description="exactly one of 'text' and 'texts'",
        examples=[{"text": "苹果很好吃"}, {"texts": ["The cat sat .", "naïve café 🙂"]}],
    ),
    "TokenizeResponse": _obj(
        {"texts": _array(_obj({"tokens": _STRINGS, "offsets": _array(_SPAN)}, required=("tokens", "offsets")))},
        required=("texts",),
    ),
    "Model": _obj(
        {
            "id": _STRING,
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": _STRING,
            "n_layers": _COUNT,
            "dim": _COUNT,
            "version": {"type": "string", "description": "onnx.json's version, else sha256: of the checkpoint"},
            "model_version": _MODEL_VERSION,
            "versions": _array(_VERSION, description="its loaded versions (--model-root); pin one as MODEL@VERSION"),
            "execution_provider": _STRING,
            "max_tokens_per_sentence": _COUNT,
            "tasks": _STRINGS,
            "stale_tasks": _array(_STRING, description="mixes trained on earlier weights: served, retrain them"),
            "limits": _obj({name: _COUNT for name in _LIMIT_NAMES}, required=_LIMIT_NAMES),
        },
        required=(
            "id",
            "object",
            "created",
            "owned_by",
            "n_layers",
            "dim",
            "version",
            "model_version",
            "versions",
            "execution_provider",
            "max_tokens_per_sentence",
            "tasks",
            "stale_tasks",
            "limits",
        ),
        description="a served model",
    ),
    "TaskModel": _obj(
        {
            "id": {"type": "string", "description": "MODEL:TASK"},
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": _STRING,
            "parent": {"type": "string", "description": "the model"},
            "task": _STRING,
            "stale": {"type": "boolean", "description": "trained on earlier weights: served, retrain it"},
        },
        required=("id", "object", "created", "owned_by", "parent", "task", "stale"),
        description="a task mix of a served model, usable as the model of /v1/embeddings",
    ),
    "AliasModel": _obj(
        {
            "id": {"type": "string", "description": "the alias (--model-alias NAME=MODEL[:TASK])"},
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": _STRING,
            "alias_of": {"type": "string", "description": "MODEL, or MODEL:TASK"},
        },
        required=("id", "object", "created", "owned_by", "alias_of"),
        description="another name for a served model or one of its task mixes",
    ),
    "ModelList": _obj(
        {
            "object": {"const": "list"},
            "data": _array({"oneOf": [_ref("Model"), _ref("TaskModel"), _ref("AliasModel")]}),
        },
        required=("object", "data"),
    ),
    "Health": _obj({"status": {"enum": ["SERVING", "NOT_SERVING"]}}, required=("status",)),
    # -- the admin API (--model-root with --admin-token): service.grpc.admin, the same operations as gRPC's ModelAdmin
    "VersionStatus": _obj(
        {
            "version": _COUNT,
            "state": {"enum": ["state_unspecified", "loading", "ready", "unloading", "unloaded", "failed"]},
            "serving": {"type": "boolean", "description": "new requests go to this version"},
            "memory_bytes": _COUNT,
            "in_flight": {**_COUNT, "description": "requests this version is still answering"},
            "reason": {"type": "string", "description": "why it failed, in one line"},
        },
        required=("version", "state", "serving", "memory_bytes", "in_flight"),
    ),
    "ModelStatus": _obj({"name": _STRING, "versions": _array(_ref("VersionStatus"))}, required=("name", "versions")),
    "RepositoryIndex": _obj({"models": _array(_ref("ModelStatus"))}, required=("models",)),
    "VersionRequest": _obj(
        {"version": {"type": "integer", "minimum": 0, "description": "0 or none: the latest (load) or every (unload)"}},
        description="an empty body means version 0",
    ),
}


def _content(schema: dict, media_type: str = JSON) -> dict:
    return {media_type: {"schema": schema}}


_REQUEST_ID = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "description": "echoed back as request_id (a body's request_id wins), and logged",
    "schema": {"type": "string"},
}


def _post(operation_id: str, summary: str, request: str, response: str, errors: tuple[str, ...]) -> dict:
    operation: dict[str, Any] = {
        "operationId": operation_id,
        "summary": summary,
        "requestBody": {"required": True, "content": _content(_ref(request))},
        "responses": {"200": {"description": summary, "content": _content(_ref(response))}, **_errors(*errors)},
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
        "responses": {"200": {"description": summary, "content": _content(_ref("ModelStatus"))},
                      **_errors(*_ADMIN_ERRORS)},  # fmt: skip
        "parameters": [{"name": "name", "in": "path", "required": True, "description": "a model of the repository",
                        "schema": {"type": "string"}}],  # fmt: skip
    }
    if method == "post":
        operation["requestBody"] = {"required": False, "content": _content(_ref("VersionRequest"))}
    return {method: operation}


def _health(status: str) -> dict:
    return {"allOf": [_ref("Health"), {"properties": {"status": {"const": status}}}]}


def _ok(description: str, schema: dict, media_type: str = JSON) -> dict:
    return {"200": {"description": description, "content": _content(schema, media_type)}}


@cache
def openapi_document() -> dict:
    health_503 = {
        "description": "NOT_SERVING: warming up or draining (or, as an error, too many connections are open)",
        "content": _content({"oneOf": [_health("NOT_SERVING"), _ref("Error")]}),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ELMo embedding service",
            "version": "1",
            "description": "HTTP/JSON beside the gRPC API (proto/elmo/v1/embedder.proto): the same models, limits and "
            "token. Send 'Authorization: Bearer TOKEN' when the server has one (every route but /, /health and "
            "/openapi.json). POST bodies are JSON (application/json, UTF-8). Every error is JSON, "
            '{"error": {"message", "type", "code"}}. A method a path does not serve gets 405 with an Allow header '
            "naming the ones it does; an unknown path gets 404.",
        },
        "components": {
            "schemas": _SCHEMAS,
            "responses": {f"Error{status}": _error_response(status) for status in _ERROR_STATUSES},
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's --auth-token (or ELMO_AUTH_TOKEN); a server started without one "
                    "needs no token",
                },
                "admin": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's --admin-token (or ELMO_ADMIN_TOKEN): the /admin/ routes only",
                },
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/embeddings": _post(
                "createEmbeddings",
                "OpenAI-compatible pooled embeddings: one vector per input",
                "EmbeddingsRequest",
                "EmbeddingsResponse",
                _POST_EMBED_ERRORS,
            ),
            "/v1/embed": _post(
                "embed",
                "Per-token, per-layer vectors and task mixes (the gRPC EmbedRequest as JSON)",
                "EmbedRequest",
                "EmbedResponse",
                _POST_EMBED_ERRORS,
            ),
            "/v1/tokenize": _post(
                "tokenize",
                "The service's tokens and code-point offsets (runs no model)",
                "TokenizeRequest",
                "TokenizeResponse",
                _POST_TOKENIZE_ERRORS,
            ),
            "/v1/models": _get(
                "listModels",
                "Served models and one MODEL:TASK entry per task mix (OpenAI's list)",
                {**_ok("the models", _ref("ModelList")), **_errors(*_GET_API_ERRORS)},
            ),
            "/v1/models/{model_id}": {
                **_get(
                    "getModel",
                    "One model or MODEL:TASK entry",
                    {
                        **_ok("the entry", {"oneOf": [_ref("Model"), _ref("TaskModel")]}),
                        **_errors("401", "404", "500", "503"),
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
                open_path=True,
            ),
            "/openapi.json": _get(
                "openapi",
                "This document (OpenAPI 3.1)",
                {
                    **_ok("this document", {"type": "object", "required": ["openapi", "info", "paths"]}),
                    **_errors(*_OPEN_ERRORS),
                },
                open_path=True,
            ),
            "/admin/models": {
                "get": {
                    "operationId": "repositoryIndex",
                    "summary": "Every model of the repository and its versions (admin API: --model-root with "
                    "--admin-token)",
                    "security": [{"admin": []}],
                    "responses": {
                        **_ok("the repository", _ref("RepositoryIndex")),
                        **_errors("401", "403", "500", "503"),
                    },
                }
            },
            "/admin/models/{name}/load": _admin("loadModel", "Load a version (0: the latest) and serve it", "post"),
            "/admin/models/{name}/unload": _admin("unloadModel", "Stop serving a version (0: every one)", "post"),
            "/": _get(
                "page",
                "The layer explorer page: one self-contained HTML file (it calls the API with the token typed in it)",
                {**_ok("the page", {"type": "string"}, "text/html"), **_errors(*_OPEN_ERRORS)},
                open_path=True,
            ),
        },
    }


__all__ = ["openapi_document"]
