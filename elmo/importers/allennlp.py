"""Import published ELMo weights (AllenNLP / bilm-tf ``options.json`` + ``weights.hdf5``) into a model directory.

``elmo import-allennlp --options options.json --weights weights.hdf5 --out DIR [--warm-text FILE]`` writes the
usual ``config.json`` + ``model.safetensors`` (vocab_size 0: an embedding model, no softmax), which ``elmo export``,
the runtime, the service and the batch job read like any other model directory.

The conversion (facts in ../shared/reference/ELMO.md), hdf5 dataset -> elmo.model.bilm.BiLM parameter:
- ``char_embed`` (261, d): a zero row is prepended for char id 0 ("no token here") -> (262, d).
- ``CNN/W_cnn_{i}`` (1, width, d, n) -> Conv1d weight (n, d, width); ``b_cnn_{i}`` -> bias.
- ``CNN_high_{k}``: bilm-tf's ``carry = σ(x W_carry + b_carry)`` weights the *transform*, AllenNLP's gate weights
  the *input*, so gate = 1 - carry = σ(-(x W_carry + b_carry)): gate rows = -W_carryᵀ, gate bias = -b_carry;
  the nonlinear rows are W_transformᵀ, b_transform.
- ``CNN_proj/W_proj`` (n_filters, P) -> Linear weight (P, n_filters). bilm-tf has no CNN_proj when
  n_filters == P: the projection is then the identity.
- ``RNN_{dir}/RNN/MultiRNNCell/Cell{l}/LSTMCell/W_0`` (in + P, 4C): rows [:in] -> input_linearity, rows [in:]
  -> state_linearity; ``B`` (4C,) -> state_linearity bias. TF gate blocks (i, j, f, o) become torch (i, f, g, o)
  = TF blocks (0, 2, 1, 3), and TF's run-time forget bias of +1.0 is added to the f block. ``W_P_0`` (C, P) ->
  state_projection (P, C); without W_P_0 (P == C, no projection in bilm-tf) it is the identity.

Optional warm initial state (``--warm-text``): the published models were trained with LSTM states carried across
batches, so a zero state costs a little on a sentence's first tokens. The importer runs the model once over a
warm-up text as one continuous stream, state carried (the forward stacks read ``<S> s1 </S> <S> s2 </S> ...``, the
backward stacks every sentence reversed in the same sentence order, as bilm-tf fed its two LMs), and stores each
direction/layer's final (h, c) in model.safetensors as ``{forward,backward}_layers.{l}.initial_{hidden,cell}``
with ``warm_state: true`` in config.json. Every sentence then starts from that same fixed state, so outputs stay
independent of batch composition. Off by default. Warming with sentence s reproduces what bilm-tf computed for
the sentence after s in the same batch row (tests/importers/test_allennlp.py checks this against the bilm-tf fixture).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elmo.errors import ConfigError, InputError, ModelFileError
from elmo.importers.budget import (
    DEFAULT_MAX_WEIGHT_BYTES,
    FLOAT32_BYTES,
    add_budget_argument,
    check_budget,
    checked_budget,
    describe,
)
from elmo.model.bilm import BiLM, add_sentence_boundaries, projection_lstm_scan
from elmo.model.checkpoint import save_model
from elmo.model.config import ModelConfig
from elmo.runtime.modeldir import sha256_of
from elmo.runtime.repository import readable_by_all
from elmo.text.chars import MAX_CHARS, batch_to_char_ids
from elmo.text.tokenize import tokenize, whitespace_tokens

log = logging.getLogger(__name__)

CHAR_EMBED_ROWS = 261  # bilm-tf's table: no row for the padding id 0
TF_TO_TORCH_GATES = (0, 2, 1, 3)  # TF blocks (i, j, f, o) -> torch (i, f, g, o)
TF_FORGET_BIAS = 1.0

# options.json keys that only matter for training in bilm-tf: accepted and ignored.
TRAINING_ONLY_OPTIONS = {
    "dropout",
    "all_clip_norm_val",
    "n_epochs",
    "n_train_tokens",
    "batch_size",
    "n_tokens_vocab",
    "unroll_steps",
    "n_negative_samples_batch",
    "sample_softmax",
    "share_embedding_softmax",
}
TOP_LEVEL_OPTIONS = {"lstm", "char_cnn", "bidirectional"} | TRAINING_ONLY_OPTIONS
LSTM_OPTIONS = {"dim", "projection_dim", "n_layers", "cell_clip", "proj_clip", "use_skip_connections"}
CHAR_CNN_OPTIONS = {"embedding", "filters", "n_highway", "n_characters", "max_characters_per_token", "activation"}


# -- options.json ----------------------------------------------------------------------------------------------
class _Options:
    """Typed access to a parsed options.json; every error names the dotted field."""

    def __init__(self, data: dict, source: str) -> None:
        self.data = data
        self.source = source

    def fail(self, field: str, why: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{field}': {why}")

    def section(self, name: str, known: set[str]) -> dict:
        value = self.data.get(name)
        if not isinstance(value, dict):
            raise self.fail(name, "missing or not an object")
        unknown = sorted(set(value) - known)
        if unknown:
            raise self.fail(f"{name}.{unknown[0]}", f"unknown option (known: {sorted(known)})")
        return value

    def integer(self, section: dict, path: str, default: int | None = None, minimum: int = 1) -> int:
        value = section.get(path.rsplit(".", 1)[-1], default)
        if value is None:
            raise self.fail(path, "missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(path, f"must be an integer >= {minimum} (got {value!r})")
        return value

    def clip(self, section: dict, path: str) -> float:
        """bilm-tf: null/absent = no clipping (our 0.0); a clip must be > 0 (TF would clip to exactly 0)."""
        value = section.get(path.rsplit(".", 1)[-1])
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise self.fail(path, f"must be a number > 0 or null (got {value!r})")
        return float(value)


def read_options(path: str | Path) -> ModelConfig:
    """AllenNLP / bilm-tf ``options.json`` -> ModelConfig (vocab_size 0, dropout 0). Raises ConfigError naming the
    field for unknown or inconsistent options."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: options file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return options_to_config(data, source=str(path))


