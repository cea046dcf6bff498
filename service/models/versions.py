"""Serving a model repository (``elmo serve --model-root DIR``): versions loaded, swapped and released while serving.

``DIR/NAME/VERSION/`` is an exported model directory (elmo.runtime.repository: a version counts once it is complete
and its verification record passed). The :class:`ModelManager` keeps, for every model name, the versions its policy
wants loaded: the ``--keep-versions`` highest complete versions that did not fail (default 1: the latest), plus the
versions an admin loaded by number. It reconciles at start, every ``--poll-interval-s`` seconds (0 = never: then
only the admin API changes what is loaded), and on every admin command.

A swap, in order:

1. the new version is opened in a worker thread (never on the event loop), its batcher started, and its warm-up
   forward run through the batcher and checked (shape, finite values; the folder's verification record was checked
   before opening it); until then it takes no request;
2. it is registered: new requests without a pinned version go to it (``ModelRegistry.add_version``);
3. the old version is taken out of the registry, so no new request resolves to it; the requests that already did
   hold its in-flight count (taken by the request core when a request is admitted, given back when it ends
   however it ends: service/core/requests.py) and finish on it;
4. once its count is 0 its batcher stops, its onnxruntime sessions are closed, ``gc`` runs and, on glibc,
   ``malloc_trim(0)`` hands the freed heap back to the system, so the process's RSS comes down.

With ``--processes N`` every process has its own manager, and they follow one policy (service.models.group): an
admin call changes it for the whole group and is answered once every process has reconciled to it; the supervisor,
not each process, watches the repository (``--poll-interval-s``) and tells all of them when it changed.

A version that fails at step 1 is refused with one log line (``service.models``) and
``elmo_model_load_failures_total{model}``; whatever served before keeps serving. The poller does not try a failed
version again until its folder changes (or an admin loads it by hand).

Memory guard (``--max-model-memory-bytes``): a version is counted at ``MODEL_MEMORY_FACTOR`` times the size of its graph
and weight files (``*.onnx``, ``*.data``) from the moment it starts loading until it is released; a load that would
take the total over the limit is refused, naming what is loaded and its size. During a swap both versions are
loaded, so a swap of a model of size S needs 2 x S under the limit (use ``--keep-versions 1`` and unload first when
that does not fit).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import gc
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo.service.common.errors import Kind, ServiceError, clip, not_found
from elmo.service.common.limits import Limits, human_bytes
from elmo.service.models.group import RECONCILE_SIGNAL, ModelGroup, Policy, ProcessStatus
from elmo.service.models.registry import ModelRegistry, ServedModel, serve_model
from elmo.service.telemetry.metrics import ServiceMetrics

from elmo.errors import ConfigError
from elmo.runtime.repository import NAME_PATTERN, incomplete_reason, numbered_folders, scan, version_dir
from elmo.v1 import embedder_pb2 as pb

log = logging.getLogger("service.models")

# RSS a loaded version adds per byte of its graph and weight files, measured with the model-swap bench
# after a few requests (CPU; the context graph is opened twice, for parallel runs): 2.9 for an ELMo-original-shape
# model (4096/512, 357 MiB of files), 2.2 for the small preset. See bench/notes/model-swaps.md.
MODEL_MEMORY_FACTOR = 3.0
MODEL_FILE_SUFFIXES = (".onnx", ".data")
RELEASE_POLL_S = 0.02
GROUP_POLL_S = 0.05  # how often an admin call looks whether every process of the group has followed it
GROUP_SETTLE_S = 300.0  # how long it waits for them (a load takes seconds; a slow disk, more)
LOADED_STATES = (pb.VERSION_LOADING, pb.VERSION_READY, pb.VERSION_UNLOADING)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """``2GiB``, ``1.5 GB``, ``512MiB``, ``1000000`` -> bytes (KiB/MiB/GiB are powers of 1024, kB/MB/GB of 1000)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ConfigError(f"{text!r}: expected a size like 2GiB, 512MiB, 1.5GB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[unit])


def model_file_bytes(directory: Path) -> int:
    """Bytes of a model directory's graphs and weights (what onnxruntime reads into memory)."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file() and p.name.endswith(MODEL_FILE_SUFFIXES))


def estimate_memory(directory: Path) -> int:
    return int(model_file_bytes(directory) * MODEL_MEMORY_FACTOR)


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: give freed heap pages back to the system (False where there is no glibc)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _signature(directory: Path) -> tuple:
    """What changes when a version folder is replaced or repaired (a failed load is tried again then)."""
    try:
        return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()))
    except OSError:
        return ()


@dataclass
class VersionRecord:
    name: str
    number: int
    state: int = pb.VERSION_UNLOADED
    reason: str = ""
    model: ServedModel | None = None
    memory_bytes: int = 0
    failed_signature: tuple | None = None  # the folder as it was when it failed (None: not failed)
    refused_at_memory: int | None = None  # refused by the memory guard with this much in use (tried again below it)


class ModelManager:
    """Loads, swaps and releases the versions of the models under ``root`` (see the module's description)."""

    def __init__(
        self,
        root: Path,
        registry: ModelRegistry,
        limits: Limits,
        metrics: ServiceMetrics,
        open_runtime: Callable[[Path], Any],
        poll_interval_s: float = 0.0,
        keep_versions: int = 1,
        max_memory: int | None = None,
        release_timeout_s: float = 60.0,
        on_change: Callable[[], None] | None = None,
        group: ModelGroup | None = None,
    ):
        """``on_change``: called (on the event loop) after a version is added to or taken out of the registry: the
        server's health follows what is loaded. ``group``: the process group this one is part of (default: the one
        the environment names, service.models.group)."""
        if keep_versions < 1:
            raise ConfigError(f"--keep-versions {keep_versions}: keep at least 1 (the latest)")
        if poll_interval_s < 0:
            raise ConfigError(f"--poll-interval-s {poll_interval_s}: 0 (off) or more seconds")
        self.root = Path(root)
        scan(self.root)  # ModelFileError naming the folder when it is not there
        self.registry = registry
        self.limits = limits
        self.metrics = metrics
        self.open_runtime = open_runtime
        self.poll_interval_s = poll_interval_s
        self.keep_versions = keep_versions
        self.max_memory = max_memory
        self.release_timeout_s = release_timeout_s
        self.on_change = on_change or (lambda: None)
        self.records: dict[tuple[str, int], VersionRecord] = {}
        # the admin API's choices: versions pinned, excluded, models unwanted (shared by a group's processes)
        self.group = group if group is not None else ModelGroup.from_environment()
        self.policy = Policy()
        self._following: asyncio.Task | None = None
        self._follow_again = False
        self._ops: asyncio.Lock | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="model-load")
        self._poller: asyncio.Task | None = None
        self._releases: set[asyncio.Task] = set()

    # -- lifecycle -----------------------------------------------------------------------------------------------
    @property
    def pinned(self) -> dict[str, set[int]]:
        return self.policy.pinned

    @property
    def excluded(self) -> dict[str, set[int]]:
        return self.policy.excluded

    @property
    def unwanted(self) -> set[str]:
        return self.policy.unwanted

    async def start(self) -> None:
        """Load what the policy wants (the latest complete version of every model), then poll if asked to; in a
        group, follow the group's policy whenever the supervisor says it changed."""
        self._ops = asyncio.Lock()
        await self.reconcile()
        if self.group is not None:
            asyncio.get_running_loop().add_signal_handler(RECONCILE_SIGNAL, self._follow_soon)
        if self.poll_interval_s > 0:
            self._poller = asyncio.get_running_loop().create_task(self._poll(), name="model-root-poll")

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.reconcile()
            except Exception:  # a bad moment on disk must not stop the polling
                log.exception("polling %s failed; trying again in %.1f s", self.root, self.poll_interval_s)

    def _follow_soon(self) -> None:
        """The supervisor says the group's policy or the repository changed: reconcile (once more if one runs)."""
        if self._following is not None and not self._following.done():
            self._follow_again = True
            return
        self._following = asyncio.get_running_loop().create_task(self._follow(), name="model-group-follow")

    async def _follow(self) -> None:
        self._follow_again = True
        while self._follow_again:
            self._follow_again = False
            try:
                await self.reconcile()
            except Exception:  # a bad moment on disk: the next signal tries again
                log.exception("following the group's models under %s failed", self.root)

    async def close(self) -> None:
        """Stop polling, release every version (the server is draining: its requests are done or cut)."""
        if self.group is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                asyncio.get_running_loop().remove_signal_handler(RECONCILE_SIGNAL)
        if self._following is not None:
            self._following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._following
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for record in list(self.records.values()):
            if record.model is not None and record.state == pb.VERSION_READY:
                self._retire(record, timeout_s=0.0)
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
        self._loader.shutdown(wait=False, cancel_futures=True)

    async def wait_released(self) -> None:
        """Wait until every version taken out of service has been released (tests, benchmarks)."""
        while self._releases:
            await asyncio.gather(*list(self._releases), return_exceptions=True)

    # -- the policy ----------------------------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Bring what is loaded in line with the disk and the policy (one change at a time)."""
        assert self._ops is not None, "start() first"
        async with self._ops:
            self._adopt_group_policy()
            found = await asyncio.get_running_loop().run_in_executor(None, scan, self.root)
            for name, complete in found.items():
                if name not in self.unwanted:
                    await self._settle(name, complete)
            self._drop_unwanted()
            self._report_to_group()

    def _adopt_group_policy(self) -> None:
        if self.group is not None:
            self.policy = self.group.policy()

    def _drop_unwanted(self) -> None:
        """What the admin API unloaded (here or, in a group, in another process) is not served, even as a model's
        last version."""
        for name in list(self.unwanted) + list(self.excluded):
            for record in self._loaded_records(name):
                if name in self.unwanted or record.number in self.excluded.get(name, set()):
                    self._retire(record)

    def _report_to_group(self) -> None:
        if self.group is not None:
            serving = {name: model.number for name, model in self.registry.models.items()}
            self.group.report(ProcessStatus(self.policy.round, serving))

    def _change_policy(self, mutate: Callable[[Policy], None]) -> None:
        """An admin call's change: to this process's policy, or (in a group) to the group's, which this process
        then follows (the other processes, once the supervisor tells them)."""
        if self.group is None:
            mutate(self.policy)
        else:
            self.policy = self.group.change(mutate)

    async def _wait_for_the_group(self) -> None:
        """In a group, once this process followed an admin call: until every process has (or GROUP_SETTLE_S)."""
        if self.group is None:
            return
        self._report_to_group()
        round_ = self.policy.round
        deadline = time.monotonic() + GROUP_SETTLE_S
        while self.group.settled(round_) is None:
            if time.monotonic() > deadline:
                log.warning("not every server process followed the admin call within %.0f s", GROUP_SETTLE_S)
                return
            await asyncio.sleep(GROUP_POLL_S)

    def _wanted(self, name: str, complete: list[int]) -> set[int]:
        excluded = self.excluded.get(name, set())
        usable = [v for v in complete if v not in excluded and not self._failed(name, v)]
        return set(usable[-self.keep_versions :]) | (self.pinned.get(name, set()) & set(complete))

    def _failed(self, name: str, number: int) -> bool:
        record = self.records.get((name, number))
        if record is None or record.state != pb.VERSION_FAILED:
            return False
        if record.refused_at_memory is not None:  # worth another try once memory was freed
            return self._memory_in_use()[0] >= record.refused_at_memory
        if record.failed_signature is None:
            return False
        if record.failed_signature != _signature(version_dir(self.root, name, number)):
            record.failed_signature = None  # the folder changed: worth another try
            return False
        return True

    async def _settle(self, name: str, complete: list[int]) -> None:
        """Load the wanted versions of ``name`` that are not loaded (newest first; one that fails drops out of the
        wanted set, so the next older one is wanted instead), then release the loaded ones no longer wanted. A
        model's last serving version is never released for a failed successor."""
        tried: set[int] = set()
        while True:
            wanted = self._wanted(name, complete)
            missing = sorted((v for v in wanted if not self._loaded(name, v) and v not in tried), reverse=True)
            if not missing:
                break
            tried.add(missing[0])
            await self._load(name, missing[0])
        wanted = self._wanted(name, complete)
        for record in self._loaded_records(name):
            if record.number not in wanted and any(self._loaded(name, v) for v in wanted):
                self._retire(record)

    def _loaded(self, name: str, number: int) -> bool:
        record = self.records.get((name, number))
        return record is not None and record.state == pb.VERSION_READY

    def _loaded_records(self, name: str) -> list[VersionRecord]:
        return [r for (n, _), r in sorted(self.records.items()) if n == name and r.state == pb.VERSION_READY]

    # -- loading -------------------------------------------------------------------------------------------------
    def _memory_in_use(self) -> tuple[int, list[str]]:
        loaded = [r for r in self.records.values() if r.state in LOADING_OR_LOADED]
        described = [f"{r.name}@{r.number} ({human_bytes(r.memory_bytes)}, {_state_word(r.state)})" for r in loaded]
        return sum(r.memory_bytes for r in loaded), described

    async def _load(self, name: str, number: int) -> VersionRecord:
        """Open, check and warm up one version; register it once it passed. Never raises: a failure is recorded."""
        record = self.records.setdefault((name, number), VersionRecord(name, number))
        directory = version_dir(self.root, name, number)
        record.reason, record.failed_signature, record.refused_at_memory = "", None, None
        reason = incomplete_reason(directory) if directory.is_dir() else f"{directory}: no such folder"
        if reason is not None:
            return self._refuse(record, directory, f"not a complete export: {reason}")
        estimate = estimate_memory(directory)
        if self.max_memory is not None:
            used, described = self._memory_in_use()
            if used + estimate > self.max_memory:
                record.refused_at_memory = used
                return self._refuse(
                    record,
                    directory,
                    f"needs about {human_bytes(estimate)} (x{MODEL_MEMORY_FACTOR:g} its model files), and "
                    f"{human_bytes(used)} of --max-model-memory-bytes {human_bytes(self.max_memory)} is taken by "
                    f"{', '.join(described) or 'nothing'}: unload a version first or raise the limit",
                    memory=True,
                )
        record.state, record.memory_bytes = pb.VERSION_LOADING, estimate
        started = time.monotonic()
        model: ServedModel | None = None
        try:
            runtime = await asyncio.get_running_loop().run_in_executor(self._loader, self.open_runtime, directory)
            model = serve_model(runtime, directory, self.limits, self.metrics.observer(name), name=name)
            model.number, model.memory_bytes = number, estimate
            model.batcher.start()
            await model.warm_up()  # a real forward through the batcher, its shape and values checked
        except Exception as exc:  # noqa: BLE001 - any failure refuses this version and nothing else
            message = exc.message if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"
            if model is not None:
                await self._free(model)
            return self._refuse(record, directory, message.splitlines()[0] if message else type(exc).__name__)
        serving = self.registry.models.get(name)
        if serving is not None and (serving.n_layers, serving.dim) != (model.n_layers, model.dim):
            log.warning(
                "model %s version %d has %d layers of %d, version %d had %d of %d: clients see the change",
                name,
                number,
                model.n_layers,
                model.dim,
                serving.number,
                serving.n_layers,
                serving.dim,
            )
        record.model, record.state = model, pb.VERSION_READY
        replaced = self.registry.add_version(model)
        self.on_change()
        self.metrics.model_loads.labels(name).inc()
        self.metrics.ready.labels(name).set(1)
        if self.registry.models.get(name) is model:
            self.metrics.serving_version.labels(name).set(number)
        log.info(
            "model %s version %d loaded in %.1f s (%s, about %s)%s",
            name,
            number,
            time.monotonic() - started,
            model.provider,
            human_bytes(estimate),
            f"; it takes new requests from version {replaced.number}" if replaced is not None else "",
        )
        return record

    def _refuse(self, record: VersionRecord, directory: Path, reason: str, memory: bool = False) -> VersionRecord:
        record.state, record.reason, record.model, record.memory_bytes = pb.VERSION_FAILED, reason, None, 0
        # a memory refusal is tried again once memory frees up (refused_at_memory), not when the folder changes
        record.failed_signature = None if memory else _signature(directory)
        self.metrics.load_failures.labels(record.name).inc()
        serving = self.registry.models.get(record.name)
        still = f"; version {serving.number} keeps serving" if serving is not None else ""
        log.error("model %s version %d refused: %s%s", record.name, record.number, reason, still)
        return record

    # -- releasing -----------------------------------------------------------------------------------------------
    def _retire(self, record: VersionRecord, timeout_s: float | None = None) -> None:
        """Take a version out of service now; release it once its last request is done (in the background)."""
        model = record.model
        assert model is not None
        record.state = pb.VERSION_UNLOADING
        self.registry.remove_version(model)
        self.on_change()
        serving = self.registry.models.get(record.name)
        if serving is not None:
            self.metrics.serving_version.labels(record.name).set(serving.number)
        else:
            self.metrics.ready.labels(record.name).set(0)
            self.metrics.serving_version.labels(record.name).set(0)
        timeout = self.release_timeout_s if timeout_s is None else timeout_s
        task = asyncio.get_running_loop().create_task(self._release(record, model, timeout))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, record: VersionRecord, model: ServedModel, timeout_s: float) -> None:
        started = time.monotonic()
        while model.in_flight > 0 and time.monotonic() - started < timeout_s:
            await asyncio.sleep(RELEASE_POLL_S)
        if model.in_flight > 0 and timeout_s > 0:
            log.warning(
                "model %s version %d: %d requests still in flight after %.0f s; releasing it under them",
                record.name,
                record.number,
                model.in_flight,
                timeout_s,
            )
        waited = time.monotonic() - started
        if record.model is model:  # (not when the same version was loaded again meanwhile)
            record.model = None
        await self._free(model)
        del model
        await asyncio.get_running_loop().run_in_executor(None, _collect)
        if record.state == pb.VERSION_UNLOADING:
            record.state, record.memory_bytes = pb.VERSION_UNLOADED, 0
        self.metrics.model_unloads.labels(record.name).inc()
        log.info(
            "model %s version %d released (%.2f s after it stopped taking requests)", record.name, record.number, waited
        )

    async def _free(self, model: ServedModel) -> None:
        await model.batcher.close()
        runtime, model.runtime = model.runtime, None
        if hasattr(runtime, "close"):
            await asyncio.get_running_loop().run_in_executor(None, runtime.close)
        model.batcher = None  # type: ignore[assignment]  (it holds the runtime's bound methods)

    # -- explicit control (the admin API) --------------------------------------------------------------------------
    def _check_name(self, name: str) -> Path:
        if not NAME_PATTERN.fullmatch(name or ""):
            raise ServiceError(Kind.INVALID_INPUT, f"model name {clip(name)!r} is not a model folder's name")
        folder = self.root / name
        if not folder.is_dir():
            raise not_found(f"no model '{clip(name)}' under {self.root}")
        return folder

    async def load(self, name: str, version: int = 0) -> pb.ModelStatus:
        """Load a version (0: the latest complete one) and keep it loaded; the policy then releases what it no longer
        wants. ServiceError: NOT_FOUND (no such model or version), REFUSED (it failed; the reason is given)."""
        folder = self._check_name(name)
        assert self._ops is not None
        async with self._ops:
            complete = await asyncio.get_running_loop().run_in_executor(None, scan, self.root)
            versions = complete.get(name, [])
            if version == 0:
                if not versions:
                    present = numbered_folders(folder)
                    why = f" (folders {', '.join(map(str, present))} are not complete exports)" if present else ""
                    raise not_found(f"model '{name}' has no complete version under {folder}{why}")
                version = versions[-1]
            elif version not in numbered_folders(folder):
                raise not_found(f"model '{name}' has no version {version} under {folder}")
            latest = versions[-1] if versions else 0

            def want(policy: Policy) -> None:
                policy.unwanted.discard(name)
                policy.excluded.get(name, set()).discard(version)
                if version != latest:
                    policy.pinned.setdefault(name, set()).add(version)

            self._change_policy(want)
            if not self._loaded(name, version):
                record = await self._load(name, version)
                if record.state != pb.VERSION_READY:
                    self._change_policy(lambda policy: policy.pinned.get(name, set()).discard(version))
                    self._report_to_group()
                    raise ServiceError(Kind.REFUSED, f"model {name} version {version} refused: {record.reason}")
            await self._settle(name, versions)
        await self._wait_for_the_group()
        return self.status(name)

    async def unload(self, name: str, version: int = 0) -> pb.ModelStatus:
        """Stop serving a version (0: every version; the poller then leaves the model alone until it is loaded
        again); its requests in flight finish first. NOT_FOUND when it is not loaded."""
        self._check_name(name)
        assert self._ops is not None
        async with self._ops:
            loaded = self._loaded_records(name)
            chosen = loaded if version == 0 else [r for r in loaded if r.number == version]
            if not chosen:
                have = ", ".join(f"{name}@{r.number}" for r in loaded) or "none"
                what = f"model '{name}'" if version == 0 else f"model version {name}@{version}"
                raise not_found(f"{what} is not loaded (loaded: {have})")

            def unwant(policy: Policy) -> None:
                if version == 0:
                    policy.unwanted.add(name)
                    policy.pinned.pop(name, None)
                else:
                    policy.excluded.setdefault(name, set()).add(version)
                    policy.pinned.get(name, set()).discard(version)

            self._change_policy(unwant)
            for record in chosen:
                self._retire(record)
            if self.group is not None and version != 0:  # as the others will: an older version may be wanted now
                complete = await asyncio.get_running_loop().run_in_executor(None, scan, self.root)
                await self._settle(name, complete.get(name, []))
        await self._wait_for_the_group()
        return self.status(name)

    # -- listing -------------------------------------------------------------------------------------------------
    def status(self, name: str, on_disk: bool = True) -> pb.ModelStatus:
        """A model's versions and their states: loaded ones, failed ones, and (``on_disk``) the rest of its folders
        (UNLOADED, with the reason a folder does not count yet)."""
        serving = self.registry.models.get(name)
        versions: dict[int, pb.VersionStatus] = {}
        if on_disk:
            for number in numbered_folders(self.root / name):
                reason = incomplete_reason(version_dir(self.root, name, number)) or ""
                versions[number] = pb.VersionStatus(version=number, state=pb.VERSION_UNLOADED, reason=reason)
        for (record_name, number), record in self.records.items():
            if record_name != name or (not on_disk and record.state not in LOADING_OR_LOADED):
                continue
            model = record.model
            versions[number] = pb.VersionStatus(
                version=number,
                state=record.state,
                reason=record.reason,
                serving=serving is not None and model is serving,
                memory_bytes=record.memory_bytes,
                in_flight=model.in_flight if model is not None else 0,
            )
        return pb.ModelStatus(name=name, versions=[versions[v] for v in sorted(versions)])

    def index(self) -> list[pb.ModelStatus]:
        names = set(scan(self.root)) | {name for name, _ in self.records}
        return [self.status(name) for name in sorted(names)]


