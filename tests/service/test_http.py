"""The HTTP/JSON API on a real server on 127.0.0.1 (same process, same event loop as gRPC): answers equal to gRPC's,
every bad input answered with its status and a JSON error while the server stays up, the token, TLS, metrics,
warm-up, long inputs under each overflow policy, and HTTP and gRPC clients mixed under load."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from elmo.service.common.limits import Limits
from elmo.service.http.openapi import openapi_document

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime import Embedder
from tests.service_helpers import ServerThread, call, limits_with, model_with_pos_demo, self_signed_cert

TEXTS = ["The cat sat on the mat .", "苹果很好吃，苹果公司发布了新手机。", "naïve café 🙂", "a"]
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return model_with_pos_demo(tiny_model_dir, tmp_path_factory.mktemp("http"))


@pytest.fixture(scope="module")
def runtime(model_dir) -> Embedder:
    return Embedder(model_dir, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(runtime):
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), metrics_port=0, http=True)
    srv.warm_up()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def grpc_client(server):
    with EmbedderClient(server.target) as client:
        yield client


# -- answers ---------------------------------------------------------------------------------------------------
def test_embed_json_is_the_grpc_answer(server, grpc_client):
    status, answer = call(server.http_url, "/v1/embed", {"inputs": TEXTS, "task": "pos_demo"})
    assert status == 200 and answer["model"] == "tiny" and answer["layers"] == [0, 1, 2]
    expected = grpc_client.embed(TEXTS, task="pos_demo")
    assert answer["usage"]["prompt_tokens"] == sum(len(e.tokens) for e in expected)
    for got, want in zip(answer["embeddings"], expected):
        assert got["tokens"] == want.tokens and [tuple(o) for o in got["offsets"]] == want.offsets
        np.testing.assert_array_equal(np.asarray(got["layers"], dtype=np.float32), want.layers)
        np.testing.assert_array_equal(np.asarray(got["mix"], dtype=np.float32), want.mix)


def test_embed_base64_float16_decodes_to_the_grpc_vectors(server, grpc_client):
    inputs = [["pre", "tokenized"], {"text": "苹果"}]
    body = {"inputs": inputs, "layers": [2, 0], "dtype": "float16", "encoding": "base64"}
    status, answer = call(server.http_url, "/v1/embed", body)
    assert status == 200 and answer["layers"] == [2, 0]
    expected = grpc_client.embed([["pre", "tokenized"], "苹果"], layers=[2, 0], dtype="float16")
    for got, want in zip(answer["embeddings"], expected):
        tensor = got["layers"]
        assert tensor["dtype"] == "float16" and tensor["shape"] == list(want.layers.shape)
        decoded = np.frombuffer(base64.b64decode(tensor["data"]), dtype="<f2").reshape(tensor["shape"])
        np.testing.assert_array_equal(decoded, want.layers)
    assert "offsets" not in answer["embeddings"][0] and "offsets" in answer["embeddings"][1]


def test_tokenize_models_health_and_openapi(server, grpc_client):
    status, answer = call(server.http_url, "/v1/tokenize", {"texts": TEXTS})
    assert status == 200
    for got, (tokens, offsets) in zip(answer["texts"], grpc_client.tokenize(TEXTS)):
        assert got["tokens"] == tokens and [tuple(o) for o in got["offsets"]] == offsets
    status, models = call(server.http_url, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["tiny", "tiny:pos_demo"]
    assert models["data"][0]["dim"] == 16 and models["data"][0]["tasks"] == ["pos_demo"]
    assert call(server.http_url, "/v1/models/tiny:pos_demo")[1]["task"] == "pos_demo"
    assert call(server.http_url, "/health") == (200, {"status": "SERVING"})
    status, spec = call(server.http_url, "/openapi.json")
    assert status == 200 and spec == json.loads(json.dumps(openapi_document()))
    routes = {r.resource.canonical for r in server.server.http.app.router.routes()}
    assert routes == set(spec["paths"])  # no /admin/ routes: this server has no --admin-token (test_openapi.py)


def test_http_requests_are_counted_in_the_metrics(server):
    before = server.metric("elmo_requests_total", method="POST /v1/tokenize", code="200")
    call(server.http_url, "/v1/tokenize", {"text": "hello"})
    assert server.metric("elmo_requests_total", method="POST /v1/tokenize", code="200") == before + 1


def test_health_checks_and_paths_of_no_route_are_counted_apart_from_the_apis_requests(server):
    """A browser's /favicon.ico (404) and the probes' /health are not the API's requests: they are counted in
    elmo_other_requests_total, by kind, and never in elmo_requests_total (nor its error rate)."""
    other = {"favicon": ("unmatched", "GET", "404"), "health": ("health", "GET /health", "200")}
    counted = {name: dict(zip(("kind", "method", "code"), labels)) for name, labels in other.items()}
    before = {name: server.metric("elmo_other_requests_total", **labels) for name, labels in counted.items()}
    assert call(server.http_url, "/favicon.ico")[0] == 404
    assert call(server.http_url, "/health")[0] == 200
    for name, labels in counted.items():
        assert server.metric("elmo_other_requests_total", **labels) == before[name] + 1
    assert server.metric("elmo_requests_total", method="GET /health", code="200") == 0
    assert server.metric("elmo_requests_total", method="GET unmatched", code="404") == 0
    assert server.metric("elmo_requests_total", method="GET", code="404") == 0


def test_every_route_takes_its_texts_as_input_and_the_older_names_as_aliases(server):
    """One name for one idea: 'input' on /v1/embeddings, /v1/embed and /v1/tokenize; 'inputs' and 'text'/'texts'
    answer the same."""
    texts = TEXTS[:2]
    status, pooled = call(server.http_url, "/v1/embeddings", {"input": texts})
    assert status == 200 and [item["index"] for item in pooled["data"]] == [0, 1]
    status, embedded = call(server.http_url, "/v1/embed", {"input": texts, "encoding_format": "base64"})
    assert status == 200 and len(embedded["embeddings"]) == 2
    assert (
        call(server.http_url, "/v1/embed", {"inputs": texts, "encoding": "base64"})[1]["embeddings"]
        == (embedded["embeddings"])
    )
    status, one = call(server.http_url, "/v1/embed", {"input": texts[0]})  # one string: one input
    assert status == 200 and one["embeddings"][0]["tokens"] == embedded["embeddings"][0]["tokens"]
    status, tokenized = call(server.http_url, "/v1/tokenize", {"input": texts})
    assert status == 200 and [t["tokens"] for t in tokenized["texts"]] == [e["tokens"] for e in embedded["embeddings"]]
    assert call(server.http_url, "/v1/tokenize", {"texts": texts})[1] == tokenized
    status, single = call(server.http_url, "/v1/tokenize", {"input": texts[1]})
    assert status == 200 and single == call(server.http_url, "/v1/tokenize", {"text": texts[1]})[1]
    assert single["texts"] == tokenized["texts"][1:]


def test_an_answer_of_only_the_mix_names_no_layers(server):
    """Under omit_layers the answer holds no layers, and says so (it does not echo the model's layers)."""
    status, answer = call(server.http_url, "/v1/embed", {"input": ["x y"], "task": "pos_demo", "omit_layers": True})
    assert status == 200 and answer["layers"] == [] and "layers" not in answer["embeddings"][0]
    assert "mix" in answer["embeddings"][0]


def test_layers_with_omit_layers_is_refused_by_both_doors_alike(server, grpc_client):
    """A field that cannot take effect is refused, with the same words on gRPC as on HTTP."""
    body = {"input": ["x"], "layers": [1], "task": "pos_demo", "omit_layers": True}
    status, answer = call(server.http_url, "/v1/embed", body)
    assert status == 400
    with pytest.raises(RemoteError) as refused:
        grpc_client.embed(["x"], layers=[1], task="pos_demo", omit_layers=True)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert "layers has no effect with omit_layers" in answer["error"]["message"]
    assert refused.value.details == answer["error"]["message"]


# -- bad input ---------------------------------------------------------------------------------------------------
BAD = [
    ("/v1/embeddings", b"{not json", 400, "not valid JSON"),
    ("/v1/embeddings", b"[1, 2]", 400, "must be a JSON object, not a list"),
    ("/v1/embeddings", b"", 400, "body is empty"),
    ("/v1/embeddings", b"\xff\xfe", 400, "not UTF-8"),
    ("/v1/embeddings", {"model": "tiny"}, 400, "'input' is missing"),
    ("/v1/embeddings", {"input": []}, 400, "'input' is an empty list"),
    ("/v1/embeddings", {"input": ""}, 400, "inputs[0] is empty"),
    ("/v1/embeddings", {"input": [[1, 2, 3]]}, 400, "token id"),
    ("/v1/embeddings", {"input": [None]}, 400, "'input[0]' must be a string, not null"),
    ("/v1/embeddings", {"input": 5}, 400, "must be a string or a list of strings, not a number"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 400, "'encoding_format' must be one of float, base64"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "'dimensions' is 8, but model 'tiny' has 16"),
    ("/v1/embeddings", {"input": "x", "model": "nope"}, 404, "unknown model 'nope'"),
    ("/v1/embeddings", {"input": "x", "model": "tiny:nope"}, 404, "unknown task 'nope'"),
    ("/v1/embeddings", {"input": ["x"] * 17}, 413, "too many inputs: 17, limit 16 per request (--max-pooled-inputs)"),
    ("/v1/embeddings", {"input": " ".join(["w"] * 21)}, 413, "over the limit of 20 per sentence"),
    ("/v1/embeddings", {"input": ["w " * 20] * 7}, 413, "request has 140 tokens, over the limit of 120 (--max-pooled"),
    ("/v1/embeddings", {"input": "x", "overflow": "chop"}, 400, "'overflow' must be one of reject, truncate, window"),
    ("/v1/embed", {"inputs": ["x"], "layerz": [1]}, 400, "unknown field 'layerz'"),
    ("/v1/embed", {"inputs": ["x"], "layers": [7]}, 400, "layers[0] = 7 is out of range"),
    ("/v1/embed", {"inputs": ["x"], "layers": ["1"]}, 400, "'layers[0]' must be an integer, not a string"),
    ("/v1/embed", {"inputs": ["x"], "omit_layers": "yes"}, 400, "'omit_layers' must be true or false"),
    ("/v1/embed", {"inputs": [{"text": "a", "tokens": ["a"]}]}, 400, "exactly one of 'text' and 'tokens'"),
    ("/v1/embed", {"inputs": [["a", ""]]}, 400, "inputs[0].tokens[1] is an empty string"),
    ("/v1/embed", {"inputs": ["x"], "dtype": "int8"}, 400, "'dtype' must be one of float32, float16"),
    ("/v1/embed", {"inputs": ["x"], "task": "nope"}, 404, "unknown task 'nope'"),
    ("/v1/embed", {"inputs": ["x"] * 8, "layers": [0, 1, 2], "encoding": "base64"}, 200, None),
    # the same answer as JSON numbers is over the 8 KiB response limit: refused before it is built, naming base64
    ("/v1/embed", {"inputs": ["x"] * 8, "layers": [0, 1, 2]}, 413, '"encoding": "base64"'),
    ("/v1/tokenize", {"texts": "not a list"}, 400, "'texts' must be a list"),
    ("/v1/tokenize", {"texts": []}, 400, "texts is empty"),
    ("/v1/nothing", {}, 404, "no such endpoint"),
    # a field that cannot take effect is refused, never echoed as if applied; a field and its alias are one field
    (
        "/v1/embed",
        {"input": ["x"], "layers": [2], "task": "pos_demo", "omit_layers": True},
        400,
        "layers has no effect with omit_layers",
    ),
    ("/v1/embed", {"input": ["x"], "inputs": ["x"]}, 400, "'inputs' is an alias of 'input'"),
    (
        "/v1/embed",
        {"input": "x", "encoding": "base64", "encoding_format": "float"},
        400,
        "'encoding' is an alias of 'encoding_format'",
    ),
    ("/v1/embed", {"layers": [1]}, 400, "'input' is missing"),
    ("/v1/tokenize", {"input": "x", "text": "x"}, 400, "'text' is an alias of 'input'"),
    ("/v1/tokenize", {"text": "x", "texts": ["x"]}, 400, "both are aliases of 'input'"),
    ("/v1/tokenize", {"text": ["x"]}, 400, "'text' must be a string, not a list"),
    ("/v1/tokenize", {"model": "tiny"}, 400, "'input' is missing"),
]


@pytest.fixture(scope="module")
def edges(runtime):
    """Small limits (tests/service_helpers.EDGE_LIMITS) so every size edge is cheap to reach."""
    srv = ServerThread({"tiny": runtime}, limits_with(max_message_bytes=4096), http=True)
    srv.warm_up()
    yield srv
    srv.stop()


@pytest.mark.parametrize("path, body, status, message", BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_bad_input_gets_its_status_and_a_json_error(edges, path, body, status, message):
    raw = body if isinstance(body, bytes) else None
    got_status, answer = call(edges.http_url, path, None if raw is not None else body, raw=raw)
    assert got_status == status, answer
    if message is not None:
        assert message in answer["error"]["message"] and answer["error"]["code"] == status
    assert call(edges.http_url, "/health")[0] == 200  # still serving


def test_a_body_over_the_message_limit_is_413_and_a_wrong_method_405(edges):
    status, answer = call(edges.http_url, "/v1/embed", {"inputs": ["x" * 5000]})
    assert status == 413 and "--max-message-bytes" in answer["error"]["message"]
    status, answer = call(edges.http_url, "/v1/embed", method="GET")
    assert status == 405 and "POST" in answer["error"]["message"]


def test_overload_is_429_and_the_rest_complete(edges):
    """The runtime thread held: one batch and 64 queued tokens are accepted, the rest refused at once with 429."""
    # 30 tokens: two requests fill a batch, two more fill the queue (one layer as base64: within the response limit)
    body = {"inputs": [["w"] * 15] * 2, "layers": [2], "encoding": "base64"}
    with ThreadPoolExecutor(8) as pool:
        with edges.hold_worker():
            futures = [pool.submit(call, edges.http_url, "/v1/embed", body) for _ in range(8)]
            deadline = time.monotonic() + 20
            while sum(f.done() for f in futures) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = [f.result() for f in futures if f.done()]  # answered while the runtime is held
    assert len(refused) >= 4
    assert all(status == 429 and answer["error"]["message"].startswith("overloaded") for status, answer in refused)
    statuses = [f.result()[0] for f in futures]
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2


# -- token, TLS, warm-up -----------------------------------------------------------------------------------------
def test_the_bearer_token_guards_the_api_but_not_health_or_the_page(runtime):
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), auth_token=TOKEN, http=True)
    srv.warm_up()
    try:
        status, answer = call(srv.http_url, "/v1/embeddings", {"input": "x"})
        assert status == 401 and "missing 'Authorization: Bearer <token>'" in answer["error"]["message"]
        wrong = {"Authorization": "Bearer nope"}
        assert call(srv.http_url, "/v1/models", headers=wrong)[1]["error"]["message"] == "invalid bearer token"
        right = {"Authorization": f"Bearer {TOKEN}"}
        assert call(srv.http_url, "/v1/embeddings", {"input": "x"}, headers=right)[0] == 200
        assert call(srv.http_url, "/health")[0] == 200
        with urllib.request.urlopen(srv.http_url + "/", timeout=30) as page:
            assert page.status == 200
    finally:
        srv.stop()


