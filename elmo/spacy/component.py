"""The ``elmo`` spaCy component: spaCy's own tokens in, every biLM layer per token out.

::

    nlp = spacy.blank("en")                      # or spacy.blank("zh"): characters, no segmenter needed
    nlp.add_pipe("elmo", config={"model": "models/default"})   # or {"server": "host:50051"}
    doc = nlp("The apple fell.")
    doc._.elmo_layers                            # float32 (n_layers, len(doc), dim): layer 0 = char-CNN, 1..L = biLSTM
    doc.tensor                   # float32 (len(doc), dim): config "output" (average / top / layer:N / task:NAME)
    doc[1].vector, doc.vector, doc[1].similarity(other[3])     # ELMo vectors, no static vectors needed

How a batch runs (``nlp.pipe(texts, batch_size=...)`` hands the component a batch at a time): each Doc becomes one
token sequence (one per sentence when sentence boundaries are set), whitespace tokens left out and given zero
vectors; every sequence of the batch not already in the layer cache goes to the runtime (or the server) in one
call; a sequence over the model's per-sentence limit follows ``overflow`` (``window``: overlapping windows stitched
back, the runtime's policy; ``truncate``; ``reject``: an error naming the document).

The component is "listened to" (spaCy's ``ListenedToComponent``): ``elmo.ElmoListener.v1`` layers in later
components (tagger, ner, textcat, spancat) read ``doc._.elmo_layers`` and learn their own scalar mix. For ``spacy
train`` it is frozen and annotating; ``cache_mb`` keeps each training sentence's layers so the biLM runs once per
sentence, not once per epoch.

Saved with the pipeline (``nlp.to_disk``) by reference (the model directory's absolute path or the server), or with
the model's serving files inside the pipeline folder (``bundle = true``). Loading it, a model path in ``cfg.json`` is
taken from the component's folder, and one that leads outside it (by reference, a symlink, a ``..``) is loaded with
one WARNING naming where (docs/how-to/models.md, "Paths that leave their folder").
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from spacy.language import Language
from spacy.pipeline import Pipe
from spacy.tokens import Doc
from spacy.util import minibatch
from thinc.api import Model

from elmo.backends import connect
from elmo.errors import ElmoError, InputError
from elmo.features import select_layer
from elmo.runtime.modeldir import note_if_outside
from elmo.text.overflow import Overflow, embed_windowed, over_limit_message

DEFAULT_EXTENSION = "elmo_layers"
LISTENER_NAME = "elmo_listener"  # the name of elmo.ElmoListener.v1's mix layer, by which this component finds it
CFG_FILE = "cfg.json"
BUNDLE_DIR = "model"
# The model directory's files the runtime reads (graphs, metadata, char scheme, probe) and its tasks; the PyTorch
# checkpoint, training configs and reports stay behind.
BUNDLE_SUFFIXES = (".json", ".onnx", ".data", ".bin", ".txt")
BUNDLE_SKIP = ("train_config",)
TASKS_DIR = "tasks"
TASK_FILES = ("task.json", "head.safetensors")


class ElmoSpacyError(ElmoError):
    """A misconfigured or failing ``elmo`` component (names the component, the cause and the way out)."""


# -- what doc.tensor holds ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Output:
    """``doc.tensor``'s content: ``average`` (equal mix of the layers), ``top``, ``layer:N``, ``task:NAME`` (a stored
    task's learned mix) or ``none`` (doc.tensor left as it is)."""

    kind: str
    layer: int = 0
    task: str = ""

    @classmethod
    def parse(cls, value: str) -> Output:
        text = str(value).strip()
        if text in ("average", "top", "none"):
            return cls(text)
        if text.startswith("layer:") and text[6:].lstrip("-").isdigit():
            return cls("layer", layer=int(text[6:]))
        if text.startswith("task:") and text[5:]:
            return cls("task", task=text[5:])
        raise ElmoSpacyError(
            f"elmo component: output {value!r} is not one of 'average', 'top', 'layer:N', 'task:NAME', 'none'"
        )

    def vectors(self, layers: np.ndarray, mixed: np.ndarray | None) -> np.ndarray:
        """(L, n, D) layers (and the task's (n, D) mix) -> (n, D) float32."""
        if self.kind == "task":
            return mixed
        try:
            return select_layer(layers, self.layer if self.kind == "layer" else self.kind)
        except InputError as exc:
            raise ElmoSpacyError(f"elmo component: output layer:{self.layer}: {exc}") from None


