"""JSON answers encoded in pieces, so that a large one never holds the GIL for its whole length.

``json.dumps`` and ``ndarray.tolist`` are single C calls: a 50 MB answer encoded in one call on a worker thread
still stops the event loop's thread for the whole second or so it takes. Here arrays are encoded a block of rows
at a time (about :data:`PIECE_VALUES` numbers, ~2 ms), and between blocks the worker gives the GIL away, so health
checks and small requests keep flowing while the largest legal answer is encoded. The bytes are exactly
``json.dumps(value_with_lists, separators=(",", ":"), ensure_ascii=False)``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np

PIECE_VALUES = 16384  # numbers per piece


def encode_json(value: Any) -> bytes:
    """``value`` (dicts, lists, scalars and numpy arrays) as compact UTF-8 JSON."""
    parts: list[str] = []
    _encode(value, parts)
    return "".join(parts).encode("utf-8")


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _encode(value: Any, parts: list[str]) -> None:
    if isinstance(value, np.ndarray):
        _encode_array(value, parts)
    elif isinstance(value, dict):
        parts.append("{")
        for i, (key, item) in enumerate(value.items()):
            parts.append(f"{',' if i else ''}{_dumps(str(key))}:")
            _encode(item, parts)
        parts.append("}")
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, np.ndarray)) for item in value):
        parts.append("[")
        for i, item in enumerate(value):
            if i:
                parts.append(",")
            _encode(item, parts)
        parts.append("]")
    else:
        parts.append(_dumps(value))


def _encode_array(array: np.ndarray, parts: list[str]) -> None:
    if array.size <= PIECE_VALUES:
        parts.append(_dumps(array.tolist()))
        return
    parts.append("[")
    if array.ndim == 1:
        for start in range(0, len(array), PIECE_VALUES):
            parts.append(("," if start else "") + _dumps(array[start : start + PIECE_VALUES].tolist())[1:-1])
            time.sleep(0)  # let the event loop's thread take the GIL between pieces
    else:
        rows = max(1, PIECE_VALUES // max(1, array[0].size))  # whole sub-arrays per piece
        for start in range(0, len(array), rows):
            block = array[start : start + rows]
            if block[0].size > PIECE_VALUES:  # one sub-array is itself too large: go one level down
                for i, sub in enumerate(block):
                    parts.append("," if start or i else "")
                    _encode_array(sub, parts)
            else:
                parts.append(("," if start else "") + _dumps(block.tolist())[1:-1])
                time.sleep(0)
    parts.append("]")


__all__ = ["PIECE_VALUES", "encode_json"]
