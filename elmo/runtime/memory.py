"""How the runtime's memory is allocated and given back: onnxruntime's CPU arena and glibc's mmap threshold, chosen
once per process (``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``) and applied by
:func:`elmo.runtime.providers.open_session` to every session opened after; and the release once the process is idle
(``--memory-trim-interval-s``): each runtime's arenas shrunk (:func:`register_release`), then glibc's heaps trimmed.
No onnxruntime import here: the flags are built for ``elmo serve --help`` without loading it.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from elmo.errors import ConfigError
from elmo.flags import add_fields_as_flags, fields_from_args

log = logging.getLogger("elmo.runtime")

# onnxruntime's CPU arena keeps every chunk it ever grew to: after bursts of the largest requests a server held
# 2.8-2.9x its idle memory for good (bench/service/memory_after_burst.py, models/default). Without the arena the
# memory comes back (each tensor a malloc, trimmed once idle), but bursts of the largest requests ran 10-24 % fewer
# tokens/s: every run maps and faults its large buffers afresh. So the arena stays on, and once the process is idle
# each session's arena hands its free regions back (onnxruntime's run option memory.enable_memory_arena_shrinkage, on
# one tiny run), then glibc's free heap memory goes back too (malloc_trim); a fixed mmap threshold (which also stops
# glibc's own rising one) maps the largest freed regions on their own. Measured there (2 loaded cores): 0.99-1.02x
# after 60 s idle, bursts' tokens/s within the kept arena's spread. The shrinking runs (one token per session) take
# 10-150 ms, once per idle interval.
ARENA_CHOICES = ("off", "on")


@dataclass(frozen=True)
class MemoryOptions:
    """How the runtime's memory is allocated (``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``)."""

    cpu_memory_arena: str = "on"  # onnxruntime's CPU arena: reused batch to batch, shrunk once the process is idle
    malloc_mmap_threshold_bytes: int = 32 * 1024 * 1024  # glibc: blocks this large are mmapped (0: glibc's own)
    memory_trim_interval_s: float = 10.0  # arenas' free regions and glibc's free heap memory handed back after
    # an interval this long in which the process was idle (0: never, and the arena keeps its peak)

    def validate(self) -> MemoryOptions:
        if self.cpu_memory_arena not in ARENA_CHOICES:
            raise ConfigError(
                f"--cpu-memory-arena must be one of {', '.join(ARENA_CHOICES)} (got {self.cpu_memory_arena!r})"
            )
        if self.malloc_mmap_threshold_bytes < 0:
            got = self.malloc_mmap_threshold_bytes
            raise ConfigError(f"--malloc-mmap-threshold-bytes must be 0 or more (got {got})")
        if self.memory_trim_interval_s < 0:
            raise ConfigError(f"--memory-trim-interval-s must be 0 or more (got {self.memory_trim_interval_s})")
        return self


_MEMORY_HELP = {
    "cpu_memory_arena": "onnxruntime's CPU memory arena: 'on' reuses a batch's memory for the next batches (the "
    "largest requests run faster) and gives its free part back once the server is idle (--memory-trim-interval-s); "
    "'off' allocates each tensor on its own (the CPU-side buffers of the CUDA provider follow the same setting)",
    "malloc_mmap_threshold_bytes": "glibc's mmap threshold: blocks at least this large are mapped on their own and "
    "returned to the system when freed; 0 leaves glibc's own rising threshold (and MALLOC_MMAP_THRESHOLD_ in the "
    "environment wins over this)",
    "memory_trim_interval_s": "look this often whether the process was idle (under a twentieth of a core) since the "
    "last look, and if so give the free memory back to the system: the memory arenas' free regions (CPU, and the GPU's "
    "on CUDA) and what glibc holds free (malloc_trim). After a burst the memory returns to about its idle level within "
    "two of these; never under load, where it would be taken again; 0 = never (the arena then keeps its peak)",
}
# What open_session applies: onnxruntime's and glibc's own behaviour (the batch job, the library) until
# configure_memory sets it, as `elmo serve` does with its flags' defaults (MemoryOptions()).
_memory = MemoryOptions(cpu_memory_arena="on", malloc_mmap_threshold_bytes=0, memory_trim_interval_s=0)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime memory")
    add_fields_as_flags(group, MemoryOptions(), _MEMORY_HELP, choices={"cpu_memory_arena": ARENA_CHOICES})


