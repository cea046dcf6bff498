"""The request core's own helpers (service/core/requests.py): what is decided by where the work runs."""

from __future__ import annotations

import asyncio

from elmo.service.core.checks import _give_way, _stay, gil_yielder
from elmo.service.core.requests import RequestCore
from elmo.service.models.registry import ModelRegistry
from elmo.service.models.versions import FixedModels

from elmo.runtime.priority import per_thread_priorities, thread_nice
from tests.service_helpers import limits_with


def test_tokenizing_gives_the_gil_away_on_a_worker_but_not_on_the_event_loop():
    async def on_the_loop():
        return gil_yielder()

    assert gil_yielder() is _give_way  # no running loop here: a worker thread's view
    assert asyncio.run(on_the_loop()) is _stay


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
