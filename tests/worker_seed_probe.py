"""Run only by tests/test_tiers.py, which names it (pytest collects no file that is not test_*.py by itself): each
case writes down the fuzz seed that its worker draws from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import FUZZ_SEED


@pytest.mark.parametrize("case", range(4))
def test_write_down_the_seed(case: int) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(os.environ["TESTS_SEED_PROBE_OUT"]) / f"{worker}-{case}").write_text(str(FUZZ_SEED))
