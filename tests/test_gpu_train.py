"""scripts/gpu-train.sh, the GPU training recipe for the borrowed GPU machine, rehearsed end to end on the CPU in
its tiny mode (GPU_TRAIN_TINY=1: configs/tiny.json's shape, a slice of the Brown test corpus, 6 steps): prepare
here, train "there" (this host, with matplotlib, gRPC and onnxruntime made unimportable, as they may be missing on
that machine), receive here. What comes back must fit the device call: at most 8 files of at most 16 MiB, plain
names. The real run needs the GPU machine (docs/how-to/deploy.md, "GPU training")."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu-train.sh"
BLOCKED = ("matplotlib", "grpc", "onnxruntime")  # the training path must not need them
PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
MIB = 1024 * 1024


def run_script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


def write_wheel(directory: Path, module: str, version: str) -> Path:
    """A minimal valid pure-Python wheel holding the package ``module``."""
    dist = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n".encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }

    def record_line(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    record = "\n".join([*(record_line(n, d) for n, d in files.items()), f"{dist}/RECORD,,"]) + "\n"
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return wheel


@pytest.fixture(scope="module")
def rehearsal(brown_corpus, tmp_path_factory) -> SimpleNamespace:
    """prepare + train in the tiny mode; two carried wheels: one the host lacks (installed into the private
    site), one it has (tqdm: left to the host's own)."""
    root = tmp_path_factory.mktemp("gpu_train")
    wheels = root / "wheels"
    wheels.mkdir()
    write_wheel(wheels, "gt_probe_pkg", "1.0")
    write_wheel(wheels, "tqdm", "0.0.1")
    block = root / "block"
    for module in BLOCKED:
        (block / module).mkdir(parents=True)
        (block / module / "__init__.py").write_text(f"raise ImportError('no {module} on the GPU machine')\n")
    env = {
        "GPU_TRAIN_TINY": "1",
        "GPU_TRAIN_DIR": str(root / "carry"),
        "GPU_TRAIN_CORPUS": str(brown_corpus),
        "GPU_TRAIN_WORK": str(root / "work"),
        "GPU_TRAIN_SITE": str(root / "site"),
        "GPU_TRAIN_WHEELS": str(wheels),
        "PYTHON": sys.executable,
    }
    prepared = run_script("prepare", env=env)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    out = root / "out"
    trained = run_script("train", env={**env, "OUT": str(out), "PYTHONPATH": str(block)})
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    return SimpleNamespace(root=root, env=env, prepared=prepared, trained=trained, out=out, run=root / "work" / "run")


def test_prepare_packs_the_corpus_and_wheels_and_prints_the_device_call(rehearsal):
    out = rehearsal.prepared.stdout
    assert 'run(command="bash scripts/gpu-train.sh train", carry=[' in out and "timeout_s=560)" in out
    assert re.search(r"sizes: working tree [\d.]+ MiB \+ bundle and manifest [\d.]+ MiB", out)
    carry = rehearsal.root / "carry"
    manifest = dict(reversed(line.split()) for line in (carry / "manifest.sha256").read_text().splitlines())
    assert manifest["bundle.tar"] == hashlib.sha256((carry / "bundle.tar").read_bytes()).hexdigest()
    assert {"corpus/train.txt", "corpus/train.zh.txt", "corpus/valid.txt", "corpus/vocab.txt"} <= set(manifest)
    with tarfile.open(carry / "bundle.tar") as bundle:
        names = set(bundle.getnames())
        assert bundle.extractfile("mode.txt").read() == b"tiny\n"
    # train.txt is train.en.txt + train.zh.txt: only its parts travel, xz-compressed
    assert "corpus/train.txt.xz" not in names and "corpus/train.en.txt.xz" in names
    assert {"wheels/gt_probe_pkg-1.0-py3-none-any.whl", "wheels/tqdm-0.0.1-py3-none-any.whl"} <= names


def test_train_brings_back_at_most_8_files_of_at_most_16_mib(rehearsal):
    files = sorted(p.name for p in rehearsal.out.iterdir())
    assert files == sorted(
        ["config.json", "gpu-train.json", "model.safetensors.part-00", "train.log", "train_state.json", "vocab.txt"]
    )
    assert len(files) <= 8
    assert all(PLAIN_NAME.match(name) and (rehearsal.out / name).is_file() for name in files)
    assert all((rehearsal.out / name).stat().st_size <= 16 * MIB for name in files)
    report = json.loads((rehearsal.out / "gpu-train.json").read_text())
    parts = report["parts"]
    assert [p["name"] for p in parts] == ["model.safetensors.part-00"]
    assert all(p["bytes"] <= 15 * MIB and (rehearsal.out / p["name"]).stat().st_size == p["bytes"] for p in parts)
    assert sum(p["bytes"] for p in parts) == report["model_safetensors"]["bytes"]
    assert report["model_safetensors"]["dtype"] == "float16"
    assert report["device"] == "cpu" and report["cuda_available"] is False  # this host; "NVIDIA H200" there
    assert report["step"] == 6 and report["tokens"] > 0 and report["tokens_per_s"] > 0
    assert report["train_exit_code"] == 0 and report["final_valid"]["valid_avg_ppl"] > 1
    timings = {"device_and_bundle_check_s", "unpack_s", "install_wheels_s", "train_s", "pack_s", "total_s"}
    assert timings <= set(report["timings_s"])


def test_the_machine_side_needs_no_matplotlib_grpc_or_onnxruntime(rehearsal):
    log = (rehearsal.out / "train.log").read_text()
    assert log == rehearsal.trained.stdout  # everything the step printed, the training's log included
    assert log.count("matplotlib is not installed: no curve.png") == 1
    assert "torch {" in log and "elmo train --config" in log
    # only the wheels whose module the host lacks are installed, into the private site
    site = rehearsal.root / "site"
    assert (site / "gt_probe_pkg" / "__init__.py").is_file() and not (site / "tqdm").exists()
    assert "have tqdm" in log


def test_receive_writes_a_model_directory_with_the_runs_float16_weights(rehearsal):
    from elmo.cli import main
    from elmo.model.checkpoint import load_model_and_vocab, load_state

    model = rehearsal.root / "model"
    done = run_script("receive", str(rehearsal.out), str(model), env={"PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in model.iterdir()} == {
        "config.json",
        "vocab.txt",
        "model.safetensors",
        "train_state.json",
        "gpu-train.json",
        "curve.png",
    }
    received, trained = load_state(model / "model.safetensors"), load_state(rehearsal.run / "model.safetensors")
    assert set(received) == set(trained)
    for name, tensor in trained.items():
        expected = tensor.half().float() if tensor.is_floating_point() else tensor
        assert received[name].equal(expected), name
    bilm, vocab = load_model_and_vocab(model)
    assert len(vocab) == bilm.cfg.vocab_size
    valid = rehearsal.root / "work" / "corpus" / "valid.txt"
    assert main(["eval-lm", "--model", str(model), "--text", str(valid), "--tokenized", "--threads", "1"]) == 0
    assert main(["export", "--model", str(model), "--out", str(rehearsal.root / "onnx"), "--threads", "1"]) == 0
    again = run_script("receive", str(rehearsal.out), str(model), env={"PYTHON": sys.executable})
    assert again.returncode == 1 and "not empty" in again.stderr  # never written over


def test_receive_refuses_a_corrupted_or_missing_part(rehearsal):
    damaged = rehearsal.root / "damaged"
    shutil.copytree(rehearsal.out, damaged)
    part = damaged / "model.safetensors.part-00"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    done = run_script("receive", str(damaged), str(rehearsal.root / "refused"), env={"PYTHON": sys.executable})
    assert done.returncode == 1
    assert "model.safetensors.part-00 does not match its sha256" in done.stderr
    assert not (rehearsal.root / "refused").exists()
    part.unlink()
    done = run_script("receive", str(damaged), str(rehearsal.root / "refused"), env={"PYTHON": sys.executable})
    assert done.returncode == 1 and "part-00 is missing" in done.stderr


def test_train_refuses_a_damaged_bundle(rehearsal, tmp_path):
    carry = tmp_path / "carry"
    shutil.copytree(rehearsal.root / "carry", carry)
    data = bytearray((carry / "bundle.tar").read_bytes())
    data[700] ^= 0xFF
    (carry / "bundle.tar").write_bytes(bytes(data))
    env = {**rehearsal.env, "GPU_TRAIN_DIR": str(carry), "GPU_TRAIN_WORK": str(tmp_path / "work")}
    done = run_script("train", env={**env, "OUT": str(tmp_path / "out")})
    assert done.returncode == 1
    assert "bundle.tar does not match" in done.stdout and "carry it again" in done.stdout
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["train.log"]


def test_a_full_run_wants_cuda_and_a_full_bundle(rehearsal, tmp_path):
    env = {**rehearsal.env, "GPU_TRAIN_TINY": "0", "GPU_TRAIN_WORK": str(tmp_path / "work")}
    env["OUT"] = str(tmp_path / "out")
    done = run_script("train", env=env)  # this host has no CUDA: no 7-minute CPU run
    assert done.returncode == 1 and "torch sees no CUDA device" in done.stdout
    done = run_script("train", env={**env, "GPU_TRAIN_ALLOW_CPU": "1"})
    assert done.returncode == 1 and "the bundle is a tiny rehearsal's" in done.stdout


def test_prepare_refuses_a_bundle_that_does_not_fit_in_a_call(brown_corpus, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "big-1.0-py3-none-any.whl").write_bytes(os.urandom(50 * MIB))
    env = {
        "GPU_TRAIN_TINY": "1",
        "GPU_TRAIN_DIR": str(tmp_path / "carry"),
        "GPU_TRAIN_CORPUS": str(brown_corpus),
        "GPU_TRAIN_WHEELS": str(wheels),
        "PYTHON": sys.executable,
    }
    done = run_script("prepare", env=env)
    assert done.returncode == 1
    assert "over the 60 MiB a device call may carry" in done.stderr


def test_the_large_gpu_config_and_its_weights_fit_the_way_back():
    from elmo.model.bilm import BiLM
    from elmo.model.config import ModelConfig
    from elmo.train.config import load_train_config

    cfg = load_train_config(REPO / "configs" / "default-gpu-large.json")
    small = load_train_config(REPO / "configs" / "default-gpu.json")
    m, d, t = cfg.model, cfg.data, cfg.train
    assert (m.filters, m.char_dim, m.n_highway) == (small.model.filters, small.model.char_dim, small.model.n_highway)
    assert (m.projection_dim, m.cell_dim, m.n_layers, m.dropout) == (256, 1024, 2, 0.1)
    assert d.train == ["data/corpus/train.txt", "data/corpus/train.zh.txt", "data/corpus/train.zh.txt"]
    assert (d.valid, d.vocab) == ("data/corpus/valid.txt", "data/corpus/vocab.txt")
    assert d.max_sentence_tokens == 128 and d.mask_cut_boundaries is True
    assert (t.optimizer, t.lr, t.schedule, t.anneal_by_time, t.max_time_s) == ("adam", 2e-3, "cosine", True, 420)
    assert (t.tokens_per_batch, t.n_negatives, t.warmup_steps, t.clip, t.threads) == (32768, 8192, 100, 5.0, 8)
    assert (t.valid_every, t.checkpoint_every, t.calibrate_bias_tokens) == (200, 200, 20000)
    assert t.init_bias_unigram is True and t.seed != 0
    assert t.max_steps >= 10 * t.max_time_s  # the time budget ends the run, not the step budget
    # float16 weights with the shipped 30,000-token vocabulary: 3 parts of 15 MiB at most, beside 5 other files
    bilm = BiLM(ModelConfig.from_dict({**m.to_dict(), "vocab_size": 30000}, source="test"))
    size = sum(tensor.numel() * 2 for tensor in bilm.state_dict().values())
    assert math.ceil(size / (15 * MIB)) <= 3
