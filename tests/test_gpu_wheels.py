"""scripts/gpu-wheels.sh, the way to the borrowed GPU machine: split here, parts carried one per device call,
reassembled, checked and installed there. The round trip runs here on a small real wheel (a few MiB of random
bytes, 1 MiB parts): the machine's side is the same script with other folders."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu-wheels.sh"
PAYLOAD_BYTES = 2 * 1024 * 1024 + 12345  # three 1 MiB parts
WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(directory: Path, payload: bytes) -> Path:
    """A minimal valid pure-Python wheel: package probe_pkg holding ``payload`` (random: incompressible)."""
    files = {
        "probe_pkg/__init__.py": b"from pathlib import Path\nPAYLOAD = Path(__file__).with_name('payload.bin')\n",
        "probe_pkg/payload.bin": payload,
        "probe_pkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: probe-pkg\nVersion: 1.0\n",
        "probe_pkg-1.0.dist-info/WHEEL": WHEEL_FILE,
    }
    record = "\n".join([*(record_line(n, d) for n, d in files.items()), "probe_pkg-1.0.dist-info/RECORD,,"]) + "\n"
    wheel = directory / "probe_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for name, data in {**files, "probe_pkg-1.0.dist-info/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return wheel


def run_script(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300
    )


@pytest.fixture()
def prepared(tmp_path: Path) -> tuple[Path, bytes, dict[str, str]]:
    """``prepare`` on one wheel with 1 MiB parts; the environment that points both sides at tmp_path."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    payload = os.urandom(PAYLOAD_BYTES)
    write_wheel(wheels, payload)
    env = {
        "GPU_PARTS": str(tmp_path / "parts"),
        "GPU_PARTS_STORE": str(tmp_path / "store"),
        "GPU_SITE": str(tmp_path / "site"),
        "PART_MIB": "1",
        "PYTHON": sys.executable,
    }
    done = run_script("prepare", str(wheels), env=env)
    assert done.returncode == 0, done.stderr
    return tmp_path, payload, env


def carry(parts: Path, part: str, call: Path) -> Path:
    """What one device call brings: the manifest and one part, in a fresh folder."""
    call.mkdir()
    shutil.copy(parts / "manifest.sha256", call)
    shutil.copy(parts / part, call)
    return call


def part_names(parts: Path) -> list[str]:
    return sorted(p.name for p in parts.glob("wheels.tar.part-*"))


def test_parts_fit_the_size_and_the_manifest_lists_them(prepared):
    tmp_path, _, _ = prepared
    parts = tmp_path / "parts"
    names = part_names(parts)
    assert names == ["wheels.tar.part-000", "wheels.tar.part-001", "wheels.tar.part-002"]
    assert all((parts / n).stat().st_size <= 1024 * 1024 for n in names)
    listed = [line.split()[1] for line in (parts / "manifest.sha256").read_text().splitlines()]
    assert listed == ["wheels.tar", *names]
    assert not (parts / "wheels.tar").exists()  # only the parts travel


def test_parts_arrive_one_call_at_a_time_in_any_order_then_install(prepared):
    tmp_path, payload, env = prepared
    names = part_names(tmp_path / "parts")
    for index, name in enumerate(reversed(names)):  # order does not matter
        call = carry(tmp_path / "parts", name, tmp_path / f"call-{index}")
        done = run_script("receive", env={**env, "GPU_PARTS": str(call)})
        if index < len(names) - 1:
            assert done.returncode == 3, done.stdout + done.stderr
            assert "still missing" in done.stdout
        else:
            assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    assert (site / "probe_pkg" / "payload.bin").read_bytes() == payload
    probe = "import probe_pkg; print(probe_pkg.__file__)"
    shown = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True
    )
    assert shown.stdout.strip() == str(site / "probe_pkg" / "__init__.py")
    # A later call with nothing new: the installed bundle is recognised, not installed again.
    again = run_script("receive", env={**env, "GPU_PARTS": str(carry(tmp_path / "parts", names[0], tmp_path / "x"))})
    assert again.returncode == 0 and "already installed" in again.stdout


def test_a_part_corrupted_in_transfer_is_refused(prepared):
    tmp_path, _, env = prepared
    name = part_names(tmp_path / "parts")[1]
    call = carry(tmp_path / "parts", name, tmp_path / "call")
    data = bytearray((call / name).read_bytes())
    data[1000] ^= 0xFF
    (call / name).write_bytes(bytes(data))
    done = run_script("receive", env={**env, "GPU_PARTS": str(call)})
    assert done.returncode == 1
    assert name in done.stderr and "carry it again" in done.stderr
    assert not (tmp_path / "store" / name).exists()


def test_receive_without_a_manifest_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    done = run_script("receive", env={"GPU_PARTS": str(tmp_path / "empty"), "GPU_PARTS_STORE": str(tmp_path / "s")})
    assert done.returncode == 1 and "manifest.sha256" in done.stderr


def test_torchs_nvidia_libraries_are_linked_in_beside_onnxruntime(prepared):
    # On the GPU machine the CUDA 13 / cuDNN 9 libraries are torch's nvidia-* wheels in the interpreter's own
    # site-packages; preload_dlls looks beside onnxruntime, i.e. in the private site. A venv stands in for it.
    tmp_path, _, env = prepared
    machine = tmp_path / "machine"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(machine)], check=True)
    python = machine / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    nvidia = Path(purelib) / "nvidia"
    (nvidia / "cu13" / "lib").mkdir(parents=True)
    (nvidia / "cu13" / "lib" / "libcudart.so.13").touch()
    call = tmp_path / "call"
    call.mkdir()
    for path in (tmp_path / "parts").iterdir():  # all parts in one call: receive takes whatever was carried
        shutil.copy(path, call)
    done = run_script("receive", env={**env, "GPU_PARTS": str(call), "PYTHON": str(python)})
    assert done.returncode == 0, done.stdout + done.stderr
    site = tmp_path / "site"
    assert (site / "nvidia").is_symlink() and (site / "nvidia").resolve() == nvidia.resolve()
    assert (site / "nvidia" / "cu13" / "lib" / "libcudart.so.13").is_file()
