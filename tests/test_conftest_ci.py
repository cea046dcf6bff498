"""tests/conftest.py's ``bilm_tf_fixture``: a missing ``../shared/reference/bilm-tf-fixture`` is a skip on a
developer's machine and a failure when the environment variable ``CI`` is set.

Each case runs pytest in a subprocess on a throwaway directory whose conftest imports the suite's own fixture from
tests/conftest.py and points its ``BILM_TF_FIXTURE`` at a path of the case's choosing; the one test there asks for
the fixture by name, exactly as tests/importers/test_allennlp.py does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

CONFTEST = """\
from pathlib import Path

import tests.conftest as suite
from tests.conftest import bilm_tf_fixture  # noqa: F401 - the suite's fixture, requested by name below

suite.BILM_TF_FIXTURE = Path({path!r})
"""

TEST = """\
def test_reads_the_reference(bilm_tf_fixture):
    assert (bilm_tf_fixture / "lm_weights.hdf5").is_file()
"""


def run_pytest(directory: Path, reference: Path, ci: str | None) -> subprocess.CompletedProcess:
    (directory / "conftest.py").write_text(CONFTEST.format(path=str(reference)))
    (directory / "test_reference.py").write_text(TEST)
    (directory / "pytest.ini").write_text("[pytest]\n")  # this directory is the rootdir: the repo's config stays out
    env = {key: value for key, value in os.environ.items() if key != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # seconds of third-party plugins this tiny run does not need
    command = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(directory)]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci", ["1", "true"])
def test_missing_reference_fails_in_ci(tmp_path, ci):
    missing = tmp_path / "shared" / "reference" / "bilm-tf-fixture"
    result = run_pytest(tmp_path, missing, ci)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 error" in out and "skipped" not in out, out
    assert "ERROR at setup of test_reads_the_reference" in out
    assert f"bilm-tf-fixture is not beside the repo ({missing})" in out and "CI is set" in out


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_missing_reference_skips_outside_ci(tmp_path, ci):
    missing = tmp_path / "nowhere" / "bilm-tf-fixture"
    result = run_pytest(tmp_path, missing, ci)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 skipped" in out and "error" not in out.lower(), out
    assert f"bilm-tf-fixture is not beside the repo ({missing})" in out


def test_present_reference_is_used_in_ci(tmp_path):
    """The fixture's path really is the one the cases above point at: present there, the test runs and passes."""
    present = tmp_path / "bilm-tf-fixture"
    present.mkdir()
    (present / "lm_weights.hdf5").write_bytes(b"")
    result = run_pytest(tmp_path, present, "1")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 passed" in out, out
