"""Stopping a long command cleanly: Ctrl-C (SIGINT) or SIGTERM asks it to stop after the step in progress, so that it
can save what it has (a checkpoint, the adaptation record) and say how to resume; a second signal stops at once.

Without it, ``elmo train`` stopped before its first checkpoint would leave an empty run folder, and a stop in
the middle of a step could leave the weights and the optimizer state out of step with each other. Torch-free.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """While entered (``with StopRequest("elmo train") as stop:``), the first SIGINT / SIGTERM only sets
    ``stop.signal``; the loop looks at it between steps. The second one raises KeyboardInterrupt where the program
    is (elmo.cli prints "interrupted" then). Outside the main thread (where Python delivers signals) it does nothing.
    """

    def __init__(self, command: str = "elmo") -> None:
        self.command = command
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by that signal (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + int(self.signal or 0)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.signal = signum
        print(
            f"{self.command}: {self.name}: stopping after the step in progress and saving a checkpoint "
            "(again to stop at once, without one)",
            file=sys.stderr,
            flush=True,
        )


__all__ = ["StopRequest"]
