"""How an answer's vectors travel: one :class:`AnswerEncoding` entry per encoding, bringing its size bound.

The core checks an answer's size before building it (``--max-response-bytes``), so each encoding says how many
bytes its numbers take at most, how much framing an answer carries besides them, and what a caller can do when the
answer is over the limit. The protobuf entry lives here (it is the contract's own); the doors define theirs next to
their wire format (service/http/encodings.py: JSON numbers and base64). A new encoding is one new entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elmo.wire import NUMPY_DTYPES


@dataclass(frozen=True)
class Framing:
    """Bytes an answer carries besides its vectors: per token (its string's framing and offsets), per sentence, and
    once (the envelope). A token's own UTF-8 bytes are counted on top."""

    token: int
    sentence: int
    answer: int


@dataclass(frozen=True)
class AnswerEncoding:
    """One way of sending vectors. ``value_bytes(n, dtype)``: the most bytes ``n`` numbers of ``dtype`` take;
    ``advice``: how to make an answer that is over the size limit smaller; ``inline_bytes``: answers up to this
    size are built in place (building costs less than a thread hop); ``write_tensor`` / ``write_vector``: for
    encodings inside a JSON answer, the value written for a tensor (an array in the wire dtype) and for a pooled
    float32 vector."""

    name: str
    value_bytes: Callable[[int, int], int]
    framing: Framing
    advice: str
    inline_bytes: int
    write_tensor: Callable[[Any], Any] | None = None
    write_vector: Callable[[Any], Any] | None = None


def raw_bytes(n_values: int, dtype: int) -> int:
    return n_values * NUMPY_DTYPES[dtype].itemsize


PROTOBUF = AnswerEncoding(
    name="protobuf",
    value_bytes=raw_bytes,  # raw little-endian bytes in a Tensor message
    framing=Framing(token=16, sentence=64, answer=256),
    advice="ask for fewer inputs or layers, FLOAT16, or use EmbedStream",
    inline_bytes=4 * 1024 * 1024,  # building the message is a copy: ~0.1 ms per MiB
)


__all__ = ["PROTOBUF", "AnswerEncoding", "Framing", "raw_bytes"]
