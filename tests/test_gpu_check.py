"""scripts/gpu_check.py, the parts that run without a GPU: which onnxruntime is imported, the refusal on a host
where a plain start does not pick CUDA, and the served measurement (bench.kit reused) on whatever provider
this host's runtime picks. The CUDA steps themselves need the GPU machine (docs/how-to/deploy.md, GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from elmo.runtime import Embedder, gpu_visibility
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_onnxruntime_from_another_folder_is_refused(gpu_check, tmp_path):
    # What keeps the machine's CPU onnxruntime from passing for the private onnxruntime-gpu.
    with pytest.raises(gpu_check.CheckFailed, match=f"not {tmp_path}"):
        gpu_check.check_onnxruntime(tmp_path)


def test_onnxruntime_report_names_the_build_and_its_file(gpu_check):
    site = Path(ort.__file__).parents[1]
    if ort.get_device() != "GPU":
        with pytest.raises(gpu_check.CheckFailed, match="CPU build"):
            gpu_check.check_onnxruntime(site)
        return
    found = gpu_check.check_onnxruntime(site)
    assert found["file"] == ort.__file__ and found["version"] == ort.__version__ and found["device"] == "GPU"


def test_a_host_without_a_visible_gpu_fails_the_check_saying_why(tiny_model_dir, tmp_path):
    if gpu_visibility(os.environ)[0]:
        pytest.skip("a GPU is visible here: the check may pass, which is the GPU machine's business")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_model_dir), "--json", str(report)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "GPU CHECK FAILED: a plain start does not request CUDA" in done.stdout
    written = json.loads(report.read_text())
    assert "no GPU visible" in written["failed"] or "no CUDA provider" in written["failed"]
    assert written["onnxruntime"]["file"] == ort.__file__


def test_served_run_drives_elmo_serve_on_the_provider_the_runtime_picks(gpu_check, tiny_model_dir):
    expected = Embedder(tiny_model_dir, cache_size=0).info.provider  # CPU here, CUDA on a GPU host
    found = gpu_check.served_throughput(tiny_model_dir, seconds=1.0, clients=2, expect=expected)
    assert found["provider"] == expected and found["concurrency"] == 2
    assert found["requests"] > 0 and found["tokens"] > 0 and found["errors"] == {}
    assert found["server_exit_code"] == 0


def test_served_run_on_another_provider_than_expected_fails(gpu_check, tiny_model_dir):
    with pytest.raises(gpu_check.CheckFailed, match="runs on .*ExecutionProvider, not NoSuchExecutionProvider"):
        gpu_check.served_throughput(tiny_model_dir, seconds=1.0, clients=1, expect="NoSuchExecutionProvider")
