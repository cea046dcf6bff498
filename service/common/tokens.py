"""The bearer tokens both doors check: the clients' token (``--auth-token``) and the admin token (``--admin-token``),
the same check for gRPC metadata and HTTP headers."""

from __future__ import annotations

import hmac

from elmo.service.common.errors import Kind, ServiceError


class BearerToken:
    """``Bearer <token>`` compared in constant time; the same check for gRPC metadata and HTTP headers."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def check(self, presented: str | None, where: str) -> None:
        """Raise UNAUTHENTICATED unless ``presented`` (the header's value, None when absent) is the token.
        ``where`` names the carrier in the message: "metadata" (gRPC) or "header" (HTTP)."""
        if presented is None:
            name = "Authorization" if where == "header" else "authorization"
            raise ServiceError(Kind.UNAUTHENTICATED, f"missing '{name}: Bearer <token>' {where}")
        if not hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._expected):
            raise ServiceError(Kind.UNAUTHENTICATED, "invalid bearer token")


class AdminToken:
    """The admin token's check, for gRPC metadata and HTTP headers alike: missing -> UNAUTHENTICATED, another
    token -> PERMISSION_DENIED."""

    def __init__(self, token: str):
        self._token = BearerToken(token)

    def check(self, presented: str | None, where: str) -> None:
        try:
            self._token.check(presented, where)
        except ServiceError as exc:
            if presented is None:
                raise ServiceError(Kind.UNAUTHENTICATED, f"{exc.message} (the admin API needs --admin-token)") from None
            raise ServiceError(Kind.PERMISSION_DENIED, "not the admin token (--admin-token)") from None


__all__ = ["AdminToken", "BearerToken"]
