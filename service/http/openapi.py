"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json`` (tests check it names every route)."""

from __future__ import annotations

from functools import cache

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string", "description": "what is wrong, naming the field or the limit"},
                "type": {"type": "string", "examples": ["invalid_input", "too_large", "not_found", "overloaded"]},
                "code": {"type": "integer", "description": "the HTTP status again"},
            },
        }
    },
}
_TENSOR = {
    "description": "nested lists of numbers (encoding=float), or the little-endian bytes in base64 (encoding=base64)",
    "oneOf": [
        {"type": "array", "items": {}},
        {
            "type": "object",
            "required": ["dtype", "shape", "data"],
            "properties": {
                "dtype": {"enum": ["float32", "float16"]},
                "shape": {"type": "array", "items": {"type": "integer"}},
                "data": {"type": "string", "contentEncoding": "base64"},
            },
        },
    ],
}
_OVERFLOW = {
    "enum": ["reject", "truncate", "window"],
    "description": "sentences over max_tokens_per_sentence: refuse (413), keep the first tokens, or embed "
    "overlapping windows stitched back; default: the server's --overflow",
}
_USAGE = {
    "type": "object",
    "properties": {"prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}},
}
_STATUSES = {
    "400": "invalid JSON, wrong types, empty input",
    "401": "missing or wrong bearer token (when the server has one)",
    "404": "unknown model or task",
    "413": "over a size limit (inputs, tokens per sentence or request, body or response bytes)",
    "429": "overloaded: too many tokens queued; retry with backoff",
    "503": "warming up or shutting down",
}


def _errors() -> dict:
    return {
        code: {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
        for code, text in _STATUSES.items()
    }


def _post(summary: str, request: str, response: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{request}"}}},
            },
            "responses": {
                "200": {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}}}},
                **_errors(),
            },
        }
    }


def _get(summary: str, schema: dict, open_path: bool = False) -> dict:
    operation = {"summary": summary, "responses": {"200": {"content": {"application/json": {"schema": schema}}}}}
    return {"get": {**operation, "security": []} if open_path else operation}


@cache
def openapi_document() -> dict:
    schemas = {
        "Error": _ERROR,
        "EmbeddingsRequest": {
            "type": "object",
            "required": ["input"],
            "properties": {
                "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                "model": {"type": "string", "description": "served model, or MODEL:TASK for a task's mix"},
                "encoding_format": {"enum": ["float", "base64"], "default": "float"},
                "dimensions": {"type": "integer", "description": "must equal the model's dim if given"},
                "overflow": _OVERFLOW,
            },
        },
        "EmbeddingsResponse": {
            "type": "object",
            "properties": {
                "object": {"const": "list"},
                "model": {"type": "string"},
                "usage": _USAGE,
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "object": {"const": "embedding"},
                            "index": {"type": "integer"},
                            "embedding": {
                                "description": "mean over the input's tokens of the mean of its layers (or of the "
                                "task's mix); float32 little-endian in base64 when encoding_format=base64",
                                "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
                            },
                        },
                    },
                },
            },
        },
        "EmbedRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "inputs": {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {"type": "string", "description": "raw text, tokenized by the service"},
                            {"type": "array", "items": {"type": "string"}, "description": "tokens, as given"},
                        ]
                    },
                },
                "layers": {"type": "array", "items": {"type": "integer"}, "description": "default: all"},
                "task": {"type": "string"},
                "omit_layers": {"type": "boolean"},
                "dtype": {"enum": ["float32", "float16"]},
                "encoding": {"enum": ["float", "base64"], "default": "float"},
                "model": {"type": "string"},
                "request_id": {"type": "string"},
                "overflow": _OVERFLOW,
            },
        },
        "EmbedResponse": {
            "type": "object",
            "properties": {
                "model": {"type": "string"},
                "layers": {"type": "array", "items": {"type": "integer"}},
                "usage": _USAGE,
                "embeddings": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "tokens": {"type": "array", "items": {"type": "string"}},
                            "offsets": {"type": "array", "description": "[start, end) code points, text inputs"},
                            "truncated_tokens": {"type": "integer"},
                            "layers": {**_TENSOR, "description": "[n_layers, n_tokens, dim]"},
                            "mix": {**_TENSOR, "description": "[n_tokens, dim]"},
                        },
                    },
                },
                "timing": {"type": "object"},
            },
        },
        "TokenizeRequest": {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "texts": {"type": "array", "items": {"type": "string"}},
                "model": {"type": "string"},
            },
        },
        "TokenizeResponse": {"type": "object", "properties": {"texts": {"type": "array"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ELMo embedding service",
            "version": "1",
            "description": "HTTP/JSON beside the gRPC API (proto/elmo/v1/embedder.proto), same models, limits and "
            "token. Send 'Authorization: Bearer TOKEN' when the server has one.",
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/v1/embeddings": _post("OpenAI-compatible pooled embeddings", "EmbeddingsRequest", "EmbeddingsResponse"),
            "/v1/embed": _post("Per-token, per-layer vectors and task mixes", "EmbedRequest", "EmbedResponse"),
            "/v1/tokenize": _post("The service's tokens and offsets", "TokenizeRequest", "TokenizeResponse"),
            "/v1/models": _get("Served models and their task mixes (OpenAI list)", {"type": "object"}),
            "/v1/models/{model_id}": {
                **_get("One model or MODEL:TASK entry", {"type": "object"}),
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            },
            "/health": _get("200 SERVING or 503 NOT_SERVING; no token", {"type": "object"}, open_path=True),
            "/openapi.json": _get("This document", {"type": "object"}, open_path=True),
            "/": _get("The layer explorer page (HTML)", {"type": "string"}, open_path=True),
        },
    }


__all__ = ["openapi_document"]
