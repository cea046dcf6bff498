"""Task scalar mixes for serving: the numpy apply and the task store. Imports no torch (the serving image has none).

A *task* is what ``elmo mix train`` leaves in a model directory: the scalar mix of the biLM layers that one
downstream task learned (Peters et al. 2018, eq. 1), plus the light head trained with it::

    ELMo_task = gamma * sum_j softmax(w)_j * h_j          h_j: layer j, (n_tokens, dim)

Layout (no pickle anywhere)::

    <model_dir>/tasks/<name>/task.json         kind, mix (raw weights w, softmax, gamma, layer_norm), labels,
                                               head shapes, pooling, metrics, data description
    <model_dir>/tasks/<name>/head.safetensors  head Linear layers "head.<i>.weight" (out, in), "head.<i>.bias" (out,)

The mix itself lives in ``task.json`` (a handful of floats, readable in a diff), so serving a mix needs only
numpy and the JSON module; the head is read lazily, only by :meth:`Task.predict`.

Serving entry points: ``TaskStore(model_dir).names()`` / ``.get(name)`` and ``apply_task(layers, task)``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elmo.errors import InputError, ModelFileError
from elmo.runtime.modeldir import note_if_outside

TASKS_DIR = "tasks"
TASK_FILE = "task.json"
HEAD_FILE = "head.safetensors"
FORMAT_VERSION = 1
KINDS = ("tagging", "classification")
POOLINGS = ("mean", "max", "mean+max")
# AllenNLP's ScalarMix epsilon: keeps an all-zero layer (e.g. a 1-token sentence's padding) finite.
LAYER_NORM_EPS = 1e-12
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class UnknownTaskError(InputError):
    """A request named a task the model directory does not have (the message lists the ones it has)."""


def check_task_name(name: str) -> str:
    """Task names become folder names: letters, digits, ``_ . -``, at most 64, no path tricks."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise InputError(
            f"task name {name!r} is not valid: use 1-64 letters, digits, '_', '.', '-' (starting with a letter/digit)"
        )
    return name


# -- the mix ---------------------------------------------------------------------------------------------------
def softmax(weights: Sequence[float]) -> np.ndarray:
    """Raw mix weights w (n_layers,) -> s = softmax(w), float64."""
    w = np.asarray(weights, dtype=np.float64)
    e = np.exp(w - w.max())
    return e / e.sum()


def normalize_layers(layers: np.ndarray) -> np.ndarray:
    """Per-layer normalisation of one sentence: (L, n, dim) -> (L, n, dim), each layer's n*dim elements shifted
    to mean 0 and scaled to variance 1 (no affine). One sentence at a time, so a sentence's vectors never depend
    on what else was in its batch (the torch ScalarMix does the same per sentence with the token mask)."""
    x = layers.astype(np.float32, copy=False)
    if x.shape[1] == 0:
        return x
    mean = x.mean(axis=(1, 2), keepdims=True, dtype=np.float64)
    var = ((x - mean) ** 2).mean(axis=(1, 2), keepdims=True)
    return ((x - mean) / np.sqrt(var + LAYER_NORM_EPS)).astype(np.float32)


def mix_layers(
    layers: np.ndarray, weights: Sequence[float], gamma: float = 1.0, layer_norm: bool = False
) -> np.ndarray:
    """``gamma * sum_j softmax(weights)_j * h_j`` for one sentence: layers (L, n, dim) -> (n, dim) float32."""
    layers = np.asarray(layers)
    if layers.ndim != 3:
        raise InputError(f"layers must have shape (n_layers, n_tokens, dim), got shape {layers.shape}")
    if layers.shape[0] != len(weights):
        raise InputError(f"the mix has {len(weights)} weights but the layers array has {layers.shape[0]} layers")
    if layer_norm:
        layers = normalize_layers(layers)
    scale = (softmax(weights) * float(gamma)).astype(np.float32)
    return np.tensordot(scale, layers.astype(np.float32, copy=False), axes=1)


