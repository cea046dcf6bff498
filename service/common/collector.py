"""Python's cyclic garbage collector in a serving process: the heap that lives as long as the process (modules,
models, onnxruntime sessions) kept out of its scans.

grpc.aio leaves six small objects in a reference cycle behind every call (its method lookup's closure, whatever
the servicer does), so under load the collector runs all the time: at ~500 calls/s on the tiny model, ~800 young
and ~7 full collections per 10 s, each full one traversing every object of the process (~23 ms, the GIL held:
every thread waits for it). Measured on an Intel Xeon (family 6 model 207); the record is in bench/notes/front-door.md.
``gc.freeze()`` once the server is warm moves what is alive then into a generation the collector never scans:
full collections fall to ~6 ms, and HTTP's p99 under load (one process) from 50-58 ms to 34-42 ms.

A model version loaded before the freeze and released later is frozen with the rest, and a cycle of it would
never be collected: every release calls :func:`settle`, which thaws the heap, collects it and freezes what is
left. This module owns the collector's state; nothing else freezes or thaws it.
"""

from __future__ import annotations

import gc

_frozen = False  # set by the serving process's entry point only: a process that embeds a server keeps its own GC


def freeze_long_lived() -> None:
    """The server is warm: collect the garbage, then freeze whatever is alive (it lives as long as the process)."""
    global _frozen
    _frozen = True
    settle()


def settle() -> None:
    """Collect the cyclic garbage, the frozen heap included where the process froze it (then freeze the rest)."""
    if _frozen:
        gc.unfreeze()
    gc.collect()
    if _frozen:
        gc.freeze()


def frozen_objects() -> int:
    """Objects the collector no longer scans (``elmo_gc_frozen_objects``)."""
    return gc.get_freeze_count()


__all__ = ["freeze_long_lived", "frozen_objects", "settle"]
