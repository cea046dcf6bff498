"""``elmo.ElmoListener.v1``: a spaCy tok2vec that learns its own ELMo scalar mix inside ``spacy train``.

Peters et al. (2018), equation 1, per downstream component::

    ELMo_k = gamma * sum_j softmax(w)_j * h_{k,j}        h_{k,j}: layer j of token k, read from doc._.elmo_layers

``w`` (n_layers,) and ``gamma`` (1,) are the listener's parameters, learned by backprop with the component's own
loss; the biLM is frozen (the ``elmo`` component computes its layers once per sentence and caches them). With
``width`` > 0 a Maxout layer (spaCy's own tok2vec unit: 3 pieces, layer-normalised) projects the mix to the
component's width. The forward pass is :func:`elmo.runtime.tasks.mix_layers`, the function the service applies
for ``task=NAME``: a mix exported with ``elmo spacy export-task`` is served with the same numbers.

Shapes: docs (a list of B Docs) -> B arrays (len(doc), dim) for the mix, (len(doc), width) after the projection.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from spacy.tokens import Doc
from spacy.util import registry
from thinc.api import Maxout, Model, chain, concatenate, with_array
from thinc.types import Floats2d

from elmo.errors import ElmoError
from elmo.runtime.tasks import TaskStore, mix_layers, softmax
from elmo.spacy.component import DEFAULT_EXTENSION, LISTENER_NAME, ElmoSpacyError


class ElmoListener(Model):
    """The scalar mix layer. ``upstream_name``: the ``elmo`` component it listens to ("*": any); ``source`` (set by
    that component when spaCy links the pipeline) lets it compute layers a Doc lacks, e.g. the sample Docs spaCy
    initializes with."""

    def __init__(self, upstream_name: str, extension: str, init_task: str) -> None:
        Model.__init__(
            self,
            name=LISTENER_NAME,
            forward=mix_forward,
            init=mix_init,
            dims={"nO": None, "nD": None, "nL": None},  # nD: the biLM layers' width (not nI: the input is Docs)
            attrs={"extension": extension, "init_task": init_task},
        )
        self.upstream_name = upstream_name
        self.source = None  # weakref to the ElmoComponent, set by its add_listener

    def layers_of(self, docs: list[Doc]) -> list[np.ndarray]:
        """Per Doc (n_layers, len(doc), dim) float32 from the Doc, computed by the linked component when missing."""
        extension = self.attrs["extension"]
        missing = [doc for doc in docs if not Doc.has_extension(extension) or doc._.get(extension) is None]
        if missing:
            component = self.source() if self.source is not None else None
            if component is None:
                raise ElmoSpacyError(
                    f"elmo listener: doc._.{extension} is not set and no 'elmo' component is linked; put an 'elmo' "
                    "component before this one in the pipeline (for `spacy train`, in [training] frozen_components "
                    "and annotating_components)"
                )
            component.annotate(missing)
        layers = [doc._.get(extension) for doc in docs]
        self._check_shapes(docs, layers)
        return layers

    def _check_shapes(self, docs: list[Doc], layers: list[np.ndarray]) -> None:
        want = (self.get_dim("nL") if self.has_dim("nL") else None, self.get_dim("nD") if self.has_dim("nD") else None)
        for doc, array in zip(docs, layers):
            shape = getattr(array, "shape", None)
            if shape is None or len(shape) != 3 or shape[1] != len(doc):
                raise ElmoSpacyError(
                    f"elmo listener: doc._.{self.attrs['extension']} must be (n_layers, {len(doc)}, "
                    f"dim) for this Doc, got {shape}"
                )
            if want[0] is not None and (shape[0], shape[2]) != want:
                raise ElmoSpacyError(
                    f"elmo listener: it was trained on {want[0]} layers of width {want[1]}, but the 'elmo' component "
                    f"gives {shape[0]} of width {shape[2]}: the pipeline's model is not the one it was trained with"
                )


def mix_init(model: ElmoListener, X: list[Doc] | None = None, Y=None) -> ElmoListener:
    """Dims from the first Docs' layers (or the linked component), w = 0 (equal weights) and gamma = 1, or the mix
    of the task folder named by ``init_task``."""
    if not model.has_dim("nL"):
        if X:
            n_layers, _, dim = model.layers_of(list(X)[:1])[0].shape
        elif model.source is not None and model.source() is not None:
            component = model.source()
            n_layers, dim = component.n_layers, component.dim
        else:
            raise ElmoSpacyError("elmo listener: cannot initialize without Docs or a linked 'elmo' component")
        model.set_dim("nL", int(n_layers))
        model.set_dim("nD", int(dim))
    if not model.has_dim("nO"):
        model.set_dim("nO", model.get_dim("nD"))
    weights, gamma = np.zeros(model.get_dim("nL"), np.float32), 1.0
    if model.attrs["init_task"]:
        weights, gamma = read_task_mix(model.attrs["init_task"], model.get_dim("nL"), model.get_dim("nD"))
    model.set_param("W", model.ops.asarray1f(np.asarray(weights, np.float32)))
    model.set_param("g", model.ops.asarray1f(np.asarray([gamma], np.float32)))
    return model


def mix_forward(model: ElmoListener, docs: list[Doc], is_train: bool):
    layers = model.layers_of(list(docs))
    weights = model.get_param("W")
    gamma = float(model.get_param("g")[0])
    outputs = [model.ops.asarray2f(mix_layers(array, weights, gamma)) for array in layers]

    def backprop(d_outputs: list[Floats2d]) -> list:
        # d loss / d scale_j, scale_j = gamma * s_j: the sum over tokens of d_output . h_j
        d_scale = np.zeros(len(weights), np.float64)
        for array, d_out in zip(layers, d_outputs):
            d_scale += np.einsum("nd,lnd->l", np.asarray(d_out, np.float64), array, dtype=np.float64)
        s = softmax(weights)
        d_s = d_scale * gamma
        model.inc_grad("W", model.ops.asarray1f((s * (d_s - float(s @ d_s))).astype(np.float32)))
        model.inc_grad("g", model.ops.asarray1f(np.array([d_scale @ s], np.float32)))
        return []

    return outputs, backprop


@registry.architectures("elmo.ElmoListener.v1")
def elmo_listener(
    width: int = 0,
    upstream: str = "*",
    extension: str = DEFAULT_EXTENSION,
    dropout: float = 0.0,
    init_task: str = "",
    embed: Model[list[Doc], list[Floats2d]] | None = None,
    encode: Model[list[Floats2d], list[Floats2d]] | None = None,
) -> Model[list[Doc], list[Floats2d]]:
    """The mix; ``embed``: the component's own token embedding x_k (e.g. spacy.MultiHashEmbed.v2) set beside it,
    [ELMo_k; x_k] as the paper feeds its task models; ``width`` > 0: a Maxout projection to ``width`` (with
    ``dropout``); ``encode``: a context encoder over the projection (e.g. spacy.MaxoutWindowEncoder.v2 of the same
    width, the paper's "task RNN"); ``init_task``: a task folder (``models/default/tasks/pos_brown``) whose mix
    starts the listener's."""
    mix = ElmoListener(upstream, extension, init_task)
    model = mix if embed is None else concatenate(mix, embed)
    if width > 0:
        model = chain(model, with_array(Maxout(nO=width, nP=3, dropout=dropout, normalize=True)))
    elif embed is not None or encode is not None:
        raise ElmoSpacyError("elmo listener: embed and encode need a projection width > 0")
    if encode is not None:
        model = chain(model, encode)
    return model


def read_task_mix(folder: str | Path, n_layers: int, dim: int) -> tuple[list[float], float]:
    """(raw weights w, gamma) of the task stored in ``folder`` (``<model>/tasks/<name>``), read by the model's task
    store, which also checks it against the listener's shape."""
    folder = Path(folder)
    try:
        task = TaskStore(folder.parent.parent, n_layers=n_layers, dim=dim).get(folder.name)
    except ElmoError as exc:
        raise ElmoSpacyError(f"elmo listener: init_task {folder}: {exc}") from None
    return list(task.weights), float(task.gamma)


def find_mix(model: Model) -> ElmoListener:
    """The listener's mix layer inside a component's model."""
    for node in model.walk():
        if isinstance(node, ElmoListener):
            return node
    raise ElmoSpacyError("this component's model has no elmo.ElmoListener.v1 layer")
