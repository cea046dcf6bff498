"""elmo adapt's time budget (elmo.train.budget): one clock for the whole command, a measured reserve for what follows
training, kept across --resume. The arithmetic, on a fixed clock; test_adapt.py runs it for real."""

from __future__ import annotations

import pytest

from elmo.train.budget import MIN_TRAINING_SHARE, CommandClock, reserve_s, spent_in_earlier_runs, training_time_s


def _clock(budget_s: float, spent_s: float) -> CommandClock:
    return CommandClock(budget_s, spent_before_s=spent_s, now=lambda: 100.0)


def test_a_three_minute_budget_trains_for_what_is_left_after_a_measured_reserve():
    # issue 30: `--minutes 3` trained ~60 s (180 - a fixed 120 s). Split and first scoring took 15 s, the scoring
    # itself 10 s: the reserve is three scorings (the loop's last validation, the final scoring, the export), the
    # rest trains.
    clock = _clock(180.0, 15.0)
    assert reserve_s(10.0, 180.0) == 30.0
    assert training_time_s(clock, reserve_s(10.0, 180.0), trained_s=0.0) == pytest.approx(135.0)
    # a resumed run adds what it trained before (the loop counts its own seconds across the resume)
    assert training_time_s(_clock(180.0, 95.0), 20.0, trained_s=80.0) == pytest.approx(80.0 + 65.0)


def test_training_keeps_a_floor_and_an_unmeasured_reserve_is_a_share():
    assert training_time_s(_clock(180.0, 30.0), reserve=300.0, trained_s=0.0) == MIN_TRAINING_SHARE * 180.0
    assert training_time_s(_clock(180.0, 200.0), reserve=20.0, trained_s=60.0) == 60.0  # spent: no more
    assert reserve_s(None, 600.0) == pytest.approx(120.0)


def test_earlier_runs_count_what_they_saved_or_what_their_checkpoints_trained():
    record = {"spent_s": 50.0, "training_mark": {"spent_s": 40.0, "elapsed_s": 10.0}}
    assert spent_in_earlier_runs(record, train_elapsed_s=70.0) == 100.0  # killed (SIGKILL) 60 s into training
    assert spent_in_earlier_runs(record, train_elapsed_s=None) == 50.0
    assert spent_in_earlier_runs({"spent_s": 50.0}, train_elapsed_s=70.0) == 50.0  # stopped cleanly: saved
    assert spent_in_earlier_runs({}, None) == 0.0


def test_the_clock_goes_on_from_the_earlier_runs():
    ticks = iter([10.0, 25.0, 40.0])
    clock = CommandClock(60.0, spent_before_s=30.0, now=lambda: next(ticks))  # opened at 10
    assert clock.spent_s() == 45.0  # at 25
    assert clock.left_s() == 0.0  # at 40
