"""``elmo adapt --time-budget-s S``: one time budget for the whole command (split, scoring, training, export), kept
across ``--resume``. Torch-free.

A fixed reserve for the final scoring and the export would starve a small budget (a 180 s budget would train for
60 s) and would not count the split and the first scoring. So the command's own seconds are summed in its record
(adapt.json) at every step, training gets what is left after a *measured* reserve, and a resumed run continues the
same clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# What follows the training steps is reserved at this multiple of the measured time of the first scoring: the
# loop's last validation and the final scoring each repeat that work (the same held-out text and benchmark), and
# the export (trace, graphs, verification against PyTorch float64) measured about one scoring more (shipped default
# model on 2 cores, 5,800 held-out tokens: scoring 7.6 s; after its 124 s of training, a 180 s budget spent 39 s
# on everything else, split and first scoring included).
RESERVE_PER_SCORING = 3.0
# Before anything is measured (fitting a softmax to an imported model comes before its first scoring): this share.
RESERVE_SHARE_UNMEASURED = 0.2
# Training keeps at least this share of the budget, whatever the reserve: a budget too small for the scoring and
# the export is overrun rather than spent on nothing but measuring.
MIN_TRAINING_SHARE = 0.25


@dataclass
class CommandClock:
    """Seconds the command has used: ``spent_before_s`` in earlier runs (from the record) plus this run's."""

    budget_s: float
    spent_before_s: float = 0.0
    now: Callable[[], float] = time.monotonic  # a fixed clock in the tests of the arithmetic
    opened: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.opened < 0:
            self.opened = self.now()

    def spent_s(self) -> float:
        return self.spent_before_s + self.now() - self.opened

    def left_s(self) -> float:
        return self.budget_s - self.spent_s()


def spent_in_earlier_runs(record: dict, train_elapsed_s: float | None) -> float:
    """What the runs before this one used: the seconds they saved in the record, or, for a run killed without
    warning (SIGKILL) in the middle of training, the seconds at the start of that training plus what the training
    loop's last checkpoint says it trained since (``train_elapsed_s``), whichever is more."""
    spent = float(record.get("spent_s", 0.0))
    mark = record.get("training_mark")
    if mark and train_elapsed_s is not None:
        spent = max(spent, mark["spent_s"] + max(0.0, train_elapsed_s - mark["elapsed_s"]))
    return spent


def reserve_s(scoring_s: float | None, budget_s: float) -> float:
    """Seconds to keep for the final scoring and the export."""
    if scoring_s is None:
        return RESERVE_SHARE_UNMEASURED * budget_s
    return RESERVE_PER_SCORING * scoring_s


def training_time_s(clock: CommandClock, reserve: float, trained_s: float) -> float:
    """The training loop's ``max_time_s`` (which counts its own seconds, across resumes): what it has trained
    (``trained_s``) plus what the budget still holds after the reserve, and at least MIN_TRAINING_SHARE of the budget
    in all."""
    more = clock.left_s() - reserve
    floor = MIN_TRAINING_SHARE * clock.budget_s - trained_s
    return trained_s + max(more, floor, 0.0)


__all__ = ["CommandClock", "reserve_s", "spent_in_earlier_runs", "training_time_s"]
