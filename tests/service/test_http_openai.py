"""The official ``openai`` Python client against ``/v1/embeddings`` on a real server (127.0.0.1, bearer token): each
vector is the gRPC answer for the same input pooled the same way (mean over tokens of the mean of the layers, or of
the task's mix), ``usage.prompt_tokens`` is the service's token count, and errors arrive as the client's own
exception types."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from elmo.service.common.limits import Limits

from elmo.client import EmbedderClient
from elmo.runtime import Embedder
from tests.service_helpers import ServerThread, model_with_pos_demo

TEXTS = ["The cat sat on the mat.", "我买了一台苹果电脑。", "苹果很好吃", "naïve café 🙂", "a"]
TOKEN = "open-sesame"


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    directory = model_with_pos_demo(tiny_model_dir, tmp_path_factory.mktemp("openai"))
    server = ServerThread(
        {"tiny": Embedder(directory, intra_op_threads=1)}, Limits(drain_seconds=1.0), auth_token=TOKEN, http=True
    )
    server.warm_up()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served.http_url}/v1", api_key=TOKEN, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_answers(served):
    with EmbedderClient(served.target, auth_token=TOKEN) as c:
        return c.embed(TEXTS, task="pos_demo")


@pytest.mark.parametrize("encoding", ["float", "base64", None])  # None: the client's default (it asks for base64)
def test_openai_client_gets_the_pooled_grpc_vectors(client, grpc_answers, encoding):
    options = {} if encoding is None else {"encoding_format": encoding}
    result = client.embeddings.create(model="tiny", input=TEXTS, **options)
    assert result.model == "tiny" and [d.index for d in result.data] == list(range(len(TEXTS)))
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(e.tokens) for e in grpc_answers)
    for item, answer in zip(result.data, grpc_answers):
        if encoding == "base64":  # the client hands back the base64 string as sent when asked for it explicitly
            import base64

            vector = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
        else:
            vector = np.asarray(item.embedding, dtype=np.float64)
        pooled = answer.layers.astype(np.float64).mean(axis=(0, 1))
        assert vector.shape == (16,)
        assert float(np.abs(vector - pooled).max()) <= 1e-6


def test_a_task_named_in_model_pools_its_mix(client, grpc_answers):
    result = client.embeddings.create(model="tiny:pos_demo", input=TEXTS)
    assert result.model == "tiny:pos_demo"
    for item, answer in zip(result.data, grpc_answers):
        pooled = answer.mix.astype(np.float64).mean(axis=0)
        assert float(np.abs(np.asarray(item.embedding) - pooled).max()) <= 1e-6


def test_one_string_input_and_the_model_list(client, grpc_answers):
    result = client.embeddings.create(model="tiny", input=TEXTS[1])
    assert len(result.data) == 1 and result.usage.prompt_tokens == len(grpc_answers[1].tokens)
    assert [m.id for m in client.models.list()] == ["tiny", "tiny:pos_demo"]


def test_errors_are_the_clients_exception_types(client, served):
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4'"):
        client.embeddings.create(model="gpt-4", input="x")
    with pytest.raises(openai.BadRequestError, match="inputs\\[0\\] is empty"):
        client.embeddings.create(model="tiny", input="")
    with openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="wrong", max_retries=0) as intruder:
        with pytest.raises(openai.AuthenticationError, match="invalid bearer token"):
            intruder.embeddings.create(model="tiny", input="x")
