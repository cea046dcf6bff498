"""service.http.encode: valid JSON whose numbers read back as exactly the arrays' float32 values, whatever the shapes
and however the pieces fall; the rest exactly as json.dumps writes it; no number longer than the size bound."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from elmo.service.http import encode
from elmo.service.http.encode import JSON_NUMBER_BYTES, base64_json, encode_json


def as_lists(value):
    return json.loads(json.dumps(value, default=lambda a: a.tolist()))


@pytest.mark.parametrize("shape", [(0,), (7,), (40,), (3, 5), (3, 13, 4), (2, 1, 50), (1, 9, 3), (2, 0, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_arrays_of_every_shape_read_back_exactly_across_piece_edges(monkeypatch, shape, dtype):
    monkeypatch.setattr(encode, "PIECE_VALUES", 8)  # tiny pieces: every branch, every edge between pieces
    array = (np.random.default_rng(sum(shape)).standard_normal(shape) * 1e3).astype(dtype)
    value = {"object": "embed", "embeddings": [{"tokens": ["苹果", 'a"b'], "layers": array, "mix": array[..., :1]}]}
    decoded = json.loads(encode_json(value))
    expected = as_lists(value)
    assert decoded["object"] == "embed" and decoded["embeddings"][0]["tokens"] == ["苹果", 'a"b']
    for name in ("layers", "mix"):
        got = np.asarray(decoded["embeddings"][0][name], dtype=np.float32)
        want = np.asarray(expected["embeddings"][0][name], dtype=np.float32)
        assert got.shape == want.shape and np.array_equal(got, want)  # bit for bit, as float32


def test_plain_values_are_json_dumps():
    value = {"a": [1, 2.5, None, True], "b": "naïve 🙂", "c": [[0, 3], [4, 9]], "d": {}}
    assert encode_json(value) == json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def test_no_number_is_longer_than_the_size_bound():
    extremes = np.array([-1.1754944e-38, -3.4028235e38, -1.4e-45, -0.1234567, -1.2345678e-5], dtype=np.float32)
    numbers = encode_json(extremes)[1:-1].split(b",")
    assert max(len(n) for n in numbers) + 1 <= JSON_NUMBER_BYTES


@pytest.mark.parametrize("size", [0, 1, 2, 3, 4, 1000, 65537])
def test_base64_data_is_written_as_a_json_string_of_its_base64(size):
    data = np.random.default_rng(size).bytes(size)
    body = encode_json({"data": base64_json(data), "tokens": ["苹果", 'a"b']})
    value = json.loads(body)
    assert base64.b64decode(value["data"], validate=True) == data
    assert value["tokens"] == ["苹果", 'a"b']


@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 200])
@pytest.mark.parametrize("dtype", ["<f4", "<f2"])
def test_base64_of_a_strided_view_is_the_base64_of_its_contiguous_copy(tokens, dtype):
    # a sentence's layers cut from its batch's padded output: one block a layer, of a length that is rarely a
    # multiple of 3 bytes (each block's leftover bytes carry into the next)
    batch = np.random.default_rng(tokens).standard_normal((2, 3, 205, 85)).astype(dtype)
    view = batch[1, :, :tokens]
    assert not view.flags.c_contiguous  # 200 tokens: over SMALL_COPY_BYTES, read block by block
    value = json.loads(encode_json({"data": base64_json(view)}))
    assert base64.b64decode(value["data"], validate=True) == np.ascontiguousarray(view).tobytes()


def test_base64_of_blocks_longer_than_a_piece_is_whole(monkeypatch):
    monkeypatch.setattr(encode, "BASE64_PIECE_BYTES", 6)  # every block spans several pieces
    view = np.arange(3 * 11 * 3, dtype="<f2").reshape(3, 11, 3)[:, :7]
    data = json.loads(encode_json({"d": base64_json(view)}))["d"]
    assert base64.b64decode(data, validate=True) == np.ascontiguousarray(view).tobytes()
