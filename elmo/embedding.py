"""One embedded sentence, as every Python API returns it: in process (``elmo.runtime.Embedder.embed``) and over gRPC
(``elmo.client.EmbedderClient.embed``) alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Embedding:
    tokens: list[str]
    offsets: list[tuple[int, int]] | None  # code points into the text; None for pre-tokenized input
    layers: np.ndarray | None  # (n_selected_layers, n_tokens, dim), None with omit_layers
    mix: np.ndarray | None  # (n_tokens, dim), None without a task
    truncated_tokens: int = 0  # cut off the end under overflow 'truncate'
    # which weights produced it (from a server's answer; the in-process runtime leaves them empty): the model's
    # name, its version under --model-root (0: served with --model DIR), and whether the task's mix was
    # carried over from earlier weights by `elmo adapt` (stale: retrain it with `elmo mix train`)
    model: str = ""
    model_version: int = 0
    task_stale: bool = False


__all__ = ["Embedding"]
