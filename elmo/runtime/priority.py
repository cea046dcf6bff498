"""Thread priorities: background work gives the cores to foreground work under load, and takes them when idle.

On Linux every thread has a nice value of its own, and a thread may lower its own priority (raise its nice value)
without privileges but never raise it back. So background work runs on threads of its own, each lowered once when it
starts (:func:`background_executor`). Niceness only matters when threads compete for a core: an idle machine runs
background threads at full speed, a loaded one gives the foreground threads ~10x their CPU share at nice +10
(the kernel's weights 1024 vs 110).

Elsewhere (macOS, Windows) per-thread priorities are not offered this way — ``setpriority(PRIO_PROCESS, tid)``
would name a *process* there — so background threads keep the normal priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # nice increment of background threads (0..19; 0 = the normal priority)
MAX_NICE = 19


def per_thread_priorities() -> bool:
    """Whether this platform lets a thread lower its own priority alone (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def lower_this_thread(increment: int) -> int:
    """Raise the calling thread's nice value by ``increment`` (capped at 19); returns the nice value it now has
    (the unchanged one where the platform has no per-thread priorities or refuses)."""
    if increment < 0:
        raise ValueError(f"a thread can only lower its priority: increment must be >= 0, not {increment}")
    if not per_thread_priorities():
        return 0
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if increment == 0:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + increment))
    except OSError as exc:  # a sandbox that forbids it: the work still runs, at the normal priority
        log.debug("could not lower thread %d's priority: %s", tid, exc)
        return current
    return os.getpriority(os.PRIO_PROCESS, tid)


def thread_nice() -> int:
    """The calling thread's nice value (0 where the platform has no per-thread priorities)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if per_thread_priorities() else 0


def background_executor(workers: int, name: str, nice: int = BACKGROUND_NICE) -> ThreadPoolExecutor:
    """A thread pool whose threads lower their priority by ``nice`` as they start."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=lower_this_thread, initargs=(nice,))


__all__ = [
    "BACKGROUND_NICE",
    "MAX_NICE",
    "background_executor",
    "lower_this_thread",
    "per_thread_priorities",
    "thread_nice",
]
