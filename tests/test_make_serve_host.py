"""`make serve` listens on this machine only (HOST=127.0.0.1 by default): the real Makefile target and the real
server, its listening sockets read from /proc/net/tcp{,6}. The serving venv is a stand-in whose `elmo` runs this
checkout's (its install stamp present, so make installs nothing); ports 0, so nothing here is taken."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, ::1


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        current = todo.pop()
        found.add(current)
        todo += children.get(current, [])
    return found


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address in /proc/net's hex, port) of every TCP socket in LISTEN that one of ``pids`` holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, port = fields[1].split(":")
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append((address, int(port, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_make_serve_listens_on_loopback_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed-cpu").touch()  # newer than pyproject.toml: the install step has nothing to do
    elmo = venv / "bin" / "elmo"
    elmo.write_text(f'#!/bin/sh\nexec {sys.executable} -m elmo.cli "$@"\n')
    elmo.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "ELMO_")) and k not in ("HOST",)}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        make = subprocess.Popen(
            [
                "make",
                "--no-print-directory",
                "serve",
                f"SERVE_VENV={venv}",
                "SERVE_FLAVOUR=cpu",
                f"MODEL={tiny_model_dir}",
                "PORT=0",
                "HTTP_PORT=0",
                "METRICS_PORT=0",
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120  # a guard against a hang, not a measurement
        sockets: list[tuple[str, int]] = []
        while len(sockets) < 3:  # gRPC, HTTP and metrics
            assert make.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"3 listening sockets not seen: {sockets}\n{log.read_text()}"
            time.sleep(0.2)
            sockets = listening(descendants(make.pid))
        assert "--host 127.0.0.1" in log.read_text()  # the command make ran
        assert all(address in LOOPBACK for address, _ in sockets), sockets
    finally:
        os.killpg(make.pid, signal.SIGTERM)  # the group this test started: make, its shell, the server
        make.wait(60)


def test_host_is_a_make_variable(tmp_path: Path) -> None:
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", "serve", f"SERVE_VENV={tmp_path}", "SERVE_FLAVOUR=cpu", "HOST=0.0.0.0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "elmo serve --model models/default --host 0.0.0.0 --port 50051 --http-port 8080" in done.stdout
