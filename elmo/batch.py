"""The batch embedding job: ``elmo embed-file INPUT OUTPUT --model DIR`` (files in, vectors out, at any scale).

The input is cut into *shards* of ``--shard-lines`` consecutive lines. A shard is the unit of work, of sorting
and of commitment::

    scan INPUT once: decode and validate every line, count lines, hash the bytes, note each shard's byte range
    for every shard not committed yet (in order; or spread over Ray actors with --engine ray):
        read its lines -> tokens -> sort by length -> windows -> runtime (batches under --batch-tokens) -> layers
        -> all / top / average / mix:TASK -> dtype -> shard file (written as *.tmp, fsynced, renamed)
        -> one JSON line appended to the committed-shards manifest        <- the commit point
    (reading + embedding run in a background thread, a couple of windows ahead of the writing)
    finish: hdf5    -> assemble the shards into one file in AllenNLP's layout, rename it into place
            parquet -> write the final manifest, rename the shard directory into place

Everything lives in ``OUTPUT.partial/`` until that last rename, so OUTPUT never exists half-written. A job killed
at any point (SIGKILL included) and started again with the same arguments keeps the committed shards, deletes
everything else in ``OUTPUT.partial/`` and carries on; the finished output holds every input line exactly once.
Memory is bounded by a few windows (hdf5) or one shard (Parquet), whatever the input's size.

The embedding itself (:func:`embed_events`, :func:`write_shards`) is the same code for the local engine, the Ray engine
(:mod:`elmo.batch_ray`) and remote mode (``--server``, through :mod:`elmo.client`). Imports no torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Full, Queue
from typing import TYPE_CHECKING, Protocol

import numpy as np

from elmo.errors import ElmoError, InputError, ModelFileError
from elmo.tokenize import tokenize, whitespace_tokens

if TYPE_CHECKING:  # elmo.client (grpc) is imported only in remote mode
    from elmo.client import Connection

log = logging.getLogger("elmo.batch")

JOB_VERSION = 1
HDF5, PARQUET = "hdf5", "parquet"
TEXT, JSONL = "text", "jsonl"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
DTYPES = {"float32": np.float32, "float16": np.float16}
DEFAULT_SHARD_LINES = 1000
# A batch job embeds documents as they come: the serving limit (elmo.runtime's 1024) would fail a long line, and a
# line longer than a batch simply runs as a batch of its own.
LOCAL_MAX_TOKENS_PER_SENTENCE = 100_000
# One runtime call gets a length-sorted *window* of a shard: as many tokens as make WINDOW_BYTES of float32
# vectors (at least one batch). The runtime plans its batches over the whole window (the more it sees, the less
# padding), and memory holds at most PREFETCH + 2 windows, whatever the input's size.
WINDOW_BYTES = 128 << 20
PREFETCH = 2  # windows embedded ahead of the writer, in a background thread
REMOTE_IN_FLIGHT = 4  # requests in flight to a server: its batcher fills while we write
REMOTE_ATTEMPTS = 10  # per request, for UNAVAILABLE / RESOURCE_EXHAUSTED (backoff 0.1 s doubling to 10 s: ~50 s)

PARTIAL_SUFFIX = ".partial"
JOB_FILE = "_job.json"
COMMIT_LOG = "_manifest.jsonl"  # committed shards, one JSON line each, appended and fsynced
MANIFEST_FILE = "_manifest.json"  # the finished Parquet output's manifest (complete: true)
ASSEMBLY_FILE = "_assembled.h5.tmp"
SENTENCE_INDEX = "sentence_to_index"  # AllenNLP's dataset name
JOB_ATTR = "elmo_batch_job"  # root attribute of the finished hdf5 (invisible to keys(): AllenNLP code unaffected)
SHARD_SENTENCES = "_sentences"  # inside an hdf5 shard only: the sentence_to_index keys of its lines, in order
SHARD_IDS = "_ids"


# -- what to write -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    """``--layers``: ``all`` -> (n_layers, n, dim); ``top`` (last layer), ``average`` (mean of the layers) and
    ``mix:TASK`` (the task's scalar mix, elmo.mix) -> (n, dim)."""

    kind: str
    task: str | None = None

    @property
    def text(self) -> str:
        return f"mix:{self.task}" if self.kind == "mix" else self.kind


def parse_layers(value: str) -> LayerSpec:
    """``all | top | average | mix:TASK`` -> LayerSpec; anything else is an InputError naming the value."""
    value = (value or "").strip()
    if value in ("all", "top", "average"):
        return LayerSpec(value)
    if value.startswith("mix:") and value[4:].strip():
        return LayerSpec("mix", value[4:].strip())
    raise InputError(f"--layers: expected all, top, average or mix:TASK, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """Shape and element type of one sentence's output array."""

    spec: LayerSpec
    n_layers: int
    dim: int
    dtype: str  # "float32" | "float16"

    def shape(self, n_tokens: int) -> tuple[int, ...]:
        if self.spec.kind == "all":
            return (self.n_layers, n_tokens, self.dim)
        return (n_tokens, self.dim)

    def empty(self) -> np.ndarray:
        """What a blank line becomes: ``(n_layers, 0, dim)`` or ``(0, dim)``."""
        return np.zeros(self.shape(0), dtype=DTYPES[self.dtype])


TaskMix = Callable[[np.ndarray], np.ndarray]  # one sentence's layers (L, n, dim) -> (n, dim)


def load_task_mix(model_dir: Path, task: str, n_layers: int, dim: int) -> TaskMix:
    """The one hook to elmo.mix: the stored task's numpy mix, per sentence (its layer norm is per sentence).

    An unknown task raises elmo.mix.UnknownTaskError ("unknown task 'x' for model DIR; available tasks: ...").
    """
    from elmo.mix import TaskStore, apply_task

    stored = TaskStore(model_dir, n_layers=n_layers, dim=dim).get(task)
    return lambda layers: apply_task(layers, stored)


def reduce_layers(layers: np.ndarray, spec: LayerSpec, mix: TaskMix | None = None) -> np.ndarray:
    """One sentence's float32 layers (L, n, dim) -> what ``spec`` asks for (float32)."""
    if spec.kind == "all":
        return layers
    if spec.kind == "top":
        return layers[-1]
    if spec.kind == "average":
        return layers.mean(axis=0, dtype=np.float32)
    if mix is None:
        raise InputError(f"--layers {spec.text}: no task mix loaded")
    return mix(layers)


# -- input ---------------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One input line. ``sentence`` is the ``sentence_to_index`` key (the stripped line, or the JSONL text)."""

    index: int  # 0-based line index in INPUT: the hdf5 key
    id: str  # JSONL id, or the line index as a string
    sentence: str
    tokens: list[str]


@dataclass(frozen=True)
class ShardSpec:
    """Lines ``[first_line, first_line + n_lines)`` of INPUT, bytes ``[byte_start, byte_end)``."""

    number: int
    first_line: int
    n_lines: int
    byte_start: int
    byte_end: int

    @property
    def stem(self) -> str:
        return f"part-{self.number:06d}"


@dataclass(frozen=True)
class InputPlan:
    path: Path
    input_format: str  # text | jsonl
    n_lines: int
    sha256: str
    shards: list[ShardSpec]


def detect_input_format(path: Path, requested: str) -> str:
    if requested in (TEXT, JSONL):
        return requested
    return JSONL if path.suffix.lower() in JSONL_SUFFIXES else TEXT


def _line_text(raw: bytes, line_index: int, path: Path) -> str:
    """Bytes of one line (terminator included) -> str without its terminator; bad UTF-8 names the line."""
    if line_index == 0 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark is not part of the first sentence
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path}: line {line_index + 1} is not valid UTF-8 (byte {exc.start + 1} of the line is "
            f"{raw[exc.start : exc.start + 1]!r})"
        ) from None
    if text.endswith("\n"):
        text = text[:-1]
    if text.endswith("\r"):
        text = text[:-1]
    return text


def _json_fields(text: str, line_index: int, path: Path) -> tuple[str, str | None, list[str] | None]:
    """A JSONL line -> (id, text, tokens). ``id`` is optional (default: the line index); exactly one of a string
    ``text`` or a list of string ``tokens``. A blank line is an empty sentence."""
    where = f"{path}: line {line_index + 1}"
    if not text.strip():
        return str(line_index), "", None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with 'id' and 'text', got {type(obj).__name__}")
    raw_id = obj.get("id", line_index)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise InputError(f"{where}: 'id' must be a string or an integer, got {raw_id!r}")
    has_text, has_tokens = "text" in obj, "tokens" in obj
    if has_text == has_tokens:
        raise InputError(f"{where}: expected exactly one of 'text' (a string) or 'tokens' (a list of strings)")
    if has_text:
        if not isinstance(obj["text"], str):
            raise InputError(f"{where}: 'text' must be a string, got {type(obj['text']).__name__}")
        return str(raw_id), obj["text"], None
    tokens = obj["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t and not t.isspace() for t in tokens):
        raise InputError(f"{where}: 'tokens' must be a list of non-empty strings")
    return str(raw_id), None, tokens


def make_record(raw: bytes, line_index: int, path: Path, input_format: str, tokenized: bool) -> Record:
    """One raw line -> Record. Raw text goes through elmo.tokenize.tokenize (the one tokenizer); with
    ``tokenized`` it is split on whitespace and embedded untouched."""
    text = _line_text(raw, line_index, path)
    tokens: list[str] | None = None
    if input_format == JSONL:
        record_id, text, tokens = _json_fields(text, line_index, path)
    else:
        record_id = str(line_index)
    if tokens is not None:
        return Record(line_index, record_id, " ".join(tokens), tokens)
    sentence = text.strip()
    words = whitespace_tokens(sentence) if tokenized else tokenize(sentence).tokens
    return Record(line_index, record_id, sentence, words)


def scan_input(path: Path, input_format: str, shard_lines: int) -> InputPlan:
    """Read INPUT once, validating every line (UTF-8; JSON for JSONL) so that a bad line fails the job before any
    work, and note where each shard starts. Memory: one entry per shard."""
    if not path.exists():
        raise InputError(f"{path}: input file not found")
    if not path.is_file():
        raise InputError(f"{path}: input is not a regular file")
    digest = hashlib.sha256()
    shards: list[ShardSpec] = []
    line_index = 0
    offset = shard_start = 0
    try:
        with open(path, "rb") as handle:
            for raw in handle:
                digest.update(raw)
                text = _line_text(raw, line_index, path)
                if input_format == JSONL:
                    _json_fields(text, line_index, path)
                line_index += 1
                offset += len(raw)
                if line_index % shard_lines == 0:
                    shards.append(ShardSpec(len(shards), line_index - shard_lines, shard_lines, shard_start, offset))
                    shard_start = offset
    except OSError as exc:
        raise InputError(f"{path}: cannot read input ({exc.strerror})") from None
    if line_index % shard_lines:
        first = len(shards) * shard_lines
        shards.append(ShardSpec(len(shards), first, line_index - first, shard_start, offset))
    return InputPlan(path, input_format, line_index, digest.hexdigest(), shards)


def read_shard(plan: InputPlan, shard: ShardSpec, tokenized: bool) -> list[Record]:
    """The shard's lines as Records (seek to its byte range; no re-scan of what came before)."""
    with open(plan.path, "rb") as handle:
        handle.seek(shard.byte_start)
        data = handle.read(shard.byte_end - shard.byte_start)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    if len(lines) != shard.n_lines:
        raise InputError(f"{plan.path}: changed while the job was running (lines {shard.first_line}+)")
    return [
        make_record(raw, shard.first_line + i, plan.path, plan.input_format, tokenized) for i, raw in enumerate(lines)
    ]


def plan_windows(lengths: Sequence[int], window_tokens: int) -> list[list[int]]:
    """Positions of the non-empty sentences sorted by length, cut into windows of about ``window_tokens`` real
    tokens (a window closes once it reaches the budget; a longer sentence is a window alone).

    A window is what one runtime call gets: the runtime cuts it into batches under ``--batch-tokens`` by its own
    padding rule, and since the window is sorted those batches waste almost no padding."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    windows: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for position in order:
        current.append(position)
        tokens += lengths[position]
        if tokens >= window_tokens:
            windows.append(current)
            current, tokens = [], 0
    if current:
        windows.append(current)
    return windows


# -- embedding backends --------------------------------------------------------------------------------------------
class Backend(Protocol):
    """Where vectors come from: the in-process runtime or a remote server. ``embed`` returns per sentence the
    output of ``layout.spec`` as float32 ((n_layers, n, dim) for ``all``, else (n, dim)), for one window of
    sentences of about ``window_tokens`` tokens."""

    n_layers: int
    dim: int
    max_tokens_per_sentence: int
    window_tokens: int

    def identity(self) -> dict: ...

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]: ...

    def close(self) -> None: ...


def _model_identity(model_dir: Path) -> dict:
    """What makes the vectors what they are: the graphs, their weights and metadata (a re-export changes them)."""
    digest = hashlib.sha256()
    graphs = sorted(p.name for p in model_dir.iterdir() if ".onnx" in p.name and p.is_file())
    for name in ["config.json", "onnx.json", *graphs]:
        path = model_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
    return {"model_sha256": digest.hexdigest()}


class LocalBackend:
    """The in-process onnxruntime runtime (elmo.runtime.Embedder), one session."""

    def __init__(
        self, model_dir: str | Path, spec: LayerSpec, batch_tokens: int | None, threads: int | None = None
    ) -> None:
        from elmo.runtime import Embedder

        self.model_dir = Path(model_dir)
        self.embedder = Embedder(
            self.model_dir,
            intra_op_threads=threads,
            max_batch_tokens=batch_tokens,
            max_tokens_per_sentence=LOCAL_MAX_TOKENS_PER_SENTENCE,
        )
        self.n_layers, self.dim = self.embedder.info.n_layers, self.embedder.info.dim
        self.max_tokens_per_sentence = self.embedder.info.max_tokens_per_sentence
        vector_bytes = self.n_layers * self.dim * 4
        self.window_tokens = max(self.embedder.max_batch_tokens, WINDOW_BYTES // vector_bytes)
        self.spec = spec
        self.mix = load_task_mix(self.model_dir, spec.task, self.n_layers, self.dim) if spec.kind == "mix" else None

    def identity(self) -> dict:
        identity = _model_identity(self.model_dir)
        if self.spec.kind == "mix":
            task_file = self.model_dir / "tasks" / str(self.spec.task) / "task.json"
            identity["task_sha256"] = hashlib.sha256(task_file.read_bytes()).hexdigest()
        return identity

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        return [reduce_layers(layers, self.spec, self.mix) for layers in self.embedder.embed_tokens(sentences)]

    def close(self) -> None:
        self.embedder = None  # frees the session (and its GPU memory) when the Ray actors take over


class RemoteBackend:
    """A running ``elmo serve`` through :class:`elmo.client.EmbedderClient` (the one client). Token lists go over
    the wire untouched; requests are cut to the server's advertised limits. ``top`` asks for the last layer only,
    ``mix:TASK`` for the server's task mix only; ``average`` is computed here from all layers, as locally."""

    def __init__(
        self,
        target: str,
        spec: LayerSpec,
        model: str = "",
        wait_s: float = 30.0,
        connection: Connection | None = None,
    ) -> None:
        from elmo.client import Connection

        self.client = (connection or Connection()).client(target)
        self.spec, self.model = spec, model
        try:
            self._wait_until_serving(target, wait_s)
            self.info = self._model_info(target)
            if spec.kind == "mix" and spec.task not in self.info.tasks:
                available = ", ".join(self.info.tasks) or "none"
                raise InputError(
                    f"unknown task '{spec.task}' on server {target} (model {self.info.name}); "
                    f"available tasks: {available}"
                )
        except BaseException:
            self.client.close()  # the job never starts: nothing else will close the channel
            raise
        self.n_layers, self.dim = int(self.info.n_layers), int(self.info.dim)
        limits = self.info.limits
        self.max_tokens_per_sentence = int(limits.max_tokens_per_sentence or self.info.max_tokens_per_sentence)
        self.max_inputs = int(limits.max_inputs) or 256
        self.max_request_tokens = int(limits.max_tokens_per_request) or 8192
        self.max_response_bytes = int(limits.max_response_bytes) or 64 << 20
        self.window_tokens = REMOTE_IN_FLIGHT * self.max_request_tokens
        self.pool = ThreadPoolExecutor(REMOTE_IN_FLIGHT, thread_name_prefix="embed-file-rpc")

    def _wait_until_serving(self, target: str, wait_s: float) -> None:
        """A server that is starting (or warming up) gets ``wait_s`` seconds to report SERVING on grpc.health."""
        from elmo.client import RemoteError

        deadline = time.monotonic() + wait_s
        while True:
            try:
                status = self.client.health()
                problem = f"health status {status}"
                if status == "SERVING":
                    return
            except RemoteError as exc:
                problem = str(exc)
            if time.monotonic() >= deadline:
                raise ElmoError(f"server {target} is not serving after {wait_s:g} s ({problem})")
            time.sleep(0.2)

    def _model_info(self, target: str):
        """The first RPC that needs the token (health checks do not): a refusal here says which flag fixes it."""
        import grpc

        from elmo.client import AUTH_TOKEN_ENV, RemoteError

        try:
            return self.client.model_info(self.model)
        except RemoteError as exc:
            if exc.code == grpc.StatusCode.UNAUTHENTICATED:
                raise ElmoError(
                    f"server {target} refused the job: {exc} (pass --auth-token TOKEN or set {AUTH_TOKEN_ENV})"
                ) from None
            raise

    def identity(self) -> dict:
        return {"server_model": self.info.name, "server_model_version": self.info.version}

    def _call(self, sentences: list[list[str]]) -> list:
        """One Embed request; overload and short outages (a restart, a drain) are retried with backoff, so that
        a long job rides them out; any other status fails the job with the server's message."""
        import grpc

        from elmo.client import RemoteError

        delay = 0.1
        for attempt in range(REMOTE_ATTEMPTS):
            try:
                return self.client.embed(sentences, **self._request_options())
            except RemoteError as exc:
                retryable = exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                if not retryable or attempt == REMOTE_ATTEMPTS - 1:
                    raise
                log.warning("server: %s; retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        raise AssertionError("unreachable")

    def _request_options(self) -> dict:
        if self.spec.kind == "mix":
            return {"task": self.spec.task, "omit_layers": True, "model": self.model}
        if self.spec.kind == "top":
            return {"layers": [self.n_layers - 1], "model": self.model}
        return {"model": self.model}

    def _response_bytes(self, tokens: list[str]) -> int:
        """A generous estimate of one sentence's share of a response (vectors, token strings, framing)."""
        layers = self.n_layers if self.spec.kind in ("all", "average") else 1
        return len(tokens) * (layers * self.dim * 4 + 16) + sum(len(t) for t in tokens) * 4 + 128

    def requests(self, sentences: list[list[str]]) -> list[list[int]]:
        """Positions cut into requests within max_inputs, max_tokens_per_request and ~80 % of max_response_bytes."""
        requests: list[list[int]] = []
        current: list[int] = []
        tokens = size = 0
        for position, sentence in enumerate(sentences):
            need = self._response_bytes(sentence)
            full = len(current) >= self.max_inputs or tokens + len(sentence) > self.max_request_tokens
            if current and (full or size + need > 0.8 * self.max_response_bytes - 1024):
                requests.append(current)
                current, tokens, size = [], 0, 0
            current.append(position)
            tokens, size = tokens + len(sentence), size + need
        if current:
            requests.append(current)
        return requests

    def embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        """The window cut into requests, REMOTE_IN_FLIGHT of them on the wire at once."""
        out: list[np.ndarray] = [np.empty(0)] * len(sentences)
        requests = self.requests(sentences)
        answers = self.pool.map(self._call, [[sentences[p] for p in positions] for positions in requests])
        for positions, results in zip(requests, answers):
            for position, result in zip(positions, results):
                if self.spec.kind == "mix":
                    out[position] = result.mix
                elif self.spec.kind == "top":
                    out[position] = result.layers[0]
                else:
                    out[position] = reduce_layers(result.layers, self.spec)
        return out

    def close(self) -> None:
        self.pool.shutdown()
        self.client.close()


def make_backend(options: JobOptions) -> Backend:
    if options.server:
        return RemoteBackend(
            options.server, options.spec, options.server_model, options.server_wait, options.connection
        )
    return LocalBackend(options.model, options.spec, options.batch_tokens, options.threads)


# -- shard writers -------------------------------------------------------------------------------------------------
@dataclass
class ShardStats:
    lines: int = 0
    blank: int = 0
    tokens: int = 0

    def add(self, other: ShardStats) -> None:
        self.lines += other.lines
        self.blank += other.blank
        self.tokens += other.tokens


class ShardWriter(Protocol):
    def add(self, records: list[Record], vectors: list[np.ndarray]) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse to fsync a directory; the rename is still atomic
        pass


def _write_dataset(group_id, name: str, array: np.ndarray):
    """One dataset through h5py's low-level calls: half the cost of create_dataset, which counts when the layout
    asks for one dataset per sentence."""
    import h5py

    array = np.ascontiguousarray(array)
    space = h5py.h5s.create_simple(array.shape)
    dataset = h5py.h5d.create(group_id, name.encode(), h5py.h5t.py_create(array.dtype), space)
    if array.size:
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)
    return dataset


class Hdf5ShardWriter:
    """One shard as a small hdf5 file holding its windows as they come: per window the vectors of its sentences
    concatenated along the token axis (``w<k>/vectors``), their line indices and token counts; plus every line's
    sentence and id. One write per window, not per sentence: the per-sentence datasets of AllenNLP's layout are
    made once, by :class:`Hdf5Assembly`. Memory: one window."""

    def __init__(self, path: Path, layout: Layout, shard: ShardSpec, with_ids: bool) -> None:
        import h5py

        self.file = h5py.File(path, "w")
        self.axis = 1 if layout.spec.kind == "all" else 0  # the token axis
        self.windows = 0
        self.sentences: list[str] = [""] * shard.n_lines
        self.ids: list[str] = [""] * shard.n_lines
        self.first_line = shard.first_line

    def add(self, records: list[Record], vectors: list[np.ndarray]) -> None:
        for record in records:
            self.sentences[record.index - self.first_line] = record.sentence
            self.ids[record.index - self.first_line] = record.id
        kept = [(r, v) for r, v in zip(records, vectors) if v.shape[self.axis]]  # blank lines: nothing to store
        if not kept:
            return
        group = self.file.create_group(f"w{self.windows}")
        self.windows += 1
        _write_dataset(group.id, "vectors", np.concatenate([v for _, v in kept], axis=self.axis))
        _write_dataset(group.id, "index", np.array([r.index for r, _ in kept], dtype=np.int64))
        _write_dataset(group.id, "lengths", np.array([v.shape[self.axis] for _, v in kept], dtype=np.int64))

    def abort(self) -> None:
        self.file.close()

    def close(self) -> None:
        import h5py

        strings = h5py.string_dtype("utf-8")
        self.file.attrs["windows"] = self.windows
        self.file.create_dataset(SHARD_SENTENCES, data=np.array(self.sentences, dtype=object), dtype=strings)
        self.file.create_dataset(SHARD_IDS, data=np.array(self.ids, dtype=object), dtype=strings)
        self.file.close()


def parquet_schema(layout: Layout):
    """index int64, id string, tokens list<string>, vectors: (n, dim) as list<fixed_size_list<dim>>, and
    (n_layers, n, dim) for ``all`` as list<list<fixed_size_list<dim>>>."""
    import pyarrow as pa

    element = pa.float16() if layout.dtype == "float16" else pa.float32()
    vectors = pa.list_(pa.list_(element, layout.dim))
    if layout.spec.kind == "all":
        vectors = pa.list_(vectors)
    meta = {"elmo": json.dumps({"layers": layout.spec.text, "n_layers": layout.n_layers, "dim": layout.dim})}
    fields = [
        pa.field("index", pa.int64()),
        pa.field("id", pa.string()),
        pa.field("tokens", pa.list_(pa.string())),
        pa.field("vectors", vectors),
    ]
    return pa.schema(fields, metadata=meta)


def _vectors_array(arrays: list[np.ndarray], layout: Layout):
    """Per-sentence arrays -> one Arrow column built from offsets (no Python lists of floats)."""
    import pyarrow as pa

    element = pa.float16() if layout.dtype == "float16" else pa.float32()
    flat = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0, DTYPES[layout.dtype])
    rows = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=element), layout.dim)
    if layout.spec.kind == "all":
        # one inner list per (sentence, layer): n tokens each; then one outer list per sentence: n_layers each
        per_layer = np.repeat([a.shape[1] for a in arrays], layout.n_layers)
        inner = pa.ListArray.from_arrays(_offsets(per_layer), rows)
        return pa.ListArray.from_arrays(_offsets(np.full(len(arrays), layout.n_layers)), inner)
    return pa.ListArray.from_arrays(_offsets([a.shape[0] for a in arrays]), rows)


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int32)


