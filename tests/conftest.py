from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_REFERENCE = REPO.parent / "shared" / "reference"
BILM_TF_FIXTURE = SHARED_REFERENCE / "bilm-tf-fixture"


@pytest.fixture(scope="session")
def bilm_tf_fixture() -> Path:
    if not (BILM_TF_FIXTURE / "lm_weights.hdf5").is_file():
        pytest.skip("../shared/reference/bilm-tf-fixture is not beside the repo")
    return BILM_TF_FIXTURE
