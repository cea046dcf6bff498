"""bench.service.compiled_load's generators, the real ones (Debian's wrk and nghttp2's h2load, installed by
`make test`), against a real `elmo serve` of the tiny model: every request of a body that is not ASCII is answered,
and a run whose requests fail stops the bench with the generator's report instead of a rate of zero."""

from __future__ import annotations

import socket

import pytest

from bench.kit.load import build_http_requests, build_requests
from bench.kit.serve import start_server
from bench.service.compiled_load import grpc_frame, milliseconds, run_h2load, run_wrk, wrk_script

TEXTS = ["Les “guillemets” → ici, naïve café.", "苹果公司发布了新手机。"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    running = start_server(tiny_model_dir, threads=1)
    yield running
    running.stop()


def test_wrk_script_reads_the_body_byte_for_byte(tmp_path):
    body = build_http_requests(TEXTS, len(TEXTS), [], "float32")[0][0]
    script = wrk_script(body, tmp_path).read_text(encoding="utf-8")
    assert script.isascii() and "\\u" not in script  # nothing for Lua to unescape
    assert (tmp_path / "body.json").read_bytes() == body and not body.isascii()


def test_wrk_posts_a_body_that_is_not_ascii_and_every_request_is_answered(server, tmp_path):
    body = build_http_requests(TEXTS, len(TEXTS), [], "float32")[0][0]
    result = run_wrk(server.http_address, body, connections=2, duration=1, work=tmp_path)
    assert result["requests"] > 0 and result["failed"] == 0
    latency = result["latency_ms"]  # wrk --latency's percentiles, read from its report
    assert set(latency) == {"p50", "p99"} and 0 < latency["p50"] <= latency["p99"] < 1000 * result["seconds"]


def test_h2load_calls_embed_and_every_call_is_answered(server, tmp_path):
    body = tmp_path / "grpc.bin"
    body.write_bytes(grpc_frame(build_requests(TEXTS, len(TEXTS), [], "float32")[0][0]))
    result = run_h2load(server.grpc_target, body, connections=2, duration=1)
    assert result["requests"] > 0 and result["failed"] == 0
    latency = result["latency_ms"]  # h2load's "time for request" line: no percentiles there
    assert set(latency) == {"mean", "max"} and 0 < latency["mean"] <= latency["max"] < 1000 * result["seconds"]


@pytest.mark.parametrize(("duration", "ms"), [("850.12us", 0.85012), ("41.63ms", 41.63), ("1.20s", 1200.0)])
def test_generator_durations_read_in_milliseconds(duration, ms):
    assert milliseconds(duration) == pytest.approx(ms)


def test_failed_requests_stop_the_bench_with_the_generators_report(server, tmp_path):
    with pytest.raises(SystemExit, match=r"(?s)wrk: \d+ requests failed, 0 answered; its report:\n.*Non-2xx"):
        run_wrk(server.http_address, b'{"input": 42}', connections=1, duration=1, work=tmp_path)
    # h2load sees HTTP statuses only (gRPC's travels in trailers: compiled_load.check_answers reads it); a port
    # where nothing listens answers nothing.
    body = tmp_path / "grpc.bin"
    body.write_bytes(grpc_frame(build_requests(TEXTS, len(TEXTS), [], "float32")[0][0]))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(SystemExit, match=r"h2load: 0 requests failed, 0 answered"):
        run_h2load(closed, body, connections=1, duration=1)
