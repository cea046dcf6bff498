"""The request core's own helpers (service/core.py): what is decided by where the work runs."""

from __future__ import annotations

import asyncio

from elmo.service.core import _give_way, _stay, gil_yielder


def test_tokenizing_gives_the_gil_away_on_a_worker_but_not_on_the_event_loop():
    async def on_the_loop():
        return gil_yielder()

    assert gil_yielder() is _give_way  # no running loop here: a worker thread's view
    assert asyncio.run(on_the_loop()) is _stay
