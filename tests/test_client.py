"""The Python client (numpy out, `elmo embed`) and an independent Node client built from the .proto alone, both
against a real server on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess

import grpc
import numpy as np
import pytest

from elmo.cli import main as elmo_main
from elmo.client import EmbedderClient, RemoteError, to_input
from elmo.errors import InputError
from elmo.runtime import Embedder
from tests.conftest import REPO
from tests.service_helpers import EDGE_LIMITS, ServerThread

NODE_DIR = REPO / "tests" / "node"
PROTO = REPO / "proto" / "elmo" / "v1" / "embedder.proto"


@pytest.fixture(scope="module")
def runtime(tiny_model_dir) -> Embedder:
    return Embedder(tiny_model_dir, intra_op_threads=1)


@pytest.fixture(scope="module")
def server(runtime):
    srv = ServerThread({"tiny": runtime}, EDGE_LIMITS)
    srv.warm_up()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with EmbedderClient(server.target) as c:
        yield c


def test_client_returns_numpy_arrays_like_the_runtime(client, runtime):
    texts = ["The apple fell .", "苹果"]
    expected = runtime.embed_texts(texts)
    arrays = client.embed_texts(texts)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.writeable for a in arrays)
    assert [a.tobytes() for a in arrays] == [v.tobytes() for v in expected]
    sentences = [e.tokens for e in runtime.embed(texts)]
    assert [a.tobytes() for a in client.embed_tokens(sentences)] == [v.tobytes() for v in expected]
    utf8 = client.embed_texts([text.encode("utf-8") for text in texts])  # bytes are accepted when UTF-8
    assert [a.tobytes() for a in utf8] == [v.tobytes() for v in expected]


def test_client_refuses_undecodable_input_before_sending():
    with pytest.raises(InputError, match=r"inputs\[2\] is not valid UTF-8 \(byte 0xff at offset 1\)"):
        EmbedderClient("127.0.0.1:1").request(["ok", b"ok", b"a\xffb"])
    with pytest.raises(InputError, match=r"inputs\[0\].tokens\[1\] cannot be encoded as UTF-8"):
        to_input(["fine", "lone \udc80 surrogate"])
    with pytest.raises(InputError, match="not one string"):
        EmbedderClient("127.0.0.1:1").request("one string")
    with pytest.raises(InputError, match="dtype"):
        EmbedderClient("127.0.0.1:1").request(["x"], dtype="int8")


def test_remote_errors_carry_code_and_message(client):
    with pytest.raises(RemoteError) as info:
        client.embed(["x"], layers=[9])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "layers[0] = 9 is out of range" in str(info.value)


def test_unreachable_server_is_unavailable():
    with EmbedderClient("127.0.0.1:1", timeout=2) as nowhere:
        with pytest.raises(RemoteError) as info:
            nowhere.embed(["x"])
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_elmo_embed_command(server, runtime, capsys):
    assert elmo_main(["embed", "--server", server.target, "The cat sat .", "苹果很好吃"]) == 0
    out = capsys.readouterr().out
    assert "'The cat sat .': 4 tokens ['The', 'cat', 'sat', '.']" in out
    assert "layers float32 (3, 4, 16)" in out and "layers float32 (3, 5, 16)" in out
    (vectors,) = runtime.embed_texts(["The cat sat ."])
    assert f"{vectors[0, 0, 0]:.4f}"[:5] in out  # first number of layer 0, token 0
    assert (
        elmo_main(["embed", "--server", server.target, "--tokens", "--layers", "2", "--dtype", "float16", "a b"]) == 0
    )
    assert "layers float16 (1, 2, 16)" in capsys.readouterr().out
    assert elmo_main(["embed", "--server", server.target, ""]) == 2
    assert "elmo embed: error: INVALID_ARGUMENT: inputs[0] is empty" in capsys.readouterr().err


def test_elmo_embed_overflow(server, capsys):
    """EDGE_LIMITS: 20 tokens per sentence. 25 tokens: refused by default, cut or windowed on request."""
    long = " ".join(f"w{i}" for i in range(25))
    assert elmo_main(["embed", "--server", server.target, long]) == 2
    assert "25 tokens, over the limit of 20 per sentence" in capsys.readouterr().err
    assert elmo_main(["embed", "--server", server.target, "--overflow", "truncate", long]) == 0
    assert ": 20 tokens (5 more cut off)" in capsys.readouterr().out
    assert elmo_main(["embed", "--server", server.target, "--overflow", "window", long]) == 0
    assert "layers float32 (3, 25, 16)" in capsys.readouterr().out


def _node_ready() -> bool:
    if (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return True
    command = ["npm", "ci"] if (NODE_DIR / "package-lock.json").is_file() else ["npm", "install"]
    result = subprocess.run(
        [*command, "--no-audit", "--no-fund", "--silent"], cwd=NODE_DIR, capture_output=True, text=True, timeout=300
    )
    return result.returncode == 0


@pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="needs node and npm")
def test_node_client_from_the_proto_alone_gets_the_same_vectors(server, client, runtime):
    if not _node_ready():
        pytest.skip("npm could not install @grpc/grpc-js and @grpc/proto-loader")
    texts = ["The cat sat on the mat .", "苹果很好吃", "naïve 🙂"]
    for dtype, layers in (("FLOAT32", []), ("FLOAT16", [2, 0])):
        request = {
            "inputs": [{"text": t} for t in texts] + [{"tokens": {"tokens": ["pre", "tokenized"]}}],
            "layers": layers,
            "dtype": dtype,
        }
        result = subprocess.run(
            ["node", "embed.js", server.target, str(PROTO), json.dumps(request)],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        node = json.loads(result.stdout)
        python = client.embed([*texts, ["pre", "tokenized"]], layers=layers, dtype=dtype.lower())
        # The provider the runtime really chose (CPU here, CUDA on a GPU host), as the server reports it.
        assert runtime.info.provider in ("CPUExecutionProvider", "CUDAExecutionProvider")
        assert node["info"] == {"name": "tiny", "n_layers": 3, "dim": 16, "provider": runtime.info.provider}
        assert node["model"] == "tiny" and len(node["embeddings"]) == len(python) == 4
        for from_node, from_python in zip(node["embeddings"], python, strict=True):
            assert from_node["tokens"] == from_python.tokens
            assert [tuple(s) for s in from_node["offsets"]] == (from_python.offsets or [])
            assert from_node["layers"]["dtype"] == dtype
            assert tuple(from_node["layers"]["shape"]) == from_python.layers.shape
            assert (
                base64.b64decode(from_node["layers"]["data_base64"])
                == from_python.layers.astype(from_python.layers.dtype.newbyteorder("<")).tobytes()
            )
        assert node["empty_request_error"] == {
            "code": grpc.StatusCode.INVALID_ARGUMENT.value[0],
            "details": "inputs is empty: send at least one sentence",
        }


def test_in_process_and_remote_apis_return_the_same_kind_of_value(client, runtime):
    """The README's promise: ``Embedder`` and ``EmbedderClient`` answer the same call with the same kind of value
    (``embed_texts``: arrays; ``embed``: Embedding objects with tokens and offsets), bit for bit."""
    texts = ["The apple fell .", "苹果很好吃"]
    local, remote = runtime.embed_texts(texts), client.embed_texts(texts)
    assert [type(v) for v in local] == [type(v) for v in remote] == [np.ndarray, np.ndarray]
    assert [v.tobytes() for v in local] == [v.tobytes() for v in remote]
    inputs = [texts[0], ["pre", "tokenized"]]
    for here, there in zip(runtime.embed(inputs), client.embed(inputs), strict=True):
        assert type(here) is type(there)
        assert (here.tokens, here.offsets, here.mix) == (there.tokens, there.offsets, there.mix)
        assert here.layers.tobytes() == there.layers.tobytes()
