"""The HTTP answers' encodings of vectors, one :class:`~service.core.encodings.AnswerEncoding` entry each: JSON
numbers (``"float"``, the default) and base64 of the raw little-endian bytes (``"base64"``, 4x smaller). The
request's ``encoding`` (/v1/embed) or ``encoding_format`` (/v1/embeddings) picks one by name; a new encoding is one
new entry here (its size bound, its advice, how it writes a tensor and a pooled vector)."""

from __future__ import annotations

from typing import Any

import numpy as np
from elmo.service.core.encodings import AnswerEncoding, Framing, raw_bytes
from elmo.service.http.encode import JSON_NUMBER_BYTES, base64_json

from elmo.v1 import embedder_pb2 as pb
from elmo.wire import NUMPY_DTYPES

# per token its string (quotes, separators) and its offsets; per sentence its fields; per answer its envelope
JSON_FRAMING = Framing(token=32, sentence=256, answer=512)
INLINE_ANSWER_BYTES = 256 * 1024  # bytes of one JSON answer, as sent, built in place below this


def _base64_tensor(array: np.ndarray) -> dict[str, Any]:
    """An array in its wire dtype (little-endian float32 or float16; a strided view is read in place), as the Tensor
    message holds it."""
    dtype = "float16" if array.dtype == NUMPY_DTYPES[pb.FLOAT16] else "float32"
    return {"dtype": dtype, "shape": list(array.shape), "data": base64_json(array)}


def _base64_bytes(n_values: int, dtype: int) -> int:
    return 4 * ((raw_bytes(n_values, dtype) + 2) // 3)


JSON_FLOAT = AnswerEncoding(
    name="float",
    value_bytes=lambda n_values, dtype: n_values * JSON_NUMBER_BYTES,
    framing=JSON_FRAMING,
    advice='ask for fewer inputs or layers, or "encoding": "base64" (4x smaller than JSON numbers)',
    inline_bytes=INLINE_ANSWER_BYTES,
    write_tensor=lambda array: array,  # nested lists of numbers, written by service.http.encode
    write_vector=lambda vector: vector,
)
JSON_BASE64 = AnswerEncoding(
    name="base64",
    value_bytes=_base64_bytes,
    framing=JSON_FRAMING,
    advice='ask for fewer inputs or layers, or "dtype": "float16"',
    inline_bytes=INLINE_ANSWER_BYTES,
    write_tensor=_base64_tensor,  # {dtype, shape, data: base64 of the little-endian bytes}, as on the wire
    write_vector=lambda vector: base64_json(np.asarray(vector, dtype="<f4").tobytes()),
)
ENCODINGS: dict[str, AnswerEncoding] = {encoding.name: encoding for encoding in (JSON_FLOAT, JSON_BASE64)}


__all__ = ["ENCODINGS", "INLINE_ANSWER_BYTES", "JSON_BASE64", "JSON_FLOAT"]
