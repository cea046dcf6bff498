"""The onnxruntime runtime: a model directory in, per-sentence layer vectors out. Imports no torch.

``Embedder(model_dir)`` loads ``model.onnx`` (checked against ``onnx.json`` and ``config.json``), picks the
execution provider (CUDA first, then CPU; one log line says which one is active and why), and embeds
tokenized or raw sentences into float32 arrays ``(n_layers, n_tokens, dim)``. Sentences are sorted by length
and cut into batches under a token budget, so padding stays small and results come back in input order.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from elmo.chars import MAX_CHARS, batch_to_char_ids
from elmo.errors import ElmoError, InputError, ModelFileError
from elmo.modeldir import ONNX_FILE, model_directory, read_onnx_metadata
from elmo.tokenize import Tokenized, tokenize

log = logging.getLogger("elmo.runtime")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
DEFAULT_MAX_BATCH_TOKENS = 4096
DEFAULT_MAX_TOKENS_PER_SENTENCE = 1024


@dataclass(frozen=True)
class EmbedderInfo:
    """What a caller needs to know about a loaded model."""

    name: str
    n_layers: int  # output layers, the token layer included
    dim: int
    max_tokens_per_sentence: int
    provider: str  # the execution provider that is really active
    model_dir: Path


# -- providers -----------------------------------------------------------------------------------------------------
def _requested_providers(providers: Sequence[str] | None) -> list[str]:
    if providers is not None:
        return list(providers)
    if CUDA in ort.get_available_providers():
        return [CUDA, CPU]
    return [CPU]


def _provider_reason(requested: list[str], active: str) -> str:
    """Why ``active`` is the provider in use, for the one log line."""
    if active == CUDA:
        return "CUDA provider loaded and the graph runs on the GPU"
    if CUDA in requested:
        return (
            "CUDA provider requested but onnxruntime could not use it (no GPU visible, or the CUDA 13 / cuDNN 9 "
            "libraries are missing: install onnxruntime-gpu[cuda,cudnn]); onnxruntime's own message above says which"
        )
    if CUDA not in ort.get_available_providers():
        return "this onnxruntime build has no CUDA provider"
    return f"providers={requested} were requested"


def create_session(
    path: Path,
    providers: Sequence[str] | None = None,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for ``path`` with CUDA -> CPU selection and exactly one log line about the provider.

    An explicit provider list without the CPU provider is a demand: failing to get it raises ElmoError.
    """
    if not path.is_file():
        raise ModelFileError(f"{path}: ONNX graph not found (run `elmo export --model {path.parent}`)")
    requested = _requested_providers(providers)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_threads:
        options.intra_op_num_threads = int(intra_op_threads)
    if inter_op_threads:
        options.inter_op_num_threads = int(inter_op_threads)
    try:
        session = ort.InferenceSession(str(path), options, providers=requested)
    except Exception as exc:  # onnxruntime raises its own untyped errors for unreadable graphs
        raise ModelFileError(f"{path}: onnxruntime cannot load this graph ({type(exc).__name__}: {exc})") from None
    active = session.get_providers()[0]
    if active not in requested:
        raise ElmoError(f"execution provider {requested[0]} was demanded but {active} is active for {path}")
    log.info("onnxruntime provider: %s active for %s (%s)", active, path.name, _provider_reason(requested, active))
    return session


