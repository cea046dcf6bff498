"""service.telemetry.observe: refusals for want of room are logged once per client and interval, not once per call."""

from __future__ import annotations

import logging

from elmo.service.telemetry.metrics import ServiceMetrics
from elmo.service.telemetry.observe import RefusalLines, RequestObserver

REQUESTS_LOG = "service.requests"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refuse(observer: RequestObserver, peer: str, outcome: str = "RESOURCE_EXHAUSTED") -> None:
    seen = observer.start("Embed")
    seen.finish(outcome, server_fault=True, describe=lambda: (peer, "-", "over its share"))


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == REQUESTS_LOG and r.levelno >= logging.WARNING]


def test_a_client_refused_again_and_again_gets_one_warning_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger=REQUESTS_LOG)
    clock = Clock()
    observer = RequestObserver(ServiceMetrics())
    observer.refusal_lines = RefusalLines(60.0, clock)
    for port in range(100):  # one client address, a new port (connection) each time
        refuse(observer, f"ipv4:10.0.0.7:{5000 + port}")
    for _ in range(50):
        refuse(observer, "10.0.0.8", "503")  # HTTP's peers carry no port
    lines = warnings(caplog)
    assert len(lines) == 2 and "peer=ipv4:10.0.0.7:5000" in lines[0] and "peer=10.0.0.8" in lines[1], lines
    clock.now += 61
    refuse(observer, "ipv4:10.0.0.7:6000")
    assert warnings(caplog)[-1].endswith("over its share (99 more like it from this client since its last one logged)")
    assert len(warnings(caplog)) == 3
    # every call is still counted
    text = observer.metrics.registry.get_sample_value("elmo_requests_total", {"method": "Embed", "code": "503"})
    assert text == 50


def test_other_server_faults_are_each_logged():
    observer = RequestObserver(ServiceMetrics())
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(REQUESTS_LOG).addHandler(handler)
    try:
        for _ in range(3):
            seen = observer.start("Embed")
            seen.finish("INTERNAL", server_fault=True, describe=lambda: ("ipv4:10.0.0.7:5000", "-", "bug"))
    finally:
        logging.getLogger(REQUESTS_LOG).removeHandler(handler)
    assert len([r for r in records if r.levelno == logging.WARNING]) == 3
