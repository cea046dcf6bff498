"""The service's one error type and its one mapping to gRPC status codes (and to HTTP statuses).

The queue, the limits and the servicer raise :class:`ServiceError` with a :class:`Kind` and a message that names
the problem; only :func:`grpc_code` knows about gRPC, only :func:`http_status` about HTTP. Library errors
(``elmo.errors``) are translated once by :func:`from_library_error`.
"""

from __future__ import annotations

import enum

import grpc

from elmo.errors import ConfigError, ElmoError, InputError, ModelFileError


class Kind(enum.Enum):
    INVALID_INPUT = "invalid input"  # the request itself is wrong; retrying it cannot help
    TOO_LARGE = "too large"  # over a size limit (inputs, tokens, bytes); split the request
    NOT_FOUND = "not found"  # unknown model or task
    OVERLOADED = "overloaded"  # queue full; retry later with backoff
    DEADLINE = "deadline exceeded"  # the caller's deadline passed before the work was done
    UNAVAILABLE = "unavailable"  # warming up or draining; retry on another replica
    UNAUTHENTICATED = "unauthenticated"  # missing or wrong bearer token
    UNSUPPORTED_MEDIA = "unsupported media type"  # HTTP: a body that is not JSON
    PERMISSION_DENIED = "permission denied"  # a token, but not the one this API needs (the admin API)
    REFUSED = "refused"  # admin: a model version that failed to load or its checks, or over --max-model-memory-bytes
    INTERNAL = "internal"  # a bug or a broken model; logged with a traceback


_GRPC_CODES: dict[Kind, grpc.StatusCode] = {
    Kind.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,  # the request is wrong as sent, not the server out of room
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Kind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Kind.UNSUPPORTED_MEDIA: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Kind.REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    Kind.INTERNAL: grpc.StatusCode.INTERNAL,
}


# The same kinds as HTTP statuses (the HTTP API, service.http); OpenAI-style clients read 400/401/404/413/429/503.
_HTTP_STATUSES: dict[Kind, int] = {
    Kind.INVALID_INPUT: 400,
    Kind.TOO_LARGE: 413,
    Kind.NOT_FOUND: 404,
    Kind.OVERLOADED: 429,
    Kind.DEADLINE: 504,
    Kind.UNAVAILABLE: 503,
    Kind.UNAUTHENTICATED: 401,
    Kind.UNSUPPORTED_MEDIA: 415,
    Kind.PERMISSION_DENIED: 403,
    Kind.REFUSED: 409,
    Kind.INTERNAL: 500,
}


class ServiceError(Exception):
    """A failure meant for the caller: ``kind`` picks the status code, ``message`` names the problem."""

    def __init__(self, kind: Kind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"ServiceError({self.kind.name}, {self.message!r})"


def grpc_code(kind: Kind) -> grpc.StatusCode:
    return _GRPC_CODES[kind]


def http_status(kind: Kind) -> int:
    return _HTTP_STATUSES[kind]


def from_library_error(exc: ElmoError) -> ServiceError:
    """Translate an ``elmo.errors`` exception raised by the runtime or a task store."""
    if isinstance(exc, InputError):
        return ServiceError(Kind.INVALID_INPUT, str(exc))
    if isinstance(exc, (ModelFileError, ConfigError)):
        return ServiceError(Kind.INTERNAL, f"model error: {exc}")
    return ServiceError(Kind.INTERNAL, str(exc))


def invalid(message: str) -> ServiceError:
    return ServiceError(Kind.INVALID_INPUT, message)


def too_large(message: str) -> ServiceError:
    return ServiceError(Kind.TOO_LARGE, message)


def not_found(message: str) -> ServiceError:
    return ServiceError(Kind.NOT_FOUND, message)


def clip(value: str, limit: int = 64) -> str:
    """A client's string as quoted in a message: at most ``limit`` characters, so a huge name is not echoed back."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


__all__ = [
    "Kind",
    "clip",
    "ServiceError",
    "from_library_error",
    "grpc_code",
    "http_status",
    "invalid",
    "not_found",
    "too_large",
]
