"""service.http.encode writes exactly what json.dumps writes for the same value with lists, whatever the shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.http import encode
from service.http.encode import encode_json


def reference(value) -> bytes:
    plain = json.loads(json.dumps(value, default=lambda a: a.tolist()))  # arrays as lists, floats as Python floats
    return json.dumps(plain, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize("shape", [(0,), (7,), (40,), (3, 5), (3, 13, 4), (2, 1, 50), (1, 9, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_arrays_of_every_shape_match_json_dumps_across_piece_edges(monkeypatch, shape, dtype):
    monkeypatch.setattr(encode, "PIECE_VALUES", 8)  # tiny pieces: every branch, every edge between pieces
    array = (np.random.default_rng(sum(shape)).standard_normal(shape) * 1e3).astype(dtype)
    value = {"object": "embed", "embeddings": [{"tokens": ["苹果", "a\"b"], "layers": array, "mix": array[..., :1]}]}
    assert encode_json(value) == reference(value)


def test_plain_values_are_json_dumps():
    value = {"a": [1, 2.5, None, True], "b": "naïve 🙂", "c": [[0, 3], [4, 9]], "d": {}}
    assert encode_json(value) == reference(value)