class ParquetShardWriter:
    """One shard as one Parquet file, rows in line order (memory: the shard's vectors)."""

    def __init__(self, path: Path, layout: Layout, shard: ShardSpec, with_ids: bool) -> None:
        self.path, self.layout = path, layout
        self.rows: list[tuple[Record, np.ndarray] | None] = [None] * shard.n_lines
        self.first_line = shard.first_line

    def add(self, records: list[Record], vectors: list[np.ndarray]) -> None:
        for record, array in zip(records, vectors):
            self.rows[record.index - self.first_line] = (record, array)

    def abort(self) -> None:
        self.rows = []

    def close(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        missing = [self.first_line + i for i, row in enumerate(self.rows) if row is None]
        if missing:
            raise ElmoError(f"internal: shard lost lines {missing[:5]}")
        records = [row[0] for row in self.rows]
        columns = [
            pa.array([r.index for r in records], pa.int64()),
            pa.array([r.id for r in records], pa.string()),
            pa.array([r.tokens for r in records], pa.list_(pa.string())),
            _vectors_array([row[1] for row in self.rows], self.layout),
        ]
        table = pa.Table.from_arrays(columns, schema=parquet_schema(self.layout))
        # lz4 costs next to nothing; zstd, dictionaries and min/max statistics on the float vectors cost up to a
        # tenth of the embedding time for almost no gain on floats (use --dtype float16 to halve the size)
        pq.write_table(table, self.path, compression="lz4", use_dictionary=False, write_statistics=["index"])


WRITERS = {HDF5: (Hdf5ShardWriter, ".h5"), PARQUET: (ParquetShardWriter, ".parquet")}


@dataclass
class ShardStart:
    shard: ShardSpec
    records: list[Record]


@dataclass
class Window:
    positions: list[int]  # into the current shard's records
    outputs: list[np.ndarray]  # float32, layout.spec's shape


@dataclass
class ShardEnd:
    shard: ShardSpec


def _checked_records(plan: InputPlan, shard: ShardSpec, tokenized: bool, limit: int) -> list[Record]:
    """The shard's records, every one within the backend's sentence limit (else an error naming the line)."""
    records = read_shard(plan, shard, tokenized)
    for record in records:
        if len(record.tokens) > limit:
            raise InputError(
                f"{plan.path}: line {record.index + 1} has {len(record.tokens)} tokens; the limit is "
                f"{limit} (split the line, or raise the server's limit)"
            )
    return records


def embed_events(
    plan: InputPlan, shards: Sequence[ShardSpec], options: JobOptions, backend: Backend
) -> Iterator[ShardStart | Window | ShardEnd]:
    """The embedding itself, the same for every engine: per shard its records (read and tokenized one shard
    ahead, in a thread of their own), then per window its vectors. Windows are length-sorted; blank lines get no
    model call (the writer fills them in)."""
    limit = backend.max_tokens_per_sentence
    read_ahead = prefetched(
        ((shard, _checked_records(plan, shard, options.tokenized, limit)) for shard in shards), depth=1
    )
    for shard, records in read_ahead:
        yield ShardStart(shard, records)
        for positions in plan_windows([len(r.tokens) for r in records], backend.window_tokens):
            yield Window(positions, backend.embed([records[p].tokens for p in positions]))
        yield ShardEnd(shard)


def prefetched(items: Iterator, depth: int = PREFETCH) -> Iterator:
    """``items`` produced by a background thread, up to ``depth`` ahead of the consumer. The runtime (and gRPC)
    release the GIL, so the next window computes while this thread writes the last one to disk; on a GPU that
    keeps the device busy. An exception in the producer is raised here; leaving early stops the producer."""
    queue: Queue = Queue(maxsize=depth)
    stop = threading.Event()
    finished = object()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(finished)
        except BaseException as exc:  # handed to the consumer, raised there
            put(_Failure(exc))

    thread = threading.Thread(target=produce, name="embed-file-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = queue.get()
            if item is finished:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue, then let it finish its window
            try:
                queue.get(timeout=0.1)
            except Empty:
                pass


@dataclass
class _Failure:
    error: BaseException


def write_shards(
    events: Iterator[ShardStart | Window | ShardEnd],
    options: JobOptions,
    layout: Layout,
    directory: Path,
    with_ids: bool,
    on_batch: Callable[[int, int], None] | None = None,
) -> Iterator[dict]:
    """Consume embed_events: each shard goes to ``directory/part-NNNNNN.(h5|parquet)``, written under a unique
    temporary name, fsynced, renamed; then its manifest entry is yielded (committing it is the caller's job).
    ``on_batch(sentences, tokens)`` reports progress."""
    writer_class, suffix = WRITERS[options.output_format]
    dtype = DTYPES[layout.dtype]
    writer = temporary = records = None
    stats = ShardStats()
    try:
        for event in events:
            if isinstance(event, ShardStart):
                records = event.records
                temporary = directory / f".{event.shard.stem}.{uuid.uuid4().hex[:8]}{suffix}.tmp"
                writer = writer_class(temporary, layout, event.shard, with_ids)
                blank = [record for record in records if not record.tokens]
                writer.add(blank, [layout.empty()] * len(blank))
                stats = ShardStats(lines=len(records), blank=len(blank))
                if on_batch and blank:
                    on_batch(len(blank), 0)
            elif isinstance(event, Window):
                window = [records[position] for position in event.positions]
                for record, vectors in zip(window, event.outputs):
                    if tuple(vectors.shape) != layout.shape(len(record.tokens)):
                        raise ElmoError(f"line {record.index + 1}: got vectors of shape {vectors.shape}")
                writer.add(window, [vectors.astype(dtype, copy=False) for vectors in event.outputs])
                tokens = sum(len(record.tokens) for record in window)
                stats.tokens += tokens
                if on_batch:
                    on_batch(len(event.positions), tokens)
            else:
                writer.close()
                writer = None
                final = directory / (event.shard.stem + suffix)
                _fsync_file(temporary)
                os.replace(temporary, final)
                _fsync_dir(directory)
                yield {
                    "shard": event.shard.number,
                    "file": final.name,
                    "first_line": event.shard.first_line,
                    "n_lines": event.shard.n_lines,
                    "blank": stats.blank,
                    "tokens": stats.tokens,
                    "bytes": final.stat().st_size,
                }
    finally:
        if writer is not None:
            writer.abort()
        if temporary is not None and temporary.exists():
            temporary.unlink()


def write_shard(
    plan: InputPlan,
    shard: ShardSpec,
    options: JobOptions,
    backend: Backend,
    layout: Layout,
    directory: Path,
    on_batch: Callable[[int, int], None] | None = None,
) -> dict:
    """Read, embed and write one shard (what a Ray actor does per row); returns its manifest entry."""
    events = prefetched(embed_events(plan, [shard], options, backend))
    (entry,) = write_shards(events, options, layout, directory, plan.input_format == JSONL, on_batch)
    return entry


# -- the job directory ---------------------------------------------------------------------------------------------
@dataclass
class JobOptions:
    input: Path
    output: Path
    model: Path | None
    server: str | None
    server_model: str
    spec: LayerSpec
    output_format: str
    dtype: str
    tokenized: bool
    input_format: str
    batch_tokens: int | None
    shard_lines: int
    engine: str = "local"
    workers: int | None = None
    threads: int | None = None
    overwrite: bool = False
    progress: bool = True
    ray_address: str | None = None
    server_wait: float = 30.0
    # --server's TLS and token (elmo.client.Connection); None: plaintext, token from env ELMO_AUTH_TOKEN. Not part
    # of the fingerprint: it changes how vectors travel, not what they are (and the token must not be written).
    connection: Connection | None = None


def job_fingerprint(options: JobOptions, plan: InputPlan, backend_identity: dict, layout: Layout) -> dict:
    """Everything that decides the output's content. A partial job resumes only under the same fingerprint;
    batch size, engine, workers and threads only change the speed, so they are left out."""
    return {
        "version": JOB_VERSION,
        "input": str(plan.path.resolve()),
        "input_sha256": plan.sha256,
        "input_lines": plan.n_lines,
        "input_format": plan.input_format,
        "tokenized": options.tokenized,
        "layers": options.spec.text,
        "dtype": options.dtype,
        "format": options.output_format,
        "shard_lines": options.shard_lines,
        "n_layers": layout.n_layers,
        "dim": layout.dim,
        "source": backend_identity,
    }


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3])


