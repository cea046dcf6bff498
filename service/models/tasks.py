"""Scalar-mix tasks of one served model: one lookup call for the servicer.

The tasks live in the model directory and are read by ``elmo.runtime.tasks.TaskStore`` (torch-free, beside the
runtime; elmo.mix trains them). Unknown names are NOT_FOUND.

Requests never touch the disk for a task: the listing and the loaded tasks are kept, and at most once per
``refresh_s`` a cheap check (the tasks folder's and each task.json's modification time) decides whether to read them
again — a task saved or retrained while serving (``elmo mix train``) is picked up within that interval.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Protocol

import numpy as np
from elmo.service.common.errors import ServiceError, clip, from_library_error, not_found

from elmo.errors import ElmoError
from elmo.runtime.tasks import TASK_FILE, TaskStore, UnknownTaskError

log = logging.getLogger("service.tasks")  # the documented logger name (docs/reference/metrics.md)


class Task(Protocol):
    name: str

    def apply(self, layers: np.ndarray) -> np.ndarray:
        """One sentence's float32 (n_layers, n_tokens, dim) -> float32 (n_tokens, dim)."""


REFRESH_S = 1.0


class ModelTasks:
    def __init__(self, model_dir: Path, n_layers: int, dim: int, refresh_s: float = REFRESH_S):
        self._model_dir = model_dir
        self._refresh_s = refresh_s
        self._lock = threading.Lock()  # lookups run on the request workers too
        self._checked = float("-inf")
        self._signature: tuple | None = None
        self._names: list[str] = []
        self._tasks: dict[str, Task] = {}
        self._store = TaskStore(model_dir, n_layers=n_layers, dim=dim)

    def _refresh(self) -> None:
        """Re-read the listing (and drop loaded tasks) when the folder changed; looked at once per ``refresh_s``."""
        now = time.monotonic()
        if now - self._checked < self._refresh_s:
            return
        with self._lock:
            self._checked = now
            signature = self._disk_signature()
            if signature != self._signature:
                self._signature = signature
                self._names = list(self._store.names())
                self._tasks = {}

    def _disk_signature(self) -> tuple:
        root = self._store.root
        try:
            entries = sorted((p.name, (p / TASK_FILE).stat().st_mtime_ns) for p in root.iterdir() if p.is_dir())
            return (root.stat().st_mtime_ns, tuple(entries))
        except OSError:  # no tasks folder, or a task being replaced right now: read again next time
            return (None,)

    def names(self) -> list[str]:
        self._refresh()
        return list(self._names)

    def stale_names(self) -> list[str]:
        """Tasks carried over from earlier weights by ``elmo adapt`` (still served; retrain them)."""
        stale = []
        for name in self.names():
            try:
                if self.get(name).stale:
                    stale.append(name)
            except ServiceError:
                continue  # unreadable: get() reports it to whoever asks for that task
        return stale

    def get(self, name: str) -> Task:
        """The task called ``name``; ServiceError NOT_FOUND "unknown task 'x'" when there is none."""
        names = self.names()  # refreshes the listing (and drops loaded tasks) when the folder changed
        if name in self._tasks:
            return self._tasks[name]
        if name not in names:
            raise not_found(f"unknown task '{clip(name)}' (tasks of this model: {', '.join(names) or 'none'})")
        try:
            task = self._store.get(name)
        except UnknownTaskError:
            listing = ", ".join(self.names()) or "none"
            raise not_found(f"unknown task '{clip(name)}' (tasks of this model: {listing})") from None
        except ElmoError as exc:
            raise from_library_error(exc) from None
        self._tasks[name] = task
        return task


__all__ = ["ModelTasks", "Task"]
