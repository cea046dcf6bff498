"""A listener's learned mix <-> a model directory's task, so the service answers ``task=NAME`` with spaCy's mix.

``export_task(pipeline, component, model_dir, name)`` reads the ``elmo.ElmoListener.v1`` mix (w, gamma) of one
component of a saved spaCy pipeline and stores it as ``<model_dir>/tasks/<name>/task.json`` (no head: the spaCy
component keeps its own). The reverse, a stored task starting a listener, is the listener's ``init_task``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from elmo.runtime.modeldir import read_onnx_metadata
from elmo.runtime.tasks import Task, check_task_name, save_task
from elmo.spacy.component import ElmoSpacyError
from elmo.spacy.listener import find_mix

CLASSIFIERS = ("textcat", "textcat_multilabel")


def listener_task(nlp, component: str, name: str) -> Task:
    """The mix of ``component``'s listener as a (headless) task named ``name``."""
    if component not in nlp.component_names:
        raise ElmoSpacyError(f"the pipeline has no component {component!r}; it has {', '.join(nlp.component_names)}")
    proc = nlp.get_pipe(component)
    mix = find_mix(proc.model)
    if not mix.has_param("W"):
        raise ElmoSpacyError(f"component {component!r}: its elmo listener was never initialized (train it first)")
    factory = nlp.get_pipe_meta(component).factory
    classification = factory in CLASSIFIERS
    return Task(
        name=check_task_name(name),
        kind="classification" if classification else "tagging",
        n_layers=int(mix.get_dim("nL")),
        dim=int(mix.get_dim("nD")),
        weights=[float(v) for v in np.asarray(mix.get_param("W"))],
        gamma=float(np.asarray(mix.get_param("g"))[0]),
        labels=[str(label) for label in getattr(proc, "labels", ())],
        pooling="mean" if classification else None,
        metrics={k: v for k, v in (nlp.meta.get("performance") or {}).items() if isinstance(v, (int, float))},
        data={"source": "spacy", "component": component, "factory": factory},
    )


def export_task(pipeline: str | Path, component: str, model_dir: str | Path, name: str) -> Path:
    """Load the spaCy pipeline, take ``component``'s mix and store it as task ``name`` of ``model_dir``."""
    import spacy

    check_task_name(name)
    meta = read_onnx_metadata(model_dir, check_checkpoint=False)
    if not (Path(pipeline) / "config.cfg").is_file():
        raise ElmoSpacyError(f"{pipeline}: not a saved spaCy pipeline (no config.cfg; e.g. training/model-last)")
    try:
        nlp = spacy.load(pipeline)
    except (OSError, ValueError) as exc:
        raise ElmoSpacyError(f"{pipeline}: spaCy cannot load it: {exc}") from None
    task = listener_task(nlp, component, name)
    if (task.n_layers, task.dim) != (int(meta["n_layers"]), int(meta["dim"])):
        raise ElmoSpacyError(
            f"component {component!r} mixes {task.n_layers} layers of width {task.dim}; the model "
            f"{model_dir} has {meta['n_layers']} of width {meta['dim']}"
        )
    task.data["pipeline"] = str(Path(pipeline).resolve())
    return save_task(model_dir, task)
