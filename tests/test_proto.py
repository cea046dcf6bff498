"""The wire contract: committed generated code matches proto/, tensors pack exactly, undecodable requests are
explained, the public names of issue 5 exist."""

from __future__ import annotations

import numpy as np
import pytest
from elmo.service.grpc.decode import UndecodableRequest, lenient_parser

from elmo.errors import InputError
from elmo.v1 import embedder_pb2 as pb
from elmo.wire import (
    SMALL_COPY_BYTES,
    contiguous_blocks,
    field_head,
    from_tensor,
    span_fields,
    tensor_field,
    to_tensor,
)
from tests.conftest import REPO

GENERATED = ["elmo/v1/embedder_pb2.py", "elmo/v1/embedder_pb2.pyi", "elmo/v1/embedder_pb2_grpc.py"]


def test_regenerating_gives_the_committed_files(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the code")
    from scripts.gen_proto import generate

    written = generate(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == sorted(GENERATED)
    for name in GENERATED:
        assert (tmp_path / name).read_bytes() == (REPO / name).read_bytes(), f"{name} is stale: run `make proto`"


def test_public_contract_names():
    service = pb.DESCRIPTOR.services_by_name["Embedder"]
    assert pb.DESCRIPTOR.package == "elmo.v1"
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) for m in service.methods
    }
    assert methods["Embed"] == ("EmbedRequest", "EmbedResponse", False, False)
    assert methods["EmbedStream"] == ("EmbedRequest", "EmbedResponse", True, True)
    assert methods["Tokenize"] == ("TokenizeRequest", "TokenizeResponse", False, False)
    assert methods["GetModelInfo"] == ("GetModelInfoRequest", "ModelInfo", False, False)
    request = pb.EmbedRequest.DESCRIPTOR.fields_by_name
    assert {"inputs", "layers", "task", "omit_layers", "dtype", "model"} <= set(request)
    assert [f.name for f in pb.Input.DESCRIPTOR.oneofs_by_name["kind"].fields] == ["text", "tokens"]
    assert set(pb.Tensor.DESCRIPTOR.fields_by_name) == {"shape", "dtype", "data"}
    assert {"tokens", "offsets", "layers", "mix"} <= set(pb.Embedding.DESCRIPTOR.fields_by_name)
    assert {"embeddings", "model", "timing"} <= set(pb.EmbedResponse.DESCRIPTOR.fields_by_name)
    assert (pb.FLOAT32, pb.FLOAT16) == (0, 1)
    info = set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
    assert {"name", "version", "n_layers", "dim", "max_tokens_per_sentence", "tasks", "execution_provider"} <= info


@pytest.mark.parametrize("dtype, np_dtype", [(pb.FLOAT32, np.float32), (pb.FLOAT16, np.float16)])
def test_tensor_round_trip_is_exact_little_endian_row_major(dtype, np_dtype):
    array = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    tensor = to_tensor(array, dtype)
    assert list(tensor.shape) == [3, 5, 4] and tensor.dtype == dtype
    expected = np.ascontiguousarray(array, dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes()
    assert tensor.data == expected
    back = from_tensor(pb.Tensor.FromString(tensor.SerializeToString()))
    assert back.dtype == np_dtype and back.flags.writeable
    np.testing.assert_array_equal(back, array.astype(np_dtype))
    # Non-contiguous input is packed row-major too.
    assert to_tensor(array[:, ::2], dtype).data == np.ascontiguousarray(array[:, ::2], dtype=np_dtype).tobytes()


@pytest.mark.parametrize(
    "cut",
    [lambda a: a, lambda a: a[1, :, :3], lambda a: a[:, 1:, :2], lambda a: a[0, :, :, ::2], lambda a: a[:, :, :0]],
    ids=["contiguous", "a-row-of-a-padded-batch", "strided-two-axes", "gaps-in-the-last-axis", "empty"],
)
def test_tensor_field_writes_strided_views_as_their_contiguous_copies_would(cut):
    batch = np.random.default_rng(1).standard_normal((2, 3, 5, 4)).astype("<f4")
    view = cut(batch)
    layers = pb.Embedding.DESCRIPTOR.fields_by_name["layers"].number
    tensor = pb.Embedding.FromString(b"".join(tensor_field(layers, view, pb.FLOAT32))).layers  # the field, head and all
    assert list(tensor.shape) == list(view.shape)
    assert tensor.data == np.ascontiguousarray(view).tobytes()
    assert b"".join(contiguous_blocks(view)) == np.ascontiguousarray(view).tobytes()


def test_a_large_strided_view_is_written_from_its_own_memory_a_block_a_layer():
    batch = np.random.default_rng(2).standard_normal((2, 3, 40, 256)).astype("<f4")
    view = batch[1, :, :30]  # 92 KB: over SMALL_COPY_BYTES
    blocks = contiguous_blocks(view)
    assert view.nbytes > SMALL_COPY_BYTES and len(blocks) == 3
    assert all(isinstance(block, memoryview) and block.obj is not None for block in blocks)  # not copies
    assert b"".join(blocks) == np.ascontiguousarray(view).tobytes()
    small = batch[1, :, :2]  # 6 KB: one copy, made in C
    assert [bytes(b) for b in contiguous_blocks(small)] == [np.ascontiguousarray(small).tobytes()]


def test_tensor_field_refuses_another_dtype():
    with pytest.raises(InputError, match="float16"):
        tensor_field(1, np.zeros((2, 2), np.float32), pb.FLOAT16)


def test_tensor_with_wrong_byte_count_is_refused():
    with pytest.raises(InputError, match="needs 24 bytes, got 20"):
        from_tensor(pb.Tensor(shape=[2, 3], dtype=pb.FLOAT32, data=b"\0" * 20))
    with pytest.raises(InputError, match="dtype 9"):
        from_tensor(pb.Tensor(shape=[1], dtype=9, data=b"\0" * 4))


def test_span_fields_parse_into_the_same_spans_as_built_messages():
    """span_fields' bytes, merged into an Embedding, are the Spans that building them one by one gives: every varint
    length (1 to 5 bytes), zeros (which proto3 leaves out when it builds them), and empty sentences."""
    edges = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28, 2**31 - 1]
    sentences = [[(a, b) for a in edges for b in edges], [], [(3, 7)], [(0, 0)]]
    field = pb.Embedding.DESCRIPTOR.fields_by_name["offsets"].number
    for spans, encoded in zip(sentences, span_fields(sentences, field), strict=True):
        merged = pb.Embedding()
        merged.MergeFromString(encoded)
        built = pb.Embedding(offsets=[pb.Span(start=a, end=b) for a, b in spans])
        assert merged == built
        assert merged.SerializeToString() == built.SerializeToString()


