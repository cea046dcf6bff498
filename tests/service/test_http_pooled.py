"""POST /v1/embeddings at OpenAI's request sizes on a real server (127.0.0.1): pooled requests are embedded in
chunks of the per-token limits and give exactly the vectors of one request per input; unit-length vectors on
request or by default; model aliases on both protocols; any key when the server has no token."""

from __future__ import annotations

import numpy as np
import pytest
from elmo.service.models.registry import parse_alias

from elmo.client import EmbedderClient
from elmo.errors import ConfigError
from elmo.runtime import Embedder
from tests.serve_process import wait_until
from tests.service_helpers import ServerThread, call, limits_with, model_with_pos_demo

ALIASES = {"text-embedding-3-small": ("tiny", ""), "ada-pos": ("tiny", "pos_demo")}
# 24 inputs of 3..14 tokens (~200 tokens): 3 times --max-inputs (8) and --max-request-tokens (60) of the limits
DOCUMENTS = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(3 + i % 12)) + " ." for i in range(24)]
LIMITS = dict(max_pooled_inputs=32, max_pooled_tokens=400)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return model_with_pos_demo(tiny_model_dir, tmp_path_factory.mktemp("pooled"))


@pytest.fixture(scope="module")
def runtime(model_dir):
    return Embedder(model_dir, intra_op_threads=1)


@pytest.fixture(scope="module")
def served(runtime):
    server = ServerThread({"tiny": runtime}, limits_with(**LIMITS), http=True, aliases=ALIASES)
    server.warm_up()
    yield server
    server.stop()


def embeddings(server, body, headers=None) -> np.ndarray:
    status, answer = call(server.http_url, "/v1/embeddings", body, headers=headers)
    assert status == 200, answer
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


def test_a_request_over_the_per_token_limits_equals_one_request_per_input(served):
    together = embeddings(served, {"model": "tiny", "input": DOCUMENTS})
    one_by_one = np.concatenate([embeddings(served, {"model": "tiny", "input": [d]}) for d in DOCUMENTS])
    assert together.shape == (len(DOCUMENTS), 16)
    np.testing.assert_allclose(together, one_by_one, rtol=0, atol=1e-6)


def test_usage_counts_every_chunk(served):
    status, answer = call(served.http_url, "/v1/embeddings", {"model": "tiny", "input": DOCUMENTS})
    expected = sum(len(d.split()) for d in DOCUMENTS)
    assert status == 200 and answer["usage"]["prompt_tokens"] == expected > 60


def test_normalized_vectors_have_unit_norm_and_the_same_direction(served):
    raw = embeddings(served, {"model": "tiny", "input": DOCUMENTS})
    unit = embeddings(served, {"model": "tiny", "input": DOCUMENTS, "normalize": True})
    np.testing.assert_allclose(np.linalg.norm(unit.astype(np.float64), axis=1), 1.0, rtol=0, atol=1e-6)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)  # the raw means are not unit length
    np.testing.assert_allclose(unit, raw / np.linalg.norm(raw, axis=1, keepdims=True), rtol=0, atol=1e-6)


def test_normalize_must_be_a_boolean(served):
    status, answer = call(served.http_url, "/v1/embeddings", {"input": "x", "normalize": "yes"})
    assert status == 400 and "'normalize' must be true or false, not a string" in answer["error"]["message"]


def test_the_server_default_normalizes_unless_a_request_says_not_to(runtime):
    server = ServerThread({"tiny": runtime}, limits_with(**LIMITS), http=True, normalize=True)
    try:
        server.warm_up()
        unit = embeddings(server, {"input": DOCUMENTS[:3]})
        raw = embeddings(server, {"input": DOCUMENTS[:3], "normalize": False})
    finally:
        server.stop()
    np.testing.assert_allclose(np.linalg.norm(unit.astype(np.float64), axis=1), 1.0, rtol=0, atol=1e-6)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)