def _expect_exchange(url: str, head: str, body: bytes | None = None) -> tuple[bytes, bytes]:
    """Send headers with ``Expect: 100-continue``; -> (the first answer, and what follows once ``body`` is sent)."""
    import socket

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        first = sock.recv(65536)
        rest = b""
        if body is not None and first.startswith(b"HTTP/1.1 100"):
            sock.sendall(body)
            while b"\r\n\r\n" not in rest or not rest.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                rest += chunk
        return first, rest


def test_expect_100_continue_is_answered_only_after_the_size_and_the_token(runtime):
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), auth_token=TOKEN, http=True)
    srv.warm_up()
    try:

        def head(length: int, token: str | None = TOKEN, expect: str = "100-continue") -> str:
            auth = f"Authorization: Bearer {token}\r\n" if token else ""
            return (
                f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                f"Content-Length: {length}\r\nExpect: {expect}\r\n\r\n"
            )

        huge, _ = _expect_exchange(srv.http_url, head(10 * 1024**3))
        assert huge.startswith(b"HTTP/1.1 413") and b"(--max-message-bytes)" in huge
        assert b"nosniff" in huge and b"100 Continue" not in huge
        no_token, _ = _expect_exchange(srv.http_url, head(20, token=None))
        assert no_token.startswith(b"HTTP/1.1 401") and b"missing 'Authorization: Bearer <token>'" in no_token
        odd, _ = _expect_exchange(srv.http_url, head(20, expect="something-else"))
        assert odd.startswith(b"HTTP/1.1 417") and b"is not supported" in odd
        body = json.dumps({"input": "苹果"}).encode()
        go_on, answer = _expect_exchange(srv.http_url, head(len(body)), body)
        assert go_on.startswith(b"HTTP/1.1 100 Continue") and answer.startswith(b"HTTP/1.1 200")
        assert len(json.loads(answer.split(b"\r\n\r\n", 1)[1])["data"]) == 1
    finally:
        srv.stop()


