"""Fuzzing a real server (127.0.0.1, the tiny model, small limits) from both front doors.

HTTP: Schemathesis generates requests from the served OpenAPI document (valid and invalid ones, every operation) and
checks every answer: no 5xx, the status documented for the operation, the documented content type, a body that
conforms to the documented schema. gRPC: Hypothesis builds ``EmbedRequest`` and ``TokenizeRequest`` messages over
every field (odd Unicode, huge and negative layers, unknown enum values, empty and oversized inputs), and raw random
bytes; the answer is a vector or a clear status, never INTERNAL or UNKNOWN.

Two tiers, no deadline: every fuzz test runs once *fixed* (derandomized: the same cases on every run, a fifth of the
examples; the fast tier, `make check`) and once *random* (all the examples from the run's seed, which the test
session prints on its first line and in every failure, and which ``ELMO_FUZZ_SEED=N`` replays; the slow tier): CI finds
new cases on every run, and any of them reproduces. The admin API is fuzzed from the same document, against a
repository server of its own (so that unloading its model cannot disturb the other tests), and over gRPC there too
(elmo.v1.ModelAdmin: every method, any name and version, with the admin token, none or a wrong one, and raw bytes;
the server must still load its model and embed afterwards).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
import schemathesis
from elmo.service.http.openapi import openapi_document
from elmo.service.server import RepositoryOptions
from hypothesis import HealthCheck, event, example, given, seed, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, save_task
from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from tests.conftest import FUZZ_SEED
from tests.service_helpers import EDGE_LIMITS, ServerThread

TASK = "pos_demo"
REPO = Path(__file__).resolve().parents[2]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    unsupported_method,  # a method a path does not serve: 405 with an Allow header
]
FUZZ = settings(database=None, deadline=None, suppress_health_check=list(HealthCheck))
TIERS = [pytest.param("fixed", id="fixed-seed"), pytest.param("random", id="random", marks=pytest.mark.slow)]
ADMIN = "fuzz-admin"


def fuzz(tier: str, examples: int):
    """The tier's Hypothesis settings for a test of ``examples`` examples: fixed = derandomized, a fifth of them;
    random = all of them, drawn from FUZZ_SEED (a failure names the seed that replays it)."""

    def apply(test):
        if tier == "fixed":
            return settings(FUZZ, derandomize=True, max_examples=max(10, examples // 5))(test)
        seeded = seed(FUZZ_SEED)(settings(FUZZ, derandomize=False, max_examples=examples)(test))

        def replayable(*args, **kwargs):
            try:
                return seeded(*args, **kwargs)
            except BaseException as exc:
                exc.add_note(f"random fuzz tier, seed {FUZZ_SEED}: ELMO_FUZZ_SEED={FUZZ_SEED} replays it")
                raise

        return replayable

    return apply


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir, tmp_path_factory):
    """The tiny model with one task mix, small limits (tests/service_helpers.EDGE_LIMITS), HTTP and gRPC."""
    directory = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, Task(TASK, "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8, layer_norm=True))
    server = ServerThread({"tiny": Embedder(directory, intra_op_threads=1)}, EDGE_LIMITS, http=True)
    server.warm_up()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def admin_server(tiny_model_dir, tmp_path_factory):
    """A model repository (root/tiny/1) with the admin API, for the /admin/ operations of the document."""
    root = tmp_path_factory.mktemp("fuzz-repository")
    shutil.copytree(tiny_model_dir, root / "tiny" / "1")
    repository = RepositoryOptions(root, lambda d: Embedder(d, intra_op_threads=1), release_timeout_s=5.0)
    server = ServerThread({}, EDGE_LIMITS, http=True, repository=repository, admin_token=ADMIN)
    server.warm_up()
    yield server
    server.stop()


def call_and_validate(case, fuzz_server, admin_server):
    """The case against the server that serves its operation, with the admin token (which the other server,
    having no token of its own, ignores)."""
    server = admin_server if case.path.startswith("/admin/") else fuzz_server
    sent = {name.lower() for name in case.headers or {}}
    headers = {} if "authorization" in sent else {"Authorization": f"Bearer {ADMIN}"}
    return case.call_and_validate(base_url=server.http_url, checks=CHECKS, timeout=30, headers=headers)


# -- HTTP: Schemathesis from the served document -----------------------------------------------------------------
# The documents are built here, not fetched at import (there is no server yet); test_each_fuzzed_document_is_the_one
# its_server_serves checks that each is exactly what its server's GET /openapi.json serves.
# (schemathesis.pytest.from_fixture, which would fetch it, reads a pytest-internal attribute that pytest 9 no longer
# has.) Neither fuzzed server has a clients' token, so their documents list no 401 on the clients' routes (the admin
# routes answer 401 without the admin token); the token server's document, with them, checks the 401 answers.
DOCUMENT = json.loads(json.dumps(openapi_document(admin=True)))  # admin_server's: fuzz_server's and the admin routes
PLAIN_DOCUMENT = json.loads(json.dumps(openapi_document()))  # fuzz_server's
TOKEN_DOCUMENT = json.loads(json.dumps(openapi_document(bearer=True)))  # runtime_with_token's
schema = schemathesis.openapi.from_dict(DOCUMENT)
token_schema = schemathesis.openapi.from_dict(TOKEN_DOCUMENT)


def served_document(server) -> dict:
    with urllib.request.urlopen(f"{server.http_url}/openapi.json", timeout=30) as response:
        return json.loads(response.read())


def test_each_fuzzed_document_is_the_one_its_server_serves(fuzz_server, admin_server, runtime_with_token):
    assert served_document(admin_server) == DOCUMENT
    assert served_document(fuzz_server) == PLAIN_DOCUMENT
    assert served_document(runtime_with_token) == TOKEN_DOCUMENT
    routes = {route.resource.canonical for route in admin_server.server.http.app.router.routes()}
    assert routes == set(DOCUMENT["paths"])  # the admin routes included: every one of them is fuzzed
    # the operations call_and_validate sends to fuzz_server are, in DOCUMENT, exactly those fuzz_server documents
    assert {p: item for p, item in DOCUMENT["paths"].items() if not p.startswith("/admin/")} == PLAIN_DOCUMENT["paths"]


@schema.parametrize()
@fuzz("fixed", 100)
def test_every_http_answer_is_documented_and_none_is_a_server_error(case, fuzz_server, admin_server):
    """The fixed tier: every operation of the document, its cases derandomized."""
    call_and_validate(case, fuzz_server, admin_server)


@pytest.mark.slow
def test_random_http_requests_are_documented_and_none_is_a_server_error(fuzz_server, admin_server):
    """The random tier: valid and invalid cases for every operation, from the run's seed."""
    cases = st.one_of(
        schema.as_strategy(schemathesis.GenerationMode.POSITIVE),
        schema.as_strategy(schemathesis.GenerationMode.NEGATIVE),
    )

    @fuzz("random", 400)
    @given(case=cases)
    def check(case):
        call_and_validate(case, fuzz_server, admin_server)

    check()


