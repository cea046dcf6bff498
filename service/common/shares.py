"""Bounded shares of a counted capacity: no one peer holds more than its share, and all peers together no more
than the whole (``--max-concurrent-rpcs`` / ``--max-calls-per-peer`` for gRPC calls, ``--max-connections`` /
``--max-connections-per-peer`` for HTTP connections).

A peer is a client's network address without its port (``peer_address``): one host opening many connections is one
peer. Behind a proxy every call comes from the proxy's address, so a proxied deployment raises the per-peer share
to the whole (docs/how-to/secure.md).
"""

from __future__ import annotations

from elmo.service.common.errors import Kind, ServiceError


def peer_address(peer: str) -> str:
    """The address part of a gRPC peer string or a ``host:port`` pair: ``ipv4:10.0.0.7:5312`` -> ``10.0.0.7``,
    ``ipv6:[::1]:5312`` -> ``::1``; a unix socket's peer is itself (all callers on one socket are one peer)."""
    for scheme in ("ipv4:", "ipv6:"):
        if peer.startswith(scheme):
            peer = peer[len(scheme) :]
            break
    else:
        if peer.startswith("unix:") or ":" not in peer:
            return peer
    if peer.startswith("["):  # [v6]:port
        return peer[1 : peer.index("]")] if "]" in peer else peer
    return peer.rsplit(":", 1)[0]


class Shares:
    """Counts what each peer holds. ``take`` raises ServiceError(OVERLOADED) naming the limit that was reached,
    before anything is taken; ``give_back`` returns one."""

    def __init__(self, total: int, per_peer: int, what: str, flags: tuple[str, str]):
        self.total, self.per_peer = total, per_peer
        self._what, self._flags = what, flags
        self._held: dict[str, int] = {}
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count >= self.total

    def held_by(self, peer: str) -> int:
        return self._held.get(peer, 0)

    def refusal(self, peer: str) -> str | None:
        """Why ``peer`` may not take one more now, or None."""
        if self.full:
            return f"server busy: {self.total} {self._what} open at once ({self._flags[0]}); retry later"
        if self._held.get(peer, 0) >= self.per_peer:
            return (
                f"this client ({peer}) has {self.per_peer} {self._what} open at once, its share "
                f"({self._flags[1]}); retry when one has ended"
            )
        return None

    def take(self, peer: str) -> None:
        why = self.refusal(peer)
        if why is not None:
            raise ServiceError(Kind.OVERLOADED, why)
        self._held[peer] = self._held.get(peer, 0) + 1
        self.count += 1

    def give_back(self, peer: str) -> None:
        left = self._held[peer] - 1
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]
        self.count -= 1


__all__ = ["Shares", "peer_address"]
