"""The request core's own helpers (service/core/requests.py): what is decided by where the work runs."""

from __future__ import annotations

import asyncio

from elmo.service.core import checks
from elmo.service.core.checks import _GiveWay, _stay, gil_yielder
from elmo.service.core.requests import RequestCore
from elmo.service.models.registry import ModelRegistry
from elmo.service.models.versions import FixedModels

from elmo.runtime.priority import per_thread_priorities, thread_nice
from tests.service_helpers import limits_with


def test_tokenizing_gives_the_gil_away_on_a_worker_but_not_on_the_event_loop():
    async def on_the_loop():
        return gil_yielder()

    assert isinstance(gil_yielder(), _GiveWay)  # no running loop here: a worker thread's view
    assert asyncio.run(on_the_loop()) is _stay


def test_a_worker_gives_the_gil_away_once_per_interval_not_once_per_text(monkeypatch):
    """A yield is a system call that costs more than a short text's tokens: between texts the worker yields only
    once YIELD_EVERY_S has passed since its last yield."""
    yields = []
    real_sleep = checks.time.sleep
    monkeypatch.setattr(checks.time, "sleep", lambda seconds: (yields.append(seconds), real_sleep(seconds)))
    give_way = gil_yielder()
    for _ in range(1000):  # back to back: far less than 1000 intervals
        give_way()
    assert len(yields) < 100
    before = len(yields)
    for _ in range(3):
        real_sleep(2 * checks.YIELD_EVERY_S)  # work that takes longer than the interval
        give_way()
    assert len(yields) == before + 3 and set(yields) == {0}


def test_the_request_workers_run_at_the_event_loops_priority():
    """They hold the GIL for their Python work: lowered, one preempted by the OS while holding it kept the event loop
    (health checks) waiting up to 1.3 s. --background-nice lowers the runtime's threads, never these."""
    registry = ModelRegistry([], allow_empty=True)
    core = RequestCore(registry, limits_with(background_nice=7), FixedModels(registry))
    try:
        seen = asyncio.run(core.run(thread_nice, heavy=True))
    finally:
        core.close()
    assert seen == thread_nice() or not per_thread_priorities()
