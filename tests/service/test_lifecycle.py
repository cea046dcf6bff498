"""The `elmo serve` process's life, on real processes: a drain whose grace period runs out (the RPC still running is
cancelled, the process exits 0 and says so), and a model whose warm-up forward gives non-finite vectors (the
server stops before SERVING, exit 2, one error line, no traceback)."""

from __future__ import annotations

import hashlib
import json
import queue
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from elmo.client import EmbedderClient
from elmo.runtime import Embedder
from tests.serve_process import ServeProcess, serve_until_exit


def test_drain_grace_expiry_cancels_the_rpc_still_running_and_exits_0(tiny_model_dir: Path, tmp_path: Path) -> None:
    with ServeProcess(["--model", str(tiny_model_dir), "--drain-timeout-s", "1"], tmp_path) as server:
        target = server.wait_serving()
        with EmbedderClient(target, timeout=30) as client:
            requests: queue.Queue = queue.Queue()
            responses = client.stub.EmbedStream(iter(requests.get, None), timeout=30)
            requests.put(client.request(["still running"]))
            assert list(next(responses).embeddings[0].tokens) == ["still", "running"]
            server.sigterm()
            # The client never ends this stream: only the server can, once the grace period is over.
            with pytest.raises(grpc.RpcError) as info:
                next(responses)
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), info.value
            requests.put(None)
        assert server.wait(30) == 0
        log = server.stderr()
    assert "in-flight RPCs have 1 s to finish" in log
    assert "drain: 1 RPCs still in flight after 1 s; cancelling them" in log
    assert log.rstrip().endswith("drained and stopped"), log
    assert "Traceback" not in log


def write_non_finite_copy(source: Path, target: Path) -> Path:
    """A copy of a model directory whose char-embedding table (the first weight every token meets) is NaN, written
    into the exported weight file itself, with onnx.json's checksum of that file updated: the model loads and runs
    as any other, only its vectors are not numbers."""
    import onnx  # the export's own dependency, like the torch that made tiny_model_dir

    shutil.copytree(source, target)
    encoder = onnx.load(target / "encoder.onnx", load_external_data=False)
    weight = next(t for t in encoder.graph.initializer if t.external_data and t.data_type == onnx.TensorProto.FLOAT)
    where = {entry.key: entry.value for entry in weight.external_data}
    data_file = target / where["location"]
    data = bytearray(data_file.read_bytes())
    start, length = int(where["offset"]), int(where["length"])
    data[start : start + length] = np.full(length // 4, np.nan, dtype=np.float32).tobytes()
    data_file.write_bytes(bytes(data))
    meta_file = target / "onnx.json"
    meta = json.loads(meta_file.read_text())
    assert meta["weights_data"]["file"] == where["location"]
    meta["weights_data"]["sha256"] = hashlib.sha256(bytes(data)).hexdigest()
    meta_file.write_text(json.dumps(meta, indent=2))
    return target


def test_warm_up_failure_on_non_finite_output_is_one_clear_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    broken = write_non_finite_copy(tiny_model_dir, tmp_path / "nan_model")
    # it loads: every check of the files passes; the load-time check (elmo.runtime.probe) is what refuses it
    runtime = Embedder(broken, intra_op_threads=1, check_on_load=False)
    (vectors,) = runtime.embed_tokens([["warm", "-", "up"]])
    assert np.isnan(vectors).all()
    name = runtime.info.name
    values = int(np.prod(json.loads((broken / "onnx.json").read_text())["probe"]["shape"]))

    finished = serve_until_exit(["--model", str(broken)], tmp_path / "serve")
    assert finished.returncode == 2, finished.stderr
    (line,) = finished.error_lines()
    assert line.startswith(f"elmo serve: error: warm-up failed: model {name}: load-time check of {broken} on ")
    assert f"FAILED: {values} non-finite values (NaN or inf) of {values} in the probe's vectors" in line
    assert "Traceback" not in finished.stderr
    # Nothing else alarming on the way out: the stop is a clean, immediate drain with nothing in flight.
    assert [line for line in finished.stderr.splitlines() if " WARNING " in line or " ERROR " in line] == []
    assert "drained and stopped" in finished.stderr
    assert finished.stdout == ""
