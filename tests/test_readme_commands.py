"""The README's two set-up commands work verbatim in this checkout (in CI: a fresh clone on a fresh machine).

`make test` is what CI runs (.ci/run), so this suite running at all proves it. The serve command is taken from the
README's set-up block (not hard-coded), started in the background exactly as written, and must reach grpc.health
SERVING, answer one Embed call through the generated client, expose /metrics, and exit cleanly on SIGTERM.

The first run creates .venv-serve (about a minute); later runs reuse it. The shipped default model is part of the
product: if models/default/model.onnx is missing this test fails, it does not skip.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from elmo.wire import from_tensor

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DEFAULT_MODEL = REPO / "models" / "default"
GRPC_PORT, METRICS_PORT = 50051, 9090
SERVING_DEADLINE_S = 480  # first run builds .venv-serve: pip install of the serve extra on 2 busy cores
EXIT_DEADLINE_S = 60
SENTENCE = "The cat sat on the mat ."


def setup_block(readme: str) -> str:
    """The first fenced code block after the README's 'Set-up' heading."""
    heading = re.search(r"^#+ .*set-?up.*$", readme, flags=re.IGNORECASE | re.MULTILINE)
    assert heading, "README.md has no set-up section"
    block = re.search(r"^```[a-z]*\n(.*?)^```", readme[heading.end() :], flags=re.DOTALL | re.MULTILINE)
    assert block, "README.md's set-up section has no code block"
    return block[1]


def readme_command(readme: str, program: str) -> str:
    """The set-up block's line that starts with ``program`` (e.g. 'make serve'), without its trailing comment."""
    lines = [line for line in setup_block(readme).splitlines() if line.strip().startswith(program)]
    assert len(lines) == 1, f"expected one line starting with {program!r} in the set-up block, found {lines}"
    return " ".join(shlex.split(lines[0], comments=True))


def test_setup_block_parsing_finds_the_commands() -> None:
    text = "# T\n\n## Set-up: the two commands\n\n```bash\nmake serve   # serve it\nmake test    # test it\n```\n"
    assert readme_command(text, "make serve") == "make serve"
    assert readme_command(text, "make test") == "make test"
    with pytest.raises(AssertionError):
        readme_command("# T\n\nno set-up here\n", "make serve")


def test_ci_runs_the_readme_test_command() -> None:
    """The second command: CI's entry point runs exactly the README's test command."""
    command = readme_command(README.read_text(), "make test")
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run does not run the README's {command!r}"


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def fresh_shell_environment() -> dict[str, str]:
    """The environment of a person's shell: none of the make/pytest/venv context this test runs in."""
    drop = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "VIRTUAL_ENV", "PYTHONPATH", "PYTEST_CURRENT_TEST"}
    drop |= {"MODEL", "PORT", "METRICS_PORT", "SERVE_VENV", "VENV"}  # the Makefile's `?=` variables
    return {key: value for key, value in os.environ.items() if key not in drop}


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def serve_process(make_pid: int) -> int | None:
    """The `elmo serve` process that `make serve` started (what an orchestrator would send SIGTERM to)."""
    for pid in descendants(make_pid):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/elmo") for a in argv) and b"serve" in argv:
            return pid
    return None


def health_status(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status
    except grpc.RpcError:
        return None


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The README's serve command running in the background until SERVING; stopped (hard) at the end if still up."""
    assert (DEFAULT_MODEL / "model.onnx").is_file(), (
        f"{DEFAULT_MODEL}/model.onnx is missing: `make serve` serves the shipped default model"
    )
    for port in (GRPC_PORT, METRICS_PORT):
        assert port_is_free(port), f"port {port} is taken: stop whatever listens there before running this test"
    command = readme_command(README.read_text(), "make serve")
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", command],  # as typed into a shell, in the repo root
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=fresh_shell_environment(),
            start_new_session=True,  # its own process group: cleanup can reach make, pip and elmo alike
        )
    try:
        deadline = time.monotonic() + SERVING_DEADLINE_S
        while health_status(f"127.0.0.1:{GRPC_PORT}") != health_pb2.HealthCheckResponse.SERVING:
            if process.poll() is not None:
                pytest.fail(f"`{command}` exited with {process.returncode} before SERVING:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"`{command}` not SERVING after {SERVING_DEADLINE_S} s:\n{tail(log_path)}")
            time.sleep(1)
        yield process, log_path
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # only the group this fixture started
            process.wait(timeout=30)


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def test_readme_serve_command_serves_embeds_and_stops_cleanly(served) -> None:
    process, log_path = served
    address = f"127.0.0.1:{GRPC_PORT}"
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        reply = stub.Embed(pb.EmbedRequest(inputs=[pb.Input(text=SENTENCE)], request_id="readme-test"), timeout=60)
    (embedding,) = reply.embeddings
    layers = from_tensor(embedding.layers)
    assert embedding.tokens == SENTENCE.split()
    assert layers.shape == (info.n_layers, len(embedding.tokens), info.dim)
    assert np.isfinite(layers).all() and np.abs(layers).sum() > 0
    assert reply.request_id == "readme-test"

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    counted = [line for line in metrics.splitlines() if line.startswith("elmo_requests_total{")]
    embeds = [line for line in counted if 'method="Embed"' in line and 'code="OK"' in line]
    assert [line.rsplit(" ", 1)[1] for line in embeds] == ["1.0"], f"the Embed call is not counted: {counted}"

    pid = serve_process(process.pid)
    assert pid is not None, f"no `elmo serve` process under `make serve`:\n{tail(log_path)}"
    os.kill(pid, signal.SIGTERM)  # what `docker stop` / Kubernetes do
    try:
        code = process.wait(timeout=EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`elmo serve` still running {EXIT_DEADLINE_S} s after SIGTERM:\n{tail(log_path)}")
    assert code == 0, f"`make serve` exited with {code} after SIGTERM (elmo serve must drain and exit 0):\n" + tail(
        log_path
    )
    assert "drained and stopped" in log_path.read_text(errors="replace")