def options_to_config(data: dict, source: str = "options.json") -> ModelConfig:
    opts = _Options(data, source)
    unknown = sorted(set(data) - TOP_LEVEL_OPTIONS)
    if unknown:
        raise opts.fail(unknown[0], f"unknown option (known: {sorted(TOP_LEVEL_OPTIONS)})")
    if "char_cnn" not in data:
        raise opts.fail("char_cnn", "missing: only character-input ELMo models can be imported")
    if data.get("bidirectional", True) is not True:
        raise opts.fail("bidirectional", "must be true: ELMo needs the forward and the backward LM")
    lstm = opts.section("lstm", LSTM_OPTIONS)
    cnn = opts.section("char_cnn", CHAR_CNN_OPTIONS)

    embedding = cnn.get("embedding")
    if not isinstance(embedding, dict) or set(embedding) != {"dim"}:
        raise opts.fail("char_cnn.embedding", f"must be {{'dim': int}} (got {embedding!r})")
    n_characters = cnn.get("n_characters")
    if n_characters not in (261, 262) or isinstance(n_characters, bool):
        raise opts.fail("char_cnn.n_characters", f"must be 261 (training) or 262 (inference) (got {n_characters!r})")
    max_chars = cnn.get("max_characters_per_token")
    if max_chars != MAX_CHARS or isinstance(max_chars, bool):
        raise opts.fail("char_cnn.max_characters_per_token", f"must be {MAX_CHARS} (got {max_chars!r})")
    activation = cnn.get("activation")
    if activation not in ("relu", "tanh"):
        raise opts.fail("char_cnn.activation", f"must be 'relu' or 'tanh' (got {activation!r})")
    filters = cnn.get("filters")
    if not isinstance(filters, list) or not filters:
        raise opts.fail("char_cnn.filters", f"must be a non-empty list of [width, count] (got {filters!r})")
    for pair in filters:
        ok = isinstance(pair, list) and len(pair) == 2 and all(type(v) is int and v > 0 for v in pair)
        if not ok or pair[0] > MAX_CHARS:
            raise opts.fail("char_cnn.filters", f"entry {pair!r} is not [width <= {MAX_CHARS}, count] of integers")

    cell_dim = opts.integer(lstm, "lstm.dim")
    projection_dim = opts.integer(lstm, "lstm.projection_dim")
    if projection_dim > cell_dim:
        raise opts.fail("lstm.projection_dim", f"must be <= lstm.dim={cell_dim} (got {projection_dim})")
    n_filters = sum(count for _, count in filters)
    if projection_dim > n_filters:
        # bilm-tf only ever projects the char-CNN output down (its CNN_proj asserts n_filters > projection_dim).
        raise opts.fail("lstm.projection_dim", f"must be <= the char-CNN width {n_filters} (got {projection_dim})")
    skip = lstm.get("use_skip_connections", False)
    if not isinstance(skip, bool):
        raise opts.fail("lstm.use_skip_connections", f"must be true or false (got {skip!r})")

    cfg = ModelConfig(
        char_dim=opts.integer(embedding, "char_cnn.embedding.dim"),
        filters=[list(p) for p in filters],
        n_highway=opts.integer(cnn, "char_cnn.n_highway", default=0, minimum=0),
        activation=activation,
        projection_dim=projection_dim,
        cell_dim=cell_dim,
        n_layers=opts.integer(lstm, "lstm.n_layers", default=1),
        cell_clip=opts.clip(lstm, "lstm.cell_clip"),
        proj_clip=opts.clip(lstm, "lstm.proj_clip"),
        residual=skip,
        vocab_size=0,
        dropout=0.0,
    )
    return cfg.validate()


