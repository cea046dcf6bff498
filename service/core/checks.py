"""The bounds a request is held to and the messages that name them: checked cheapest first, before the work they
bound (counts, layers, the task and the dtype; then tokens, counting stopped once a limit is crossed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from elmo.service.common.errors import invalid, too_large
from elmo.service.common.limits import Limits, flag_name, human_bytes
from elmo.service.core.encodings import AnswerEncoding

from elmo.text.overflow import Overflow
from elmo.text.tokenize import Tokenized, tokenize
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import OVERFLOW_VALUES

OVERFLOW_POLICIES = {value: Overflow(name) for name, value in OVERFLOW_VALUES.items()}


@dataclass(frozen=True)
class Bounds:
    """The count and token limits a request is held to: the per-token endpoints', or the pooled endpoint's (one
    vector per input answers, so OpenAI's far larger requests are fine there)."""

    max_inputs: int
    max_tokens: int
    inputs_flag: str
    tokens_flag: str

    @staticmethod
    def of(limits: Limits, pooled: bool = False) -> Bounds:
        if pooled:
            return Bounds(limits.max_pooled_inputs, limits.max_pooled_tokens, "max-pooled-inputs", "max-pooled-tokens")
        tokens_flag = flag_name("max_tokens_per_request")
        return Bounds(limits.max_inputs, limits.max_tokens_per_request, "max-inputs", tokens_flag)


def overflow_policy(value: int, limits: Limits) -> Overflow:
    """The request's policy, or the server's default (``--overflow``) when it names none."""
    if value == pb.OVERFLOW_DEFAULT:
        return Overflow.parse(limits.overflow)
    if value not in OVERFLOW_POLICIES:
        raise invalid(f"overflow {value} is not OVERFLOW_REJECT (1), OVERFLOW_TRUNCATE (2) or OVERFLOW_WINDOW (3)")
    return OVERFLOW_POLICIES[value]


def check_count(n: int, bounds: Bounds, field: str = "inputs") -> None:
    if n == 0:
        raise invalid(f"{field} is empty: send at least one sentence")
    if n > bounds.max_inputs:
        raise too_large(
            f"too many {field}: {n}, limit {bounds.max_inputs} per request (--{bounds.inputs_flag}); split the request"
        )


YIELD_EVERY_S = 0.0005  # a worker tokenizing gives the GIL away this often (the event loop waits no longer)


def gil_yielder() -> Callable[[], None]:
    """What to call between two texts being tokenized: off the event loop (on a worker), give the GIL away every
    :data:`YIELD_EVERY_S`, since `tokenizers`' calls let no waiting thread in (2,048 texts tokenized back to back on
    a worker made the event loop wait ~300 ms; with yields between them, 3 ms); on the event loop, nothing (the
    request is small there, and the loop would then have to wait for the GIL to come back)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _GiveWay()
    return _stay


class _GiveWay:
    """``time.sleep(0)`` once at least :data:`YIELD_EVERY_S` has passed since the last one: a yield is a system
    call (~80 us on a 2-core VM), more than tokenizing a sentence on the fast path, so not one per text."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._last >= YIELD_EVERY_S:
            time.sleep(0)
            self._last = time.perf_counter()


def _stay() -> None:
    pass


def request_chars(request: pb.EmbedRequest) -> int:
    """Code points of text in a request (pre-tokenized tokens included): what its preparation costs."""
    return sum(
        len(item.text) if item.WhichOneof("kind") == "text" else sum(map(len, item.tokens.tokens))
        for item in request.inputs
    )


def request_tokens_message(n_tokens: int, bounds: Bounds, at_least: bool = False) -> str:
    """``at_least``: counting stopped once the limit was crossed, so the request's own count is unknown."""
    limit = bounds.max_tokens
    found = f"more than {limit}" if at_least else str(n_tokens)
    return f"request has {found} tokens, over the limit of {limit} (--{bounds.tokens_flag}); split it"


def response_size_message(size: int, limits: Limits, encoding: AnswerEncoding) -> str:
    return (
        f"response would be up to {human_bytes(size)} as {encoding.name}, over the "
        f"{human_bytes(limits.max_response_bytes)} limit (--max-response-bytes): {encoding.advice}"
    )


def input_tokens(
    item: pb.Input, i: int, stop_after: int | None
) -> tuple[list[str], list[tuple[int, int]] | None, bool]:
    """(tokens, offsets or None for pre-tokenized input, whether all tokens were found)."""
    kind = item.WhichOneof("kind")
    if kind == "text":
        tokenized: Tokenized = tokenize(item.text, stop_after=stop_after)
        if not tokenized.tokens:
            raise invalid(f"inputs[{i}] is empty: the text has no tokens")
        return tokenized.tokens, tokenized.offsets, tokenized.complete
    if kind == "tokens":
        tokens = list(item.tokens.tokens)
        if not tokens:
            raise invalid(f"inputs[{i}] is empty: no tokens")
        for j, token in enumerate(tokens):
            if not token:
                raise invalid(f"inputs[{i}].tokens[{j}] is an empty string")
        return tokens, None, True
    raise invalid(f"inputs[{i}] has neither text nor tokens")


__all__ = [
    "Bounds",
    "check_count",
    "gil_yielder",
    "input_tokens",
    "overflow_policy",
    "request_chars",
    "request_tokens_message",
    "response_size_message",
]
