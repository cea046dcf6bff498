"""numpy <-> ``elmo.v1.Tensor`` (packed little-endian bytes, row-major), shared by the server and the clients.

Torch-free and grpc-free: only numpy and the generated protobuf messages.
"""

from __future__ import annotations

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


__all__ = ["DTYPE_NAMES", "NUMPY_DTYPES", "OVERFLOW_VALUES", "from_tensor", "itemsize", "to_tensor"]
