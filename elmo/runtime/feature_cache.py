"""Embed a list of sentences once into a memory-mapped .npy, reused while the model, the sentences and the dtype stay
the same: the frozen features `elmo mix train` fits its task heads on (and elmo.features hands to callers).

Shapes: ``CachedFeatures.layers`` (n_layers, total_tokens, dim), ``offsets`` (n_sentences + 1,): sentence i's tokens
are ``layers[:, offsets[i]:offsets[i + 1]]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from elmo.errors import InputError

log = logging.getLogger(__name__)


def sentences_digest(sentences: Sequence[Sequence[str]]) -> str:
    digest = hashlib.sha256()
    for tokens in sentences:
        digest.update("\u241f".join(tokens).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


class CachedFeatures:
    """Cached layers of a list of sentences: ``layers`` (L, N_tokens, D) (memory-mapped), ``offsets`` (n + 1,)."""

    def __init__(self, layers: np.ndarray, offsets: np.ndarray) -> None:
        self.layers = layers
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sentence(self, i: int) -> np.ndarray:
        """Sentence i's layers (L, n_i, D) as float32."""
        return np.asarray(self.layers[:, self.offsets[i] : self.offsets[i + 1]], dtype=np.float32)


def cache_features(
    embed: Callable[[list[list[str]]], list[np.ndarray]],
    sentences: Sequence[Sequence[str]],
    directory: str | Path,
    name: str,
    model_key: str,
    dtype: str = "float16",
    chunk: int = 1024,
    progress: Callable[[int, int], None] | None = None,
) -> CachedFeatures:
    """Embed ``sentences`` once (in chunks, written straight to a memory-mapped .npy) or reuse the cache when the
    model key, the sentences and the dtype match. float16 halves the cache; values beyond its range fall back to
    float32 storage."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers_path, offsets_path, meta_path = (directory / f"{name}{s}" for s in (".layers.npy", ".offsets.npy", ".json"))
    key = {"model": model_key, "sentences": sentences_digest(sentences), "dtype": dtype, "n": len(sentences)}
    if meta_path.is_file() and layers_path.is_file() and offsets_path.is_file():
        if json.loads(meta_path.read_text()).get("key") == key:
            log.info("features %s: cached (%s)", name, layers_path)
            return CachedFeatures(np.load(layers_path, mmap_mode="r"), np.load(offsets_path))
    meta_path.unlink(missing_ok=True)  # the meta file is written last: its presence marks a complete cache
    lengths = np.array([len(s) for s in sentences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    first = embed([list(sentences[0])]) if len(sentences) else []
    if not first:
        raise InputError(f"features {name}: no sentences to embed")
    n_layers, dim = first[0].shape[0], first[0].shape[2]
    out = np.lib.format.open_memmap(
        layers_path, mode="w+", dtype=np.dtype(dtype), shape=(n_layers, int(offsets[-1]), dim)
    )
    for start in range(0, len(sentences), chunk):
        batch = [list(s) for s in sentences[start : start + chunk]]
        for i, layers in enumerate(embed(batch), start):
            if np.dtype(dtype) == np.float16 and np.abs(layers).max(initial=0) > 60000:
                raise InputError(f"features {name}: values overflow float16; use dtype='float32'")
            out[:, offsets[i] : offsets[i + 1]] = layers
        if progress:
            progress(min(start + chunk, len(sentences)), len(sentences))
    out.flush()
    del out
    np.save(offsets_path, offsets)
    meta_path.write_text(json.dumps({"key": key, "n_layers": n_layers, "dim": dim}) + "\n")
    return CachedFeatures(np.load(layers_path, mmap_mode="r"), offsets)
