"""Feature extraction for downstream models. Imports no torch (the torch module is loaded lazily on first use).

Three ways in, one set of numbers:

1. **numpy API** — ``Features(model="models/default")`` (local onnxruntime) or ``Features(server="host:50051")``
   (the gRPC service) with the same calls: ``.layers(sentences)`` -> per sentence (L, n, D); ``.mix(sentences,
   task="pos_brown")`` or ``.mix(sentences, weights=[...], gamma=...)`` -> (n, D); ``.sentence_vectors(...)``.
   Sentences are raw strings (tokenized by :func:`elmo.text.tokenize.tokenize`) or token lists (used as they are).
2. **torch module** — ``from elmo.features import Elmo`` (AllenNLP's ``Elmo(options, weights,
   num_output_representations=k)``): k learned mixes + mask, on our BiLM or on precomputed features.
3. **scikit-learn transformer** — :class:`ElmoVectorizer` (``fit``/``transform``, sentence pooling), so
   ``Pipeline([("elmo", ElmoVectorizer(model=...)), ("clf", LogisticRegression())])`` just works.

It also holds the on-disk **feature cache** that ``elmo mix train`` uses so the biLM runs once per data set:
``<dir>/<name>.layers.npy`` (L, N_tokens, D) float16 + ``<name>.offsets.npy`` + ``<name>.json`` (a key naming the
model checkpoint and a hash of the sentences; a different model or data set recomputes).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from elmo.backends import Backend, LocalBackend, RemoteBackend, connect  # noqa: F401  (re-exported)
from elmo.errors import InputError
from elmo.runtime.feature_cache import CachedFeatures, cache_features, sentences_digest  # noqa: F401  (re-exported)
from elmo.runtime.tasks import POOLINGS, Task, mix_layers, pool
from elmo.text.tokenize import tokenize

log = logging.getLogger(__name__)


def as_tokens(sentences: Sequence[str | Sequence[str]]) -> list[list[str]]:
    """Raw strings are tokenized by the one tokenizer; token lists pass through untouched."""
    if isinstance(sentences, str):
        raise InputError("expected a list of sentences, got one string (wrap it in a list)")
    out = []
    for i, sentence in enumerate(sentences):
        if isinstance(sentence, str):
            out.append(tokenize(sentence).tokens)
        elif isinstance(sentence, (list, tuple, np.ndarray)) and all(isinstance(t, str) for t in sentence):
            out.append(list(sentence))
        else:
            raise InputError(f"sentence {i} is {type(sentence).__name__}: expected a string or a list of token strings")
    return out


class Features:
    """The numpy feature API; the same calls work on a local model or a remote server."""

    def __init__(
        self,
        model: str | Path | None = None,
        server: str | None = None,
        backend: Backend | None = None,
        **options: Any,
    ) -> None:
        self.backend = backend if backend is not None else connect(model, server, **options)

    @property
    def n_layers(self) -> int:
        return self.backend.n_layers

    @property
    def dim(self) -> int:
        return self.backend.dim

    def tokens(self, sentences: Sequence[str | Sequence[str]]) -> list[list[str]]:
        return as_tokens(sentences)

    def layers(self, sentences: Sequence[str | Sequence[str]]) -> list[np.ndarray]:
        """Per sentence float32 (n_layers, n_tokens, dim)."""
        return self.backend.embed_tokens(as_tokens(sentences))

    def mix(
        self,
        sentences: Sequence[str | Sequence[str]],
        task: str | Task | None = None,
        weights: Sequence[float] | None = None,
        gamma: float = 1.0,
        layer_norm: bool = False,
    ) -> list[np.ndarray]:
        """Per sentence (n_tokens, dim): a stored task by name (applied where the model is), a :class:`Task`,
        or raw weights (softmax-normalised here; ``weights=[0]*L`` is the plain average)."""
        tokens = as_tokens(sentences)
        if isinstance(task, str):
            return self.backend.mix(tokens, task)
        if isinstance(task, Task):
            return [task.apply(layers) for layers in self.backend.embed_tokens(tokens)]
        if weights is None:
            raise InputError("mix needs task=NAME, a Task, or weights=[...]")
        return [mix_layers(layers, weights, gamma, layer_norm) for layers in self.backend.embed_tokens(tokens)]

    def select(self, sentences: Sequence[str | Sequence[str]], layer: int | str = "average", task: str | None = None):
        """Per sentence (n_tokens, D') for one representation: ``layer`` int, "top", "average" (equal mix), "all"
        (layers side by side, L*D), or a stored ``task``'s mix (overrides ``layer``)."""
        if task is not None:
            return self.mix(sentences, task=task)
        per_sentence = self.layers(sentences)
        return [select_layer(layers, layer) for layers in per_sentence]

    def sentence_vectors(
        self,
        sentences: Sequence[str | Sequence[str]],
        layer: int | str = "average",
        task: str | None = None,
        pooling: str = "mean",
    ) -> np.ndarray:
        """(n_sentences, D') pooled over tokens ("mean", "max" or "mean+max"); an empty sentence pools to zeros."""
        vectors = self.select(sentences, layer=layer, task=task)
        return np.stack([pool(v, pooling) for v in vectors]) if vectors else np.zeros((0, 0), np.float32)


def select_layer(layers: np.ndarray, layer: int | str) -> np.ndarray:
    """(L, n, D) -> (n, D) for an int / "top" / "average"; (n, L*D) for "all"."""
    if isinstance(layer, (int, np.integer)) and not isinstance(layer, bool):
        if not -layers.shape[0] <= layer < layers.shape[0]:
            raise InputError(f"layer {layer} does not exist: the model has layers 0..{layers.shape[0] - 1}")
        return layers[layer]
    if layer == "top":
        return layers[-1]
    if layer == "average":
        return layers.mean(axis=0)
    if layer == "all":
        return np.concatenate(list(layers), axis=-1)
    raise InputError(f"layer must be an int, 'top', 'average' or 'all', got {layer!r}")


# -- scikit-learn ----------------------------------------------------------------------------------------------
try:
    from sklearn.base import BaseEstimator, TransformerMixin
except ImportError:  # the serving image has no scikit-learn; the transformer then is a plain class

    class BaseEstimator:  # two distinct stand-ins: a class cannot list `object` twice among its bases
        pass

    class TransformerMixin:
        pass


class ElmoVectorizer(TransformerMixin, BaseEstimator):
    """Sentences -> one ELMo vector each, for scikit-learn pipelines.

    ``X`` is a list of raw strings or of token lists. ``layer`` (int / "top" / "average" / "all") or a stored
    ``task`` picks the token vectors, ``pooling`` ("mean", "max", "mean+max") makes one vector per sentence.
    The biLM is frozen, so ``fit`` only checks the settings; the model is opened lazily on first ``transform`` and
    is not pickled with the estimator (a copy re-opens it).
    """

    def __init__(
        self,
        model: str | None = None,
        server: str | None = None,
        layer: int | str = "average",
        task: str | None = None,
        pooling: str = "mean",
        batch_size: int = 256,
    ) -> None:
        self.model = model
        self.server = server
        self.layer = layer
        self.task = task
        self.pooling = pooling
        self.batch_size = batch_size

    def _features(self) -> Features:
        if getattr(self, "_cached_features", None) is None:
            self._cached_features = Features(model=self.model, server=self.server)
        return self._cached_features

    def fit(self, X, y=None):  # noqa: N803 (scikit-learn's names)
        if self.pooling not in POOLINGS:
            raise InputError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        features = self._features()
        width = features.dim * (features.n_layers if self.layer == "all" and self.task is None else 1)
        self.n_features_out_ = width * (2 if self.pooling == "mean+max" else 1)
        return self

    def transform(self, X) -> np.ndarray:  # noqa: N803
        if not hasattr(self, "n_features_out_"):
            self.fit(X)
        X = list(X)
        features = self._features()
        parts = [
            features.sentence_vectors(X[i : i + self.batch_size], self.layer, self.task, self.pooling)
            for i in range(0, len(X), self.batch_size)
        ]
        return np.concatenate(parts) if parts else np.zeros((0, self.n_features_out_), np.float32)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_cached_features", None)
        return state


def __getattr__(name: str):
    """``Elmo``/``ScalarMix`` come from elmo.mix.modules on first access, so importing this module needs no torch."""
    if name in ("Elmo", "ElmoOutput", "ScalarMix"):
        from elmo.mix import modules

        return getattr(modules, name)
    raise AttributeError(f"module 'elmo.features' has no attribute {name!r}")
