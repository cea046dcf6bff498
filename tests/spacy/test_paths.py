"""Where a saved pipeline's `elmo` component finds its model (docs/how-to/models.md, "Paths that leave their
folder"): the model `elmo/cfg.json` names, or the bundled one, is loaded wherever it leads, and one WARNING names
the place when that is outside the component's folder (saved by reference, a symlink, a `..`); a bundle inside says
nothing."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import spacy

from elmo.runtime.modeldir import OUTSIDE_RULE
from elmo.runtime.tasks import Task, save_task

TEXT = "The apple fell ."


def save_pipeline(folder: Path, model: Path, bundle: bool = False) -> np.ndarray:
    """An `elmo` pipeline on ``model`` saved to ``folder``; the layers it gives TEXT."""
    nlp = spacy.blank("en")
    nlp.add_pipe("elmo", config={"model": str(model), "bundle": bundle})
    nlp.to_disk(folder)
    return nlp(TEXT)._.elmo_layers


def load_and_embed(folder: Path, caplog: pytest.LogCaptureFixture) -> tuple[np.ndarray, list[str]]:
    """The reloaded pipeline's layers for TEXT, and the WARNINGs its loading logged about paths."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        layers = spacy.load(folder)(TEXT)._.elmo_layers
    return layers, [r.getMessage() for r in caplog.records if "leads outside" in r.getMessage()]


def outside_line(component: Path, what: str, shown: Path, real: Path) -> str:
    return (
        f"elmo component 'elmo': {component / 'cfg.json'} names a {what}; {shown} leads outside {component}, "
        f"to {real}: loaded from there ({OUTSIDE_RULE})"
    )


@pytest.fixture
def model(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A copy of the tiny model of this test's own (the WARNING is said once per process and place)."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny"))


def test_a_pipeline_saved_by_reference_names_the_model_it_loads(tmp_path: Path, model: Path, caplog) -> None:
    want = save_pipeline(tmp_path / "pipeline", model)
    layers, said = load_and_embed(tmp_path / "pipeline", caplog)
    np.testing.assert_array_equal(layers, want)
    assert said == [outside_line(tmp_path / "pipeline" / "elmo", "model", model, model)]
    _, said = load_and_embed(tmp_path / "pipeline", caplog)
    assert said == []  # once per process


def test_a_bundled_model_inside_the_pipeline_says_nothing(tmp_path: Path, model: Path, caplog) -> None:
    want = save_pipeline(tmp_path / "pipeline", model, bundle=True)
    layers, said = load_and_embed(tmp_path / "pipeline", caplog)
    np.testing.assert_array_equal(layers, want)
    assert said == []


def test_a_bundled_model_that_is_a_symlink_to_elsewhere_is_named(tmp_path: Path, model: Path, caplog) -> None:
    want = save_pipeline(tmp_path / "pipeline", model, bundle=True)
    component = tmp_path / "pipeline" / "elmo"
    shutil.rmtree(component / "model")
    (component / "model").symlink_to(model)
    layers, said = load_and_embed(tmp_path / "pipeline", caplog)
    np.testing.assert_array_equal(layers, want)
    assert said == [outside_line(component, "bundled model", component / "model", model)]


def test_a_relative_model_path_is_taken_from_the_components_folder(tmp_path: Path, model: Path, caplog) -> None:
    """A hand-written relative path: from the folder of cfg.json, not the current directory; `..` leaves it."""
    want = save_pipeline(tmp_path / "pipeline", model)
    component = tmp_path / "pipeline" / "elmo"
    cfg = json.loads((component / "cfg.json").read_text())
    cfg["model"] = "../../models/tiny"
    (component / "cfg.json").write_text(json.dumps(cfg))
    layers, said = load_and_embed(tmp_path / "pipeline", caplog)
    np.testing.assert_array_equal(layers, want)
    assert said == [outside_line(component, "model", component / "../../models/tiny", model)]
    assert spacy.load(tmp_path / "pipeline").get_pipe("elmo").model_path == str(component / "../../models/tiny")


def test_bundling_copies_a_task_folder_that_leads_outside_and_names_it(tmp_path: Path, model: Path, caplog) -> None:
    """The runtime reads a symlinked task folder (said once), so the bundle carries a copy of it, and the pipeline
    keeps working once the outside folder is gone."""
    save_task(model, Task("pos_demo", "tagging", 3, 16, [0.4, -0.9, 1.7], 0.8))
    shared = tmp_path / "shared" / "pos_demo"
    shutil.move(model / "tasks" / "pos_demo", shared)
    (model / "tasks" / "pos_demo").symlink_to(shared)
    nlp = spacy.blank("en")
    nlp.add_pipe("elmo", config={"model": str(model), "bundle": True, "output": "task:pos_demo"})
    want = nlp(TEXT).tensor
    with caplog.at_level(logging.WARNING):
        nlp.to_disk(tmp_path / "pipeline")
    said = [r.getMessage() for r in caplog.records if "leads outside" in r.getMessage()]
    assert said == [
        f"task folder {model / 'tasks' / 'pos_demo'} leads outside {model}, to {shared}: loaded from "
        f"there ({OUTSIDE_RULE})"
    ]
    bundled = tmp_path / "pipeline" / "elmo" / "model" / "tasks" / "pos_demo"
    assert not bundled.is_symlink() and (bundled / "task.json").is_file()
    shutil.rmtree(shared)
    np.testing.assert_array_equal(spacy.load(tmp_path / "pipeline")(TEXT).tensor, want)