class JobDirectory:
    """``OUTPUT.partial/``: the job's fingerprint, the committed-shards log and the shard files.

    The log is the only truth: a shard file not listed there (killed before its commit) or a listed one that is
    missing or has another size is redone. A torn last line of the log (killed mid-append) is dropped.
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.with_name(output.name + PARTIAL_SUFFIX)
        self.committed: dict[int, dict] = {}
        self.on_commit: Callable[[dict], None] | None = None  # e.g. the hdf5 assembly copying the shard in
        self.timeline: list[tuple[float, int]] = []  # (time, tokens) of this run's commits

    def open(self, fingerprint: dict, overwrite: bool) -> None:
        job_file = self.path / JOB_FILE
        if self.path.exists() and overwrite:
            shutil.rmtree(self.path)
        if self.path.exists() and job_file.is_file():
            old = _read_json(job_file)
            if old != fingerprint:
                raise InputError(
                    f"{self.path} holds an unfinished job with other arguments or input "
                    f"({_differences(old, fingerprint)}); rerun with the same arguments to resume it, "
                    "or pass --overwrite to start over"
                )
            self._load_log()
        else:
            if self.path.exists():  # killed before the fingerprint was written: nothing worth keeping
                shutil.rmtree(self.path)
            self.path.mkdir(parents=True)
            _write_json_atomic(job_file, fingerprint)
        self._remove_uncommitted()

    def _load_log(self) -> None:
        log_path = self.path / COMMIT_LOG
        if not log_path.is_file():
            return
        entries = []
        for line in log_path.read_bytes().split(b"\n"):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # the torn tail of an append cut short
            shard_file = self.path / str(entry.get("file", ""))
            if shard_file.is_file() and shard_file.stat().st_size == entry.get("bytes"):
                entries.append(entry)
        self.committed = {entry["shard"]: entry for entry in entries}
        # rewrite the log without the torn line so that later appends start on a fresh line
        _write_text_atomic(log_path, "".join(json.dumps(e) + "\n" for e in self.committed.values()))

    def _remove_uncommitted(self) -> None:
        keep = {JOB_FILE, COMMIT_LOG} | {entry["file"] for entry in self.committed.values()}
        for child in self.path.iterdir():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()

    def commit(self, entry: dict) -> None:
        """Append one shard's entry to the log and fsync: from here on the shard survives any crash."""
        with open(self.path / COMMIT_LOG, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.committed[entry["shard"]] = entry
        self.timeline.append((time.perf_counter(), entry["tokens"]))
        if self.on_commit:
            self.on_commit(entry)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _write_json_atomic(path: Path, value: dict) -> None:
    _write_text_atomic(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


# -- finishing -----------------------------------------------------------------------------------------------------
def finished_job(output: Path, output_format: str) -> dict | None:
    """The fingerprint a finished OUTPUT was made with ({} when it exists but is not ours; None when absent)."""
    if not output.exists():
        return None
    if output_format == PARQUET:
        manifest = _read_json(output / MANIFEST_FILE) if output.is_dir() else {}
        return manifest.get("job", {}) if manifest.get("complete") else {}
    try:
        import h5py

        with h5py.File(output, "r") as handle:
            return json.loads(handle.attrs.get(JOB_ATTR, "{}"))
    except (OSError, ValueError):
        return {}


def _ordered_entries(job: JobDirectory, plan: InputPlan) -> list[dict]:
    """The committed shards in line order, checked to cover every input line exactly once."""
    entries = [job.committed[shard.number] for shard in plan.shards]
    expected = 0
    for entry in entries:
        if entry["first_line"] != expected:
            raise ElmoError(f"internal: committed shards leave a gap at line {expected}")
        expected += entry["n_lines"]
    if expected != plan.n_lines:
        raise ElmoError(f"internal: committed shards hold {expected} lines, the input has {plan.n_lines}")
    return entries


class Hdf5Assembly:
    """The final hdf5 in AllenNLP's layout, built while the job runs: as soon as a shard is committed its windows
    are cut into one dataset per line (so this overlaps the embedding of the next shards), and the file is
    fsynced; :meth:`finish` adds ``sentence_to_index`` and renames the file to OUTPUT. The file is only ever a copy
    of committed shards: a crash leaves it as a temporary in OUTPUT.partial/, deleted on resume and rebuilt.

    Memory: one window; at the end the sentence -> index map (the size of the input's text), as in AllenNLP."""

    def __init__(self, job: JobDirectory, fingerprint: dict, layout: Layout, with_ids: bool) -> None:
        import h5py

        self.job, self.layout, self.with_ids = job, layout, with_ids
        self.path = job.path / ASSEMBLY_FILE
        self.file = h5py.File(self.path, "w")
        self.file.attrs[JOB_ATTR] = json.dumps(fingerprint, sort_keys=True)
        self.copied: set[int] = set()

    def add(self, entry: dict) -> None:
        import h5py

        first, n_lines = entry["first_line"], entry["n_lines"]
        axis = 1 if self.layout.spec.kind == "all" else 0
        done = np.zeros(n_lines, dtype=bool)
        with h5py.File(self.job.path / entry["file"], "r") as shard:
            ids = shard[SHARD_IDS].asstr()[...] if self.with_ids else None
            for window in range(int(shard.attrs["windows"])):
                group = shard[f"w{window}"]
                vectors, index, lengths = group["vectors"][...], group["index"][...], group["lengths"][...]
                starts = np.concatenate([[0], np.cumsum(lengths)])
                for line, start, stop in zip(index.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
                    piece = vectors[:, start:stop] if axis else vectors[start:stop]
                    self._dataset(line, piece, None if ids is None else ids[line - first])
                    done[line - first] = True
            for offset in np.flatnonzero(~done).tolist():  # blank lines
                self._dataset(first + offset, self.layout.empty(), None if ids is None else ids[offset])
        self.file.flush()
        _fsync_file(self.path)  # a little at a time, so that the final fsync has little left to do
        self.copied.add(entry["shard"])

    def _dataset(self, line: int, array: np.ndarray, record_id: str | None) -> None:
        import h5py

        dataset = _write_dataset(self.file.id, str(line), array)
        if record_id is not None:  # JSONL input: the line's id rides along as an attribute
            h5py.Dataset(dataset).attrs["id"] = record_id

    def finish(self, plan: InputPlan) -> None:
        import h5py

        entries = _ordered_entries(self.job, plan)
        sentence_to_index: dict[str, str] = {}
        for entry in entries:
            if entry["shard"] not in self.copied:  # committed by an earlier run
                self.add(entry)
            with h5py.File(self.job.path / entry["file"], "r") as shard:
                for offset, sentence in enumerate(shard[SHARD_SENTENCES].asstr()[...]):
                    sentence_to_index[sentence] = str(entry["first_line"] + offset)  # later duplicates win
        index_dataset = self.file.create_dataset(SENTENCE_INDEX, (1,), dtype=h5py.string_dtype())
        index_dataset[0] = json.dumps(sentence_to_index)
        self.file.close()
        _fsync_file(self.path)
        os.replace(self.path, self.job.output)
        _fsync_dir(self.job.output.parent)
        shutil.rmtree(self.job.path)

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()


def finish_parquet(job: JobDirectory, plan: InputPlan, fingerprint: dict, totals: ShardStats) -> None:
    """Write the final manifest (complete: true) into the shard directory and rename the directory to OUTPUT."""
    entries = _ordered_entries(job, plan)
    manifest = {
        "complete": True,
        "job": fingerprint,
        "lines": totals.lines,
        "blank": totals.blank,
        "tokens": totals.tokens,
        "shards": [{k: e[k] for k in ("file", "first_line", "n_lines", "blank", "tokens", "bytes")} for e in entries],
    }
    _write_json_atomic(job.path / MANIFEST_FILE, manifest)
    for name in (JOB_FILE, COMMIT_LOG):
        (job.path / name).unlink(missing_ok=True)
    os.replace(job.path, job.output)
    _fsync_dir(job.output.parent)


# -- progress ------------------------------------------------------------------------------------------------------
class Progress:
    """tqdm bar over sentences (rate = sentences/s, ETA) with tokens/s as a postfix."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=done, unit="sent", desc="embed-file", disable=not enabled, dynamic_ncols=True
        )
        self.started = time.perf_counter()
        self.tokens = 0
        self.sentences = 0

    def __call__(self, sentences: int, tokens: int) -> None:
        self.sentences += sentences
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(sentences)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        self.bar.close()


# -- the job -------------------------------------------------------------------------------------------------------
@dataclass
class JobResult:
    output: Path
    lines: int = 0
    blank: int = 0
    tokens: int = 0
    resumed_lines: int = 0
    embedded_lines: int = 0
    embedded_tokens: int = 0
    seconds: float = 0.0
    already_complete: bool = False
    steady_tokens_per_s: float | None = None  # between this run's first and last commit (3+ shards)

    def summary(self) -> str:
        if self.already_complete:
            return f"embed-file: {self.output} is already complete ({self.lines} sentences); nothing to do"
        rate = self.embedded_lines / self.seconds if self.seconds else 0.0
        token_rate = self.embedded_tokens / self.seconds if self.seconds else 0.0
        resumed = f"; {self.resumed_lines} resumed from an earlier run" if self.resumed_lines else ""
        return (
            f"embed-file: {self.lines} sentences ({self.blank} blank, {self.tokens} tokens) -> {self.output} "
            f"({_size(self.output)}); this run embedded {self.embedded_lines} sentences in {self.seconds:.1f} s: "
            f"{rate:,.1f} sentences/s, {token_rate:,.0f} tokens/s{resumed}"
        )


def _size(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    for unit in ("B", "KB", "MB", "GB"):
        if total < 1024 or unit == "GB":
            return f"{total:.1f} {unit}" if unit != "B" else f"{total} B"
        total /= 1024
    return f"{total} B"


def check_options(options: JobOptions) -> None:
    if options.model is None and not options.server:
        raise InputError("give --model DIR (local runtime) or --server HOST:PORT (remote)")
    if options.model is not None and options.server:
        raise InputError("give either --model DIR or --server HOST:PORT, not both")
    if options.connection is not None and options.connection.flags() and not options.server:
        raise InputError(f"{', '.join(options.connection.flags())} only apply with --server HOST:PORT")
    if options.model is not None and not options.model.is_dir():
        raise ModelFileError(f"{options.model}: model directory not found")
    if options.batch_tokens is not None and options.batch_tokens < 1:
        raise InputError(f"--batch-tokens must be >= 1, got {options.batch_tokens}")
    if options.shard_lines < 1:
        raise InputError(f"--shard-lines must be >= 1, got {options.shard_lines}")
    if options.output.resolve() == options.input.resolve():
        raise InputError(f"{options.output}: OUTPUT would overwrite INPUT")
    if not options.output.parent.is_dir():
        raise InputError(f"{options.output.parent}: output directory does not exist")


def run_job(options: JobOptions) -> JobResult:
    """The whole job: scan, resume or start, embed the pending shards (local or Ray), finish. Idempotent."""
    check_options(options)
    plan = scan_input(options.input, detect_input_format(options.input, options.input_format), options.shard_lines)
    backend = make_backend(options)
    try:
        layout = Layout(options.spec, backend.n_layers, backend.dim, options.dtype)
        fingerprint = job_fingerprint(options, plan, backend.identity(), layout)
        job = JobDirectory(options.output)
        done = finished_job(options.output, options.output_format)
        if done is not None and not options.overwrite:
            if done == fingerprint:
                if job.path.exists():  # killed between the final rename and the clean-up
                    shutil.rmtree(job.path)
                return JobResult(options.output, lines=plan.n_lines, already_complete=True)
            why = (
                f"was made with other arguments or input ({_differences(done, fingerprint)})" if done else "is not ours"
            )
            raise InputError(f"{options.output} already exists and {why}; remove it or pass --overwrite")
        if done is not None:
            shutil.rmtree(options.output) if options.output.is_dir() else options.output.unlink()
        job.open(fingerprint, options.overwrite)
        return _embed_pending(options, plan, backend, layout, job, fingerprint)
    finally:
        backend.close()


def _embed_pending(
    options: JobOptions, plan: InputPlan, backend: Backend, layout: Layout, job: JobDirectory, fingerprint: dict
) -> JobResult:
    pending = [shard for shard in plan.shards if shard.number not in job.committed]
    resumed = sum(entry["n_lines"] for entry in job.committed.values())
    if resumed:
        log.info("resuming %s: %d of %d lines already committed", job.path, resumed, plan.n_lines)
    progress = Progress(plan.n_lines, resumed, options.progress)
    with_ids = plan.input_format == JSONL
    assembly = Hdf5Assembly(job, fingerprint, layout, with_ids) if options.output_format == HDF5 else None
    job.on_commit = assembly.add if assembly else None
    try:
        if options.engine == "ray" and pending:
            backend.close()  # the actors hold their own sessions
            from elmo.batch_ray import embed_shards_on_ray

            embed_shards_on_ray(plan, pending, options, layout, job, progress)
        else:
            events = prefetched(embed_events(plan, pending, options, backend))
            for entry in write_shards(events, options, layout, job.path, plan.input_format == JSONL, progress):
                job.commit(entry)
        totals = ShardStats()
        for entry in job.committed.values():
            totals.add(ShardStats(entry["n_lines"], entry["blank"], entry["tokens"]))
        if assembly:
            assembly.finish(plan)
        else:
            finish_parquet(job, plan, fingerprint, totals)
        seconds = progress.elapsed  # start to finished OUTPUT
    finally:
        progress.close()
        if assembly:
            assembly.close()
    return JobResult(
        options.output,
        lines=totals.lines,
        blank=totals.blank,
        tokens=totals.tokens,
        resumed_lines=resumed,
        embedded_lines=progress.sentences,
        embedded_tokens=progress.tokens,
        seconds=seconds,
        steady_tokens_per_s=_steady_rate(job.timeline),
    )


def _steady_rate(timeline: list[tuple[float, int]]) -> float | None:
    """Tokens/s while shards stream, start-up and the final flush left out: what a long input runs at."""
    if len(timeline) < 3 or timeline[-1][0] <= timeline[0][0]:
        return None
    return sum(tokens for _, tokens in timeline[1:]) / (timeline[-1][0] - timeline[0][0])


# -- reading the output back ---------------------------------------------------------------------------------------
def iter_parquet(path: str | Path) -> Iterator[tuple[int, str, list[str], np.ndarray]]:
    """(index, id, tokens, vectors) per sentence of a Parquet output, in line order; vectors as numpy arrays of
    the stored dtype, shape (n_layers, n, dim) or (n, dim). Reads one row group at a time."""
    import pyarrow.parquet as pq

    path = Path(path)
    files = (
        [path / entry["file"] for entry in _read_json(path / MANIFEST_FILE).get("shards", [])]
        if path.is_dir()
        else [path]
    )
    for file in files:
        parquet = pq.ParquetFile(file)
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group)
            vectors = table.column("vectors").combine_chunks()
            for row, (index, record_id, tokens) in enumerate(
                zip(
                    table.column("index").to_pylist(),
                    table.column("id").to_pylist(),
                    table.column("tokens").to_pylist(),
                )
            ):
                yield index, record_id, tokens, _row_array(vectors, row)


def _row_array(vectors, row: int) -> np.ndarray:
    """Row ``row`` of a vectors column as a numpy array: (n, dim), or (n_layers, n, dim) for ``all``."""
    import pyarrow as pa

    value = vectors[row].values  # the sentence's token vectors, or its list of layers
    if pa.types.is_fixed_size_list(value.type):
        return value.flatten().to_numpy(zero_copy_only=False).reshape(len(value), value.type.list_size)
    tokens = value.flatten()  # n_layers * n token vectors, layer by layer
    return tokens.flatten().to_numpy(zero_copy_only=False).reshape(len(value), -1, tokens.type.list_size)


# -- the command ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="text file (one sentence per line) or JSONL with 'id' and 'text'")
    parser.add_argument("output", type=Path, help="output .hdf5 file, or Parquet directory")
    source = parser.add_argument_group("where vectors come from (one of)")
    source.add_argument("--model", type=Path, help="model directory (local onnxruntime)")
    source.add_argument("--server", help="HOST:PORT of a running `elmo serve` (remote mode)")
    source.add_argument("--server-model", default="", help="model name on the server (default: its default model)")
    source.add_argument(
        "--server-wait", type=float, default=30.0, help="seconds to wait for the server to report SERVING"
    )
    from elmo.client import add_connection_arguments

    add_connection_arguments(source)  # the same --tls-ca / --tls-server-name / --auth-token as `elmo embed`
    parser.add_argument(
        "--layers", default="all", help="all (n_layers, n, dim) | top | average | mix:TASK -> (n, dim); default all"
    )
    parser.add_argument("--format", choices=[HDF5, PARQUET], help="default: parquet for a .parquet OUTPUT, else hdf5")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--tokenized", action="store_true", help="lines are whitespace-separated tokens, untouched")
    parser.add_argument("--input-format", choices=["auto", TEXT, JSONL], default="auto", help="auto: .jsonl -> jsonl")
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="padded tokens per runtime batch (default: the runtime's, 4096 on CPU, 16384 on CUDA)",
    )
    parser.add_argument(
        "--shard-lines", type=int, default=DEFAULT_SHARD_LINES, help="lines per shard (unit of commit and sorting)"
    )
    parser.add_argument("--engine", choices=["local", "ray"], default="local")
    parser.add_argument("--workers", type=int, help="Ray actors (default: one per GPU, else CPUs / --threads)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads per session")
    parser.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument("--overwrite", action="store_true", help="discard an existing OUTPUT or unfinished job")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def options_from_args(args: argparse.Namespace) -> JobOptions:
    from elmo.client import connection_from_args

    output_format = args.format or (PARQUET if args.output.suffix.lower() in PARQUET_SUFFIXES else HDF5)
    return JobOptions(
        input=args.input,
        output=args.output,
        model=args.model,
        server=args.server,
        server_model=args.server_model,
        spec=parse_layers(args.layers),
        output_format=output_format,
        dtype=args.dtype,
        tokenized=args.tokenized,
        input_format=args.input_format,
        batch_tokens=args.batch_tokens,
        shard_lines=args.shard_lines,
        engine=args.engine,
        workers=args.workers,
        threads=args.threads,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        ray_address=args.ray_address,
        server_wait=args.server_wait,
        connection=connection_from_args(args),
    )


def run(args: argparse.Namespace) -> int:
    result = run_job(options_from_args(args))
    print(result.summary(), file=sys.stdout, flush=True)
    return 0


__all__ = [
    "InputPlan",
    "JobOptions",
    "JobResult",
    "LayerSpec",
    "Layout",
    "Record",
    "ShardSpec",
    "add_arguments",
    "embed_events",
    "iter_parquet",
    "parse_layers",
    "plan_windows",
    "run",
    "run_job",
    "scan_input",
]
