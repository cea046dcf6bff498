"""elmo.backends: one backend pair, one request cutter, one retry policy, for the features, spaCy and the batch job.

The server is a real `elmo serve` subprocess on 127.0.0.1 with a small --max-message-bytes, so that what each path
sends at once is larger than one message the server accepts: gRPC itself refuses it whole (shown first), and each
path must cut it by the server's advertised limits and get the vectors the in-process runtime gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from elmo.backends import RequestCutter, RetryPolicy, ServerLimits
from elmo.client import EmbedderClient, RemoteError
from tests.serve_process import ServeProcess

MAX_MESSAGE_BYTES = 4096
WORDS = "the a cat dog sat ran on under mat tree 苹果 很 好 . , ! zebras quietly graze".split()
ATOL = 1e-5  # a server's batches are padded otherwise than one local call's: the sums run in another order


def sentences(n: int) -> list[list[str]]:
    rng = np.random.default_rng(1)
    return [list(rng.choice(WORDS, size=int(rng.integers(3, 12)))) for _ in range(n)]


SENTENCES = [[str(t) for t in s] for s in sentences(120)]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    args = ["--model", str(tiny_model_dir), "--max-message-bytes", str(MAX_MESSAGE_BYTES)]
    with ServeProcess(args, tmp_path_factory.mktemp("serve")) as process:
        yield process.wait_serving()


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> list[np.ndarray]:
    from elmo.features import Features

    return Features(model=tiny_model_dir).layers(SENTENCES)


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, i
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0, err_msg=f"sentence {i}")


def test_the_sentences_are_more_than_one_message_the_server_takes(server):
    with EmbedderClient(server, retry_policy=None) as client:
        assert client.request(SENTENCES).ByteSize() > MAX_MESSAGE_BYTES
        with pytest.raises(RemoteError) as refused:
            client.embed(SENTENCES)
        assert refused.value.code.name == "RESOURCE_EXHAUSTED"
        assert client.model_info().limits.max_message_bytes == MAX_MESSAGE_BYTES  # what the cutter reads


def test_features_cut_to_the_servers_message_limit(server, local):
    from elmo.features import Features

    features = Features(server=server)
    assert features.backend.cutter.limits.max_message_bytes == MAX_MESSAGE_BYTES
    assert len(features.backend.cutter.cut(SENTENCES, features.n_layers)) > 1
    assert_same(features.layers(SENTENCES), local)


def test_the_spacy_component_cuts_to_the_servers_message_limit(server, local, tiny_model_dir):
    spacy = pytest.importorskip("spacy")
    import elmo.spacy  # noqa: F401  (registers the component)

    nlp = spacy.blank("en")
    nlp.add_pipe("elmo", config={"server": server})
    docs = list(nlp.pipe([" ".join(s) for s in SENTENCES], batch_size=len(SENTENCES)))
    assert [[t.text for t in doc] for doc in docs] == SENTENCES  # spaCy's tokens are the ones the runtime got
    assert_same([doc._.elmo_layers for doc in docs], local)


def test_the_batch_job_cuts_to_the_servers_message_limit(server, local, tmp_path):
    from elmo.batch.writers import iter_parquet
    from tests.batch.test_job import embed_file, write_lines

    source = write_lines(tmp_path / "in.txt", [" ".join(s) for s in SENTENCES])
    output = tmp_path / "out.parquet"
    assert embed_file(source, output, "--server", server, "--shard-lines", len(SENTENCES), "--tokenized") == 0
    rows = list(iter_parquet(output))
    assert [list(tokens) for _, _, tokens, _ in rows] == SENTENCES
    assert_same([np.asarray(vectors, np.float32) for *_, vectors in rows], local)


# -- the cutter and the policy on their own ------------------------------------------------------------------------
def test_a_cut_request_stays_within_every_advertised_limit():
    limits = ServerLimits(max_inputs=7, max_tokens_per_request=40, max_message_bytes=4096, max_response_bytes=20_000)
    cutter = RequestCutter(limits, dim=16)
    requests = cutter.cut(SENTENCES, vectors_per_token=4)
    assert [p for request in requests for p in request] == list(range(len(SENTENCES)))
    for request in requests:
        chosen = [SENTENCES[p] for p in request]
        assert len(chosen) <= limits.max_inputs
        assert sum(map(len, chosen)) <= limits.max_tokens_per_request
        assert sum(cutter.request_bytes(s) for s in chosen) <= 0.8 * limits.max_message_bytes
        assert sum(cutter.response_bytes(s, 4) for s in chosen) <= 0.8 * limits.max_response_bytes


def test_a_sentence_no_request_can_carry_is_refused_by_name():
    from elmo.errors import InputError

    cutter = RequestCutter(ServerLimits(max_message_bytes=2048), dim=16)
    with pytest.raises(InputError, match="--max-message-bytes 2,048"):
        cutter.cut([["word"] * 400], vectors_per_token=1)


def test_the_retry_policy_doubles_its_wait_up_to_the_cap():
    assert list(RetryPolicy(attempts=6, first_s=0.5, max_s=3.0).delays()) == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_one_backend_pair_in_the_tree():
    import re

    root = Path(__file__).resolve().parents[1]
    found = [
        path.relative_to(root).as_posix()
        for folder in ("elmo", "service", "export", "bench")
        for path in (root / folder).rglob("*.py")
        if re.search(r"^class (Local|Remote)Backend\b", path.read_text(encoding="utf-8"), re.M)
    ]
    assert found == ["elmo/backends.py"]