# -- weights.hdf5 ----------------------------------------------------------------------------------------------
def expected_datasets(cfg: ModelConfig, names: set[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every dataset the import reads -> (the shape options.json implies, why), from the config alone (``names``,
    the file's dataset names, only pick between bilm-tf's optional layouts). Nothing else in the file is read."""
    d, n_filters, p, c = cfg.char_dim, cfg.n_filters, cfg.projection_dim, cfg.cell_dim
    expected = {"char_embed": ((CHAR_EMBED_ROWS, d), f"char_cnn.embedding.dim={d}")}
    for i, (width, count) in enumerate(cfg.filters):
        why = f"char_cnn.filters[{i}]=[{width}, {count}], embedding dim {d}"
        expected[f"CNN/W_cnn_{i}"] = ((1, width, d, count), why)
        expected[f"CNN/b_cnn_{i}"] = ((count,), why)
    for k in range(cfg.n_highway):
        why = f"char_cnn.n_highway={cfg.n_highway}, CNN width {n_filters}"
        for kind in ("carry", "transform"):
            expected[f"CNN_high_{k}/W_{kind}"] = ((n_filters, n_filters), why)
            expected[f"CNN_high_{k}/b_{kind}"] = ((n_filters,), why)
    if "CNN_proj/W_proj" in names or n_filters != p:  # bilm-tf has no CNN_proj when the CNN is P wide
        why = f"CNN width {n_filters} -> lstm.projection_dim={p}"
        expected["CNN_proj/W_proj"] = ((n_filters, p), why)
        expected["CNN_proj/b_proj"] = ((p,), why)
    for direction in (0, 1):
        for layer in range(cfg.n_layers):
            prefix = lstm_prefix(names, direction, layer, cfg.n_layers)
            why = f"lstm.dim={c}, lstm.projection_dim={p}, input {p}"
            expected[f"{prefix}/W_0"] = ((p + p, 4 * c), why)
            expected[f"{prefix}/B"] = ((4 * c,), why)
            if f"{prefix}/W_P_0" in names or p != c:  # no W_P_0: LSTMCell without num_proj
                expected[f"{prefix}/W_P_0"] = ((c, p), why)
    return expected


def read_hdf5(path: str | Path, cfg: ModelConfig, max_bytes: int = DEFAULT_MAX_WEIGHT_BYTES) -> dict[str, np.ndarray]:
    """The datasets of a bilm-tf weight file that ``cfg`` (its options.json) implies -> {name: float32 array}.

    A weights file is hostile until checked, and every check runs before any dataset is read:
    - links: HDF5 lets a name point elsewhere (soft and external links), and a dataset keep its bytes in other files
      (external storage, virtual datasets), which h5py follows transparently, so an imported "weight" could be any
      file the importing process can read (its /proc/self/environ): refused, naming the dataset;
    - declarations: a few KB can declare a dataset of any size (chunked, compressed or never-written storage), so
      every dataset read must declare exactly the float32 shape options.json implies, and their total must fit
      ``max_bytes``; datasets the import does not use are ignored, never read."""
    import h5py  # train extra; imported here so that `elmo --help` stays light

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: weights file not found")
    try:
        with h5py.File(path, "r") as handle:
            names = _hard_linked_names(path, handle, h5py)
            expected = expected_datasets(cfg, names)
            check_budget(str(path), (shape for shape, _ in expected.values()), max_bytes, "options.json")
            datasets = [
                _declared_dataset(path, handle, name, shape, why, h5py) for name, (shape, why) in expected.items()
            ]
            ignored = sorted(n for n in names - set(expected) if handle.get(n, getclass=True) is h5py.Dataset)
            if ignored:
                log.info(
                    "%s: ignored %d dataset(s) not used for embedding (not read): %s", path, len(ignored), ignored[:6]
                )
            return {name: _read_float32(dataset) for name, dataset in zip(expected, datasets)}
    except (OSError, RuntimeError, SystemError, ValueError, KeyError, TypeError) as exc:  # a corrupt file, as h5py
        why = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__  # says it
        raise ModelFileError(f"{path}: not a readable hdf5 file ({why})") from None


def _hard_linked_names(path: Path, handle, h5py) -> set[str]:
    """Every name in the file (groups and datasets); a soft or external link anywhere is refused."""
    links: list[tuple[str, object]] = []  # raised after the walk: h5py's C callbacks must not raise
    handle.visititems_links(lambda name, link: links.append((name, link)))
    for name, link in links:
        _refuse_indirect_link(path, name, link, h5py)
    return {name for name, _ in links}


def _declared_dataset(path: Path, handle, name: str, shape: tuple[int, ...], why: str, h5py):
    """The dataset ``name``, its declaration checked (own storage, float32, ``shape``) without reading it."""
    if name not in handle:
        raise ModelFileError(f"{path}: missing dataset '{name}' ({why})")
    dataset = handle[name]
    if not isinstance(dataset, h5py.Dataset):
        raise ModelFileError(f"{path}: '{name}' is a group, options.json implies a dataset {shape} float32 ({why})")
    _refuse_data_elsewhere(path, name, dataset)
    is_float32 = dataset.dtype.kind == "f" and dataset.dtype.itemsize == FLOAT32_BYTES
    if not is_float32 or tuple(dataset.shape) != shape:  # float32 of any byte order; nothing is converted
        raise ModelFileError(
            f"{path}: dataset '{name}' is declared {describe(dataset.shape, dataset.dtype)}, "
            f"options.json implies {shape} float32 ({why}): refused before reading"
        )
    return dataset


def _read_float32(dataset) -> np.ndarray:
    array = np.empty(dataset.shape, dtype=np.float32)
    if array.size:
        dataset.read_direct(array)
    return array


def _refuse_indirect_link(path: Path, name: str, link, h5py) -> None:
    if isinstance(link, h5py.ExternalLink):
        raise ModelFileError(
            f"{path}: '{name}' is an HDF5 external link to {link.filename}:{link.path}: refused "
            "(a weights file must hold its own data)"
        )
    if isinstance(link, h5py.SoftLink):
        raise ModelFileError(
            f"{path}: '{name}' is an HDF5 soft link to {link.path}: refused (a weights file must hold its own data)"
        )


def _refuse_data_elsewhere(path: Path, name: str, dataset) -> None:
    if dataset.external:
        files = sorted({str(entry[0]) for entry in dataset.external})
        raise ModelFileError(
            f"{path}: dataset '{name}' keeps its data in external file(s) {files}: refused (a "
            "weights file must hold its own data)"
        )
    if dataset.is_virtual:
        raise ModelFileError(
            f"{path}: dataset '{name}' is a virtual dataset (its data maps to other files): refused "
            "(a weights file must hold its own data)"
        )


def lstm_prefix(names: Collection[str], direction: int, layer: int, n_layers: int) -> str:
    """bilm-tf names: ``RNN_{d}/RNN/MultiRNNCell/Cell{l}/LSTMCell``; a one-layer model made without MultiRNNCell
    has ``RNN_{d}/RNN/LSTMCell``."""
    prefix = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
    single = f"RNN_{direction}/RNN/LSTMCell"
    if n_layers == 1 and f"{prefix}/W_0" not in names and f"{single}/W_0" in names:
        return single
    return prefix


@dataclass
class _Datasets:
    """Shape-checked access to the hdf5 datasets; errors name the dataset and what options.json implies."""

    arrays: dict[str, np.ndarray]
    source: str

    def get(self, name: str, shape: tuple[int, ...], why: str) -> np.ndarray:
        if name not in self.arrays:
            raise ModelFileError(f"{self.source}: missing dataset '{name}' ({why})")
        array = self.arrays[name]
        if tuple(array.shape) != shape:
            raise ModelFileError(
                f"{self.source}: dataset '{name}' has shape {tuple(array.shape)}, options.json implies {shape} ({why})"
            )
        if not np.isfinite(array).all():
            raise ModelFileError(f"{self.source}: dataset '{name}' contains NaN or infinite values")
        return array

    def has(self, name: str) -> bool:
        return name in self.arrays


def _t(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def tf_gates_to_torch(array: np.ndarray, cell_dim: int) -> np.ndarray:
    """Reorder the last axis' four C-wide gate blocks from TF (i, j, f, o) to torch (i, f, g, o)."""
    blocks = [array[..., k * cell_dim : (k + 1) * cell_dim] for k in TF_TO_TORCH_GATES]
    return np.concatenate(blocks, axis=-1)


def convert_weights(cfg: ModelConfig, arrays: dict[str, np.ndarray], source: str = "weights.hdf5") -> dict:
    """bilm-tf datasets -> elmo.model.bilm.BiLM state dict (float32 tensors, no warm-state buffers)."""
    data = _Datasets(arrays, source)
    d, n_filters, p, c = cfg.char_dim, cfg.n_filters, cfg.projection_dim, cfg.cell_dim
    state: dict[str, torch.Tensor] = {}

    char_embed = data.get("char_embed", (CHAR_EMBED_ROWS, d), f"char_cnn.embedding.dim={d}")
    state["encoder.char_embedding.weight"] = _t(np.concatenate([np.zeros((1, d), np.float32), char_embed]))

    for i, (width, count) in enumerate(cfg.filters):
        why = f"char_cnn.filters[{i}]=[{width}, {count}], embedding dim {d}"
        kernel = data.get(f"CNN/W_cnn_{i}", (1, width, d, count), why)
        state[f"encoder.convs.{i}.weight"] = _t(kernel[0].transpose(2, 1, 0))  # (width, d, n) -> (n, d, width)
        state[f"encoder.convs.{i}.bias"] = _t(data.get(f"CNN/b_cnn_{i}", (count,), why))

    for k in range(cfg.n_highway):
        why = f"char_cnn.n_highway={cfg.n_highway}, CNN width {n_filters}"
        square, vector = (n_filters, n_filters), (n_filters,)
        w_carry = data.get(f"CNN_high_{k}/W_carry", square, why)
        b_carry = data.get(f"CNN_high_{k}/b_carry", vector, why)
        w_transform = data.get(f"CNN_high_{k}/W_transform", square, why)
        b_transform = data.get(f"CNN_high_{k}/b_transform", vector, why)
        state[f"encoder.highway.layers.{k}.weight"] = _t(np.concatenate([w_transform.T, -w_carry.T]))
        state[f"encoder.highway.layers.{k}.bias"] = _t(np.concatenate([b_transform, -b_carry]))

    if data.has("CNN_proj/W_proj") or n_filters != p:
        why = f"CNN width {n_filters} -> lstm.projection_dim={p}"
        state["encoder.projection.weight"] = _t(data.get("CNN_proj/W_proj", (n_filters, p), why).T)
        state["encoder.projection.bias"] = _t(data.get("CNN_proj/b_proj", (p,), why))
    else:  # bilm-tf skips the projection when the CNN is already projection_dim wide
        state["encoder.projection.weight"] = torch.eye(p)
        state["encoder.projection.bias"] = torch.zeros(p)

    for direction, stack in ((0, "forward_layers"), (1, "backward_layers")):
        for layer in range(cfg.n_layers):
            prefix = lstm_prefix(arrays, direction, layer, cfg.n_layers)
            why = f"lstm.dim={c}, lstm.projection_dim={p}, input {p}"
            w_0 = tf_gates_to_torch(data.get(f"{prefix}/W_0", (p + p, 4 * c), why), c)
            bias = tf_gates_to_torch(data.get(f"{prefix}/B", (4 * c,), why), c).copy()
            bias[c : 2 * c] += TF_FORGET_BIAS  # torch block 1 is the forget gate
            if data.has(f"{prefix}/W_P_0") or p != c:
                w_proj = data.get(f"{prefix}/W_P_0", (c, p), why)
            else:  # bilm-tf's LSTMCell without num_proj: the cell output is the state
                w_proj = np.eye(c, dtype=np.float32)
            name = f"{stack}.{layer}"
            state[f"{name}.input_linearity.weight"] = _t(w_0[:p].T)
            state[f"{name}.state_linearity.weight"] = _t(w_0[p:].T)
            state[f"{name}.state_linearity.bias"] = _t(bias)
            state[f"{name}.state_projection.weight"] = _t(w_proj.T)
    return state


def build_model(cfg: ModelConfig, arrays: dict[str, np.ndarray], source: str = "weights.hdf5") -> BiLM:
    """A BiLM in eval mode holding the converted weights (warm-state buffers, if any, stay zero)."""
    model = BiLM(cfg)
    state = model.state_dict()
    converted = convert_weights(cfg, arrays, source)
    state.update(converted)
    model.load_state_dict(state, strict=True)
    return model.eval()


# -- warm initial state ----------------------------------------------------------------------------------------
def read_warm_sentences(path: str | Path, tokenized: bool = False) -> list[list[str]]:
    """A text file, one sentence per line (raw text, or whitespace tokens when ``tokenized``) -> token lists."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: warm-up text not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc})") from None
    sentences = [whitespace_tokens(line) if tokenized else tokenize(line).tokens for line in lines]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise InputError(f"{path}: warm-up text has no tokens")
    return sentences


def warm_streams(sentences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The warm-up sentences as the two LMs saw their training data (bilm-tf): the forward stream
    ``<S> s1 </S> <S> s2 </S> ...`` and the backward stream of every sentence reversed, in the same sentence order
    ``</S> s1ʳ <S> </S> s2ʳ <S> ...``. Returns two (1, N, 50) char-id tensors."""
    forward, backward = [], []
    for sentence in sentences:
        ids = torch.as_tensor(batch_to_char_ids([sentence])).long()
        with_boundaries, _ = add_sentence_boundaries(ids)  # (1, len + 2, 50)
        forward.append(with_boundaries)
        backward.append(with_boundaries.flip(1))
    return torch.cat(forward, dim=1), torch.cat(backward, dim=1)


@torch.no_grad()
def compute_warm_state(model: BiLM, sentences: list[list[str]], chunk: int = 256) -> dict[str, torch.Tensor]:
    """Run each LSTM stack statefully over its warm-up stream (see ``warm_streams``) in chunks of ``chunk``
    positions with the state carried, as bilm-tf carried it across batches.

    Returns the final state of every LSTM: ``{stack}.{layer}.initial_hidden`` (P,) and ``.initial_cell`` (C,).
    Warming with sentence s gives the state bilm-tf had when it embedded the sentence after s in the same row.
    """
    cfg = model.cfg
    result = {}
    for stack_name, stream in zip(("forward_layers", "backward_layers"), warm_streams(sentences)):
        stack = getattr(model, stack_name)
        states = [(torch.zeros(1, cfg.projection_dim), torch.zeros(1, cfg.cell_dim)) for _ in stack]
        for start in range(0, stream.shape[1], chunk):
            x = model.encoder(stream[:, start : start + chunk])  # (1, chunk, P)
            for index, layer in enumerate(stack):
                gates = layer.input_linearity(x)
                h, hidden, cell = projection_lstm_scan(
                    gates,
                    layer.state_linearity.weight,
                    layer.state_linearity.bias,
                    layer.state_projection.weight,
                    layer.cell_clip,
                    layer.proj_clip,
                    *states[index],
                )
                states[index] = (hidden, cell)
                x = h + x if index > 0 and cfg.residual else h
        for index, (hidden, cell) in enumerate(states):
            result[f"{stack_name}.{index}.initial_hidden"] = hidden[0].clone()
            result[f"{stack_name}.{index}.initial_cell"] = cell[0].clone()
    return result


def with_warm_state(model: BiLM, warm: dict[str, torch.Tensor]) -> BiLM:
    """A copy of ``model`` (same weights) whose config has warm_state on and whose LSTMs start from ``warm``."""
    cfg = ModelConfig.from_dict({**model.cfg.to_dict(), "warm_state": True})
    warm_model = BiLM(cfg)
    state = model.state_dict()
    state.update(warm)
    warm_model.load_state_dict(state, strict=True)
    return warm_model.eval()


# -- the command -----------------------------------------------------------------------------------------------
def import_allennlp(
    options: str | Path,
    weights: str | Path,
    out: str | Path,
    warm_text: str | Path | None = None,
    warm_tokenized: bool = False,
    max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES,
) -> BiLM:
    """options.json + weights.hdf5 (+ optional warm-up text) -> model directory ``out``. Returns the model.
    ``max_weight_bytes`` bounds the weights options.json may imply (checked before anything is read)."""
    cfg = read_options(options)
    model = build_model(cfg, read_hdf5(weights, cfg, max_weight_bytes), source=str(weights))
    warm_note = "zero initial state (stateless, the default)"
    if warm_text is not None:
        sentences = read_warm_sentences(warm_text, tokenized=warm_tokenized)
        model = with_warm_state(model, compute_warm_state(model, sentences))
        n_tokens = sum(len(s) for s in sentences)
        warm_note = f"warm initial state from {Path(warm_text).name} ({len(sentences)} sentences, {n_tokens} tokens)"
    out = Path(out)
    save_model(model, out)
    _write_model_card(out, cfg, Path(options), Path(weights), warm_note, model.num_parameters())
    readable_by_all(out)  # whatever the umask: a server running as another user must read the model
    return model


def _write_model_card(out: Path, cfg: ModelConfig, options: Path, weights: Path, warm_note: str, n_params: int):
    lines = [
        f"# {out.name}",
        "",
        "ELMo biLM imported from AllenNLP / bilm-tf weights with `elmo import-allennlp` (embedding only: no softmax).",
        "",
        f"- options: `{options.name}` (sha256 {sha256_of(options)})",
        f"- weights: `{weights.name}` (sha256 {sha256_of(weights)})",
        f"- shape: {cfg.n_layers} layers, cell {cfg.cell_dim}, projection {cfg.projection_dim}, "
        f"char-CNN {cfg.n_filters} ({cfg.activation}), {cfg.n_highway} highway; {n_params / 1e6:.1f} M parameters",
        f"- LSTM start: {warm_note}",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--options", required=True, help="AllenNLP / bilm-tf options.json")
    parser.add_argument("--weights", required=True, help="weights.hdf5 (bilm-tf dump_weights layout)")
    parser.add_argument("--out", required=True, help="model directory to write")
    parser.add_argument(
        "--warm-text",
        default=None,
        help="optional warm-up text (one sentence per line): store a fixed warm initial LSTM state computed from it",
    )
    parser.add_argument("--warm-tokenized", action="store_true", help="the warm-up text is whitespace-tokenized")
    add_budget_argument(parser)


def run(args: argparse.Namespace) -> int:
    with torch.no_grad():  # scoped: `elmo.cli.main` may run in a process that trains afterwards
        model = import_allennlp(
            args.options,
            args.weights,
            args.out,
            args.warm_text,
            args.warm_tokenized,
            max_weight_bytes=checked_budget(args),
        )
    cfg = model.cfg
    print(
        json.dumps(
            {
                "out": str(args.out),
                "n_layers": cfg.n_layers,
                "dim": cfg.output_dim,
                "cell_dim": cfg.cell_dim,
                "parameters": model.num_parameters(),
                "warm_state": cfg.warm_state,
            }
        )
    )
    return 0
