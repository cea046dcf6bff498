"""scripts/healthcheck.py, run as Docker runs it, against a real `elmo serve --auth-token` process (not a stand-in
health servicer): SERVING -> exit 0; the token does not matter to it, since the server exempts health checks from
auth (probes carry no secrets) while every Embedder RPC still needs it; a draining server -> NOT_SERVING -> exit 1;
no server -> exit 1."""

from __future__ import annotations

import queue
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from elmo.client import EmbedderClient, RemoteError
from tests.conftest import REPO
from tests.serve_process import HEALTH_SCRIPT, ServeProcess, clean_env

TOKEN = "probe-s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTH_SCRIPT), *args, "--timeout", "10"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )


def test_probe_against_a_real_server_through_serving_draining_and_gone(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_model_dir), "--auth-token", TOKEN, "--drain-timeout-s", "60"]
    with ServeProcess(args, tmp_path) as server:
        target = server.wait_serving()

        # SERVING, whatever the token: right, wrong or none; for the whole server and for the Embedder service.
        for flags in ([], ["--token", TOKEN], ["--token", "wrong"], ["--service", "elmo.v1.Embedder"]):
            done = probe(target, *flags)
            assert (done.returncode, done.stdout, done.stderr) == (0, f"{target}: SERVING\n", ""), flags
        # ... while auth is on for everything else.
        with EmbedderClient(target, auth_token="wrong", timeout=30) as wrong:
            with pytest.raises(RemoteError) as info:
                wrong.list_models()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

        with EmbedderClient(target, auth_token=TOKEN, timeout=60) as client:
            # An open stream keeps the drain going (60 s of grace) for as long as the probes take.
            requests: queue.Queue = queue.Queue()
            responses = client.stub.EmbedStream(iter(requests.get, None), timeout=60, metadata=AUTH)
            requests.put(client.request(["before the signal"]))
            assert len(next(responses).embeddings) == 1
            server.sigterm()
            for service in ("", "elmo.v1.Embedder"):
                done = probe(target, "--service", service, "--token", TOKEN)
                assert done.returncode == 1, done
                assert (done.stdout, done.stderr) == ("", f"{target}: NOT_SERVING\n")
            assert not server.exited()  # NOT_SERVING came from the draining server, not from a closed port
            requests.put(None)
            assert list(responses) == []
        assert server.wait(30) == 0

    done = probe(target)
    assert done.returncode == 1
    assert done.stderr.startswith(f"{target}: UNAVAILABLE: ")
