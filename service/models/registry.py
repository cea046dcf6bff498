"""The served models: one runtime, one batcher and one task store per model, looked up by name."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from elmo.service.common.errors import Kind, ServiceError, clip, not_found
from elmo.service.common.limits import Limits
from elmo.service.models.batcher import Batcher
from elmo.service.models.tasks import ModelTasks
from elmo.service.telemetry.hooks import BatcherObserver

from elmo.errors import ConfigError, ModelFileError
from elmo.runtime.repository import VERSION_PATTERN

log = logging.getLogger("service.models")  # the documented logger name (docs/reference/metrics.md)


@dataclass
class ServedModel:
    name: str
    directory: Path
    runtime: Any  # elmo.runtime.Embedder (duck-typed: .info, .embed_tokens_with_stats, .warmup)
    batcher: Batcher
    tasks: ModelTasks
    n_layers: int
    dim: int
    max_tokens_per_sentence: int  # the model's own limit (the service may cap it lower)
    provider: str
    version: str
    ready: bool = field(default=False)
    number: int = 0  # the version's folder number under --model-root (0: a model served with --model DIR)
    memory_bytes: int = 0  # what it counts against --max-model-memory-bytes
    _in_flight: int = field(default=0, repr=False)
    _count_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ref(self) -> str:
        """``name@number`` (the answer's X-Elmo-Model header), or ``name`` for a model served with --model."""
        return f"{self.name}@{self.number}" if self.number else self.name

    @property
    def in_flight(self) -> int:
        """Requests that resolved to this version and have not finished: its release waits for 0."""
        return self._in_flight

    def acquire(self) -> None:
        """Taken and given back by the request core only (service/core/requests.py, ``_in_flight``)."""
        with self._count_lock:
            self._in_flight += 1

    def release(self) -> None:
        with self._count_lock:
            self._in_flight -= 1

    async def warm_up(self) -> None:
        """runtime.warmup() in the worker thread, then one real forward through the batcher (checked)."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        if hasattr(self.runtime, "warmup"):  # elmo.runtime.Embedder: the load-time check first (elmo.runtime.probe)
            try:
                await loop.run_in_executor(self.batcher.executor, self.runtime.warmup)
            except ModelFileError as exc:
                raise ServiceError(Kind.REFUSED, f"model {self.name}: {exc}") from None
        (vectors,), _ = await self.batcher.embed([["warm", "-", "up"]])
        expected = (self.n_layers, 3, self.dim)
        if vectors.shape != expected:
            raise ServiceError(
                Kind.INTERNAL, f"model {self.name}: warm-up forward gave shape {vectors.shape}, expected {expected}"
            )
        finite = int(np.count_nonzero(np.isfinite(vectors)))
        if finite != vectors.size:
            raise ServiceError(
                Kind.INTERNAL,
                f"model {self.name}: warm-up forward gave {vectors.size - finite} non-finite values (NaN or inf) "
                f"of {vectors.size}: the model's weights are broken (check {self.directory})",
            )
        self.ready = True
        log.info("model %s warmed up in %.2f s (provider %s)", self.name, time.monotonic() - started, self.provider)


def _info_value(info: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = info.get(name) if isinstance(info, dict) else getattr(info, name, None)
        if value is not None:
            return value
    return default


def _version(runtime: Any) -> str:
    """The model's version: onnx.json ``version`` if set, else the checkpoint hash it was exported from."""
    meta = getattr(runtime, "meta", None) or {}
    if meta.get("version"):
        return str(meta["version"])
    sha = meta.get("checkpoint_sha256")
    return f"sha256:{sha[:12]}" if sha else ""


def _embed_fn(runtime: Any, **options: bool):
    """The runtime's embed function with those of ``options`` it offers (elmo.runtime.Embedder's ``background``
    and ``views``; a duck-typed runtime may offer neither)."""
    embed = runtime.embed_tokens_with_stats
    offered = inspect.signature(embed).parameters
    options = {name: value for name, value in options.items() if name in offered}
    return functools.partial(embed, **options) if options else embed


def _background_embed(runtime: Any):
    """The runtime's embed function for long requests: its parallel batches on lowered threads too, where the
    runtime offers that (elmo.runtime.Embedder's ``background``)."""
    return _embed_fn(runtime, background=True, views=True)


def parse_alias(value: str) -> tuple[str, tuple[str, str]]:
    """``NAME=MODEL[:TASK]`` -> (NAME, (MODEL, TASK)); an empty MODEL is the default model."""
    name, sep, target = value.partition("=")
    model, _, task = target.partition(":")
    if not sep or not name or not (model or task):
        raise ConfigError(f"--model-alias {value}: expected NAME=MODEL or NAME=MODEL:TASK")
    return name, (model, task)


def serve_model(
    runtime: Any, directory: Path, limits: Limits, observer: BatcherObserver, name: str = ""
) -> ServedModel:
    """Wrap a loaded runtime for serving (``name`` overrides the name the model reports)."""
    info = runtime.info
    name = name or str(_info_value(info, "name", default=directory.name))
    n_layers = int(_info_value(info, "n_layers"))
    dim = int(_info_value(info, "dim"))
    batcher = Batcher(
        # Views, not copies, of each sentence's vectors: the answers copy them anyway, and each copy on the worker
        # would wait for the GIL beside the busy event loop (elmo.runtime.Embedder.embed_tokens_with_stats).
        _embed_fn(runtime, views=True),
        max_batch_tokens=limits.max_batch_tokens,
        max_batch_sentences=limits.max_batch_sentences,
        max_delay_s=limits.max_delay_ms / 1000.0,
        max_queue_tokens=limits.max_queue_tokens,
        name=name,
        observer=observer,
        workers=int(getattr(runtime, "runs_in_flight", 1)),  # CPU: as many calls as runs at once; CUDA: one
        express_tokens=limits.express_tokens,
        background_fn=_background_embed(runtime),
        background_nice=limits.background_nice,
    )
    return ServedModel(
        name=name,
        directory=directory,
        runtime=runtime,
        batcher=batcher,
        tasks=ModelTasks(directory, n_layers=n_layers, dim=dim),
        n_layers=n_layers,
        dim=dim,
        max_tokens_per_sentence=int(
            _info_value(info, "max_tokens_per_sentence", default=limits.max_tokens_per_sentence)
        ),
        provider=str(_info_value(info, "provider", default="")),
        version=_version(runtime),
    )


class ModelRegistry:
    """Models by name; the first one registered is the default (empty ``model`` in a request). Aliases
    (``--model-alias NAME=MODEL[:TASK]``) are further names for a model, or for one of its task mixes, for clients
    that cannot change the name they send (``text-embedding-3-small``).

    Under ``--model-root`` a name may have several loaded versions (service.models.versions adds and removes them while
    serving): ``models[NAME]`` is the one that takes new requests (the highest loaded), ``versions[NAME][N]`` every
    loaded one, and a request may pin one as ``NAME@N``. Lookups and the in-flight count a request takes
    (:meth:`acquire`) happen under one lock with the changes, so a version taken out of service is never handed to a
    new request after :meth:`remove_version` returns."""

    def __init__(
        self,
        models: list[ServedModel],
        aliases: dict[str, tuple[str, str]] | None = None,
        allow_empty: bool = False,
    ):
        if not models and not allow_empty:
            raise ConfigError("no model to serve (--model DIR)")
        self._lock = threading.Lock()
        self.models: dict[str, ServedModel] = {}
        self.versions: dict[str, dict[int, ServedModel]] = {}
        for model in models:
            if model.name in self.models:
                raise ConfigError(f"two models are named '{model.name}': give one another name with --model NAME=DIR")
            self.models[model.name] = model
            self.versions[model.name] = {model.number: model}
        self._default = models[0].name if models else ""
        self.aliases: dict[str, tuple[str, str]] = {}
        for alias, (model_name, task) in (aliases or {}).items():
            if models:  # under --model-root the models load later: an alias to a missing one answers NOT_FOUND
                self._check_alias(alias, model_name, task)
            self.aliases[alias] = (model_name or self.default, task)

    @property
    def default(self) -> str:
        """The model an empty ``model`` names: the first registered, else (under --model-root, once that one is
        unloaded) the first in name order."""
        if self._default in self.models or not self.models:
            return self._default
        return sorted(self.models)[0]

    def _check_alias(self, alias: str, model_name: str, task: str) -> None:
        where = f"--model-alias {alias}={model_name}{':' + task if task else ''}"
        if alias in self.models:
            raise ConfigError(f"{where}: '{alias}' is already a served model's name")
        if model_name and model_name not in self.models:
            raise ConfigError(f"{where}: no served model is named '{model_name}' (serving: {', '.join(self.models)})")
        model = self.models[model_name or self.default]
        if task and task not in model.tasks.names():
            raise ConfigError(
                f"{where}: model '{model.name}' has no task '{task}' (tasks: "
                f"{', '.join(model.tasks.names()) or 'none'})"
            )

    def get(self, name: str) -> ServedModel:
        return self.resolve(name)[0]

    def resolve(self, name: str) -> tuple[ServedModel, str]:
        """A request's ``model`` -> (the model, the task an alias names, else ""). ``NAME@N`` pins version N."""
        with self._lock:
            return self._resolve(name)

    def acquire(self, name: str) -> tuple[ServedModel, str]:
        """:meth:`resolve`, counting the request in the version's in-flight count (give it back with
        ``model.release()``): the version is not released while the count is above 0."""
        with self._lock:
            model, task = self._resolve(name)
            model.acquire()
            return model, task

    def _resolve(self, name: str) -> tuple[ServedModel, str]:
        task = ""
        if name in self.aliases:
            name, task = self.aliases[name]
        name = name or self.default
        base, sep, number = name.partition("@")
        if sep:
            loaded = self.versions.get(base, {})
            # the repository's own rule: "²" or "٣" pass str.isdigit() and then break int() (a 500 once)
            if not VERSION_PATTERN.fullmatch(number) or int(number) not in loaded:
                have = ", ".join(m.ref for m in sorted(loaded.values(), key=lambda m: m.number)) or "none"
                raise not_found(
                    f"model version '{clip(name)}' is not loaded (loaded versions of '{clip(base)}': {have})"
                )
            return loaded[int(number)], task
        try:
            return self.models[name], task
        except KeyError:
            raise not_found(f"unknown model '{clip(name)}' (serving: {', '.join(self.names()) or 'none'})") from None

    def add_version(self, model: ServedModel) -> ServedModel | None:
        """Register a loaded, warmed-up version; it takes new requests when it is the name's highest loaded version.
        Returns the version that served new requests before, if this one replaces it."""
        with self._lock:
            versions = self.versions.setdefault(model.name, {})
            versions[model.number] = model
            before = self.models.get(model.name)
            if before is None or model.number >= before.number:
                self.models[model.name] = model
                if not self._default:
                    self._default = model.name
                return before if before is not model else None
            return None

    def remove_version(self, model: ServedModel) -> None:
        """Take a version out of service: no request resolves to it afterwards (those that did keep their count)."""
        with self._lock:
            versions = self.versions.get(model.name, {})
            if versions.get(model.number) is model:
                del versions[model.number]
            if self.models.get(model.name) is model:
                if versions:
                    self.models[model.name] = versions[max(versions)]
                else:
                    del self.models[model.name]
            if not versions:
                self.versions.pop(model.name, None)

    def loaded(self) -> list[ServedModel]:
        """Every loaded version of every model (the ones that take new requests and the pinned older ones)."""
        with self._lock:
            return [m for versions in self.versions.values() for m in versions.values()]

    def names(self) -> list[str]:
        """Served models' names, then aliases."""
        return [*self.models, *self.aliases]

    def __iter__(self):
        return iter(list(self.models.values()))


__all__ = ["ModelRegistry", "ServedModel", "parse_alias", "serve_model"]
