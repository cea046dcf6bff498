"""`make serve` picks the serving venv's flavour by itself: the `gpu` extra where `nvidia-smi -L` lists a GPU, the
`serve` extra alone otherwise, one stamp per flavour. Dry runs (`make -n`): nothing is installed. This host has no
GPU, so a stand-in `nvidia-smi` on PATH plays the driver's answer (the listing format of `nvidia-smi -L`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

GPU_LISTING = "GPU 0: NVIDIA H200 (UUID: GPU-5f3c2a10-0000-0000-0000-000000000000)"


def dry_run(tmp_path: Path, nvidia_smi: str | None, *variables: str) -> str:
    """`make -n serve` with SERVE_VENV under tmp_path and, when given, an `nvidia-smi` that runs ``nvidia_smi``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE") and k != "SERVE_FLAVOUR"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "serve", f"SERVE_VENV={tmp_path / 'venv'}", *variables],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(autouse=True)
def no_real_gpu() -> None:
    listed = subprocess.run("nvidia-smi -L", shell=True, capture_output=True, text=True).stdout
    if listed.startswith("GPU"):
        pytest.skip("a real nvidia-smi lists a GPU here and comes first on PATH for the no-GPU cases")


def test_a_listed_gpu_installs_the_gpu_extra(tmp_path):
    out = dry_run(tmp_path, f"echo '{GPU_LISTING}'")
    assert "pip install -q -e '.[serve,gpu]'" in out
    assert f"touch {tmp_path / 'venv'}/.installed-gpu" in out


@pytest.mark.parametrize(
    "nvidia_smi", ["echo 'No devices were found'; exit 6", "echo 'NVIDIA-SMI has failed'; exit 9", None]
)
def test_no_listed_gpu_installs_the_serve_extra_alone(tmp_path, nvidia_smi):
    out = dry_run(tmp_path, nvidia_smi)
    assert "pip install -q -e '.[serve]'" in out
    assert "'.[serve,gpu]'" not in out and ".installed-gpu" not in out
    assert f"touch {tmp_path / 'venv'}/.installed-cpu" in out


def test_a_host_that_gains_a_gpu_gets_the_extra_and_then_nothing_more(tmp_path):
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / ".installed-cpu").touch()  # installed before the GPU came (newer than pyproject.toml)
    assert "pip install" not in dry_run(tmp_path, "exit 6")
    assert "'.[serve,gpu]'" in dry_run(tmp_path, f"echo '{GPU_LISTING}'")
    (tmp_path / "venv" / ".installed-gpu").touch()
    out = dry_run(tmp_path, f"echo '{GPU_LISTING}'")
    assert "pip install" not in out and "elmo serve --model" in out


def test_serve_flavour_overrides_the_detection(tmp_path):
    assert "'.[serve]'" in dry_run(tmp_path, f"echo '{GPU_LISTING}'", "SERVE_FLAVOUR=cpu")
    assert "'.[serve,gpu]'" in dry_run(tmp_path, "exit 6", "SERVE_FLAVOUR=gpu")
