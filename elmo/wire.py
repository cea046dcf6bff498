"""numpy <-> ``elmo.v1.Tensor`` (packed little-endian bytes, row-major), shared by the server and the clients.

Torch-free and grpc-free: only numpy and the generated protobuf messages.
"""

from __future__ import annotations

import functools

import numpy as np

from elmo.errors import InputError
from elmo.text.overflow import Overflow
from elmo.v1 import embedder_pb2 as pb

# Wire dtype -> numpy dtype with the byte order spelled out (the wire is little-endian whatever the host is).
NUMPY_DTYPES: dict[int, np.dtype] = {pb.FLOAT32: np.dtype("<f4"), pb.FLOAT16: np.dtype("<f2")}
DTYPE_NAMES: dict[str, int] = {"float32": pb.FLOAT32, "float16": pb.FLOAT16}
# A policy's name -> its wire value (OVERFLOW_DEFAULT, 0, is "the server's --overflow").
OVERFLOW_VALUES: dict[str, int] = {
    Overflow.REJECT.value: pb.OVERFLOW_REJECT,
    Overflow.TRUNCATE.value: pb.OVERFLOW_TRUNCATE,
    Overflow.WINDOW.value: pb.OVERFLOW_WINDOW,
}


def itemsize(dtype: int) -> int:
    return NUMPY_DTYPES[dtype].itemsize


def to_tensor(array: np.ndarray, dtype: int = pb.FLOAT32, out: pb.Tensor | None = None) -> pb.Tensor:
    """Pack ``array`` (any float dtype) as ``dtype``; fills ``out`` in place when given (a submessage)."""
    packed = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[dtype])
    tensor = pb.Tensor() if out is None else out
    tensor.shape[:] = packed.shape
    tensor.dtype = dtype
    tensor.data = packed.tobytes()
    return tensor


_TENSOR_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_TABLED = 1 << 14  # offsets below this (texts of up to 16,384 code points) are looked up, not encoded


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint: 7 bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=1)
def _span_tables() -> tuple[list[bytes], list[bytes]]:
    """Span.start (field 1) and Span.end (field 2), tag and varint, for every value below ``_TABLED``."""
    return [b"\x08" + _varint(v) for v in range(_TABLED)], [b"\x10" + _varint(v) for v in range(_TABLED)]


@functools.lru_cache(maxsize=4)
def _span_heads(field: int) -> list[bytes]:
    """A Span field's tag (length-delimited) and length byte, by the Span's length (always < 128 bytes)."""
    return [bytes([(field << 3) | 2, n]) for n in range(128)]


def span_fields(offsets: list[list[tuple[int, int]]], field: int) -> list[bytes]:
    """Per sentence, its ``[start, end)`` offsets as the wire bytes of ``repeated Span <field>``: what
    ``message.MergeFromString`` turns into the field. Built from tabled pieces (~0.12 us a token), where building
    the Span messages one by one cost ~0.7 us a token, most of a small request's answer."""
    starts, ends = _span_tables()
    heads = _span_heads(field)
    out = []
    for spans in offsets:
        parts = []
        for start, end in spans:
            if 0 <= start < _TABLED and 0 <= end < _TABLED:
                body = starts[start] + ends[end]
            elif 0 <= start < 2**31 and 0 <= end < 2**31:
                body = b"\x08" + _varint(start) + b"\x10" + _varint(end)
            else:
                raise InputError(f"span ({start}, {end}) is outside [0, 2**31)")
            parts.append(heads[len(body)] + body)
        out.append(b"".join(parts))
    return out


def field_head(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length: what precedes its ``length`` bytes on the wire."""
    return _varint((number << 3) | 2) + _varint(length)


@functools.lru_cache(maxsize=4096)
def _tensor_head(shape: tuple[int, ...], dtype: int) -> bytes:
    """A Tensor's shape and dtype fields, serialized (one per sentence length: cached)."""
    return pb.Tensor(shape=shape, dtype=dtype).SerializeToString()


SMALL_COPY_BYTES = 1 << 16  # strided arrays up to this size are copied in one C call, not cut into blocks


def contiguous_blocks(array: np.ndarray) -> list[bytes | memoryview]:
    """``array``'s bytes in row-major order as C-contiguous pieces: the array itself when it is contiguous; a
    strided view of a large one as its contiguous sub-arrays along the first axis, recursively, not copied (a
    sentence's layers cut from its batch's padded output are one block a layer); a small one (at most
    :data:`SMALL_COPY_BYTES`, or one with gaps in its last axis) copied by ``memoryview.tobytes``: one C call,
    cheaper than cutting it up in Python (0.7 against 2.2 us for a tiny model's sentence), and unlike numpy's copies
    it never gives the GIL away (on the event loop, taking it back can wait for the switch interval)."""
    if not array.size:
        return []  # (a memoryview of a shape with a 0 in it cannot be cast to bytes)
    if array.flags.c_contiguous:
        return [memoryview(array).cast("B")]
    if array.ndim == 1 or array.nbytes <= SMALL_COPY_BYTES:
        return [memoryview(array).tobytes()]
    return [block for sub in array for block in contiguous_blocks(sub)]


def tensor_field(number: int, array: np.ndarray, dtype: int) -> list[bytes | memoryview]:
    """Field ``number`` holding ``array`` as a ``Tensor`` message, as wire pieces: the array's bytes are not copied
    here (memoryviews of its contiguous blocks: ``b"".join`` copies them once, into the answer). ``array`` must be in
    the wire dtype (``NUMPY_DTYPES[dtype]``); it may be a strided view (:func:`contiguous_blocks`)."""
    if array.dtype != NUMPY_DTYPES[dtype]:
        raise InputError(f"tensor_field needs a {NUMPY_DTYPES[dtype]} array, got {array.dtype}")
    head = _tensor_head(array.shape, dtype)
    body = [head, field_head(_TENSOR_DATA_FIELD, array.nbytes), *contiguous_blocks(array)]
    return [field_head(number, len(head) + len(body[1]) + array.nbytes), *body]


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """Unpack a Tensor into a writable native-order numpy array of its shape (float32 or float16)."""
    if tensor.dtype not in NUMPY_DTYPES:
        raise InputError(f"tensor dtype {tensor.dtype} is not one of {sorted(NUMPY_DTYPES)}")
    wire_dtype = NUMPY_DTYPES[tensor.dtype]
    shape = tuple(int(d) for d in tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * wire_dtype.itemsize
    if len(tensor.data) != expected:
        raise InputError(
            f"tensor of shape {shape} and dtype {wire_dtype} needs {expected} bytes, got {len(tensor.data)}"
        )
    return np.frombuffer(tensor.data, dtype=wire_dtype).reshape(shape).astype(wire_dtype.newbyteorder("="))


__all__ = [
    "DTYPE_NAMES",
    "SMALL_COPY_BYTES",
    "contiguous_blocks",
    "NUMPY_DTYPES",
    "OVERFLOW_VALUES",
    "field_head",
    "from_tensor",
    "itemsize",
    "span_fields",
    "tensor_field",
    "to_tensor",
]
