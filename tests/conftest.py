from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Hypothesis' per-example deadline (200 ms) is a timing threshold: on a loaded 2-core CI machine it failed a correct
# property test (tests/text/test_overflow.py, 406 ms for one example). Properties are checked, not timed.
settings.register_profile("elmo", deadline=None)
settings.load_profile("elmo")
SHARED_REFERENCE = REPO.parent / "shared" / "reference"
BILM_TF_FIXTURE = SHARED_REFERENCE / "bilm-tf-fixture"


def in_ci() -> bool:
    """The environment variable CI is set (GitHub Actions, GitLab and most CI systems set CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def bilm_tf_fixture() -> Path:
    """The bilm-tf reference files. Missing: a skip on a developer's machine, a failure in CI (where a skip would
    silently drop the reference comparisons)."""
    if not (BILM_TF_FIXTURE / "lm_weights.hdf5").is_file():
        message = f"../shared/reference/bilm-tf-fixture is not beside the repo ({BILM_TF_FIXTURE})"
        if in_ci():
            pytest.fail(f"{message}; CI is set, so the reference tests must run, not skip", pytrace=False)
        pytest.skip(message)
    return BILM_TF_FIXTURE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-weights model directory: config.json + model.safetensors + model.onnx + onnx.json, the export
    verified against PyTorch (a second or two). Clips of 0.5 with N(0, 0.3) weights keep the clips active while
    the float32 recurrence stays within the 1e-5 export tolerance. Treat it as read-only: it is shared."""
    from elmo.export.random_model import write_random_model

    directory = tmp_path_factory.mktemp("tiny_model")
    return write_random_model(directory, "tiny", seed=0, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5)


@pytest.fixture(scope="session")
def brown_corpus(tmp_path_factory) -> Path:
    """A real Brown-only LM corpus from `elmo data fetch --sources brown` (train/valid/test, vocab, heldout)."""
    from tests.lm_fixtures import build_brown_corpus

    return build_brown_corpus(tmp_path_factory.mktemp("brown_corpus"))


@pytest.fixture(scope="session")
def trained_tiny_lm(tmp_path_factory, brown_corpus) -> Path:
    """The CI-sized training run (tiny config, a few hundred steps on a slice of Brown). Read-only: shared."""
    from elmo.cli import main
    from tests.lm_fixtures import write_train_config

    work = tmp_path_factory.mktemp("tiny_lm")
    config = write_train_config(work / "train.json", brown_corpus)
    assert main(["train", "--config", str(config), "--out", str(work / "model")]) == 0
    return work / "model"
