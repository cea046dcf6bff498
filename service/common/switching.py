"""The GIL switch interval: short while heavy Python work runs on worker threads, Python's default otherwise.

A thread waiting for the GIL gets it only after the holder has run for the switch interval (5 ms by default).
The event loop gives the GIL away at every system call, so a health check or a one-sentence request that needs a
few dozen turns waited 100+ ms behind a worker encoding a large answer. A short interval fixes that, but costs
hand-offs when nothing heavy runs (~0.2 ms on a one-sentence request): so it is short only while heavy work is in
flight (``--switch-interval-ms``), and back to what it was when the last heavy piece ends.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class SwitchInterval:
    """Counts heavy work in flight; while any is, the process's switch interval is ``busy_s`` (None: left alone),
    and once none is, what it was before."""

    def __init__(self, busy_s: float | None = None):
        self.busy_s = busy_s
        self._idle_s = sys.getswitchinterval()
        self._heavy = 0
        self._lock = threading.Lock()

    def configure(self, busy_s: float | None) -> None:
        self.busy_s = busy_s

    @contextlib.contextmanager
    def heavy(self) -> Iterator[None]:
        with self._lock:
            self._heavy += 1
            if self._heavy == 1 and self.busy_s is not None:
                self._idle_s = sys.getswitchinterval()
                sys.setswitchinterval(self.busy_s)
        try:
            yield
        finally:
            with self._lock:
                self._heavy -= 1
                if self._heavy == 0 and self.busy_s is not None:
                    sys.setswitchinterval(self._idle_s)

    def wrap(self, work: Callable[..., T]) -> Callable[..., T]:
        """``work`` counted as heavy while it runs."""

        def heavy_work(*args, **kwargs) -> T:
            with self.heavy():
                return work(*args, **kwargs)

        return heavy_work


# One per process, as the interval is: the server configures it (--switch-interval-ms) when it starts.
PROCESS = SwitchInterval()

__all__ = ["PROCESS", "SwitchInterval"]