def test_span_fields_of_a_field_number_past_15_are_protobufs_spans():
    """A tag of two bytes (field 16 and up: ``82 01`` for field 16, length-delimited) takes the general path: each
    Span as protobuf serializes it (no zeros here, which it would leave out), behind that tag and its length."""
    spans = [(3, 5), (130, 20000), (16384, 16385), (2**31 - 1, 2**31 - 1)]
    (encoded,) = span_fields([spans], 16)
    bodies = [pb.Span(start=a, end=b).SerializeToString() for a, b in spans]
    assert encoded == b"".join(b"\x82\x01" + bytes([len(body)]) + body for body in bodies)


@pytest.mark.parametrize("length", [1, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 3 * 2**21])
def test_field_head_is_protobufs_own(length):
    """field_head(number, n) is what protobuf writes before a length-delimited field of n bytes: two bytes, three
    (both by the loop-free path) or more."""
    data = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
    serialized = pb.Tensor(data=b"x" * length).SerializeToString()
    assert serialized[: len(serialized) - length] == field_head(data, length)


@pytest.mark.parametrize("span", [(-1, 3), (0, 2**31)])
def test_span_fields_refuse_what_int32_cannot_hold(span):
    with pytest.raises(InputError, match="outside"):
        span_fields([[span]], 2)


def test_lenient_parser_names_the_bad_field():
    parse = lenient_parser(pb.EmbedRequest)
    good = pb.EmbedRequest(inputs=[pb.Input(text="héllo"), pb.Input(tokens=pb.Tokens(tokens=["a", "QQ"]))])
    assert parse(good.SerializeToString()) == good
    bad = parse(good.SerializeToString().replace(b"QQ", b"\xe4\xb8"))  # a truncated 3-byte sequence
    assert isinstance(bad, UndecodableRequest)
    assert bad.message.startswith("inputs[1].tokens.tokens[1] is not valid UTF-8 (byte 0xe4 at offset 0)")
    text_bad = parse(
        pb.EmbedRequest(inputs=[pb.Input(text="AB")], task="T").SerializeToString().replace(b"AB", b"\x80a")
    )
    assert text_bad.message.startswith("inputs[0].text is not valid UTF-8 (byte 0x80 at offset 0)")
    task_bad = parse(pb.EmbedRequest(task="TT").SerializeToString().replace(b"TT", b"\xff\xff"))
    assert task_bad.message.startswith("task is not valid UTF-8")
    assert "malformed protobuf" in parse(b"\x0a\xff").message


# -- one vocabulary: the proto's JSON names are the HTTP API's words ------------------------------------------------
HTTP_ONLY = {"EmbedRequest": {"encoding_format"}, "TokenizeRequest": set()}  # how JSON writes vectors: no proto field


@pytest.mark.parametrize("message", ["EmbedRequest", "TokenizeRequest"])
def test_the_protos_json_names_are_the_http_requests_fields(message):
    """Every field of the request has the JSON name the HTTP route takes (the texts are 'input' on both), and every
    field of the HTTP request that is not an alias is the proto's, but for how JSON writes vectors."""
    from elmo.service.http.openapi import openapi_document

    properties = openapi_document()["components"]["schemas"][message]["properties"]
    words = {name for name, schema in properties.items() if not schema.get("deprecated")}
    json_names = {field.json_name for field in getattr(pb, message).DESCRIPTOR.fields}
    assert json_names == words - HTTP_ONLY[message]


def test_an_http_embed_body_is_the_protos_json_form():
    """protobuf's own JSON parser reads a /v1/embed body into the message the HTTP door builds from it."""
    from elmo.service.http.schema import parse_embed
    from google.protobuf import json_format

    body = {"input": [{"text": "苹果很好吃"}], "layers": [2, 0], "task": "pos", "dtype": "FLOAT16", "model": "m"}
    body |= {"request_id": "r-1", "omit_layers": False}
    assert json_format.ParseDict(body, pb.EmbedRequest()) == parse_embed(body).embed
    assert json_format.MessageToDict(parse_embed(body).embed)["input"] == [{"text": "苹果很好吃"}]
    tokenize = pb.TokenizeRequest(texts=["a b"], model="m")
    assert json_format.MessageToDict(tokenize) == {"input": ["a b"], "model": "m"}