def pool(mixed: np.ndarray, pooling: str) -> np.ndarray:
    """Sentence vector from token vectors: (n, dim) -> (dim,) for mean/max, (2*dim,) for mean+max.
    An empty sentence pools to zeros (nothing to average)."""
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    n, dim = mixed.shape
    mean = mixed.mean(axis=0) if n else np.zeros(dim, np.float32)
    big = mixed.max(axis=0) if n else np.zeros(dim, np.float32)
    parts = {"mean": [mean], "max": [big], "mean+max": [mean, big]}[pooling]
    return np.concatenate(parts).astype(np.float32)


# -- one task --------------------------------------------------------------------------------------------------
@dataclass
class Task:
    """A stored task. ``weights`` are the raw (pre-softmax) mix weights w; ``head`` is loaded on demand.

    ``head_layers`` lists the Linear shapes ``[in, out]`` of the head (ReLU between layers); its input is the
    mixed token vector (tagging) or the pooled sentence vector (classification).
    """

    name: str
    kind: str
    n_layers: int
    dim: int
    weights: list[float]
    gamma: float
    layer_norm: bool = False
    labels: list[str] = field(default_factory=list)
    pooling: str | None = None
    head_layers: list[list[int]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    stale: str = ""  # why the mix no longer matches the model's weights (set by `elmo adapt`); "" = current
    directory: Path | None = None
    _head: list[tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False, compare=False)

    @property
    def normalized_weights(self) -> list[float]:
        return [float(v) for v in softmax(self.weights)]

    def apply(self, layers: np.ndarray) -> np.ndarray:
        """The task's mix of one sentence: layers (n_layers, n_tokens, dim) -> (n_tokens, dim) float32."""
        layers = np.asarray(layers)
        if layers.ndim != 3 or layers.shape[0] != self.n_layers or layers.shape[2] != self.dim:
            raise InputError(
                f"task '{self.name}' mixes layers of shape ({self.n_layers}, n_tokens, {self.dim}); "
                f"got shape {tuple(layers.shape)}"
            )
        return mix_layers(layers, self.weights, self.gamma, self.layer_norm)

    def head_input(self, layers: np.ndarray) -> np.ndarray:
        """What the head reads: the mix (n, dim) for tagging; the pooled mix (1, pooled_dim) for classification."""
        mixed = self.apply(layers)
        if self.kind == "classification":
            return pool(mixed, self.pooling or "mean")[None, :]
        return mixed

    def head(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The head's Linear layers [(weight (out, in), bias (out,)), ...] read from head.safetensors."""
        if self._head is None:
            self._head = load_head(self.directory / HEAD_FILE if self.directory else None, len(self.head_layers))
        return self._head

    def logits(self, layers: np.ndarray) -> np.ndarray:
        """Head logits: (n_tokens, n_labels) for tagging, (1, n_labels) for classification."""
        x = self.head_input(layers).astype(np.float32)
        head = self.head()
        for index, (weight, bias) in enumerate(head):
            x = x @ weight.T + bias
            if index < len(head) - 1:
                x = np.maximum(x, 0.0)
        return x

    def predict(self, layers: np.ndarray) -> list[str]:
        """Labels: one per token (tagging) or a single one (classification)."""
        return [self.labels[i] for i in self.logits(layers).argmax(axis=-1)]

    # -- persistence --------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "name": self.name,
            "kind": self.kind,
            "n_layers": self.n_layers,
            "dim": self.dim,
            "mix": {
                "weights": [float(v) for v in self.weights],
                "softmax": self.normalized_weights,
                "gamma": float(self.gamma),
                "layer_norm": bool(self.layer_norm),
            },
            "pooling": self.pooling,
            "labels": list(self.labels),
            "head": {"file": HEAD_FILE, "layers": [list(map(int, s)) for s in self.head_layers], "activation": "relu"},
            "metrics": self.metrics,
            "data": self.data,
            "model": self.model,
            **({"stale": self.stale} if self.stale else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping, source: str = TASK_FILE, directory: Path | None = None) -> Task:
        def fail(why: str) -> ModelFileError:
            return ModelFileError(f"{source}: {why}")

        if not isinstance(data, Mapping):
            raise fail("must hold a JSON object")
        if data.get("format") != FORMAT_VERSION:
            raise fail(f"unsupported task format {data.get('format')!r} (this code reads format {FORMAT_VERSION})")
        try:
            mix = data["mix"]
            task = cls(
                name=str(data["name"]),
                kind=str(data["kind"]),
                n_layers=int(data["n_layers"]),
                dim=int(data["dim"]),
                weights=[float(v) for v in mix["weights"]],
                gamma=float(mix["gamma"]),
                layer_norm=bool(mix.get("layer_norm", False)),
                labels=[str(v) for v in data.get("labels", [])],
                pooling=data.get("pooling"),
                head_layers=[list(map(int, s)) for s in data.get("head", {}).get("layers", [])],
                metrics=dict(data.get("metrics", {})),
                data=dict(data.get("data", {})),
                model=dict(data.get("model", {})),
                stale=str(data.get("stale") or ""),
                directory=directory,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise fail(f"missing or malformed field ({exc!r})") from None
        task.validate(source)
        return task

    def validate(self, source: str = "task") -> Task:
        def need(ok: bool, why: str) -> None:
            if not ok:
                raise ModelFileError(f"{source}: {why}")

        check_task_name(self.name)
        need(self.kind in KINDS, f"kind must be one of {KINDS}, got {self.kind!r}")
        need(self.n_layers >= 1 and self.dim >= 1, "n_layers and dim must be positive")
        need(len(self.weights) == self.n_layers, f"mix has {len(self.weights)} weights for {self.n_layers} layers")
        need(all(math.isfinite(v) for v in [*self.weights, self.gamma]), "mix weights and gamma must be finite")
        if self.kind == "classification":
            need(self.pooling in POOLINGS, f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.head_layers:
            need(len(self.labels) >= 2, "a task with a head needs at least 2 labels")
            pooled = self.dim * (2 if self.pooling == "mean+max" else 1) if self.kind == "classification" else self.dim
            need(self.head_layers[0][0] == pooled, f"head input {self.head_layers[0][0]} != {pooled}")
            need(self.head_layers[-1][1] == len(self.labels), "head output size != number of labels")
            for a, b in zip(self.head_layers, self.head_layers[1:]):
                need(a[1] == b[0], f"head layer shapes do not chain: {self.head_layers}")
        return self


def load_head(path: Path | None, n_linear: int) -> list[tuple[np.ndarray, np.ndarray]]:
    if path is None or not path.is_file():
        raise ModelFileError(f"{path}: task head file not found")
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc})") from None
    try:
        return [
            (tensors[f"head.{i}.weight"].astype(np.float32), tensors[f"head.{i}.bias"].astype(np.float32))
            for i in range(n_linear)
        ]
    except KeyError as exc:
        raise ModelFileError(f"{path}: missing tensor {exc}") from None


# -- the store -------------------------------------------------------------------------------------------------
class TaskStore:
    """The tasks of one model directory. ``names()`` lists them; ``get(name)`` returns a validated :class:`Task`
    (cached; re-read when its task.json changes) or raises :class:`UnknownTaskError` naming the available ones.

    ``n_layers``/``dim`` (optional, e.g. from the runtime's info) make ``get`` reject a task trained on a model
    of another shape with a clear error instead of failing later on a shape mismatch.
    """

    def __init__(self, model_dir: str | Path, n_layers: int | None = None, dim: int | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.root = self.model_dir / TASKS_DIR
        self.n_layers = n_layers
        self.dim = dim
        self._cache: dict[str, tuple[float, Task]] = {}

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / TASK_FILE).is_file() and _NAME_RE.match(p.name))

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> Task:
        if not isinstance(name, str) or not _NAME_RE.match(name) or name not in self.names():
            available = ", ".join(self.names()) or "none"
            raise UnknownTaskError(f"unknown task {name!r} for model {self.model_dir}; available tasks: {available}")
        path = self.root / name / TASK_FILE
        mtime = path.stat().st_mtime_ns
        cached = self._cache.get(name)
        if cached and cached[0] == mtime:
            return cached[1]
        note_if_outside(self.model_dir, Path(TASKS_DIR, name), "task folder")  # followed, said once (how-to/models.md)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
        task = Task.from_json(data, source=str(path), directory=path.parent)
        if task.name != name:
            raise ModelFileError(f"{path}: names task {task.name!r} but lives in folder {name!r}")
        self._check_shape(task, path)
        self._cache[name] = (mtime, task)
        return task

    def _check_shape(self, task: Task, path: Path) -> None:
        if self.n_layers is not None and task.n_layers != self.n_layers:
            raise ModelFileError(f"{path}: task mixes {task.n_layers} layers but the model has {self.n_layers}")
        if self.dim is not None and task.dim != self.dim:
            raise ModelFileError(f"{path}: task expects dim {task.dim} but the model outputs {self.dim}")

    def all(self) -> list[Task]:
        return [self.get(name) for name in self.names()]

    def stale_names(self) -> list[str]:
        """Tasks whose mix was trained on other weights (``elmo adapt`` carried them over); unreadable ones are
        left to :meth:`get` to report."""
        stale = []
        for name in self.names():
            try:
                if self.get(name).stale:
                    stale.append(name)
            except ModelFileError:
                continue
        return stale

    def save(self, task: Task, head: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> Path:
        """Write ``tasks/<name>/`` atomically (a temp folder renamed into place); replaces an existing task."""
        return save_task(self.model_dir, task, head)


def save_task(model_dir: str | Path, task: Task, head: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> Path:
    """Store a task (and its head Linear layers [(weight (out, in), bias (out,)), ...]) under model_dir/tasks/."""
    check_task_name(task.name)
    if head is not None:
        task.head_layers = [[int(w.shape[1]), int(w.shape[0])] for w, _ in head]
    task.validate(f"task '{task.name}'")
    root = Path(model_dir) / TASKS_DIR
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{task.name}.", dir=root))
    staging.chmod(0o755)  # mkdtemp makes it 0700: a served model is often read by another (non-root) user
    try:
        if head is not None:
            from safetensors.numpy import save_file

            tensors = {}
            for i, (weight, bias) in enumerate(head):
                tensors[f"head.{i}.weight"] = np.ascontiguousarray(weight, dtype=np.float32)
                tensors[f"head.{i}.bias"] = np.ascontiguousarray(bias, dtype=np.float32)
            save_file(tensors, str(staging / HEAD_FILE))
        (staging / TASK_FILE).write_text(json.dumps(task.to_json(), indent=2, ensure_ascii=False) + "\n", "utf-8")
        for path in staging.iterdir():
            path.chmod(0o644)
        target = root / task.name
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{task.name}.old.", dir=root))
            os.replace(target, old / "task")
        os.replace(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    task.directory = target
    task._head = None
    return target


def mark_tasks_stale(model_dir: str | Path, reason: str) -> list[str]:
    """Mark every task of ``model_dir`` stale (its mix and head were trained on other weights); a task retrained by
    ``elmo mix train`` is current again. Returns the names marked."""
    store = TaskStore(model_dir)
    names = store.names()
    for name in names:
        path = store.root / name / TASK_FILE
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("stale") != reason:
            data["stale"] = reason
            tmp = path.with_name(TASK_FILE + ".tmp")
            tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", "utf-8")
            os.replace(tmp, path)
    return names


def apply_task(layers: np.ndarray, task: Task) -> np.ndarray:
    """Serving entry point: one sentence's layers (n_layers, n_tokens, dim) -> the task's mix (n_tokens, dim)."""
    return task.apply(layers)


def list_tasks(model_dir: str | Path) -> list[str]:
    """Names of the tasks stored in a model directory (empty when it has none)."""
    return TaskStore(model_dir).names()
