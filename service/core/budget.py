"""The budget of answer bytes in flight (``--in-flight-answer-bytes``, ``--in-flight-answer-bytes-per-peer``).

An answer's size is known before it is computed (service.core.answers.answer_bytes), and an answer that is built
but not yet taken by its client holds its memory until the client reads it or its connection closes. So every
embedding answer holds its bytes in the budget from before its vectors are computed until it has left: gRPC's call
is done, HTTP's last piece was written or its connection closed. A call whose answer does not fit in its peer's
share or in the whole is refused before any work (gRPC RESOURCE_EXHAUSTED, HTTP 503 with Retry-After): a client that
never reads its answers keeps its share full and its new calls are refused, instead of pinning more memory.
"""

from __future__ import annotations

import asyncio

from elmo.service.common.errors import Kind, ServiceError
from elmo.service.common.limits import Limits, human_bytes

RETRY_AFTER_S = 1  # what a refused HTTP caller is told to wait: answers in flight usually leave within a second


class AnswerBudgetFull(ServiceError):
    """An answer that does not fit in the budget now: retry later (HTTP answers 503 with Retry-After)."""

    def __init__(self, message: str):
        super().__init__(Kind.OVERLOADED, message)


class AnswerBudget:
    """Bytes of answers in flight, counted per peer (a client address without its port) and in all."""

    def __init__(self, total: int, per_peer: int):
        self.total, self.per_peer = total, per_peer
        self.held = 0
        self._by_peer: dict[str, int] = {}

    @classmethod
    def for_limits(cls, limits: Limits) -> AnswerBudget:
        return cls(limits.answer_bytes_in_flight, limits.answer_bytes_in_flight_per_peer)

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def claim(self, peer: str, after: AnswerClaim | None = None) -> AnswerClaim:
        """An empty claim for one answer of ``peer``: the core fills it once the answer's size is known."""
        return AnswerClaim(self, peer, after)

    def _take(self, peer: str, n: int) -> None:
        # An answer larger than a share on its own (--max-response-bytes above it) still goes when nothing else is
        # held: the bound is then one answer, never a refusal of every call.
        mine = self._by_peer.get(peer, 0)
        if mine and mine + n > self.per_peer:
            raise AnswerBudgetFull(
                f"this client ({peer}) has {human_bytes(mine)} of answers not yet taken and this answer needs "
                f"{human_bytes(n)} more: over its share of {human_bytes(self.per_peer)} "
                "(--in-flight-answer-bytes-per-peer); read the answers in flight, then retry"
            )
        if self.held and self.held + n > self.total:
            raise AnswerBudgetFull(
                f"server busy: {human_bytes(self.held)} of answers in flight and this answer needs {human_bytes(n)} "
                f"more, over {human_bytes(self.total)} (--in-flight-answer-bytes); retry later"
            )
        self._by_peer[peer] = mine + n
        self.held += n

    def _give_back(self, peer: str, n: int) -> None:
        left = self._by_peer[peer] - n
        if left:
            self._by_peer[peer] = left
        else:
            del self._by_peer[peer]
        self.held -= n


class AnswerClaim:
    """One answer's place in the budget: :meth:`take` its size (once, before the work; raises
    :class:`AnswerBudgetFull`), :meth:`release` once the answer has left (any number of times, from any outcome).
    ``after``: another claim that must have taken its place (or given up) first, :meth:`turn` waits for it: a
    stream's answers take their places in the order they are sent. Used on the event loop only."""

    __slots__ = ("budget", "peer", "bytes", "after", "_settled")

    def __init__(self, budget: AnswerBudget, peer: str, after: AnswerClaim | None = None):
        self.budget, self.peer = budget, peer
        self.bytes = 0
        self.after = after
        self._settled = asyncio.Event()

    async def turn(self) -> None:
        """Wait until the claim this one comes after has taken its place or given up."""
        if self.after is not None:
            await self.after._settled.wait()
            self.after = None  # no reference kept to what has left

    def settle(self) -> None:
        """This claim has taken its place, or never will: the claim after it may go."""
        self._settled.set()

    async def take_in_turn(self, n: int) -> None:
        """:meth:`turn`, then :meth:`take`: a stream's answers take their places in the order they are sent."""
        await self.turn()
        self.take(n)

    def take(self, n: int) -> None:
        self.release()  # a claim holds one answer's bytes: a second take replaces the first
        self.budget._take(self.peer, n)
        self.bytes = n
        self.settle()

    def release(self) -> None:
        if self.bytes:
            self.budget._give_back(self.peer, self.bytes)
            self.bytes = 0


__all__ = ["RETRY_AFTER_S", "AnswerBudget", "AnswerBudgetFull", "AnswerClaim"]
