"""Scalar-mix tasks of one served model: one lookup call for the servicer.

The tasks live in the model directory and are read by ``elmo.mix.store.TaskStore`` (issue 6). When that module is not
there (an older checkout, a trimmed image) the model simply has no tasks. Unknown names are NOT_FOUND.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from elmo.errors import ElmoError
from service.errors import from_library_error, not_found

log = logging.getLogger(__name__)


class Task(Protocol):
    name: str

    def apply(self, layers: np.ndarray) -> np.ndarray:
        """One sentence's float32 (n_layers, n_tokens, dim) -> float32 (n_tokens, dim)."""


class ModelTasks:
    def __init__(self, model_dir: Path, n_layers: int, dim: int):
        self._model_dir = model_dir
        self._store = None
        try:
            from elmo.mix.store import TaskStore
        except ImportError:
            log.info("elmo.mix.store is not available: model %s serves no tasks", model_dir)
            return
        self._store = TaskStore(model_dir, n_layers=n_layers, dim=dim)

    def names(self) -> list[str]:
        return list(self._store.names()) if self._store is not None else []

    def stale_names(self) -> list[str]:
        """Tasks carried over from earlier weights by ``elmo adapt`` (still served; retrain them)."""
        return list(self._store.stale_names()) if self._store is not None else []

    def get(self, name: str) -> Task:
        """The task called ``name``; ServiceError NOT_FOUND "unknown task 'x'" when there is none."""
        if self._store is None:
            raise not_found(f"unknown task '{name}' (this server has no task support: elmo.mix.store is missing)")
        from elmo.mix.store import UnknownTaskError

        try:
            return self._store.get(name)
        except UnknownTaskError:
            listing = ", ".join(self.names()) or "none"
            raise not_found(f"unknown task '{name}' (tasks of this model: {listing})") from None
        except ElmoError as exc:
            raise from_library_error(exc) from None


__all__ = ["ModelTasks", "Task"]
