"""Client input that Python's json and protobuf refuse in their own ways is a 400 with the JSON error shape, never a
500: lone surrogates in any string field (protobuf cannot encode them), integers outside int32 (protobuf's range),
nesting past the parser's depth, integers past Python's digit limit, NaN; and a client's long names are cut, not
echoed back whole. Against a real server (127.0.0.1, the tiny model), which stays up throughout."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest
from elmo.service.common.errors import ServiceError
from elmo.service.http import schema

from elmo.client import EmbedderClient, RemoteError
from elmo.runtime import Embedder
from tests.service_helpers import ServerThread, limits_with

LONE = "\\ud800"  # as the JSON escape: the body itself is plain ASCII
SURROGATE_MESSAGE = "holds a lone surrogate (\\ud800 at code point {}): strings must be valid Unicode"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """Small limits, but a body of up to 1 MiB: room for 100,000 brackets and 100,000-character names."""
    srv = ServerThread(
        {"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}, limits_with(max_message_bytes=2**20), http=True
    )
    srv.warm_up()
    yield srv
    srv.stop()


def post(url: str, path: str, raw: bytes, headers: dict | None = None) -> tuple[int, dict, str]:
    """(status, JSON body, Content-Type) of one POST of ``raw``; error statuses are answers too."""
    request = urllib.request.Request(
        url + path, data=raw, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), response.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers["Content-Type"]


def assert_400(server, path: str, raw: bytes, message: str, headers: dict | None = None) -> str:
    status, answer, content_type = post(server.http_url, path, raw, headers)
    assert (status, content_type.split(";")[0]) == (400, "application/json"), answer
    assert set(answer) == {"error"} and answer["error"]["code"] == 400 and answer["error"]["type"] == "invalid_input"
    assert message in answer["error"]["message"], answer["error"]["message"]
    with urllib.request.urlopen(server.http_url + "/health", timeout=30) as health:
        assert health.status == 200  # still serving
    return answer["error"]["message"]


# -- lone surrogates: every string field of every endpoint -----------------------------------------------------
SURROGATES = [
    ("/v1/embeddings", '{"input": "abc\\ud800"}', "'input' " + SURROGATE_MESSAGE.format(3)),
    ("/v1/embeddings", '{"input": ["ok", "abc\\ud800"]}', "'input[1]' " + SURROGATE_MESSAGE.format(3)),
    ("/v1/embeddings", '{"input": "x", "model": "\\ud800"}', "'model' " + SURROGATE_MESSAGE.format(0)),
    ("/v1/embeddings", '{"input": "x", "encoding_format": "float\\ud800"}', "'encoding_format' holds"),
    ("/v1/embeddings", '{"input": "x", "overflow": "\\ud800"}', "'overflow' holds"),
    ("/v1/embeddings", '{"input": "x", "user": "\\ud800"}', "'user' holds"),  # ignored, but not valid Unicode
    ("/v1/embeddings", '{"input": "x", "\\ud800": 1}', "a field name " + SURROGATE_MESSAGE.format(0)),
    ("/v1/embed", '{"inputs": ["ab\\ud800"]}', "'inputs[0]' " + SURROGATE_MESSAGE.format(2)),
    ("/v1/embed", '{"inputs": [["ok", "\\ud800"]]}', "'inputs[0][1]' holds"),
    ("/v1/embed", '{"inputs": [{"text": "\\ud800"}]}', "'inputs[0].text' holds"),
    ("/v1/embed", '{"inputs": [{"tokens": ["a", "b\\ud800"]}]}', "'inputs[0].tokens[1]' holds"),
    ("/v1/embed", '{"inputs": [{"t\\ud800": 1}]}', "a field name in 'inputs[0]' holds"),
    ("/v1/embed", '{"inputs": ["x"], "task": "\\ud800"}', "'task' holds"),
    ("/v1/embed", '{"inputs": ["x"], "model": "\\ud800"}', "'model' holds"),
    ("/v1/embed", '{"inputs": ["x"], "request_id": "\\ud800"}', "'request_id' holds"),
    ("/v1/embed", '{"inputs": ["x"], "dtype": "\\ud800"}', "'dtype' holds"),
    ("/v1/embed", '{"inputs": ["x"], "encoding": "\\ud800"}', "'encoding' holds"),
    ("/v1/embed", '{"inputs": ["x"], "overflow": "\\ud800"}', "'overflow' holds"),
    (
        "/v1/embed",
        '{"inputs": ["x"], "\\udfff": 1}',
        "a field name " + SURROGATE_MESSAGE.replace("d800", "dfff").format(0),
    ),
    ("/v1/tokenize", '{"text": "\\ud800"}', "'text' holds"),
    (
        "/v1/tokenize",
        '{"texts": ["a", "\\ude00\\ud83d"]}',
        "'texts[1]' holds a lone surrogate (\\ude00 at code point 0)",
    ),
    ("/v1/tokenize", '{"text": "x", "model": "\\udbff"}', "'model' holds a lone surrogate (\\udbff at code point 0)"),
]


@pytest.mark.parametrize("path, body, message", SURROGATES, ids=[f"{p}-{m[:24]}" for p, _, m in SURROGATES])
def test_a_lone_surrogate_in_any_string_field_is_400_naming_it(server, path, body, message):
    assert_400(server, path, body.encode(), message)


def test_the_exact_message_for_a_lone_surrogate(server):
    message = assert_400(server, "/v1/embeddings", b'{"input": ["abc\\ud800"]}', "")
    assert message == "'input[0]' holds a lone surrogate (\\ud800 at code point 3): strings must be valid Unicode"


def test_a_surrogate_pair_is_one_valid_character(server):
    status, answer, _ = post(server.http_url, "/v1/tokenize", b'{"text": "a \\ud83d\\ude00 b"}')
    assert status == 200 and answer["texts"][0]["tokens"] == ["a", "\U0001f600", "b"]


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/embed"])
def test_an_x_request_id_header_that_is_not_utf8_is_400_naming_the_byte(server, path):
    body = b'{"input": "x"}' if path == "/v1/embeddings" else b'{"inputs": ["x"]}'
    message = "the 'X-Request-Id' header is not valid UTF-8 (byte 0xff at offset 2)"
    assert_400(server, path, body, message, headers={"X-Request-Id": "ab\xff"})  # sent as latin-1: the byte 0xff


# -- numbers ----------------------------------------------------------------------------------------------------
INT32_RANGE = "it must be a 32-bit integer (-2147483648..2147483647)"
NUMBERS = [
    (
        "/v1/embed",
        '{"inputs": ["x"], "layers": [2147483648]}',
        f"'layers[0]' = 2147483648 is out of range: {INT32_RANGE}",
    ),
    ("/v1/embed", '{"inputs": ["x"], "layers": [0, -2147483649]}', "'layers[1]' = -2147483649 is out of range"),
    (
        "/v1/embed",
        '{"inputs": ["x"], "layers": [1' + "0" * 4000 + "]}",
        "'layers[0]' = an integer of about 4000 digits",
    ),
    ("/v1/embed", '{"inputs": ["x"], "layers": [2147483647]}', "layers[0] = 2147483647 is out of range: model 'tiny'"),
    ("/v1/embed", '{"inputs": ["x"], "layers": [1.0]}', "'layers[0]' must be an integer, not a number"),  # as before
    ("/v1/embed", '{"inputs": ["x"], "layers": [1e400]}', "'layers[0]' must be an integer, not a number"),
    ("/v1/embed", '{"inputs": ["x"], "layers": [true]}', "'layers[0]' must be an integer, not a boolean"),
    ("/v1/embeddings", '{"input": "x", "dimensions": 0}', "'dimensions' = 0 is out of range: it must be a positive"),
    ("/v1/embeddings", '{"input": "x", "dimensions": 4294967296}', "'dimensions' = 4294967296 is out of range"),
    ("/v1/embeddings", '{"input": "x", "dimensions": 16.0}', "'dimensions' must be an integer, not a number"),
    ("/v1/embed", '{"inputs": ["x"], "layers": [' + "9" * 5000 + "]}", "an integer with more than 4300 digits"),
    ("/v1/embeddings", '{"input": "x", "user": NaN}', "NaN is not a JSON value"),
    ("/v1/embeddings", '{"input": "x", "user": -Infinity}', "-Infinity is not a JSON value"),
]


@pytest.mark.parametrize("path, body, message", NUMBERS, ids=[m[:40] for _, _, m in NUMBERS])
def test_numbers_out_of_any_range_are_400_naming_the_field_and_the_range(server, path, body, message):
    assert len(assert_400(server, path, body.encode(), message)) < 300  # a huge number is described, not echoed


def test_whole_numbers_sent_as_floats_keep_being_refused_and_integers_accepted(server):
    status, answer, _ = post(server.http_url, "/v1/embed", b'{"inputs": ["x"], "layers": [2, 0], "encoding": "base64"}')
    assert status == 200 and answer["layers"] == [2, 0]
    status, answer, _ = post(server.http_url, "/v1/embeddings", b'{"input": "x", "dimensions": 16}')
    assert status == 200 and len(answer["data"][0]["embedding"]) == 16


# -- the body as a whole ----------------------------------------------------------------------------------------
BODIES = [
    (b"[" * 100_000, "nested too deeply"),
    (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"inputs": ["x"]} trailing', "not valid JSON: Extra data at line 1 column 19"),
    (b'\xef\xbb\xbf{"inputs": ["x"]}', "not valid JSON: Unexpected UTF-8 BOM"),
    (b'"just a string"', "must be a JSON object, not a string"),
    (b'{"inputs": ["x"]', "not valid JSON"),
    (b"\xc3\x28", "not UTF-8 (byte 0xc3 at offset 0)"),
]


@pytest.mark.parametrize("body, message", BODIES, ids=[m[:30] for _, m in BODIES])
def test_any_body_the_parser_refuses_is_400(server, body, message):
    for path in ("/v1/embeddings", "/v1/embed", "/v1/tokenize"):
        assert_400(server, path, body, message)


# -- long names are cut in messages ------------------------------------------------------------------------------
HUGE = "m" * 100_000


def error_message(server, method: str, path: str, body: dict | None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.http_url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]["message"]


LONG_NAMES = [
    ("/v1/embeddings", {"input": "x", "model": HUGE}, 404, "unknown model 'mmm"),
    ("/v1/embeddings", {"input": "x", "model": f"tiny:{HUGE}"}, 404, "unknown task 'mmm"),
    ("/v1/embed", {"inputs": ["x"], "model": HUGE}, 404, "unknown model 'mmm"),
    ("/v1/embed", {"inputs": ["x"], "task": HUGE}, 404, "unknown task 'mmm"),
    ("/v1/embed", {"inputs": ["x"], HUGE: 1}, 400, "unknown field 'mmm"),
    ("/v1/embed", {"inputs": [{"text": "x", HUGE: 1}]}, 400, "unknown field 'mmm"),
    ("/v1/embed", {"inputs": ["x"], "dtype": HUGE}, 400, "'dtype' must be one of float32, float16, not 'mmm"),
    ("/v1/embeddings", {"input": "x", "encoding_format": HUGE}, 400, "must be one of float, base64, not 'mmm"),
    ("/v1/embeddings", {"input": "x", "overflow": HUGE}, 400, "must be one of reject, truncate, window, not 'mmm"),
    ("/v1/tokenize", {"text": "x", "model": HUGE}, 404, "unknown model 'mmm"),
]


@pytest.mark.parametrize("path, body, status, message", LONG_NAMES, ids=[f"{p}-{m}" for p, _, _, m in LONG_NAMES])
def test_a_100k_character_name_is_not_echoed_back_whole(server, path, body, status, message):
    got_status, got_message = error_message(server, "POST", path, body)
    assert got_status == status and message in got_message
    assert "(100000 characters)" in got_message and len(got_message) < 400, got_message[:500]


LONG_IDS = [("m" * 5000, "unknown model 'mmm"), ("tiny:" + "t" * 5000, "unknown task 'ttt")]


@pytest.mark.parametrize("model_id, message", LONG_IDS)
def test_a_long_model_id_in_the_path_is_cut_too(server, model_id, message):
    status, got = error_message(server, "GET", "/v1/models/" + model_id, None)
    assert status == 404 and message in got and "(5000 characters)" in got and len(got) < 400, got[:500]


def test_grpc_cuts_long_names_too(server):
    with EmbedderClient(server.target) as client:
        with pytest.raises(RemoteError) as raised:
            client.embed(["x"], model=HUGE)
    assert raised.value.code == grpc.StatusCode.NOT_FOUND
    assert "(100000 characters)" in str(raised.value) and len(str(raised.value)) < 400


# -- the parser on its own (no server) ---------------------------------------------------------------------------
def test_parse_json_reports_the_first_lone_surrogate_in_document_order():
    with pytest.raises(ServiceError, match=r"'inputs\[0\]\.tokens\[0\]' holds"):
        schema.parse_json(b'{"inputs": [{"tokens": ["\\ud800"]}, "\\udfff"], "task": "\\ud801"}')


def test_parse_functions_check_strings_given_directly():
    """Callers that skip parse_json still get 400s, not protobuf's UnicodeEncodeError."""
    with pytest.raises(ServiceError, match=r"'input\[0\]' holds a lone surrogate"):
        schema.parse_openai({"input": ["\ud800"]})
    with pytest.raises(ServiceError, match=r"'inputs\[0\]' holds a lone surrogate"):
        schema.parse_embed({"inputs": ["\ud800"]})
    with pytest.raises(ServiceError, match=r"'texts\[0\]' holds a lone surrogate"):
        schema.parse_tokenize({"texts": ["\ud800"]})
    with pytest.raises(ServiceError, match=r"'layers\[0\]' = 2147483648 is out of range"):
        schema.parse_embed({"inputs": ["x"], "layers": [2**31]})
    with pytest.raises(ServiceError, match="'X-Request-Id' header"):
        schema.parse_embed({"inputs": ["x"]}, request_id="\udcff")
