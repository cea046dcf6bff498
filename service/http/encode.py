"""JSON answers with their numbers written by orjson, in pieces, so that a large one never holds the GIL for long.

Arrays are written by ``orjson`` (numpy support): the shortest text that reads back as the same float32 (float16
values as their float32), about 30x faster than ``json.dumps(array.tolist())`` and half the size. The rest of an
answer (names, tokens, offsets) is written by orjson too, and base64 data as it is (:class:`JsonText`). Every call
holds the GIL, so a large array is written a block of rows at a time (about :data:`PIECE_VALUES` numbers, well under
a millisecond) and the worker gives the GIL away between blocks: health checks and small requests keep flowing while
the largest legal answer is encoded.
"""

from __future__ import annotations

import binascii
import time
from typing import Any

import numpy as np
import orjson
from elmo.service.core import JSON_NUMBER_BYTES  # the size bound of the numbers written here

PIECE_VALUES = 1 << 17  # numbers per piece


def encode_json(value: Any) -> bytes:
    """``value`` (dicts, lists, scalars and numpy arrays) as compact UTF-8 JSON."""
    parts: list[bytes] = []
    _encode(value, parts)
    return b"".join(parts)


class JsonText(bytes):
    """Bytes that are JSON text already (a base64 string with its quotes): written as they are, never re-scanned."""


def base64_json(data: bytes) -> JsonText:
    """``data`` as a JSON string of its base64 (no character of which needs escaping)."""
    return JsonText(b'"' + binascii.b2a_base64(data, newline=False) + b'"')


def _dumps(value: Any) -> bytes:
    # orjson: the same compact UTF-8 JSON as json.dumps(separators=(",", ":"), ensure_ascii=False) for what answers
    # hold (strings, numbers, lists), several times faster on long token lists
    return orjson.dumps(value)


def _numbers(array: np.ndarray) -> bytes:
    return orjson.dumps(np.ascontiguousarray(array), option=orjson.OPT_SERIALIZE_NUMPY)


def _encode(value: Any, parts: list[bytes]) -> None:
    if isinstance(value, JsonText):
        parts.append(value)
    elif isinstance(value, np.ndarray):
        _encode_array(value, parts)
    elif isinstance(value, dict):
        parts.append(b"{")
        for i, (key, item) in enumerate(value.items()):
            parts.append((b"," if i else b"") + _dumps(str(key)) + b":")
            _encode(item, parts)
        parts.append(b"}")
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, np.ndarray)) for item in value):
        parts.append(b"[")
        for i, item in enumerate(value):
            if i:
                parts.append(b",")
            _encode(item, parts)
        parts.append(b"]")
    else:
        parts.append(_dumps(value))


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


__all__ = ["JSON_NUMBER_BYTES", "PIECE_VALUES", "JsonText", "base64_json", "encode_json"]