# -- the layer cache -------------------------------------------------------------------------------------------------
class LayerCache:
    """Token sequence -> its (read-only) layer array, least recently used first out, bounded in bytes (0 = off).

    The biLM is frozen, so a sentence's layers never change: in ``spacy train`` every epoch after the first reads
    them from here instead of running the biLM again."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, ...], np.ndarray] = OrderedDict()

    def get(self, key: tuple[str, ...]) -> np.ndarray | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: tuple[str, ...], value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes or key in self._entries:
            return
        self._entries[key] = value
        self.bytes += value.nbytes
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.nbytes

    def __len__(self) -> int:
        return len(self._entries)


# -- similarity on ELMo vectors --------------------------------------------------------------------------------------
def cosine(a: Any, b: Any) -> float:
    """Cosine of two objects' ``.vector`` (0.0 when either is all zeros). Installed as the Doc's similarity hooks:
    spaCy's own similarity answers 1.0 for two tokens with the same text, which is what contextual vectors undo."""
    x, y = np.asarray(a.vector, dtype=np.float64), np.asarray(b.vector, dtype=np.float64)
    norm = float(np.linalg.norm(x) * np.linalg.norm(y))
    return float(x @ y / norm) if norm > 0 else 0.0


def add_similarity_hooks(doc: Doc) -> Doc:
    """Make ``.similarity()`` of the Doc, its spans and tokens the cosine of their ELMo vectors. The component does
    this for every Doc; Docs that crossed processes (``nlp.pipe(..., n_process=2)``) lose their hooks on the way (spaCy
    cannot send functions), and get them back with this."""
    doc.user_hooks["similarity"] = cosine
    doc.user_span_hooks["similarity"] = cosine
    doc.user_token_hooks["similarity"] = cosine
    return doc


# -- the component --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenSequence:
    """One token sequence of a Doc: the Doc's token positions it covers (whitespace tokens left out)."""

    doc: int
    positions: np.ndarray
    tokens: tuple[str, ...]


