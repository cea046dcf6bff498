"""Shard files (hdf5 / Parquet, written as *.tmp, fsynced, renamed), the finished output (hdf5 assembled in
AllenNLP's layout, or the Parquet manifest), and reading a Parquet output back.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

import numpy as np

from elmo.batch.atomic import fsync_dir, fsync_file, read_json, write_json_atomic
from elmo.batch.jobdir import COMMIT_LOG, JOB_FILE, MANIFEST_FILE, JobDirectory
from elmo.batch.layout import DTYPES, HDF5, PARQUET, Layout
from elmo.batch.options import is_fingerprint
from elmo.batch.plan import InputPlan, Record, ShardSpec
from elmo.errors import ElmoError, InputError

log = logging.getLogger("elmo.batch")


ASSEMBLY_FILE = "_assembled.h5.tmp"
SENTENCE_INDEX = "sentence_to_index"  # AllenNLP's dataset name
JOB_ATTR = "elmo_batch_job"  # root attribute of the finished hdf5 (invisible to keys(): AllenNLP code unaffected)
SHARD_SENTENCES = "_sentences"  # inside an hdf5 shard only: the sentence_to_index keys of its lines, in order
SHARD_IDS = "_ids"


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
    """One shard as a small hdf5 file holding its call groups as they come: per group the vectors of its sentences
    concatenated along the token axis (``w<k>/vectors``), their line indices and token counts; plus every line's
    sentence and id. One write per group, not per sentence: the per-sentence datasets of AllenNLP's layout are
    made once, by :class:`Hdf5Assembly`. Memory: one group. (On disk a group is still
    ``w{n}`` with the count in ``attrs["windows"]``: shard files written before the rename stay readable.)"""

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


# -- finishing -----------------------------------------------------------------------------------------------------
def earlier_output(output: Path) -> dict | None:
    """The fingerprint of the earlier embed-file output at OUTPUT, None when nothing is there. Anything else there
    (a user's folder or file, an hdf5 file embed-file did not write, an output with files added to it) is refused
    with an InputError: the job replaces only what it wrote itself."""
    if not (output.exists() or output.is_symlink()):
        return None
    if output.is_symlink():
        _refuse_output(output, "it is a symbolic link")
    if output.is_dir():
        return _earlier_parquet(output)
    return _earlier_hdf5(output)


def _earlier_parquet(output: Path) -> dict:
    """A Parquet output is ours when its _manifest.json is complete and names the job; it may hold nothing else."""
    manifest = read_json(output / MANIFEST_FILE)
    fingerprint = manifest.get("job")
    if not manifest.get("complete") or not is_fingerprint(fingerprint):
        _refuse_output(output, f"a folder without embed-file's {MANIFEST_FILE}")
    foreign = sorted(set(_entry_names(output)) - set(_parquet_files(manifest)))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        _refuse_output(output, f"an embed-file output that also holds {shown}, which embed-file did not write")
    return fingerprint


def _entry_names(folder: Path) -> list[str]:
    return [child.name + ("/" if child.is_dir() else "") for child in folder.iterdir()]


def _parquet_files(manifest: dict) -> list[str]:
    """The files of a finished Parquet output: its manifest and the shards it lists."""
    shards = manifest.get("shards") if isinstance(manifest.get("shards"), list) else []
    return [MANIFEST_FILE, *(str(entry.get("file")) for entry in shards if isinstance(entry, dict))]


def _earlier_hdf5(output: Path) -> dict:
    """An hdf5 output is ours when its root carries the job's fingerprint (the ``elmo_batch_job`` attribute)."""
    import h5py

    try:
        with h5py.File(output, "r") as handle:
            mark = handle.attrs.get(JOB_ATTR, "{}")
    except OSError:
        _refuse_output(output, "a file that is not an hdf5 file")
    try:
        fingerprint = json.loads(mark)
    except (ValueError, TypeError):
        fingerprint = None
    if not is_fingerprint(fingerprint):
        _refuse_output(output, "an hdf5 file that embed-file did not write")
    return fingerprint


def _refuse_output(output: Path, what: str) -> NoReturn:
    raise InputError(
        f"{output} already exists and is not an embed-file output ({what}); embed-file writes a new OUTPUT or "
        "replaces its own earlier one (--overwrite), never anything else: choose another OUTPUT path"
    )


def make_room_for_output(output: Path, replaced_by_file: bool) -> None:
    """Before the finished output takes OUTPUT's place: an earlier embed-file output there goes (checked again, it
    may have changed while the job ran). An hdf5 file is replaced by the rename itself (``replaced_by_file``)."""
    if earlier_output(output) is None:
        return
    if not output.is_dir():
        if not replaced_by_file:
            output.unlink()
        return
    listed = set(_parquet_files(read_json(output / MANIFEST_FILE)))
    # only the folder's own entries, never a listed name that points elsewhere; the manifest last, so that a crash
    # midway leaves a folder still marked as embed-file's
    for child in sorted(output.iterdir(), key=lambda child: child.name == MANIFEST_FILE):
        if child.name in listed and child.is_file():
            child.unlink()
    output.rmdir()
    fsync_dir(output.parent)


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
    """The final hdf5 in AllenNLP's layout, built while the job runs: as soon as a shard is committed its call groups
    are cut into one dataset per line (so this overlaps the embedding of the next shards), and the file is
    fsynced; :meth:`finish` adds ``sentence_to_index`` and renames the file to OUTPUT. The file is only ever a copy
    of committed shards: a crash leaves it as a temporary in OUTPUT.partial/, deleted on resume and rebuilt.

    Memory: one call group; at the end the sentence -> index map (the size of the input's text), as in AllenNLP."""

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
            for index in range(int(shard.attrs["windows"])):
                group = shard[f"w{index}"]
                vectors, index, lengths = group["vectors"][...], group["index"][...], group["lengths"][...]
                starts = np.concatenate([[0], np.cumsum(lengths)])
                for line, start, stop in zip(index.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
                    piece = vectors[:, start:stop] if axis else vectors[start:stop]
                    self._dataset(line, piece, None if ids is None else ids[line - first])
                    done[line - first] = True
            for offset in np.flatnonzero(~done).tolist():  # blank lines
                self._dataset(first + offset, self.layout.empty(), None if ids is None else ids[offset])
        self.file.flush()
        fsync_file(self.path)  # a little at a time, so that the final fsync has little left to do
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
        fsync_file(self.path)
        make_room_for_output(self.job.output, replaced_by_file=True)
        os.replace(self.path, self.job.output)
        fsync_dir(self.job.output.parent)
        self.job.remove()

    def close(self) -> None:
        if self.file.id.valid:
            self.file.close()


def finish_parquet(job: JobDirectory, plan: InputPlan, fingerprint: dict, totals: ShardStats) -> None:
    """Write the final manifest (complete: true) into the shard directory and rename the directory to OUTPUT."""
    entries = _ordered_entries(job, plan)
    make_room_for_output(job.output, replaced_by_file=False)
    manifest = {
        "complete": True,
        "job": fingerprint,
        "lines": totals.lines,
        "blank": totals.blank,
        "tokens": totals.tokens,
        "shards": [{k: e[k] for k in ("file", "first_line", "n_lines", "blank", "tokens", "bytes")} for e in entries],
    }
    write_json_atomic(job.path / MANIFEST_FILE, manifest)
    for name in (JOB_FILE, COMMIT_LOG):
        (job.path / name).unlink(missing_ok=True)
    os.replace(job.path, job.output)
    fsync_dir(job.output.parent)


# -- reading the output back ---------------------------------------------------------------------------------------
def iter_parquet(path: str | Path) -> Iterator[tuple[int, str, list[str], np.ndarray]]:
    """(index, id, tokens, vectors) per sentence of a Parquet output, in line order; vectors as numpy arrays of
    the stored dtype, shape (n_layers, n, dim) or (n, dim). Reads one row group at a time."""
    import pyarrow.parquet as pq

    path = Path(path)
    files = (
        [path / entry["file"] for entry in read_json(path / MANIFEST_FILE).get("shards", [])]
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
