"""How the runtime's memory is allocated: onnxruntime's CPU arena and glibc's mmap threshold, chosen once per process
(``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``) and applied by
:func:`elmo.runtime.providers.open_session` to every session opened after. No onnxruntime import here: the flags are
built for ``elmo serve --help`` without loading it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from dataclasses import dataclass, fields

from elmo.errors import ConfigError

# onnxruntime's CPU arena keeps every chunk it ever grew to: after a burst of the largest requests a server held
# 2.5x its idle memory for good. Without the arena each tensor is a malloc, and glibc hands a large block back to
# the system at free only when it was mmapped: its threshold for that starts at 128 KiB but rises to the largest
# block freed (up to 32 MiB), after which the runtime's big tensors come from the heap and stay. A fixed threshold
# keeps them mmapped. Measured on models/default (bench/service/memory_after_burst.py): resident memory back within
# 1.1x of its pre-burst level, the arena's 2.5x gone, tokens/s within the run's spread.
ARENA_CHOICES = ("off", "on")


@dataclass(frozen=True)
class MemoryOptions:
    """How the runtime's memory is allocated (``elmo serve --cpu-memory-arena``, ``--malloc-mmap-threshold-bytes``)."""

    cpu_memory_arena: str = "off"  # onnxruntime's CPU arena: "on" keeps the largest batch's memory for good
    malloc_mmap_threshold_bytes: int = 256 * 1024  # glibc: blocks at least this large are mmapped (0: glibc's own)

    def validate(self) -> MemoryOptions:
        if self.cpu_memory_arena not in ARENA_CHOICES:
            raise ConfigError(f"--cpu-memory-arena must be one of {', '.join(ARENA_CHOICES)} "
                              f"(got {self.cpu_memory_arena!r})")  # fmt: skip
        if self.malloc_mmap_threshold_bytes < 0:
            got = self.malloc_mmap_threshold_bytes
            raise ConfigError(f"--malloc-mmap-threshold-bytes must be 0 or more (got {got})")
        return self


_MEMORY_HELP = {
    "cpu_memory_arena": "onnxruntime's CPU memory arena: 'off' allocates each tensor on its own, so that the memory of "
    "a burst of large requests goes back to the system once they are answered; 'on' keeps the largest batch's memory "
    "for later batches (the CPU-side buffers of the CUDA provider follow the same setting; on the GPU, 'off' also "
    "grows the device arena by what is asked, not by powers of two)",
    "malloc_mmap_threshold_bytes": "glibc's mmap threshold: blocks at least this large are mapped on their own and "
    "returned to the system when freed; 0 leaves glibc's own rising threshold (and MALLOC_MMAP_THRESHOLD_ in the "
    "environment wins over this)",
}
# What open_session applies: onnxruntime's and glibc's own behaviour (the batch job, the library) until
# configure_memory sets it, as `elmo serve` does with its flags' defaults (MemoryOptions()).
_memory = MemoryOptions(cpu_memory_arena="on", malloc_mmap_threshold_bytes=0)


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
           "memory_options"]