def test_tls_serves_http_with_the_same_certificate(runtime, tmp_path):
    tls = self_signed_cert(tmp_path)
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), tls=tls, http=True)
    srv.warm_up()
    try:
        assert srv.http_url.startswith("https://")
        context = ssl.create_default_context(cafile=str(tls.cert))
        status, answer = call(srv.http_url, "/v1/embeddings", {"input": "苹果"}, context=context)
        assert status == 200 and len(answer["data"][0]["embedding"]) == 16
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            call(srv.http_url, "/health", context=ssl.create_default_context())
    finally:
        srv.stop()


def test_warming_up_is_503(runtime):
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=1.0), http=True)  # not warmed up
    try:
        assert call(srv.http_url, "/health") == (503, {"status": "NOT_SERVING"})
        status, answer = call(srv.http_url, "/v1/embed", {"inputs": ["x"]})
        assert status == 503 and "warming up" in answer["error"]["message"]
    finally:
        srv.stop()


# -- long inputs -------------------------------------------------------------------------------------------------
LONG = " ".join(f"w{i % 97}" for i in range(5000))


def test_a_5000_token_text_under_each_overflow_policy_on_http_and_grpc(server, grpc_client, runtime):
    status, answer = call(server.http_url, "/v1/embed", {"inputs": [LONG], "layers": [2]})
    # under 'reject' tokenizing stops once the limit is crossed: the message says so rather than counting on
    assert status == 413 and "inputs[0] has more than 512 tokens, over the limit of 512" in answer["error"]["message"]
    assert "'window'" in answer["error"]["message"]
    with pytest.raises(RemoteError, match="more than 512 tokens, over the limit of 512"):
        grpc_client.embed([LONG], layers=[2])

    status, answer = call(server.http_url, "/v1/embed", {"inputs": [LONG], "layers": [2], "overflow": "window"})
    assert status == 200
    (windowed,) = answer["embeddings"]
    assert len(windowed["tokens"]) == 5000 and windowed["offsets"][-1][1] == len(LONG)
    (over_grpc,) = grpc_client.embed([LONG], layers=[2], overflow="window")
    np.testing.assert_array_equal(np.asarray(windowed["layers"], dtype=np.float32), over_grpc.layers)
    whole = Embedder(runtime.info.model_dir, intra_op_threads=1, max_tokens_per_sentence=10_000)
    reference = whole.embed_texts([LONG])[0][2]
    got = over_grpc.layers[0]
    cos = np.sum(got * reference, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(reference, axis=-1))
    assert cos.min() > 0.99

    (cut,) = grpc_client.embed([LONG], layers=[2], overflow="truncate")
    assert len(cut.tokens) == 512 and cut.truncated_tokens == 4488 and cut.layers.shape == (1, 512, 16)
    status, answer = call(server.http_url, "/v1/embeddings", {"input": LONG, "overflow": "truncate"})
    assert status == 200 and answer["usage"]["prompt_tokens"] == 512


