"""Issue 28's front-door cases against a real server on 127.0.0.1: the largest legal requests are refused by the
bound they cross (before the work they would cost), answers are limited in the bytes they would really take, a
client that hangs up is counted as such, and HTTP hygiene (405 + Allow, 415, the page's headers, names cut short)."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from elmo.service.http.app import PAGE, page_headers

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime import Embedder
from tests.service_helpers import EDGE_LIMITS, ServerThread, limits_with, metric_value, scrape_until


def post(url: str, path: str, body: bytes, content_type: str | None = "application/json"):
    """(status, headers, parsed JSON body) of one POST; HTTP errors are answers too."""
    request = urllib.request.Request(url + path, data=body, method="POST")
    if content_type is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, json.loads(exc.read())


def get(url: str, path: str, method: str = "GET"):
    request = urllib.request.Request(url + path, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    runtime = Embedder(tiny_model_dir, intra_op_threads=1)
    srv = ServerThread({"tiny": runtime}, limits_with(max_message_bytes=64 * 1024), metrics_port=0, http=True)
    srv.warm_up()
    yield srv
    srv.stop()


def largest_body(field: str, word: str, limit: int) -> bytes:
    """``{field: word * n}`` with n as large as the body limit allows."""
    n = (limit - 64) // len(word)
    return json.dumps({field: word * n}).encode()


def test_the_largest_legal_embeddings_body_is_refused_by_the_token_limit(server):
    body = largest_body("input", "apple ", 64 * 1024)
    status, _, answer = post(server.http_url, "/v1/embeddings", body)
    assert status == 413, answer
    # tokenizing stopped at the limit: the message says "more than" instead of counting all ~10,000 tokens
    assert f"has more than {EDGE_LIMITS.max_tokens_per_sentence} tokens" in answer["error"]["message"]


def test_tokenize_has_the_request_token_limit_on_http_and_grpc(server):
    body = largest_body("text", "apple pie ", 64 * 1024)
    status, _, answer = post(server.http_url, "/v1/tokenize", body)
    assert status == 413, answer
    assert f"more than {EDGE_LIMITS.max_tokens_per_request} tokens" in answer["error"]["message"]
    assert "--max-request-tokens" in answer["error"]["message"]
    within = " ".join(["pie"] * EDGE_LIMITS.max_tokens_per_request)
    assert post(server.http_url, "/v1/tokenize", json.dumps({"text": within}).encode())[0] == 200
    with EmbedderClient(server.target) as client, pytest.raises(RemoteError) as info:
        client.tokenize(["apple pie " * 100])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "--max-request-tokens" in info.value.details


def test_a_windowed_answer_is_limited_by_its_json_size_and_base64_is_suggested(tiny_model_dir):
    runtime = Embedder(tiny_model_dir, intra_op_threads=1)
    limits = limits_with(max_tokens_per_request=600, max_queue_tokens=2000, max_response_bytes=80 * 1024)
    srv = ServerThread({"tiny": runtime}, limits, http=True)
    srv.warm_up()
    try:
        text = " ".join(f"w{i % 50}" for i in range(500))  # 500 tokens in windows of 20; one layer of 16 floats
        request = {"inputs": [text], "overflow": "window", "layers": [2]}
        status, _, answer = post(srv.http_url, "/v1/embed", json.dumps(request).encode())
        # 8,000 floats: 32 KB raw (what the old check counted: under the limit), up to 192 KB as JSON numbers
        assert status == 413 and '"encoding": "base64"' in answer["error"]["message"], answer
        assert "as float" in answer["error"]["message"]
        status, _, answer = post(srv.http_url, "/v1/embed", json.dumps({**request, "encoding": "base64"}).encode())
        assert status == 200 and len(answer["embeddings"][0]["tokens"]) == 500
    finally:
        srv.stop()


def test_a_client_that_hangs_up_mid_upload_is_counted_as_gone_not_as_an_error(server, caplog):
    caplog.set_level(logging.DEBUG)
    port = int(server.http_url.rsplit(":", 1)[1])
    head = (
        "POST /v1/embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 5000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"inputs": ["half a bo')
    text = scrape_until(server.metrics_port, "elmo_requests_total", code="client_disconnected")
    assert metric_value(text, "elmo_requests_total", method="POST /v1/embed", code="client_disconnected") == 1
    assert metric_value(text, "elmo_requests_total", method="POST /v1/embed", code="500") is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # no error, no traceback in the log
    assert get(server.http_url, "/health")[0] == 200


def test_405_names_the_allowed_methods_in_allow(server):
    status, headers, _ = get(server.http_url, "/v1/embed")
    assert status == 405 and "POST" in headers["Allow"]
    status, headers, _ = get(server.http_url, "/health", method="DELETE")
    assert status == 405 and "GET" in headers["Allow"]


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_post_that_is_not_json_is_415(server, content_type):
    status, _, answer = post(server.http_url, "/v1/embeddings", b'{"input": "x"}', content_type)
    assert status == 415 and "application/json" in answer["error"]["message"], answer


def test_json_with_a_charset_is_json(server):
    status, _, _ = post(server.http_url, "/v1/embeddings", b'{"input": "x"}', "application/json; charset=utf-8")
    assert status == 200


def test_the_page_is_sent_with_csp_and_framing_headers(server):
    status, headers, body = get(server.http_url, "/")
    assert status == 200 and b"<html" in body.lower()
    for name, value in page_headers(PAGE.read_text(encoding="utf-8")).items():
        assert headers[name] == value
    assert "'unsafe-inline'" not in headers["Content-Security-Policy"].split("style-src-attr")[0]
    assert headers["Content-Security-Policy"].count("'sha256-") == 2  # the page's one script and one style block
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert get(server.http_url, "/health")[1]["X-Content-Type-Options"] == "nosniff"


def test_a_huge_model_name_is_cut_in_the_message(server):
    name = "m" * 30_000
    status, _, answer = post(server.http_url, "/v1/embeddings", json.dumps({"input": "x", "model": name}).encode())
    assert status == 404 and len(answer["error"]["message"]) < 500
    assert "(30000 characters)" in answer["error"]["message"]


def test_a_silent_connection_is_closed_at_the_header_timeout_and_counted(tiny_model_dir):
    runtime = Embedder(tiny_model_dir, intra_op_threads=1)
    srv = ServerThread({"tiny": runtime}, limits_with(http_header_timeout=0.3), metrics_port=0, http=True)
    srv.warm_up()
    try:
        port = int(srv.http_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
            assert sock.recv(1024) == b""  # the server closed it (a generous 10 s socket timeout would raise)
        text = scrape_until(srv.metrics_port, "elmo_http_connections_closed_total", reason="header_timeout")
        assert metric_value(text, "elmo_http_connections_closed_total", reason="header_timeout") == 1
        assert metric_value(text, "elmo_http_connections") is not None
    finally:
        srv.stop()


def test_a_large_answer_sent_in_pieces_equals_the_in_process_vectors(tiny_model_dir):
    from elmo.service.common.limits import Limits
    from elmo.service.http.app import SEND_PIECE_BYTES

    runtime = Embedder(tiny_model_dir, intra_op_threads=1)
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), http=True)
    srv.warm_up()
    try:
        sentences = [[f"w{i}_{j}" for j in range(20)] for i in range(40)]  # 800 tokens x 48 floats as JSON
        status, headers, answer = post(srv.http_url, "/v1/embed", json.dumps({"inputs": sentences}).encode())
        assert status == 200 and int(headers["Content-Length"]) > SEND_PIECE_BYTES
        assert headers["X-Content-Type-Options"] == "nosniff"
        for got, want in zip(answer["embeddings"], runtime.embed_tokens(sentences), strict=True):
            np.testing.assert_allclose(np.asarray(got["layers"], dtype=np.float32), want, rtol=0, atol=1e-6)
    finally:
        srv.stop()