LOADING_OR_LOADED = LOADED_STATES


def _state_word(state: int) -> str:
    return pb.VersionState.Name(state).removeprefix("VERSION_").lower()


def _collect() -> None:
    gc.collect()  # the released version's cycles, now: its sessions' memory is what the trim gives back
    trim_heap()


class FixedModels:
    """The repository a ``--model DIR`` serves: its models, one version each (number 0), loaded at start and
    released at the drain; never polled, never swapped, no admin API. The same operations as :class:`ModelManager`
    where they apply, so that the server and the core always have a repository to ask."""

    root = None

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    async def start(self) -> None:
        """Nothing to load: the models were opened before the server started (their warm-up is the server's)."""

    async def close(self) -> None:
        for model in self.registry.loaded():
            await model.batcher.close()

    def status(self, name: str, on_disk: bool = True) -> pb.ModelStatus:
        """The one version the name serves (``on_disk`` changes nothing: there is nothing else)."""
        model = self.registry.models[name]
        state = pb.VERSION_READY if model.ready else pb.VERSION_LOADING
        version = pb.VersionStatus(version=model.number, state=state, serving=True, in_flight=model.in_flight)
        return pb.ModelStatus(name=name, versions=[version])

    def index(self) -> list[pb.ModelStatus]:
        return [self.status(name) for name in sorted(self.registry.models)]


__all__ = ["MODEL_MEMORY_FACTOR", "FixedModels", "ModelManager", "estimate_memory", "parse_bytes", "trim_heap"]
