"""How the runtime's memory is allocated: onnxruntime's CPU arena and glibc's mmap threshold, chosen once per process
(``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``) and applied by
:func:`elmo.runtime.providers.open_session` to every session opened after. No onnxruntime import here: the flags are
built for ``elmo serve --help`` without loading it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
from dataclasses import dataclass, fields

from elmo.errors import ConfigError

# onnxruntime's CPU arena keeps every chunk it ever grew to: after bursts of the largest requests a server held
# 2.8-2.9x its idle memory for good (bench/service/memory_after_burst.py, models/default). Without the arena each
# tensor is a malloc, and glibc keeps what is freed in its heaps unless told to hand it back: malloc_trim does, once
# the process is idle, and a fixed mmap threshold (which also stops glibc's own rising one) keeps the largest blocks
# out of the heaps. Measured there: 1.01x after 60 s idle. The price: bursts of the largest requests ran 10-24 %
# fewer tokens/s than with the arena, round by round (2 loaded cores); smaller thresholds (256 KiB, 1 MiB) map the
# runtime's per-step tensors afresh on every run and cost more. --cpu-memory-arena on keeps the arena's speed.
ARENA_CHOICES = ("off", "on")


@dataclass(frozen=True)
class MemoryOptions:
    """How the runtime's memory is allocated (``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``)."""

    cpu_memory_arena: str = "off"  # onnxruntime's CPU arena: "on" keeps the largest batch's memory for good
    malloc_mmap_threshold_bytes: int = 32 * 1024 * 1024  # glibc: blocks this large are mmapped (0: glibc's own)
    memory_trim_interval_s: float = 10.0  # glibc's free heap memory handed back after this long idle (0: never)

    def validate(self) -> MemoryOptions:
        if self.cpu_memory_arena not in ARENA_CHOICES:
            raise ConfigError(f"--cpu-memory-arena must be one of {', '.join(ARENA_CHOICES)} "
                              f"(got {self.cpu_memory_arena!r})")  # fmt: skip
        if self.malloc_mmap_threshold_bytes < 0:
            got = self.malloc_mmap_threshold_bytes
            raise ConfigError(f"--malloc-mmap-threshold-bytes must be 0 or more (got {got})")
        if self.memory_trim_interval_s < 0:
            raise ConfigError(f"--memory-trim-interval-s must be 0 or more (got {self.memory_trim_interval_s})")
        return self


_MEMORY_HELP = {
    "cpu_memory_arena": "onnxruntime's CPU memory arena: 'off' allocates each tensor on its own, so that the memory of "
    "a burst of large requests goes back to the system once they are answered; 'on' keeps the largest batch's memory "
    "for later batches (the CPU-side buffers of the CUDA provider follow the same setting; on the GPU, 'off' also "
    "grows the device arena by what is asked, not by powers of two)",
    "malloc_mmap_threshold_bytes": "glibc's mmap threshold: blocks at least this large are mapped on their own and "
    "returned to the system when freed; 0 leaves glibc's own rising threshold (and MALLOC_MMAP_THRESHOLD_ in the "
    "environment wins over this)",
    "memory_trim_interval_s": "look this often whether the process was idle (under a twentieth of a core) since the "
    "last look, and if so hand the memory glibc holds free back to the system (malloc_trim): after a burst the memory "
    "returns to its idle level within two of these; never under load, where it would be taken again; 0 = never",
}
# What open_session applies: onnxruntime's and glibc's own behaviour (the batch job, the library) until
# configure_memory sets it, as `elmo serve` does with its flags' defaults (MemoryOptions()).
_memory = MemoryOptions(cpu_memory_arena="on", malloc_mmap_threshold_bytes=0, memory_trim_interval_s=0)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("runtime memory")
    for f in fields(MemoryOptions):
        default = getattr(MemoryOptions(), f.name)
        group.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default,
                           help=f"{_MEMORY_HELP[f.name]} (default {default})",
                           **({"choices": list(ARENA_CHOICES)} if f.name == "cpu_memory_arena" else {}))  # fmt: skip


def memory_from_args(args: argparse.Namespace) -> MemoryOptions:
    return MemoryOptions(**{f.name: getattr(args, f.name) for f in fields(MemoryOptions)}).validate()


def configure_memory(options: MemoryOptions) -> None:
    """Apply ``options`` to this process: the arena choice for every session opened from now on, the mmap threshold
    now (glibc only; elsewhere, or where the environment sets it, the threshold is left alone)."""
    global _memory
    _memory = options.validate()
    if options.malloc_mmap_threshold_bytes and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        _set_mmap_threshold(options.malloc_mmap_threshold_bytes)
    if options.memory_trim_interval_s:
        _start_trimming(options.memory_trim_interval_s)


def release_free_memory() -> bool:
    """glibc's ``malloc_trim(0)``: the free memory of its heaps goes back to the system; False elsewhere."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


_trimmer: threading.Thread | None = None


IDLE_CPU_SHARE = 0.05  # a process that used less than this share of one core over an interval is idle


def _start_trimming(interval_s: float) -> None:
    """A daemon thread (one per process) that releases free memory after every ``interval_s`` in which the process
    was idle: under load the memory would be taken (and its pages faulted in) again at once. ctypes releases the GIL
    for the call."""
    global _trimmer
    if _trimmer is not None:
        return

    def trim() -> None:
        last = time.process_time()  # every thread's CPU time: the runtime's, the event loop's, the workers'
        while True:
            time.sleep(interval_s)
            if time.process_time() - last < IDLE_CPU_SHARE * interval_s:
                release_free_memory()
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
    """The CUDA provider's share of ``options``: without the arena's keeping, its device arena grows by what a run
    asks, not to the next power of two."""
    return {"arena_extend_strategy": "kSameAsRequested"} if options.cpu_memory_arena == "off" else {}


__all__ = ["MemoryOptions", "add_memory_arguments", "configure_memory", "cuda_memory_options", "memory_from_args",
           "memory_options", "release_free_memory"]
