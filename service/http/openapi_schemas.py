"""The schema pieces of the OpenAPI document (service.http.openapi assembles them into routes): the JSON shape of
every request and answer of the HTTP API, the error shape and what each error status means.

Each request schema names a field once, by the word the three routes share (``input``, ``encoding_format``, and the
proto's own names for the rest); an older name that is still accepted is listed as a deprecated alias of it.
"""

from __future__ import annotations

from typing import Any

from elmo.service.http.encodings import ENCODINGS

INT32_MAX = 2**31 - 1
JSON = "application/json"


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(properties: dict, required: tuple[str, ...] = (), closed: bool = True, **extra: Any) -> dict:
    """A JSON object; ``closed``: no other fields (answers are checked field by field)."""
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return {**schema, **extra}


def array(items: dict, **extra: Any) -> dict:
    return {"type": "array", "items": items, **extra}


STRING = {"type": "string"}
_INT = {"type": "integer"}
_COUNT = {"type": "integer", "minimum": 0}
_NUMBERS = array({"type": "number"})
STRINGS = array(STRING)
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
ERROR_STATUSES: dict[str, str] = {
    "400": "invalid input: the body is not JSON, not UTF-8 or not an object; a string holds a lone surrogate; a field "
    "has the wrong type or is out of range; an input is empty; an unknown field (/v1/embed, /v1/tokenize); a layer "
    "index the model does not have",
    "401": "missing or wrong bearer token (only when the server has one: --auth-token or ELMO_AUTH_TOKEN)",
    "404": "unknown model or task",
    "408": "the request body stalled: no bytes for longer than --http-body-timeout-s",
    "413": "over a size limit: too many inputs, tokens per sentence (overflow 'reject') or per request, an answer "
    "over --max-response-bytes, or a body over --max-message-bytes",
    "415": "the request body is not sent as JSON (Content-Type must be application/json)",
    "429": "overloaded: too many tokens queued (--max-queue-tokens); retry with backoff",
    "500": "internal error: a bug or a broken model (logged on the server with a traceback)",
    "503": "unavailable: the model is warming up, the server is draining after SIGTERM, or too many connections are "
    "open (--max-connections); retry shortly or on another replica",
    "504": "the request's deadline passed while it was queued (its work was dropped, never computed)",
    "403": "admin API: a token was sent, but not the admin token (--admin-token)",
    "409": "admin API: the version was refused (it failed to load or its checks, or is over --max-model-memory-bytes)",
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
_ERROR = obj(
    {
        "error": obj(
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


def error_response(status: str) -> dict:
    # the body's ``code`` is this status: the shared Error schema, with ``code`` pinned
    schema = {"allOf": [ref("Error"), {"properties": {"error": {"properties": {"code": {"const": int(status)}}}}}]}
    response: dict[str, Any] = {"description": ERROR_STATUSES[status], "content": {JSON: {"schema": schema}}}
    if status == "401":
        response["headers"] = _UNAUTHORIZED_HEADERS
    return response


def errors(*statuses: str) -> dict:
    return {status: {"$ref": f"#/components/responses/Error{status}"} for status in statuses}


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
_USAGE = obj({"prompt_tokens": _COUNT, "total_tokens": _COUNT}, required=("prompt_tokens", "total_tokens"))


def _tensor(rank: int, what: str) -> dict:
    nested: dict = _NUMBERS
    for _ in range(rank - 1):
        nested = array(nested)
    return {
        "description": f"{what}: nested lists of numbers (encoding=float), or the little-endian bytes of the "
        "requested dtype in base64 (encoding=base64), row-major in the given shape",
        "oneOf": [
            nested,
            obj(
                {
                    "dtype": {"enum": ["float32", "float16"]},
                    "shape": array(_COUNT, minItems=rank, maxItems=rank),
                    "data": {"type": "string", "contentEncoding": "base64"},
                },
                required=("dtype", "shape", "data"),
            ),
        ],
    }


_EMBED_INPUT = {
    "oneOf": [
        {"type": "string", "description": "raw text, tokenized by the service"},
        array(STRING, description="tokens, as given"),
        obj({"text": STRING}, required=("text",)),
        obj({"tokens": STRINGS}, required=("tokens",)),
    ]
}


def _alias(name: str, schema: dict) -> dict:
    """A field accepted under an older name: the same as ``name``, listed as deprecated (send one of the two)."""
    return {**schema, "deprecated": True, "description": f"alias of '{name}' (accepted; send one of the two)"}


_SPAN = array(_COUNT, minItems=2, maxItems=2, description="[start, end) in code points of the text sent")

SCHEMAS: dict[str, dict] = {
    "Error": _ERROR,
    "EmbeddingsRequest": obj(
        {
            "input": {
                "description": "the texts: one string or a list of them",
                "oneOf": [STRING, array(STRING, minItems=1)],
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
    "EmbeddingsResponse": obj(
        {
            "object": {"const": "list"},
            "model": {"type": "string", "description": "MODEL, or MODEL:TASK when a task's mix was pooled"},
            "model_version": _MODEL_VERSION,
            "task_stale": _TASK_STALE,
            "usage": _USAGE,
            "data": array(
                obj(
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
    "EmbedRequest": obj(
        {
            "input": {
                "description": "the inputs: texts (tokenized by the service) or token lists (embedded as given); one "
                "string is one text",
                "oneOf": [STRING, array(_EMBED_INPUT, minItems=1)],
            },
            "inputs": _alias("input", {"oneOf": [STRING, array(_EMBED_INPUT, minItems=1)]}),
            "layers": array(
                {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
                description="layer indices (0..n_layers-1, GET /v1/models), in the order wanted; default: all. Not "
                "with omit_layers (400: the answer would hold no layers)",
            ),
            "task": {"type": "string", "description": "a task mix of the model (GET /v1/models)"},
            "omit_layers": {"type": "boolean", "description": "only the task's mix (needs a task; not with layers)"},
            "dtype": {"enum": ["float32", "float16"], "default": "float32"},
            "encoding_format": {"enum": list(ENCODINGS), "default": "float"},
            "encoding": _alias("encoding_format", {"enum": list(ENCODINGS)}),
            "model": {"type": "string", "description": "served model; empty: the default"},
            "request_id": {"type": "string", "description": "echoed back (default: the X-Request-Id header)"},
            "overflow": _OVERFLOW,
        },
        # unknown fields are refused with 400: a typo is not silently ignored
        description="exactly one of 'input' and its alias 'inputs'; at most one of 'encoding_format' and its alias "
        "'encoding'; 'layers' only without omit_layers",
        oneOf=[{"required": ["input"]}, {"required": ["inputs"]}],
        allOf=[
            {"not": {"required": ["encoding_format", "encoding"]}},
            {
                "if": {"required": ["omit_layers"], "properties": {"omit_layers": {"const": True}}},
                "then": {"properties": {"layers": {"maxItems": 0}}},
            },
        ],
        examples=[
            {"input": ["The cat sat on the mat ."]},
            {
                "input": [["pre", "tokenized"], {"text": "苹果"}],
                "layers": [2, 0],
                "dtype": "float16",
                "encoding_format": "base64",
            },
        ],
    ),
    "EmbedResponse": obj(
        {
            "object": {"const": "embed"},
            "model": STRING,
            "model_version": _MODEL_VERSION,
            "task_stale": _TASK_STALE,
            "layers": array(_COUNT, description="the layer indices returned, in order"),
            "request_id": STRING,
            "usage": _USAGE,
            "embeddings": array(
                obj(
                    {
                        "index": _COUNT,
                        "tokens": STRINGS,
                        "offsets": array(_SPAN, description="text inputs only"),
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
            "timing": obj(
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
        ),
    ),
    "TokenizeRequest": obj(
        {
            "input": {"description": "the texts: one string or a list of them", "oneOf": [STRING, array(STRING)]},
            "text": _alias("input", STRING),
            "texts": _alias("input", array(STRING)),
            "model": {"type": "string", "description": "served model; empty: the default"},
        },
        oneOf=[{"required": ["input"]}, {"required": ["text"]}, {"required": ["texts"]}],
        description="exactly one of 'input' and its aliases 'text' (one string) and 'texts' (a list)",
        examples=[{"input": "苹果很好吃"}, {"input": ["The cat sat .", "naïve café 🙂"]}],
    ),
    "TokenizeResponse": obj(
        {"texts": array(obj({"tokens": STRINGS, "offsets": array(_SPAN)}, required=("tokens", "offsets")))},
        required=("texts",),
    ),
    "Model": obj(
        {
            "id": STRING,
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": STRING,
            "n_layers": _COUNT,
            "dim": _COUNT,
            "version": {"type": "string", "description": "onnx.json's version, else sha256: of the checkpoint"},
            "model_version": _MODEL_VERSION,
            "versions": array(_VERSION, description="its loaded versions (--model-root); pin one as MODEL@VERSION"),
            "execution_provider": STRING,
            "max_tokens_per_sentence": _COUNT,
            "tasks": STRINGS,
            "stale_tasks": array(STRING, description="mixes trained on earlier weights: served, retrain them"),
            "limits": obj({name: _COUNT for name in _LIMIT_NAMES}, required=_LIMIT_NAMES),
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
    "TaskModel": obj(
        {
            "id": {"type": "string", "description": "MODEL:TASK"},
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": STRING,
            "parent": {"type": "string", "description": "the model"},
            "task": STRING,
            "stale": {"type": "boolean", "description": "trained on earlier weights: served, retrain it"},
        },
        required=("id", "object", "created", "owned_by", "parent", "task", "stale"),
        description="a task mix of a served model, usable as the model of /v1/embeddings",
    ),
    "AliasModel": obj(
        {
            "id": {"type": "string", "description": "the alias (--model-alias NAME=MODEL[:TASK])"},
            "object": {"const": "model"},
            "created": _INT,
            "owned_by": STRING,
            "alias_of": {"type": "string", "description": "MODEL, or MODEL:TASK"},
        },
        required=("id", "object", "created", "owned_by", "alias_of"),
        description="another name for a served model or one of its task mixes",
    ),
    "ModelList": obj(
        {
            "object": {"const": "list"},
            "data": array({"oneOf": [ref("Model"), ref("TaskModel"), ref("AliasModel")]}),
        },
        required=("object", "data"),
    ),
    "Health": obj({"status": {"enum": ["SERVING", "NOT_SERVING"]}}, required=("status",)),
}
# The admin API (--model-root with --admin-token): service.grpc.admin, the same operations as gRPC's ModelAdmin.
ADMIN_SCHEMAS: dict[str, dict] = {
    "VersionStatus": obj(
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
    "ModelStatus": obj({"name": STRING, "versions": array(ref("VersionStatus"))}, required=("name", "versions")),
    "RepositoryIndex": obj({"models": array(ref("ModelStatus"))}, required=("models",)),
    "VersionRequest": obj(
        {"version": {"type": "integer", "minimum": 0, "description": "0 or none: the latest (load) or every (unload)"}},
        description="an empty body means version 0",
    ),
}


__all__ = [
    "ADMIN_SCHEMAS",
    "ERROR_STATUSES",
    "JSON",
    "SCHEMAS",
    "STRING",
    "array",
    "error_response",
    "errors",
    "obj",
    "ref",
]