class ElmoComponent(Pipe):
    """See the module docstring. ``model`` / ``server``: exactly one; the runtime or connection opens on first use."""

    def __init__(
        self,
        nlp: Language,
        name: str = "elmo",
        *,
        model: str = "",
        server: str = "",
        model_name: str = "",
        output: str = "average",
        extension: str = DEFAULT_EXTENSION,
        overflow: str = "window",
        cache_mb: int = 0,
        bundle: bool = False,
        threads: int = 0,
    ) -> None:
        if bool(model) == bool(server):
            raise ElmoSpacyError(
                f"elmo component '{name}': give exactly one of config model=DIR (the local runtime) or "
                f"server=HOST:PORT (a running `elmo serve`), got model={model!r} server={server!r}"
            )
        if cache_mb < 0 or threads < 0:
            raise ElmoSpacyError(f"elmo component '{name}': cache_mb and threads must be >= 0")
        self.vocab = nlp.vocab
        self.name = name
        self.model_path = str(model)
        self.server = str(server)
        self.model_name = str(model_name)
        self.output = Output.parse(output)
        self.overflow = Overflow.parse(overflow)
        self.extension = str(extension)
        self.bundle = bool(bundle)
        self.threads = int(threads)
        self.cache = LayerCache(int(cache_mb) << 20)
        self._backend = None
        self._pid = os.getpid()
        # spaCy's ListenedToComponent: the elmo.ElmoListener.v1 layers of later components, by component name.
        self.model: Model | None = None
        self.listener_map: dict[str, list[Model]] = {}
        if not Doc.has_extension(self.extension):
            Doc.set_extension(self.extension, default=None)

    # -- the biLM behind it -----------------------------------------------------------------------------------------
    @property
    def backend(self):
        """The runtime (``model``) or the server's client (``server``), opened on first use: a pipeline being
        loaded may still point it elsewhere (from_disk)."""
        if self._backend is None:
            try:
                if self.model_path:
                    options = {"intra_op_threads": self.threads} if self.threads else {}
                    self._backend = connect(model=self.model_path, **options)
                else:
                    self._backend = connect(server=self.server, model_name=self.model_name)
            except ElmoError as exc:
                raise ElmoSpacyError(f"elmo component '{self.name}': cannot open {self._where()}: {exc}") from None
            if self.output.kind == "task":
                try:
                    self._backend.check_task(self.output.task)
                except ElmoError as exc:
                    self._backend = None
                    raise ElmoSpacyError(
                        f"elmo component '{self.name}': output task:{self.output.task}: {exc}"
                    ) from None
        return self._backend

    def _where(self) -> str:
        return f"model directory {self.model_path}" if self.model_path else f"server {self.server}"

    @property
    def n_layers(self) -> int:
        return int(self.backend.n_layers)

    @property
    def dim(self) -> int:
        return int(self.backend.dim)

    # -- spaCy's calls ----------------------------------------------------------------------------------------------
    def __call__(self, doc: Doc) -> Doc:
        error_handler = self.get_error_handler()
        try:
            self.annotate([doc])
        except Exception as exc:
            error_handler(self.name, self, [doc], exc)
        return doc

    def pipe(self, stream: Iterable[Doc], *, batch_size: int = 128) -> Iterator[Doc]:
        """One runtime call per batch; a batch that fails goes to the error handler (spaCy's: raise), and the
        Docs already yielded keep their layers."""
        error_handler = self.get_error_handler()
        if os.getpid() != self._pid:
            # a worker of nlp.pipe(n_process=N): spaCy drops the Docs' hooks when it sends them back and says so (W109)
            # for every batch; the loss is documented (add_similarity_hooks puts them back), the warning is noise
            warnings.filterwarnings("ignore", message=r"\[W109\]")
        for batch in minibatch(stream, size=batch_size):
            docs = list(batch)
            try:
                self.annotate(docs)
            except Exception as exc:
                error_handler(self.name, self, docs, exc)
            yield from docs

    def initialize(self, get_examples: Callable[[], Iterable[Any]] | None = None, *, nlp: Language | None = None):
        """Opens the model (or connects) now, so a wrong path or a server that is down fails before training."""
        _ = self.backend

    # -- the work ---------------------------------------------------------------------------------------------------
    def annotate(self, docs: Sequence[Doc]) -> None:
        """Set ``doc._.<extension>``, ``doc.tensor`` and the similarity hooks on every Doc."""
        sequences = [seq for index, doc in enumerate(docs) for seq in self._sequences(index, doc)]
        arrays = self._layers_of([seq.tokens for seq in sequences], [seq.doc for seq in sequences], docs)
        # the shape from what came back (all of it may be cached); from the model only for Docs with no words
        rows, dim = (arrays[0].shape[0], arrays[0].shape[2]) if arrays else (self.n_layers + self._extra, self.dim)
        n_layers = rows - self._extra
        stacked: list[np.ndarray | None] = [None] * len(docs)
        for seq, array in zip(sequences, arrays):
            if array.shape[1] == len(docs[seq.doc]):  # the whole Doc, no whitespace token: the array as it is
                stacked[seq.doc] = array
                continue
            if stacked[seq.doc] is None:
                stacked[seq.doc] = np.zeros((rows, len(docs[seq.doc]), dim), np.float32)
            stacked[seq.doc][:, seq.positions[: array.shape[1]]] = array
        for doc, full in zip(docs, stacked):
            full = np.zeros((rows, len(doc), dim), np.float32) if full is None else full
            self._set(doc, full[:n_layers], full[n_layers] if self._extra else None)

    @property
    def _extra(self) -> int:
        """1 when the task's mix travels beside the layers (output task:NAME), else 0."""
        return 1 if self.output.kind == "task" else 0

    @staticmethod
    def _sequences(index: int, doc: Doc) -> list[TokenSequence]:
        spans = doc.sents if doc.has_annotation("SENT_START") else (doc,)
        out = []
        for span in spans:
            kept = [(token.i, token.text) for token in span if not token.is_space]  # one Token object each
            if kept:
                positions, words = zip(*kept)
                out.append(TokenSequence(index, np.array(positions, dtype=np.int64), words))
        return out

    def _layers_of(self, sequences: list[tuple[str, ...]], owners: list[int], docs: Sequence[Doc]) -> list[np.ndarray]:
        """Per sequence (L [+1], n, D) float32 from the cache or one call for all the misses."""
        out: list[np.ndarray | None] = [self.cache.get(tokens) for tokens in sequences]
        missing = [i for i, found in enumerate(out) if found is None]
        if missing:
            computed = self._compute([sequences[i] for i in missing], [owners[i] for i in missing], docs)
            for i, array in zip(missing, computed):
                if self.cache.max_bytes:
                    array.flags.writeable = False  # shared by every Doc of this sentence: nobody may change it
                    self.cache.put(sequences[i], array)
                out[i] = array
        return out

    def _compute(self, sequences: list[tuple[str, ...]], owners: list[int], docs: Sequence[Doc]) -> list[np.ndarray]:
        limit = int(self.backend.max_tokens_per_sentence)
        sentences = [list(tokens) for tokens in sequences]
        if self.overflow is Overflow.REJECT:
            for tokens, owner in zip(sentences, owners):
                if len(tokens) > limit:
                    refusal = over_limit_message(f"the document starting {docs[owner].text[:30]!r}", len(tokens), limit)
                    raise ElmoSpacyError(
                        f"elmo component '{self.name}': {refusal} (component config: overflow = "
                        '"window" or "truncate")'
                    )
        elif self.overflow is Overflow.TRUNCATE:
            sentences = [tokens[:limit] for tokens in sentences]
        try:
            return embed_windowed(self._embed, sentences, limit, token_axis=-2)
        except ElmoError as exc:
            raise ElmoSpacyError(f"elmo component '{self.name}': {self._where()} failed: {exc}") from None

    def _embed(self, sentences: list[list[str]]) -> list[np.ndarray]:
        if self.output.kind != "task":
            return [np.asarray(layers, dtype=np.float32) for layers in self.backend.embed_tokens(sentences)]
        pairs = self.backend.layers_and_mix(sentences, self.output.task)
        return [np.concatenate([layers, mixed[None]]).astype(np.float32, copy=False) for layers, mixed in pairs]

    def _set(self, doc: Doc, layers: np.ndarray, mixed: np.ndarray | None) -> None:
        doc._.set(self.extension, layers)
        if self.output.kind != "none":
            doc.tensor = np.ascontiguousarray(self.output.vectors(layers, mixed), dtype=np.float32)
            add_similarity_hooks(doc)

    # -- spaCy's ListenedToComponent --------------------------------------------------------------------------------
    @property
    def listeners(self) -> list[Model]:
        return [node for nodes in self.listener_map.values() for node in nodes]

    @property
    def listening_components(self) -> list[str]:
        return list(self.listener_map)

    def add_listener(self, listener: Model, component_name: str) -> None:
        self.listener_map.setdefault(component_name, [])
        if listener not in self.listener_map[component_name]:
            self.listener_map[component_name].append(listener)
        listener.source = weakref.ref(self)

    def remove_listener(self, listener: Model, component_name: str) -> bool:
        if listener in self.listener_map.get(component_name, []):
            self.listener_map[component_name].remove(listener)
            if not self.listener_map[component_name]:
                del self.listener_map[component_name]
            return True
        return False

    def find_listeners(self, component: Any) -> None:
        if isinstance(getattr(component, "model", None), Model):
            for node in component.model.walk():
                if node.name == LISTENER_NAME and getattr(node, "upstream_name", None) in ("*", self.name):
                    self.add_listener(node, component.name)

    # -- saving and loading -----------------------------------------------------------------------------------------
    def to_disk(self, path: str | Path, *, exclude: Iterable[str] = ()) -> None:
        """``cfg.json`` names the model (absolute path) or server; ``bundle``: the model's serving files go into
        ``<path>/model`` and the pipeline no longer needs the original directory."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model = ""
        if self.model_path:
            model = str(Path(self.model_path).resolve())
            if self.bundle:
                copy_serving_files(Path(self.model_path), path / BUNDLE_DIR)
                model = BUNDLE_DIR
        cfg = {"model": model, "bundled": bool(self.model_path and self.bundle), "server": self.server}
        (path / CFG_FILE).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

    def from_disk(self, path: str | Path, *, exclude: Iterable[str] = ()) -> ElmoComponent:
        path = Path(path)
        try:
            cfg = json.loads((path / CFG_FILE).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ElmoSpacyError(f"elmo component '{self.name}': {path / CFG_FILE} is not readable ({exc})") from None
        if cfg.get("bundled"):
            self.model_path, self.server = str(self._model_in(path, BUNDLE_DIR, "bundled model")), ""
        elif cfg.get("model"):
            self.model_path, self.server = str(self._model_in(path, str(cfg["model"]), "model")), ""
        else:
            self.model_path, self.server = "", str(cfg.get("server") or self.server)
        self._backend = None
        return self

    def _model_in(self, folder: Path, model: str, what: str) -> Path:
        """The model directory ``cfg.json`` names, a relative path taken from the component's folder; one that
        leads outside it (saved by reference, a symlink, a ``..``) is loaded from there, and said once in a
        WARNING (elmo.runtime.modeldir.note_if_outside, docs/how-to/models.md)."""
        note_if_outside(folder, Path(model), f"elmo component '{self.name}': {folder / CFG_FILE} names a {what};")
        return folder / model

    def to_bytes(self, *, exclude: Iterable[str] = ()) -> bytes:
        return json.dumps({"model": self.model_path, "server": self.server}).encode()

    def from_bytes(self, data: bytes, *, exclude: Iterable[str] = ()) -> ElmoComponent:
        cfg = json.loads(data)
        self.model_path, self.server, self._backend = cfg.get("model", ""), cfg.get("server", ""), None
        return self


def copy_serving_files(source: Path, target: Path) -> None:
    """The model directory's serving files (regular files only: a symlink could point anywhere on the host) and its
    tasks, copied into ``target``. A task folder that leads outside the model's folder is copied as the runtime
    reads it, and said once (elmo.runtime.modeldir.note_if_outside)."""
    if not (source / "onnx.json").is_file():
        raise ElmoSpacyError(f"elmo component: {source} is not an exported model directory (no onnx.json)")
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if item.is_file() and not item.is_symlink() and item.suffix in BUNDLE_SUFFIXES:
            if not item.name.startswith(BUNDLE_SKIP):
                shutil.copyfile(item, target / item.name)
    tasks = source / TASKS_DIR
    if tasks.is_dir():
        for task in sorted(tasks.iterdir()):
            if task.is_dir() and not task.name.startswith("."):
                note_if_outside(source, Path(TASKS_DIR, task.name), "task folder")
                (target / TASKS_DIR / task.name).mkdir(parents=True, exist_ok=True)
                for name in TASK_FILES:
                    item = task / name
                    if item.is_file() and not item.is_symlink():
                        shutil.copyfile(item, target / TASKS_DIR / task.name / name)


@Language.factory(
    "elmo",
    default_config={
        "model": "",
        "server": "",
        "model_name": "",
        "output": "average",
        "extension": DEFAULT_EXTENSION,
        "overflow": "window",
        "cache_mb": 0,
        "bundle": False,
        "threads": 0,
    },
)
def make_elmo(
    nlp: Language,
    name: str,
    model: str,
    server: str,
    model_name: str,
    output: str,
    extension: str,
    overflow: str,
    cache_mb: int,
    bundle: bool,
    threads: int,
) -> ElmoComponent:
    try:
        return ElmoComponent(
            nlp,
            name,
            model=model,
            server=server,
            model_name=model_name,
            output=output,
            extension=extension,
            overflow=overflow,
            cache_mb=cache_mb,
            bundle=bundle,
            threads=threads,
        )
    except InputError as exc:
        raise ElmoSpacyError(f"elmo component '{name}': {exc}") from None
