"""The served models: one runtime, one batcher and one task store per model, looked up by name."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from elmo.service import switching
from elmo.service.batcher import Batcher, BatcherObserver
from elmo.service.errors import Kind, ServiceError, clip, not_found
from elmo.service.limits import Limits
from elmo.service.tasks import ModelTasks

from elmo.errors import ConfigError

log = logging.getLogger("service.models")  # the documented logger name (docs/operations.md)


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

    async def warm_up(self) -> None:
        """runtime.warmup() in the worker thread, then one real forward through the batcher (checked)."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        if hasattr(self.runtime, "warmup"):
            await loop.run_in_executor(self.batcher.executor, self.runtime.warmup)
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


def _background_embed(runtime: Any):
    """The runtime's embed function for long requests: its parallel batches on lowered threads too, where the
    runtime offers that (elmo.runtime.Embedder's ``background``)."""
    embed = runtime.embed_tokens_with_stats
    if "background" in inspect.signature(embed).parameters:
        embed = functools.partial(embed, background=True)
    return switching.PROCESS.wrap(embed)  # its Python parts hold the GIL for milliseconds: hand it over fast


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
        runtime.embed_tokens_with_stats,
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
    that cannot change the name they send (``text-embedding-3-small``)."""

    def __init__(self, models: list[ServedModel], aliases: dict[str, tuple[str, str]] | None = None):
        if not models:
            raise ConfigError("no model to serve (--model DIR)")
        self.models: dict[str, ServedModel] = {}
        for model in models:
            if model.name in self.models:
                raise ConfigError(f"two models are named '{model.name}': give one another name with --model NAME=DIR")
            self.models[model.name] = model
        self.default = models[0].name
        self.aliases: dict[str, tuple[str, str]] = {}
        for alias, (model_name, task) in (aliases or {}).items():
            self._check_alias(alias, model_name, task)
            self.aliases[alias] = (model_name or self.default, task)

    def _check_alias(self, alias: str, model_name: str, task: str) -> None:
        where = f"--model-alias {alias}={model_name}{':' + task if task else ''}"
        if alias in self.models:
            raise ConfigError(f"{where}: '{alias}' is already a served model's name")
        if model_name and model_name not in self.models:
            raise ConfigError(f"{where}: no served model is named '{model_name}' (serving: {', '.join(self.models)})")
        model = self.models[model_name or self.default]
        if task and task not in model.tasks.names():
            raise ConfigError(f"{where}: model '{model.name}' has no task '{task}' (tasks: "
                              f"{', '.join(model.tasks.names()) or 'none'})")  # fmt: skip

    def get(self, name: str) -> ServedModel:
        return self.resolve(name)[0]

    def resolve(self, name: str) -> tuple[ServedModel, str]:
        """A request's ``model`` -> (the model, the task an alias names, else "")."""
        if not name:
            return self.models[self.default], ""
        if name in self.aliases:
            model_name, task = self.aliases[name]
            return self.models[model_name], task
        try:
            return self.models[name], ""
        except KeyError:
            raise not_found(f"unknown model '{clip(name)}' (serving: {', '.join(self.names())})") from None

    def names(self) -> list[str]:
        """Served models' names, then aliases."""
        return [*self.models, *self.aliases]

    def __iter__(self):
        return iter(self.models.values())


__all__ = ["ModelRegistry", "ServedModel", "parse_alias", "serve_model"]