LONG = " ".join(f"w{i}" for i in range(30))  # over the 20 tokens per sentence of EDGE_LIMITS
# Every shape of a successful answer, checked against the document: task mixes, omitted layers, base64 and float16,
# truncated and windowed sentences, pooled task mixes, the model entries (random requests rarely reach these).
ANSWERS = [
    ("POST", "/v1/embed", {"inputs": ["cat", ["pre"]], "task": TASK}),  # JSON numbers: 8 KiB is 2 tokens
    ("POST", "/v1/embed", {"inputs": [{"tokens": ["a"]}], "task": TASK, "omit_layers": True, "encoding": "base64"}),
    ("POST", "/v1/embed", {"inputs": [{"text": "苹果"}], "layers": [2, 0], "dtype": "float16", "encoding": "base64"}),
    ("POST", "/v1/embed", {"inputs": [LONG], "overflow": "truncate", "encoding": "base64", "request_id": "r-1"}),
    ("POST", "/v1/embed", {"inputs": [LONG], "layers": [1], "overflow": "window", "encoding": "base64"}),
    ("POST", "/v1/embeddings", {"input": ["苹果很好吃", "naïve café 🙂"], "model": f"tiny:{TASK}"}),
    ("POST", "/v1/embeddings", {"input": "x", "model": f":{TASK}", "encoding_format": "base64", "dimensions": 16}),
    ("POST", "/v1/embeddings", {"input": LONG, "overflow": "truncate", "user": "ignored"}),
    ("POST", "/v1/tokenize", {"texts": ["The cat sat .", "苹果很好吃"], "model": "tiny"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/{model_id}", {"model_id": "tiny"}),
    ("GET", "/v1/models/{model_id}", {"model_id": f"tiny:{TASK}"}),
    ("GET", "/v1/models/{model_id}", {"model_id": f":{TASK}"}),
    ("GET", "/health", None),
    ("GET", "/openapi.json", None),
    ("GET", "/", None),
]


@pytest.mark.parametrize("method, path, data", ANSWERS, ids=[f"{m} {p} {i}" for i, (m, p, _) in enumerate(ANSWERS)])
def test_every_kind_of_answer_conforms_to_the_document(fuzz_server, method, path, data):
    operation = schema[path][method]
    if method == "POST":
        case = operation.Case(body=data, media_type="application/json")
    else:
        case = operation.Case(path_parameters=data) if data else operation.Case()
    response = case.call_and_validate(base_url=fuzz_server.http_url, checks=CHECKS, timeout=30)
    assert response.status_code == 200, response.text


def test_the_error_answers_conform_to_the_document(fuzz_server, runtime_with_token):
    """Errors random requests cannot reach: a wrong and a missing token (401 with WWW-Authenticate), a body that is
    not JSON by its Content-Type (415), over the message limit (413)."""
    embed = schema["/v1/embed"]["POST"]
    models, model = token_schema["/v1/models"]["GET"], token_schema["/v1/models/{model_id}"]["GET"]  # its 401s
    cases = [
        (runtime_with_token, models.Case(headers={"Authorization": "Bearer nope"}), 401),
        (runtime_with_token, model.Case(path_parameters={"model_id": "tiny"}), 401),
        (fuzz_server, embed.Case(body="inputs=x", media_type="text/plain"), 415),
        (fuzz_server, embed.Case(body={"inputs": ["x" * 20_000]}, media_type="application/json"), 413),
        (fuzz_server, embed.Case(body={"inputs": ["x"], "model": "m" * 10_000}, media_type="application/json"), 404),
    ]
    for server, case, status in cases:
        response = case.call_and_validate(base_url=server.http_url, checks=CHECKS, timeout=30)
        assert response.status_code == status, response.text
        assert len(response.text) < 1000  # a huge model name is not echoed back whole


@pytest.fixture(scope="module")
def runtime_with_token(tiny_model_dir):
    server = ServerThread(
        {"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}, EDGE_LIMITS, auth_token="t", http=True
    )
    server.warm_up()
    yield server
    server.stop()


# -- gRPC: Hypothesis over every field of the contract's messages, and raw bytes -----------------------------------
FAILURES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}  # last: a hang
INT32 = st.integers(-(2**31), 2**31 - 1)
# Any code point UTF-8 can carry (protobuf strings cannot hold a lone surrogate): marks, controls, NUL, RTL, emoji,
# private use, unassigned; plus the edges a tokenizer trips on.
WEIRD = st.text(st.characters(codec="utf-8"), max_size=40)
SPECIAL = st.sampled_from(
    ["", " ", "\x00", "\u200b", "\ufeff", "\u0301", "e\u0301", "🙂👍🏽", "苹果很好吃", "\U0010ffff", "a\r\nb", "\t"]
)
WORD = st.text(st.characters(codec="utf-8", categories=("L", "M", "N", "P", "S")), min_size=1, max_size=8)
SENTENCE = st.lists(WORD, min_size=1, max_size=12).map(" ".join)
TEXTS = st.one_of(SENTENCE, WEIRD, SPECIAL, st.integers(0, 45).map(lambda n: " ".join(["w"] * n)))  # limit: 20
TOKENS = st.lists(st.one_of(WORD, WEIRD, SPECIAL), max_size=25)
INPUTS = st.one_of(
    TEXTS.map(lambda text: pb.Input(text=text)),
    TOKENS.map(lambda tokens: pb.Input(tokens=pb.Tokens(tokens=tokens))),
    st.just(pb.Input()),  # neither text nor tokens
)
# Over the 16 KiB message limit: gRPC itself refuses it (RESOURCE_EXHAUSTED), which takes it ~0.1 s, so it is an
# explicit example of each test rather than a frequent draw.
OVERSIZED = "x " * 9000

# A valid request reaches the model; one with a fault or two in any field tests that field's check, deep in the path
# (a request with every field random would almost always stop at its first bad field).
FAULTS = {
    "inputs": st.lists(INPUTS, max_size=10),  # empty, too many (the limit is 8), odd texts and tokens
    "layers": st.lists(st.one_of(st.integers(-1, 3), INT32), min_size=1, max_size=5),
    "task": WEIRD,
    "omit_layers": st.just(True),
    "dtype": INT32,  # unknown enum values: proto3 enums are open
    "model": WEIRD,
    "request_id": WEIRD,
    "overflow": INT32,
}


@st.composite
def embed_requests(draw) -> pb.EmbedRequest:
    inputs = draw(
        st.lists(
            st.one_of(
                SENTENCE.map(lambda text: pb.Input(text=text)),
                st.lists(WORD, min_size=1, max_size=10).map(lambda ts: pb.Input(tokens=pb.Tokens(tokens=ts))),
            ),
            min_size=1,
            max_size=4,
        )
    )
    task = draw(st.sampled_from(["", TASK]))
    fields = {
        "inputs": inputs,
        "layers": draw(st.lists(st.integers(0, 2), max_size=3)),
        "task": task,
        "omit_layers": bool(task) and draw(st.booleans()),
        "dtype": draw(st.sampled_from([pb.FLOAT32, pb.FLOAT16])),
        "model": draw(st.sampled_from(["", "tiny"])),
        "request_id": draw(st.sampled_from(["", "r-1"])),
        "overflow": draw(st.integers(0, 3)),
    }
    for name in draw(st.lists(st.sampled_from(sorted(FAULTS)), max_size=3, unique=True)):
        fields[name] = draw(FAULTS[name])
    return pb.EmbedRequest(**fields)


EMBED_REQUESTS = embed_requests()
TOKENIZE_REQUESTS = st.builds(
    pb.TokenizeRequest,
    texts=st.one_of(st.lists(SENTENCE, min_size=1, max_size=8), st.lists(TEXTS, max_size=10)),
    model=st.one_of(st.sampled_from(["", "tiny"]), WEIRD),
)
METHODS = ("Embed", "EmbedStream", "Tokenize", "GetModelInfo", "ListModels")


@pytest.fixture(scope="module")
def channel(fuzz_server):
    with grpc.insecure_channel(fuzz_server.target) as channel:
        yield channel


def expect_no_server_fault(call, request) -> object | None:
    """The answer, or None for a status that is the client's (never INTERNAL, UNKNOWN, or a hang)."""
    try:
        answer = call(request, timeout=30)
        event("OK")
        return answer
    except grpc.RpcError as exc:
        code = exc.code()
        event(code.name)  # the spread of answers: --hypothesis-show-statistics
        assert code not in FAILURES, f"{code.name} {exc.details()!r} for {request!r:.2000}"
        assert exc.details(), f"{code.name} without a message for {request!r:.2000}"
        return None


@pytest.mark.parametrize("tier", TIERS)
def test_embed_answers_every_request_or_names_the_fault(channel, tier):
    @fuzz(tier, 400)
    @given(request=EMBED_REQUESTS)
    @example(request=pb.EmbedRequest(inputs=[pb.Input(text=OVERSIZED)]))
    def check(request):
        answer = expect_no_server_fault(pb_grpc.EmbedderStub(channel).Embed, request)
        if answer is not None:
            assert len(answer.embeddings) == len(request.inputs) and answer.request_id == request.request_id

    check()


@pytest.mark.parametrize("tier", TIERS)
def test_a_stream_answers_in_order_or_ends_with_the_faults_status(channel, tier):
    stub = pb_grpc.EmbedderStub(channel)

    @fuzz(tier, 80)
    @given(requests=st.lists(EMBED_REQUESTS, min_size=1, max_size=4))
    @example(requests=[pb.EmbedRequest(inputs=[pb.Input(text=OVERSIZED)])])
    def check(requests):
        stream = lambda rs, timeout: list(stub.EmbedStream(iter(rs), timeout=timeout))  # noqa: E731
        answers = expect_no_server_fault(stream, requests)
        if answers is not None:
            assert [len(a.embeddings) for a in answers] == [len(r.inputs) for r in requests]

    check()


@pytest.mark.parametrize("tier", TIERS)
def test_tokenize_answers_every_request_or_names_the_fault(channel, tier):
    @fuzz(tier, 200)
    @given(request=TOKENIZE_REQUESTS)
    @example(request=pb.TokenizeRequest(texts=[OVERSIZED]))
    def check(request):
        answer = expect_no_server_fault(pb_grpc.EmbedderStub(channel).Tokenize, request)
        if answer is not None:
            assert len(answer.texts) == len(request.texts)

    check()


@st.composite
def raw_messages(draw) -> bytes:
    """Random bytes, or a valid request with a few bytes overwritten (truncated, wrong wire types, bad UTF-8...)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    data = bytearray(draw(st.one_of(EMBED_REQUESTS, TOKENIZE_REQUESTS)).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))]) if draw(st.booleans()) else bytes(data)


@pytest.mark.parametrize("tier", TIERS)
def test_raw_bytes_as_any_request_never_fault_the_server(channel, tier):
    @fuzz(tier, 300)
    @given(method=st.sampled_from(METHODS), data=raw_messages())
    @example(method="Embed", data=b"\xff" * 20_000)
    def check(method, data):
        path = f"/elmo.v1.Embedder/{method}"
        if method == "EmbedStream":  # identity serializers: the bytes go out as they are, the answers come back raw
            stream = channel.stream_stream(path, request_serializer=None, response_deserializer=None)
            expect_no_server_fault(lambda d, timeout: list(stream(iter([d]), timeout=timeout)), data)
        else:
            unary = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            expect_no_server_fault(unary, data)

    check()


# -- gRPC: the admin API (elmo.v1.ModelAdmin), against the repository server, with the admin token ----------------
INT64 = st.integers(-(2**63), 2**63 - 1)
# the one model often enough that loads and unloads really happen; names that are paths or not names; any text
MODEL_NAMES = st.one_of(
    st.just("tiny"),
    st.sampled_from(["", "nope", "..", "../tiny", "tiny/1", "tiny@1", "Tiny", ".incoming-1", "t" * 65]),
    WEIRD,
)
VERSIONS = st.one_of(st.integers(-1, 2), INT64)  # 0: the latest (load) or every version (unload); tiny has 1
ADMIN_TYPES = {  # method: (request, answer)
    "LoadModel": (pb.LoadModelRequest, pb.ModelStatus),
    "UnloadModel": (pb.UnloadModelRequest, pb.ModelStatus),
    "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
}
ADMIN_CALLS = st.one_of(
    st.tuples(st.just("LoadModel"), st.builds(pb.LoadModelRequest, name=MODEL_NAMES, version=VERSIONS)),
    st.tuples(st.just("UnloadModel"), st.builds(pb.UnloadModelRequest, name=MODEL_NAMES, version=VERSIONS)),
    st.tuples(st.just("RepositoryIndex"), st.just(pb.RepositoryIndexRequest())),
)
ADMIN_TOKEN = (("authorization", f"Bearer {ADMIN}"),)
# mostly the admin token; none and a wrong one have clear statuses of their own (UNAUTHENTICATED, PERMISSION_DENIED)
ADMIN_METADATA = st.sampled_from([ADMIN_TOKEN] * 8 + [(), (("authorization", "Bearer no"),)])


@pytest.fixture(scope="module")
def admin_channel(admin_server):
    with grpc.insecure_channel(admin_server.target) as channel:
        yield channel


def admin_call(channel, method: str, metadata, raw: bool = False):
    """``method`` of elmo.v1.ModelAdmin as a (request, timeout) callable sending ``metadata``; ``raw``: the request
    is bytes, sent as they are."""
    request, answer = ADMIN_TYPES[method]
    codecs = {"request_serializer": request.SerializeToString, "response_deserializer": answer.FromString}
    call = channel.unary_unary(f"/elmo.v1.ModelAdmin/{method}", **({} if raw else codecs))
    return lambda message, timeout: call(message, timeout=timeout, metadata=metadata)


def assert_admin_server_alive(channel) -> None:
    """After the fuzzing: the repository server answers its index, loads tiny again and embeds with it."""
    admin = pb_grpc.ModelAdminStub(channel)
    status = admin.LoadModel(pb.LoadModelRequest(name="tiny"), timeout=60, metadata=ADMIN_TOKEN)
    assert [v.version for v in status.versions if v.state == pb.VERSION_READY] == [1], status
    index = admin.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30, metadata=ADMIN_TOKEN)
    assert [model.name for model in index.models] == ["tiny"]
    request = pb.EmbedRequest(inputs=[pb.Input(text="alive")], model="tiny")
    assert len(pb_grpc.EmbedderStub(channel).Embed(request, timeout=30).embeddings) == 1


@pytest.mark.parametrize("tier", TIERS)
def test_every_admin_method_answers_every_request_or_names_the_fault(admin_channel, tier):
    """LoadModel, UnloadModel and RepositoryIndex with any name and version (odd Unicode, paths, int64 edges), with
    the admin token, none or a wrong one: an answer or a clear status, never INTERNAL or UNKNOWN; alive after."""

    @fuzz(tier, 150)
    @given(call=ADMIN_CALLS, metadata=ADMIN_METADATA)
    @example(call=("LoadModel", pb.LoadModelRequest(name=OVERSIZED)), metadata=ADMIN_TOKEN)
    @example(call=("UnloadModel", pb.UnloadModelRequest(name="tiny")), metadata=ADMIN_TOKEN)  # then nothing loaded
    @example(call=("LoadModel", pb.LoadModelRequest(name="tiny", version=2**63 - 1)), metadata=ADMIN_TOKEN)
    def check(call, metadata):
        method, request = call
        expect_no_server_fault(admin_call(admin_channel, method, metadata), request)

    check()
    assert_admin_server_alive(admin_channel)


@st.composite
def raw_admin_messages(draw) -> bytes:
    """Random bytes, or a valid admin request with a few bytes overwritten or cut."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    data = bytearray(draw(ADMIN_CALLS)[1].SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))]) if draw(st.booleans()) else bytes(data)


@pytest.mark.parametrize("tier", TIERS)
def test_raw_bytes_as_any_admin_request_never_fault_the_server(admin_channel, tier):
    @fuzz(tier, 150)
    @given(method=st.sampled_from(tuple(ADMIN_TYPES)), data=raw_admin_messages())
    @example(method="LoadModel", data=b"\xff" * 20_000)
    def check(method, data):
        expect_no_server_fault(admin_call(admin_channel, method, ADMIN_TOKEN, raw=True), data)

    check()
    assert_admin_server_alive(admin_channel)


# A stream whose second message is over --max-message-bytes, behind a valid first one that is being embedded, is cut
# by gRPC itself; the server must answer RESOURCE_EXHAUSTED and live on. Found by this fuzzer: the server process died
# of a segmentation fault (in the observer's context.peer() after gRPC ended the call). Run in a child process, so
# that a crash fails this test instead of ending the whole pytest run.
CUT_STREAM = """
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import grpc
from elmo.runtime import Embedder
from elmo.v1 import embedder_pb2 as pb, embedder_pb2_grpc as pb_grpc
from tests.service_helpers import EDGE_LIMITS, ServerThread

server = ServerThread({"tiny": Embedder(Path(sys.argv[1]), intra_op_threads=1)}, EDGE_LIMITS)
server.warm_up()
stub = pb_grpc.EmbedderStub(grpc.insecure_channel(server.target))
requests = [pb.EmbedRequest(inputs=[pb.Input(text="ok")]), pb.EmbedRequest(inputs=[pb.Input(text="x " * 9000)])]

def one(_):
    try:
        list(stub.EmbedStream(iter(requests), timeout=30))
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name

with ThreadPoolExecutor(8) as pool:
    codes = set(pool.map(one, range(int(sys.argv[2]))))
server.stop()
print("answered:", sorted(codes))
"""


def test_a_stream_cut_by_an_oversized_message_leaves_the_server_up(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", CUT_STREAM, str(tiny_model_dir), "256"],  # 8 at a time
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"the server process died ({done.returncode}):\n{done.stderr[-3000:]}"
    assert done.stdout.strip().endswith("answered: ['RESOURCE_EXHAUSTED']"), done.stdout
