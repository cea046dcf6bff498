"""What the job writes: which layers (all / top / average / mix:TASK), in which dtype and format."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elmo.errors import InputError

log = logging.getLogger("elmo.batch")


HDF5, PARQUET = "hdf5", "parquet"
HDF5_SUFFIXES = (".h5", ".hdf5")
PARQUET_SUFFIXES = (".parquet", ".pq")
DTYPES = {"float32": np.float32, "float16": np.float16}


# -- which format ----------------------------------------------------------------------------------------------
def _format_by_path(output: str) -> str | None:
    """What OUTPUT's name says: .h5/.hdf5 -> hdf5; .parquet/.pq, a trailing slash or an existing directory -> Parquet
    (always a directory); an existing file -> hdf5 (a Parquet output is never a file); else None. A name that says
    both (``out.h5/``) is an InputError."""
    path = Path(output)
    suffix = path.suffix.lower()
    directory = output.endswith(("/", os.sep)) or path.is_dir()
    if suffix in HDF5_SUFFIXES and directory:
        raise InputError(
            f"{output}: an hdf5 name ({suffix}) for a directory; an hdf5 output is one file (name it without the "
            "trailing slash), Parquet is a directory (name it .parquet)"
        )
    if suffix in HDF5_SUFFIXES:
        return HDF5
    if suffix in PARQUET_SUFFIXES or directory:
        return PARQUET
    return HDF5 if path.is_file() else None


def output_format(output: str, requested: str | None) -> str:
    """The output format: OUTPUT's name decides (see _format_by_path); ``--format`` may confirm it, or decide for a
    name that says nothing. A name that says nothing without --format, or one --format contradicts, is one
    InputError: guessing wrong costs a whole job (an hdf5 *file* named ``out`` where a directory was meant)."""
    by_path = _format_by_path(output)
    if requested and by_path and requested != by_path:
        what = "an hdf5 file" if by_path == HDF5 else "a Parquet directory"
        raise InputError(
            f"--format {requested} contradicts OUTPUT {output}, which names {what}; drop --format or rename OUTPUT "
            "(.h5/.hdf5: an hdf5 file; .parquet or a trailing /: a Parquet directory)"
        )
    if requested or by_path:
        return requested or by_path
    raise InputError(
        f"{output}: cannot tell the output format from the name; end it in .h5/.hdf5 for an hdf5 file, in .parquet "
        "or / for a Parquet directory, or pass --format hdf5|parquet"
    )


# -- what to write -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerSpec:
    """``--layers``: ``all`` -> (n_layers, n, dim); ``top`` (last layer), ``average`` (mean of the layers) and
    ``mix:TASK`` (the task's scalar mix, elmo.runtime.tasks) -> (n, dim)."""

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
    """The one hook to elmo.runtime.tasks: the stored task's numpy mix, per sentence (its layer norm is per sentence).

    An unknown task raises elmo.runtime.tasks.UnknownTaskError ("unknown task 'x' for model DIR; available tasks: ...").
    """
    from elmo.runtime.tasks import TaskStore, apply_task

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
