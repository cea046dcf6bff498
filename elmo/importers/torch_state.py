"""A torch state dict file (``torch.save``) read without unpickling anything: its declarations first, its bytes after.

Two layouts: the zip archive torch has written since 1.6 (``data.pkl`` + one stored record per storage), and the
legacy stream older torch wrote, which ELMoForManyLangs' published ``.pkl`` files use (five pickles in a row: magic
number, protocol, system info, the object, the storage keys; then each storage as an int64 element count and its raw
bytes). Either way the pickle is walked opcode by opcode (``pickletools.genops`` parses, it never executes) on a
small symbolic machine that knows what ``torch.save`` writes for a state dict: an OrderedDict of
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)``. No class is looked up, no function called,
no object built but plain containers: anything else in the file stays an opaque value, which the importer refuses.

``read_declarations`` returns each tensor's name, dtype, shape and where its bytes lie, and refuses a storage that
the file cannot hold (a record shorter or longer than declared, compressed, a count past the end of the file), so
the caller checks shapes and dtypes against its config and the total against its byte budget before ``read`` reads
just those bytes, with numpy. Torch-free.
"""

from __future__ import annotations

import io
import math
import pickletools
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elmo.errors import ModelFileError

MAX_PICKLE_BYTES = 16 << 20  # a state dict's pickle is names and shapes: KBs for ELMo; more is not a state dict
MAX_NAME = 256  # characters of a tensor name or storage key (torch's are short): longer ones are refused, not echoed
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
LEGACY_PROTOCOL = 1001
# storage class -> (numpy dtype name, bytes per element); numpy has no bfloat16: declared, never read
STORAGE_DTYPES = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}


@dataclass(frozen=True)
class Storage:
    key: str
    dtype: str
    itemsize: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class TensorDecl:
    """A tensor as the file declares it: a strided view of ``storage``."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def end(self) -> int:
        """One past the last storage element the view touches (its offset when it is empty)."""
        if math.prod(self.shape) == 0:
            return self.offset
        return self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride)) + 1


@dataclass
class StateFile:
    """The declarations of one state dict file, and how to read a storage's bytes."""

    path: Path
    tensors: dict[str, TensorDecl]
    zip_records: dict[str, str] = field(default_factory=dict)  # zip layout: storage key -> record name
    legacy_offsets: dict[str, int] = field(default_factory=dict)  # legacy layout: storage key -> first data byte

    def storages(self, names) -> dict[str, Storage]:
        return {self.tensors[n].storage.key: self.tensors[n].storage for n in names}

    def read(self, names) -> dict[str, np.ndarray]:
        """The tensors ``names`` (float32 only), each a copy of its view of its storage's bytes."""
        arrays = {}
        try:
            storages = {key: self._read_storage(storage) for key, storage in self.storages(names).items()}
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:  # a CRC or header the archive fails
            raise ModelFileError(f"{self.path}: a storage could not be read ({str(exc)[:200]})") from None
        for name in names:
            decl = self.tensors[name]
            flat = storages[decl.storage.key]
            view = np.lib.stride_tricks.as_strided(
                flat[decl.offset :], shape=decl.shape, strides=[s * decl.storage.itemsize for s in decl.stride]
            )
            arrays[name] = np.array(view, dtype=np.float32)
        return arrays

    def _read_storage(self, storage: Storage) -> np.ndarray:
        if storage.dtype != "float32":
            raise ModelFileError(f"{self.path}: storage {storage.key!r} holds {storage.dtype}, not float32")
        if self.zip_records:
            with zipfile.ZipFile(self.path) as archive:
                data = archive.read(self.zip_records[storage.key])
        else:
            with open(self.path, "rb") as handle:
                handle.seek(self.legacy_offsets[storage.key])
                data = handle.read(storage.nbytes)
        if len(data) != storage.nbytes:
            raise ModelFileError(
                f"{self.path}: storage {storage.key!r} is cut short ({len(data):,} of {storage.nbytes:,} bytes)"
            )
        return np.frombuffer(data, dtype="<f4")


