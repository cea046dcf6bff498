"""A model written by root is served by a server running as another user (issue 39: files written 0600 made a
non-root `elmo serve --model-root` refuse every pulled or imported version, while health said SERVING).

The model is imported and exported as root (this test process, under umask 077) into a repository, as `elmo pull`
does; then a real `elmo serve --model-root` runs as
the unprivileged user ``nobody`` (uid and gid 65534, no supplementary groups). The interpreter of this machine may
live where only root can read (under /root), so the server process starts as root, imports everything it needs,
drops to ``nobody`` with setgroups/setgid/setuid (irreversibly: no capability is kept) and only then runs
``elmo serve``, whose every model read happens as ``nobody``.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elmo.cli import main as elmo_main
from elmo.client import EmbedderClient
from tests.conftest import REPO
from tests.serve_process import clean_env, health_status, wait_until

NOBODY = 65534
# Runs as root until the drop: every module the server imports later is imported first (Python's own library, and
# the checkout itself, may be unreadable to nobody: elmo.cli.main imports elmo.train.threads), then the process
# becomes nobody for good and serves.
LAUNCH = """
import os, sys
import elmo.cli, elmo.train.threads, elmo.service.server, elmo.service.models.versions, elmo.runtime
import onnxruntime, grpc, encodings.idna
os.setgroups([])
os.setgid({uid})
os.setuid({uid})
assert os.getuid() == os.geteuid() == {uid} and os.getgroups() == []
sys.exit(elmo.cli.main(sys.argv[1:]))
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder the other user can enter and write in (pytest's own tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="elmo-second-user-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to write as root and then serve as another user")
def test_a_model_imported_as_root_is_served_by_nobody(bilm_tf_fixture: Path, shared_dir: Path) -> None:
    root = shared_dir / "models"
    (root / "en").mkdir(parents=True)
    for folder in (root, root / "en"):
        folder.chmod(0o755)  # made by this test, not by the writers
    out = root / "en" / "1"
    old_umask = os.umask(0o077)  # the strictest umask root might have: the writers must set the modes themselves
    try:
        assert (
            elmo_main(
                [
                    "import-allennlp",
                    "--options",
                    str(bilm_tf_fixture / "options.json"),
                    "--weights",
                    str(bilm_tf_fixture / "lm_weights.hdf5"),
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        assert elmo_main(["export", "--model", str(out), "--threads", "1"]) == 0
    finally:
        os.umask(old_umask)
    unreadable = [p for p in out.rglob("*") if not p.stat().st_mode & (stat.S_IROTH if p.is_file() else stat.S_IXOTH)]
    assert not unreadable, unreadable

    port_file = shared_dir / "serve.port"
    command = [
        sys.executable,
        "-c",
        LAUNCH.format(uid=NOBODY),
        "serve",
        "--model-root",
        str(root),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--threads",
        "1",
        "--http-port",
        "off",
    ]
    log = shared_dir / "serve.stderr"
    with open(log, "w") as err:
        server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, env=clean_env())
    try:
        wait_until(
            lambda: server.poll() is not None or port_file.is_file() and bool(port_file.read_text().strip()),
            60,
            "the server listening",
        )
        assert server.poll() is None, log.read_text()
        target = f"127.0.0.1:{port_file.read_text().split()[0]}"
        wait_until(lambda: server.poll() is not None or health_status(target) == "SERVING", 60, "health SERVING")
        assert server.poll() is None, log.read_text()
        ids = [
            line.split()[1:]
            for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
            if line.startswith(("Uid:", "Gid:"))
        ]
        assert ids == [[str(NOBODY)] * 4] * 2  # real, effective, saved and filesystem ids: all nobody's
        with EmbedderClient(target) as client:
            (result,) = client.embed(["The apple fell ."], model="en")
        assert result.layers.shape[1] == 4 and "refused" not in log.read_text()
    finally:
        server.kill()
        server.wait(10)