def memory_from_args(args: argparse.Namespace) -> MemoryOptions:
    return fields_from_args(MemoryOptions, args).validate()


def configure_memory(options: MemoryOptions) -> None:
    """Apply ``options`` to this process: the arena choice for every session opened from now on, the mmap threshold
    now (glibc only; elsewhere, or where the environment sets it, the threshold is left alone)."""
    global _memory
    _memory = options.validate()
    if options.malloc_mmap_threshold_bytes and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _set_mmap_threshold(options.malloc_mmap_threshold_bytes)
    if options.memory_trim_interval_s:
        _start_trimming(options.memory_trim_interval_s)


_releases: list[weakref.WeakMethod] = []  # the runtimes' arena shrinkers (Embedder.release_memory), while they live
_releases_lock = threading.Lock()


def register_release(method: Callable[[], object]) -> None:
    """Have :func:`release_memory` call the bound ``method`` (an Embedder's ``release_memory``) while its object
    lives; held weakly, so that an unloaded model version goes away as before."""
    with _releases_lock:
        _releases[:] = [ref for ref in _releases if ref() is not None]
        _releases.append(weakref.WeakMethod(method))


def release_memory() -> bool:
    """Give the free memory back to the system, as the server does once idle: every live runtime's arenas shrink
    to what is in use (a runtime's failure is logged, not raised: the next runtime and glibc still go), then glibc's
    heaps are trimmed. True when glibc's trim ran."""
    with _releases_lock:
        live = [method for method in (ref() for ref in _releases) if method is not None]
    for method in live:
        try:
            method()
        except Exception as exc:  # a session closing under us, or a provider that refuses shrinkage: keep going
            log.warning("could not shrink a runtime's memory arenas: %s: %s", type(exc).__name__, exc)
    return release_free_memory()


def release_free_memory() -> bool:
    """glibc's ``malloc_trim(0)``: the free memory of its heaps goes back to the system; False elsewhere."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


_trimmer: threading.Thread | None = None


IDLE_CPU_SHARE = 0.05  # a process that used less than this share of one core over an interval is idle


def _start_trimming(interval_s: float) -> None:
    """A daemon thread (one per process) that releases free memory (:func:`release_memory`) after every
    ``interval_s`` in which the process was idle: under load the memory would be taken (and its pages faulted in)
    again at once. The shrinking runs are tiny (one token) and onnxruntime frees only regions no run is using, so a
    request arriving meanwhile runs beside them unharmed; ctypes and onnxruntime release the GIL."""
    global _trimmer
    if _trimmer is not None:
        return

    def trim() -> None:
        last = time.process_time()  # every thread's CPU time: the runtime's, the event loop's, the workers'
        while True:
            time.sleep(interval_s)
            if time.process_time() - last < IDLE_CPU_SHARE * interval_s:
                release_memory()
            last = time.process_time()

    _trimmer = threading.Thread(target=trim, name="memory-trim", daemon=True)
    _trimmer.start()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _set_mmap_threshold(size: int) -> bool:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, size)``, which also stops its threshold from rising; False elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(size)))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt to speak of), or no libc symbols
        return False


def memory_options() -> MemoryOptions:
    """The memory options sessions open with now."""
    return _memory


def cuda_memory_options(options: MemoryOptions) -> dict[str, str]:
    """The CUDA provider's share of ``options``: unless the arena is to keep its peak (on, never released), the device
    arena grows by what a run asks, not to the next power of two (less held between releases; a release frees
    whole regions)."""
    keeps_peak = options.cpu_memory_arena == "on" and not options.memory_trim_interval_s
    return {} if keeps_peak else {"arena_extend_strategy": "kSameAsRequested"}


__all__ = [
    "MemoryOptions",
    "add_memory_arguments",
    "configure_memory",
    "cuda_memory_options",
    "memory_from_args",
    "memory_options",
    "register_release",
    "release_free_memory",
    "release_memory",
]
