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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weights model directory: config.json + model.safetensors + model.onnx + onnx.json, the export
    verified against PyTorch (a second or two). Clips of 0.5 with N(0, 0.3) weights keep the clips active while
    the float32 recurrence stays within the 1e-5 export tolerance. Treat it as read-only: it is shared."""
    from export.random_model import write_random_model

    directory = tmp_path_factory.mktemp("tiny_model")
    return write_random_model(directory, "tiny", seed=0, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)
