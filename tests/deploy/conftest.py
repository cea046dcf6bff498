"""Fixtures of the deployment tests."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import in_ci


@pytest.fixture(scope="module")
def haproxy() -> str:
    """Debian's haproxy. Missing: a skip on a developer's machine, a failure in CI (`make haproxy` installs it)."""
    path = shutil.which("haproxy")
    if path is None:
        message = "haproxy is not installed (make haproxy installs Debian's package)"
        if in_ci():
            pytest.fail(f"{message}; CI is set, so the balancer tests must run, not skip", pytrace=False)
        pytest.skip(message)
    return path