# -- load --------------------------------------------------------------------------------------------------------
def test_http_and_grpc_clients_mixed_under_load_see_no_errors(server, grpc_client):
    """16 client threads, half gRPC, half HTTP (the OpenAI route and /v1/embed in turn), for a few seconds: every
    answer is the vectors gRPC gave for the same text alone (pooled for /v1/embeddings), none fails."""
    from bench.kit.load import ClosedLoop

    alone = [embedding.layers for embedding in (grpc_client.embed([text])[0] for text in TEXTS)]

    def grpc_call(turn: int) -> None:
        got = grpc_client.embed([TEXTS[turn % len(TEXTS)]])[0].layers
        np.testing.assert_allclose(got, alone[turn % len(TEXTS)], atol=1e-5)

    def http_call(turn: int) -> None:
        i = turn % len(TEXTS)
        if turn % 2:
            status, answer = call(server.http_url, "/v1/embeddings", {"input": [TEXTS[i]]})
            got, want = answer["data"][0]["embedding"], alone[i].astype(np.float64).mean(axis=(0, 1))
        else:
            status, answer = call(server.http_url, "/v1/embed", {"inputs": [TEXTS[i]]})
            got, want = answer["embeddings"][0]["layers"], alone[i]
        assert status == 200, answer
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)

    records = ClosedLoop([grpc_call, http_call] * 8, seconds=4.0).run().records
    assert [repr(r.error) for r in records if r.error is not None] == []
    assert {r.client % 2 for r in records} == {0, 1}  # both protocols answered


def test_a_drain_finishes_http_requests_in_flight_and_refuses_new_ones(runtime):
    srv = ServerThread({"tiny": runtime}, Limits(drain_seconds=30.0), http=True)
    srv.warm_up()
    with ThreadPoolExecutor(2) as pool:
        with srv.hold_worker():
            in_flight = pool.submit(call, srv.http_url, "/v1/embed", {"inputs": ["still answered"]})
            deadline = time.monotonic() + 20
            while srv.server.state.active == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            drained = asyncio.run_coroutine_threadsafe(srv.server.drain(), srv.loop)
            while not srv.server.state.draining:
                time.sleep(0.01)
            status, answer = call(srv.http_url, "/v1/embeddings", {"input": "too late"})
            assert status == 503 and "shutting down" in answer["error"]["message"]
            assert call(srv.http_url, "/health") == (503, {"status": "NOT_SERVING"})
        status, answer = in_flight.result(30)
    assert status == 200 and answer["embeddings"][0]["tokens"] == ["still", "answered"]
    drained.result(30)
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    srv.thread.join(10)