# -- the embedder --------------------------------------------------------------------------------------------------
class Embedder:
    """Embed sentences with an exported biLM. Thread-safe for concurrent calls (onnxruntime sessions are)."""

    def __init__(
        self,
        model_dir: str | Path,
        providers: Sequence[str] | None = None,
        intra_op_threads: int | None = None,
        inter_op_threads: int | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_tokens_per_sentence: int = DEFAULT_MAX_TOKENS_PER_SENTENCE,
        cache_size: int = 0,
    ) -> None:
        self.model_dir = model_directory(model_dir)
        self.meta = read_onnx_metadata(self.model_dir)
        if max_batch_tokens < 1 or max_tokens_per_sentence < 1:
            raise InputError("max_batch_tokens and max_tokens_per_sentence must be >= 1")
        self.max_batch_tokens = int(max_batch_tokens)
        self.cache_size = int(cache_size)
        path = self.model_dir / self.meta.get("graph", ONNX_FILE)
        self.session = create_session(path, providers, intra_op_threads, inter_op_threads)
        self._check_graph(path)
        self.info = EmbedderInfo(
            name=str(self.meta.get("name") or self.model_dir.resolve().name),
            n_layers=int(self.meta["n_layers"]),
            dim=int(self.meta["dim"]),
            max_tokens_per_sentence=int(max_tokens_per_sentence),
            provider=self.session.get_providers()[0],
            model_dir=self.model_dir,
        )

    def _check_graph(self, path: Path) -> None:
        """The graph's declared inputs/outputs must agree with onnx.json (catches a foreign model.onnx)."""
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        problems = []
        if list(inputs) != ["char_ids"] or inputs["char_ids"][-1] != MAX_CHARS:
            problems.append(f"inputs {inputs} (expected char_ids [batch, tokens, {MAX_CHARS}])")
        layers = outputs.get("layers")
        if layers is None or len(layers) != 4 or layers[1] != self.meta["n_layers"] or layers[3] != self.meta["dim"]:
            problems.append(
                f"output layers {layers} (onnx.json says [batch, {self.meta['n_layers']}, tokens, {self.meta['dim']}])"
            )
        if problems:
            raise ModelFileError(f"{path}: graph does not match onnx.json: {'; '.join(problems)}")

    # -- public API ------------------------------------------------------------------------------------------------
    def embed_tokens(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Tokenized sentences -> per sentence float32 ``(n_layers, n_tokens, dim)`` (empty -> n_tokens 0)."""
        sentences = self._validated(sentences)
        results: list[np.ndarray | None] = [None] * len(sentences)
        for indices in self._batches([len(s) for s in sentences]):
            batch = [sentences[i] for i in indices]
            layers = self._run(batch)  # (B, L+1, T, D)
            for row, index in enumerate(indices):
                results[index] = np.ascontiguousarray(layers[row, :, : len(sentences[index])])
        empty = np.zeros((self.info.n_layers, 0, self.info.dim), dtype=np.float32)
        return [empty.copy() if r is None else r for r in results]

    def embed_texts(self, texts: Sequence[str]) -> list[tuple[Tokenized, np.ndarray]]:
        """Raw texts -> (tokens with offsets, layers) per text, tokenized by elmo.tokenize.tokenize."""
        if isinstance(texts, str):
            raise InputError("embed_texts takes a list of texts, not one string")
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise InputError(f"text {i} is {type(text).__name__}, not str")
        tokenized = [tokenize(text) for text in texts]
        vectors = self.embed_tokens([t.tokens for t in tokenized])
        return list(zip(tokenized, vectors))

    def warmup(self) -> None:
        """One real forward pass (allocations, kernel selection) before the first request."""
        self.embed_tokens([["Warm", "up", "."], ["a"]])

    # -- internals -------------------------------------------------------------------------------------------------
    def _validated(self, sentences: Sequence[Sequence[str]]) -> list[list[str]]:
        if isinstance(sentences, str):
            raise InputError("embed_tokens takes a list of tokenized sentences, not one string")
        out = []
        limit = self.info.max_tokens_per_sentence if hasattr(self, "info") else None
        for i, sentence in enumerate(sentences):
            if isinstance(sentence, str):
                raise InputError(f"sentence {i} is a string; pass a list of tokens (or use embed_texts)")
            tokens = list(sentence)
            for j, token in enumerate(tokens):
                if not isinstance(token, str) or not token:
                    raise InputError(f"sentence {i} token {j}: tokens must be non-empty strings, got {token!r}")
            if limit is not None and len(tokens) > limit:
                raise InputError(f"sentence {i} has {len(tokens)} tokens; the limit is {limit}")
            out.append(tokens)
        return out

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices of non-empty sentences sorted by length and cut so that rows x longest <= max_batch_tokens
        (a single sentence longer than the budget forms its own batch)."""
        order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        for index in order:
            if current and (len(current) + 1) * lengths[index] > self.max_batch_tokens:
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
        return batches

    def _run(self, sentences: list[list[str]]) -> np.ndarray:
        char_ids = batch_to_char_ids(sentences).astype(np.int64)
        (layers,) = self.session.run(["layers"], {"char_ids": char_ids})
        return layers
