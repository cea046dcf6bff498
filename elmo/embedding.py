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


__all__ = ["Embedding"]
