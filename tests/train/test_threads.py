"""The OpenMP wait policy (elmo.train.threads): chosen by `elmo` before torch loads libgomp, the user's own kept.

libgomp says what it read when OMP_DISPLAY_ENV=VERBOSE: its GOMP_SPINCOUNT line shows the spinning in force
(300000 when nothing is set, 0 under OMP_WAIT_POLICY=PASSIVE), so the tests look at what the library itself saw.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from elmo.train.threads import CHOSEN, SPIN_COUNT, WAIT_POLICY, apply_wait_policy, policy_in_force
from tests.lm_fixtures import REPO


def test_the_chosen_policy_is_set_unless_the_user_chose_one():
    env: dict[str, str] = {"PATH": "/bin"}
    assert apply_wait_policy(env) == CHOSEN and env == {"PATH": "/bin", **CHOSEN}
    assert policy_in_force(env) != "default"
    for own in ({WAIT_POLICY: "ACTIVE"}, {SPIN_COUNT: "10000"}, {WAIT_POLICY: "passive"}):
        env = dict(own)
        assert apply_wait_policy(env) == {} and env == own  # kept as the user set it
    assert policy_in_force({}) == "default"


def _libgomp_settings(extra_env: dict[str, str]) -> dict[str, str]:
    """What libgomp read, in a fresh `elmo eval-lm --help` (its module imports torch, so libgomp loads)."""
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT)}
    env.update(extra_env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "elmo.cli", "eval-lm", "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", proc.stderr, flags=re.M))


def _reference(policy_env: dict[str, str]) -> dict[str, str]:
    """What libgomp reads with ``policy_env`` set before torch is imported, without elmo in between."""
    env = {k: v for k, v in os.environ.items() if k not in (WAIT_POLICY, SPIN_COUNT)}
    env.update(policy_env, OMP_DISPLAY_ENV="VERBOSE")
    proc = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True, timeout=300)
    return dict(re.findall(r"^\s+(\w+) = '([^']*)'", proc.stderr, flags=re.M))


def test_the_cli_sets_the_policy_before_torch_loads():
    seen = _libgomp_settings({})
    assert seen[SPIN_COUNT] == _reference(CHOSEN)[SPIN_COUNT]
    assert seen[SPIN_COUNT] != _reference({})[SPIN_COUNT]  # libgomp's default spinning is not what the CLI leaves


@pytest.mark.parametrize("own", [{WAIT_POLICY: "ACTIVE"}, {SPIN_COUNT: "12345"}])
def test_the_users_own_setting_reaches_libgomp(own):
    seen = _libgomp_settings(own)
    if WAIT_POLICY in own:
        assert seen[WAIT_POLICY] == "ACTIVE"
    else:
        assert seen[SPIN_COUNT] == "12345"
