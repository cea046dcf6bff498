"""JSON answers with their numbers written by orjson, in pieces, so that a large one never holds the GIL for long.

Arrays are written by ``orjson`` (numpy support): the shortest text that reads back as the same float32 (float16
values as their float32), about 30x faster than ``json.dumps(array.tolist())`` and half the size. The rest of an
answer (names, tokens, offsets) is written by orjson too, and base64 data as it is (:class:`JsonText`). Every call
holds the GIL, so a large array is written a block of rows at a time (about :data:`PIECE_VALUES` numbers, well under
a millisecond) and the worker gives the GIL away between blocks: health checks and small requests keep flowing while
the largest legal answer is encoded (written whole, a 3 x 5,000 x 256 answer, 42 MB of JSON, held the GIL 250 ms on
an AMD EPYC Zen 3). That is what the pieces are for, not speed: on small answers one orjson call of the whole would
be cheaper (docs/speed.md, "What each trick is worth").
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import orjson
import pybase64

from elmo.wire import contiguous_blocks

# The longest JSON number written here for a float32 or float16 (the shortest text that reads back as the same
# float32, e.g. "-1.1754944e-38"), with its separator: the JSON answers' size bound (service/http/encodings.py).
JSON_NUMBER_BYTES = 16
PIECE_VALUES = 1 << 17  # numbers per piece
# 3 MiB of data per base64 piece (a multiple of 3: the pieces' base64 concatenates), ~0.1 ms with AVX-512 and
# well under a millisecond with AVX2: a models/default answer of 8 sentences is one piece, no GIL hand-off
BASE64_PIECE_BYTES = 3 << 20


def encode_json(value: Any) -> bytes:
    """``value`` (dicts, lists, scalars and numpy arrays) as compact UTF-8 JSON."""
    return b"".join(encode_json_parts(value))


def encode_json_parts(value: Any) -> list[bytes]:
    """The same JSON as pieces, in order: a large answer is sent piece by piece, never joined into one buffer
    (joining 33 MB holds the GIL ~60 ms, most of it page faults, while health checks wait)."""
    parts: list[bytes] = []
    _encode(value, parts)
    return parts


class JsonText(tuple):
    """Pieces of bytes that are JSON text already (a base64 string with its quotes): written as they are, never
    re-scanned."""


def base64_json(data: bytes | memoryview | np.ndarray) -> JsonText:
    """``data`` as a JSON string of its base64 (no character of which needs escaping), encoded by pybase64 (SIMD:
    40x binascii's 1 GB/s here) a piece at a time, the GIL given away between pieces. An array is read in place, in
    row-major order, a strided view (a sentence's layers in its batch's padded output) block by block
    (elmo.wire.contiguous_blocks): no contiguous copy is made first."""
    blocks = contiguous_blocks(data) if isinstance(data, np.ndarray) else [memoryview(data).cast("B")]
    pieces = [b'"']
    since_yield = 0
    for chunk in _base64_chunks(blocks):
        if since_yield >= BASE64_PIECE_BYTES:
            time.sleep(0)  # let the event loop's thread take the GIL between pieces
            since_yield = 0
        pieces.append(pybase64.b64encode(chunk))
        since_yield += len(chunk)
    pieces.append(b'"')
    return JsonText(pieces)


def _base64_chunks(blocks: list[bytes | memoryview]):
    """The blocks' bytes, in order, as chunks of at most BASE64_PIECE_BYTES bytes, each but the last a multiple of 3:
    their base64 strings, concatenated, are the base64 of the whole. Only the at most two bytes a block leaves over
    are copied, joined to the start of the next."""
    carry = b""
    for block in blocks:
        if carry:
            need = 3 - len(carry)
            if len(block) < need:
                carry += bytes(block)
                continue
            yield carry + bytes(block[:need])
            block, carry = block[need:], b""
        whole = len(block) - len(block) % 3
        for start in range(0, whole, BASE64_PIECE_BYTES):
            yield block[start : min(start + BASE64_PIECE_BYTES, whole)]
        carry = bytes(block[whole:])
    if carry:
        yield carry


def _dumps(value: Any) -> bytes:
    # orjson: the same compact UTF-8 JSON as json.dumps(separators=(",", ":"), ensure_ascii=False) for what answers
    # hold (strings, numbers, lists), several times faster on long token lists
    return orjson.dumps(value)


def _numbers(array: np.ndarray) -> bytes:
    return orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY)


def _encode(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, JsonText):
        parts.extend(value)
    elif isinstance(value, np.ndarray):
        _encode_array(value, parts)
    elif isinstance(value, dict):
        parts.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            parts.append((b"," if i else b"") + _dumps(str(key)) + b":")
            _encode(item, parts)
        parts.append(b"}")
    elif isinstance(value, (list, tuple)):
        _encode_list(value, parts)
    else:
        parts.append(_dumps(value))


_NESTED = (dict, np.ndarray, JsonText)  # what a list's items are encoded one by one for


def _encode_list(value: list | tuple, parts: list[bytes]) -> None:
    """A list of plain values (tokens, offsets) in one orjson call; item by item when its first item is nested, or
    when orjson meets an array or JSON text further in (it raises before writing anything). Scanning every item
    first (the tokens and offsets of every sentence) was ~30 us of an 8-sentence answer's 150-220."""
    if not (value and isinstance(value[0], _NESTED)):
        try:
            parts.append(_dumps(value))
            return
        except TypeError:  # orjson.JSONEncodeError: an item only the item-by-item path writes
            pass
    parts.append(b"[")
    for i, item in enumerate(value):
        if i:
            parts.append(b",")
        _encode(item, parts)
    parts.append(b"]")


def _encode_array(array: np.ndarray, parts: list[bytes]) -> None:
    if array.size <= PIECE_VALUES or array.ndim == 0:
        parts.append(_numbers(array))
        return
    parts.append(b"[")
    if array.ndim == 1:
        for start in range(0, len(array), PIECE_VALUES):
            parts.append((b"," if start else b"") + _numbers(array[start : start + PIECE_VALUES])[1:-1])
            time.sleep(0)  # let the event loop's thread take the GIL between pieces
    else:
        rows = max(1, PIECE_VALUES // max(1, array[0].size))  # whole sub-arrays per piece
        for start in range(0, len(array), rows):
            block = array[start : start + rows]
            if block[0].size > PIECE_VALUES:  # one sub-array is itself too large: go one level down
                for i, sub in enumerate(block):
                    parts.append(b"," if start or i else b"")
                    _encode_array(sub, parts)
            else:
                parts.append((b"," if start else b"") + _numbers(block)[1:-1])
                time.sleep(0)
    parts.append(b"]")


__all__ = ["JSON_NUMBER_BYTES", "PIECE_VALUES", "JsonText", "base64_json", "encode_json", "encode_json_parts"]