def test_an_alias_answers_as_its_model_and_task(served):
    by_alias = embeddings(served, {"model": "text-embedding-3-small", "input": DOCUMENTS[:4]})
    by_name = embeddings(served, {"model": "tiny", "input": DOCUMENTS[:4]})
    np.testing.assert_array_equal(by_alias, by_name)
    task_alias = embeddings(served, {"model": "ada-pos", "input": DOCUMENTS[:4]})
    task_name = embeddings(served, {"model": "tiny:pos_demo", "input": DOCUMENTS[:4]})
    np.testing.assert_array_equal(task_alias, task_name)
    assert not np.allclose(task_alias, by_name)
    status, answer = call(served.http_url, "/v1/embeddings", {"model": "ada-pos", "input": "x"})
    assert answer["model"] == "ada-pos"  # the name the client asked for


def test_aliases_are_listed_and_work_over_grpc(served, runtime):
    status, listing = call(served.http_url, "/v1/models", None)
    aliases = {e["id"]: e["alias_of"] for e in listing["data"] if "alias_of" in e}
    assert status == 200 and aliases == {"text-embedding-3-small": "tiny", "ada-pos": "tiny:pos_demo"}
    assert call(served.http_url, "/v1/models/ada-pos", None)[1]["alias_of"] == "tiny:pos_demo"
    with EmbedderClient(served.target) as client:
        (result,) = client.embed(["The cat sat ."], model="ada-pos", omit_layers=True)
        (direct,) = client.embed(["The cat sat ."], model="tiny", task="pos_demo", omit_layers=True)
    np.testing.assert_array_equal(result.mix, direct.mix)


@pytest.mark.parametrize(
    "value, message",
    [
        ("nothing", "--model-alias nothing: expected NAME=MODEL or NAME=MODEL:TASK"),
        ("a=nope", "--model-alias a=nope: no served model is named 'nope' (serving: tiny)"),
        ("a=tiny:nope", "--model-alias a=tiny:nope: model 'tiny' has no task 'nope' (tasks: pos_demo)"),
        ("tiny=tiny:pos_demo", "--model-alias tiny=tiny:pos_demo: 'tiny' is already a served model's name"),
    ],
)
def test_bad_aliases_are_one_clear_error(runtime, value, message):
    with pytest.raises(ConfigError) as info:
        ServerThread({"tiny": runtime}, limits_with(**LIMITS), aliases=dict([parse_alias(value)])).stop()
    assert str(info.value) == message


def test_without_a_server_token_any_key_is_accepted(served):
    for headers in ({"Authorization": "Bearer sk-anything"}, {"Authorization": "whatever"}, {}):
        assert call(served.http_url, "/v1/embeddings", {"input": "x"}, headers=headers)[0] == 200


def test_token_ids_are_refused_naming_the_client_setting(served):
    status, answer = call(served.http_url, "/v1/embeddings", {"input": [[101, 2023]]})
    assert status == 400 and "check_embedding_ctx_length=False" in answer["error"]["message"]


def test_a_chunk_refused_by_a_full_queue_is_a_429(runtime):
    """A pooled request's chunks are admitted one by one: when one finds the queue full the request gets the
    queue's own 429 (not a 500), and the server goes on serving."""
    from concurrent.futures import ThreadPoolExecutor

    server = ServerThread({"tiny": runtime}, limits_with(**LIMITS), http=True)
    try:
        server.warm_up()
        filler = {"input": [" ".join(["w"] * 20)] * 3}  # 60 tokens, one chunk: the queue (64) is then all but full
        with ThreadPoolExecutor(2) as pool, server.hold_worker():
            running = pool.submit(call, server.http_url, "/v1/embeddings", filler)  # dispatched, waits for the runtime
            wait_until(lambda: server.model().batcher.batches_running == 1, what="the first batch dispatched")
            queued = pool.submit(call, server.http_url, "/v1/embeddings", filler)  # waits in the queue
            wait_until(lambda: server.queued_tokens() == 60, what="60 tokens queued")
            status, answer = call(server.http_url, "/v1/embeddings", {"input": DOCUMENTS})
        assert status == 429 and answer["error"]["message"].startswith("overloaded"), answer
        assert running.result(60)[0] == queued.result(60)[0] == 200
        assert embeddings(server, {"input": DOCUMENTS}).shape == (len(DOCUMENTS), 16)
    finally:
        server.stop()
