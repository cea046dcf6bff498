"""numpy <-> ``elmo.v1.Tensor`` (packed little-endian bytes, row-major), shared by the server and the clients.

Torch-free and grpc-free: only numpy and the generated protobuf messages.
"""

from __future__ import annotations

import functools
import math

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
_INT32_END = 2**31


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint: 7 bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def span_fields(offsets: list[list[tuple[int, int]]], field: int) -> list[bytes]:
    """Per sentence, its ``[start, end)`` offsets as the wire bytes of ``repeated Span <field>``: what
    ``message.MergeFromString`` turns into the field (each Span's start and end written, zeros too, which parsing
    accepts). A Span whose start and end are below 16,384 (texts of up to 16,384 code points) is its bytes' integers
    worked out in place, one ``bytes()`` a sentence: ~0.2 us a token where the caches are cold, as on a server's event
    loop between runtime calls. Building the Span messages one by one cost ~0.7 us a token; looking the varints up in
    tables of every value (two 16,384-entry lists) ~0.3, most of it their entries' cache misses."""
    tag = (field << 3) | 2
    if tag >= 0x80:  # a field number past 15: not this contract's, so no fast path
        return [
            b"".join(field_head(field, len(body)) + body for body in (_span_body(*span) for span in spans))
            for spans in offsets
        ]
    out = []
    for spans in offsets:
        ints: list[int] = []
        extend = ints.extend
        for start, end in spans:
            if 0 <= start < 0x80:
                if 0 <= end < 0x80:
                    extend((tag, 4, 0x08, start, 0x10, end))
                    continue
                if 0x80 <= end < 0x4000:
                    extend((tag, 5, 0x08, start, 0x10, (end & 0x7F) | 0x80, end >> 7))
                    continue
            elif 0x80 <= start < 0x4000 and 0x80 <= end < 0x4000:
                extend((tag, 6, 0x08, (start & 0x7F) | 0x80, start >> 7, 0x10, (end & 0x7F) | 0x80, end >> 7))
                continue
            body = _span_body(start, end)
            extend((tag, len(body)))
            extend(body)
        out.append(bytes(ints))
    return out


def _span_body(start: int, end: int) -> bytes:
    """A Span's fields, any int32 start and end (InputError outside ``[0, 2**31)``)."""
    if not (0 <= start < _INT32_END and 0 <= end < _INT32_END):
        raise InputError(f"span ({start}, {end}) is outside [0, 2**31)")
    return b"\x08" + _varint(start) + b"\x10" + _varint(end)


def field_head(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length: what precedes its ``length`` bytes on the wire."""
    tag = (number << 3) | 2
    if tag < 0x80 and length < 0x4000:  # a field of this contract, up to 16 KiB: no loop
        return bytes((tag, length)) if length < 0x80 else bytes((tag, (length & 0x7F) | 0x80, length >> 7))
    return _varint(tag) + _varint(length)


@functools.lru_cache(maxsize=4096)
def _tensor_prefix(number: int, shape: tuple[int, ...], dtype: int) -> bytes:
    """Everything of field ``number`` holding a ``Tensor`` of ``shape`` and ``dtype`` that precedes its data's bytes:
    the field's tag and length, the Tensor's shape and dtype, its data field's tag and length (one per sentence
    length and field: cached)."""
    head = pb.Tensor(shape=shape, dtype=dtype).SerializeToString()
    n_bytes = math.prod(shape) * itemsize(dtype)
    data_head = field_head(_TENSOR_DATA_FIELD, n_bytes)
    return field_head(number, len(head) + len(data_head) + n_bytes) + head + data_head


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
    return [_tensor_prefix(number, array.shape, dtype), *contiguous_blocks(array)]


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