def read_declarations(path: str | Path) -> StateFile:
    """``path``'s tensors as declared (nothing but the pickle and the layout read); ModelFileError naming the file
    for anything that is not a state dict of tensors whose bytes the file holds."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: file not found")
    try:
        if zipfile.is_zipfile(path):
            return _read_zip(path)
        return _read_legacy(path)
    except (
        ValueError,
        TypeError,
        KeyError,
        IndexError,
        EOFError,
        RecursionError,
        struct.error,
        zipfile.BadZipFile,
        OSError,
    ) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelFileError(f"{path}: not a torch state dict of tensors ({why})") from None


# -- the two layouts -----------------------------------------------------------------------------------------------
def _read_zip(path: Path) -> StateFile:
    with zipfile.ZipFile(path) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError("no single <name>/data.pkl record in the archive")
        prefix = pickles[0][: -len("data.pkl")]
        if infos[pickles[0]].file_size > MAX_PICKLE_BYTES:
            raise ValueError(f"its pickle declares {infos[pickles[0]].file_size:,} bytes")
        tensors = _state_dict(_walk(io.BytesIO(archive.read(pickles[0]))), path)
        records = {}
        for storage in _distinct_storages(tensors, path).values():
            name = f"{prefix}data/{storage.key}"
            info = infos.get(name)
            if info is None:
                raise ModelFileError(f"{path}: storage {storage.key!r} has no record {name}")
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != storage.nbytes:
                raise ModelFileError(
                    f"{path}: record {name} holds {info.file_size:,} bytes (compression "
                    f"{info.compress_type}), its storage declares {storage.numel:,} {storage.dtype} "
                    f"= {storage.nbytes:,} stored bytes"
                )
            records[storage.key] = name
    return StateFile(path, tensors, zip_records=records)


def _read_legacy(path: Path) -> StateFile:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        stream = io.BytesIO(handle.read(min(size, MAX_PICKLE_BYTES)))
    if _walk(stream) != LEGACY_MAGIC or _walk(stream) != LEGACY_PROTOCOL:
        raise ValueError("neither a torch zip archive nor torch's legacy format (magic number, protocol)")
    info = _walk(stream)
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise ValueError("its system info does not say little-endian")
    tensors = _state_dict(_walk(stream), path)
    keys = _walk(stream)
    storages = _distinct_storages(tensors, path)
    if not isinstance(keys, list) or sorted(map(str, keys)) != sorted(storages):
        raise ModelFileError(f"{path}: its storage list ({_kind(keys)}) is not the storages its tensors use")
    offsets, position = {}, stream.tell()
    with open(path, "rb") as handle:
        for key in keys:
            storage = storages[key]
            handle.seek(position)
            count = handle.read(8)
            if len(count) != 8 or struct.unpack("<q", count)[0] != storage.numel:
                raise ModelFileError(
                    f"{path}: storage {key!r} declares {storage.numel:,} elements in the pickle "
                    "and another count (or none) before its bytes"
                )
            offsets[key], position = position + 8, position + 8 + storage.nbytes
            if position > size:
                raise ModelFileError(
                    f"{path}: storage {key!r} declares {storage.numel:,} {storage.dtype} = "
                    f"{storage.nbytes:,} bytes, past the end of the file ({size:,})"
                )
    return StateFile(path, tensors, legacy_offsets=offsets)


def _state_dict(value: object, path: Path) -> dict[str, TensorDecl]:
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: holds a {_kind(value)}, not a state dict of tensors")
    bad = [str(k)[:MAX_NAME] for k, v in value.items() if not isinstance(k, str) or not isinstance(v, TensorDecl)]
    if bad:
        raise ModelFileError(f"{path}: entries that are not tensors: {bad[:4]}")
    long = [name for name in value if len(name) > MAX_NAME]
    if long:
        raise ModelFileError(f"{path}: a tensor name of {len(long[0]):,} characters ({long[0][:MAX_NAME]}...)")
    for name, decl in value.items():
        if decl.end() > decl.storage.numel:
            raise ModelFileError(
                f"{path}: tensor '{name}' {decl.shape} reaches element {decl.end():,} of a storage "
                f"of {decl.storage.numel:,}"
            )
    return dict(value)


def _distinct_storages(tensors: dict[str, TensorDecl], path: Path) -> dict[str, Storage]:
    storages: dict[str, Storage] = {}
    for decl in tensors.values():
        seen = storages.setdefault(decl.storage.key, decl.storage)
        if seen != decl.storage:
            raise ModelFileError(f"{path}: storage {decl.storage.key!r} is declared twice, differently")
    return storages


# -- the pickle, walked --------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Global:
    module: str
    name: str


@dataclass(frozen=True, eq=False)
class _Opaque:
    """A call or object the walk does not build (whatever the pickle asked for)."""

    what: object


ORDERED_DICT = ("collections", "OrderedDict")
REBUILD_TENSOR = {("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor")}
REBUILD_PARAMETER = ("torch._utils", "_rebuild_parameter")
PUSH_ARGUMENT = {
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "LONG4",
    "BINFLOAT",
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "BINSTRING",
    "SHORT_BINSTRING",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
}
CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}


def _walk(stream: io.BytesIO) -> object:
    """One pickle from ``stream`` -> its value, built from plain containers only (see the module docstring)."""
    stack: list = []
    marks: list[int] = []
    memo: dict[int, object] = {}

    def since_mark() -> list:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    for opcode, arg, _ in pickletools.genops(stream):
        op = opcode.name
        if op in ("PROTO", "FRAME"):
            continue
        if op == "STOP":
            if len(stack) != 1 or marks:
                raise ValueError("a malformed pickle")
            return stack[0]
        if op in PUSH_ARGUMENT:
            stack.append(arg)
        elif op in CONSTANTS:
            stack.append(CONSTANTS[op])
        elif op == "MARK":
            marks.append(len(stack))
        elif op in ("EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
            count = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(op)
            items = since_mark() if count is None else [stack.pop() for _ in range(count)][::-1]
            stack.append(tuple(items))
        elif op in ("EMPTY_LIST", "LIST"):
            stack.append([] if op == "EMPTY_LIST" else since_mark())
        elif op in ("EMPTY_DICT", "DICT"):
            stack.append({} if op == "EMPTY_DICT" else _pairs({}, since_mark()))
        elif op in ("APPEND", "APPENDS"):
            items = [stack.pop()] if op == "APPEND" else since_mark()
            _container(stack[-1], list).extend(items)
        elif op in ("SETITEM", "SETITEMS"):
            items = [stack.pop(-2), stack.pop()] if op == "SETITEM" else since_mark()
            _pairs(_container(stack[-1], dict), items)
        elif op in ("GLOBAL", "STACK_GLOBAL"):
            module, name = arg.split(" ", 1) if op == "GLOBAL" else (stack.pop(-2), stack.pop())
            stack.append(_Global(str(module), str(name)))
        elif op in ("REDUCE", "NEWOBJ"):
            args = stack.pop()
            stack.append(_reduce(stack.pop(), args))
        elif op == "BUILD":
            stack.pop()  # an object's state (a state dict's _metadata): kept out of the value
        elif op == "BINPERSID":
            stack.append(_storage(stack.pop()))
        elif op in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            memo[len(memo) if op == "MEMOIZE" else int(arg)] = stack[-1]
        elif op in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[int(arg)])
        elif op == "POP":
            stack.pop()
        elif op == "DUP":
            stack.append(stack[-1])
        elif op == "POP_MARK":
            since_mark()
        else:
            raise ValueError(f"pickle opcode {op}, which torch.save does not write for a state dict")
    raise ValueError("the pickle has no end")


def _container(value: object, kind: type):
    if not isinstance(value, kind):
        raise ValueError(f"the pickle adds items to a {_kind(value)}")
    return value


def _pairs(target: dict, items: list) -> dict:
    if len(items) % 2:
        raise ValueError("an odd number of dict items")
    for key, value in zip(items[::2], items[1::2]):
        if not isinstance(key, (str, int, float, bool, type(None), bytes)):
            raise ValueError(f"a dict key that is a {_kind(key)}")
        target[key] = value
    return target


def _reduce(func: object, args: object) -> object:
    called = (func.module, func.name) if isinstance(func, _Global) else None
    if called == ORDERED_DICT and args == ():
        return {}
    if called in REBUILD_TENSOR and isinstance(args, tuple) and len(args) >= 4:
        storage, offset, shape, stride = args[:4]
        if isinstance(storage, Storage) and _index(offset) and _indices(shape) and _indices(stride):
            if len(shape) == len(stride):
                return TensorDecl(storage, offset, tuple(shape), tuple(stride))
    if called == REBUILD_PARAMETER and isinstance(args, tuple) and args and isinstance(args[0], TensorDecl):
        return args[0]
    return _Opaque((func, args))


def _storage(pid: object) -> Storage:
    """A persistent id ('storage', torch.<Type>Storage, key, location, numel[, view]) -> the storage it names."""
    ok = isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage" and isinstance(pid[1], _Global)
    if not ok or pid[1].module != "torch" or pid[1].name not in STORAGE_DTYPES or not _index(pid[4]):
        raise ValueError(f"a persistent id ({_kind(pid)}) that is not a torch storage")
    if len(pid) == 6 and pid[5] is not None:
        raise ValueError("a storage view (legacy view_metadata): not a plain state dict")
    if not isinstance(pid[2], str) or len(pid[2]) > MAX_NAME:
        raise ValueError("a storage key that is not a short string")
    dtype, itemsize = STORAGE_DTYPES[pid[1].name]
    return Storage(pid[2], dtype, itemsize, pid[4])


def _index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _indices(value: object) -> bool:
    return isinstance(value, tuple) and all(_index(v) for v in value)


def _kind(value: object) -> str:
    if isinstance(value, _Opaque):
        func = value.what[0]
        return f"{func.module}.{func.name} object" if isinstance(func, _Global) else "object"
    return type(value).__name__
