"""Import an ELMoForManyLangs (HIT-SCIR) model folder into a model directory.

``elmo import-manylangs --model DIR --out DIR`` reads the folder as ELMoForManyLangs' ``Embedder`` does:
``config.json`` (its ``config_path`` names the network's JSON: in the folder, else by file name in the folder, else
the package's own default config, which this module carries), ``char.dic``, ``word.dic`` when the network has a word
embedding (``token_embedder.word_dim > 0``), and the two torch state dicts ``token_embedder.pkl`` and ``encoder.pkl``.
The ``.pkl`` files are never unpickled: elmo.importers.torch_state reads their declarations (every tensor's name,
shape, dtype and storage), ``check_declarations`` holds them to what the config and vocabularies imply and to the byte
budget (``--max-weight-bytes``), and only then are the tensors' bytes read, with numpy.

It writes ``config.json`` + ``model.safetensors`` (char_scheme "vocab", vocab_size 0) and the char vocabulary
``char_vocab.json`` (+ ``word_vocab.json``), which ``elmo export``, the runtime, the service and the batch job read.

The conversion (their names -> elmo.model.bilm.BiLM), all the same maths, so tensors are copied as they are:
- ``char_emb_layer.embedding.weight`` (V, d), ``word_emb_layer.embedding.weight`` (Vw, dw): a zero row 0 is
  prepended ("no token here"), their ids become id + 1 (elmo.text.chars.VocabScheme).
- ``convolutions.{i}`` -> ``encoder.convs.{i}``; ``highways._layers.{k}`` -> ``encoder.highway.layers.{k}``
  (AllenNLP's highway: nonlinear rows first, gate on the input, relu); ``projection`` -> ``encoder.projection``,
  whose input is ``[word vector; highway output]`` as in their ConvTokenEmbedder.
- ``{forward,backward}_layer_{l}.{input_linearity,state_linearity,state_projection}`` ->
  ``{forward,backward}_layers.{l}.*``: their LstmCellWithProjection is AllenNLP's (gates i, f, g, o; cell and
  projection clips; 0 / null = no clip); every layer after the first adds its input (residual), as ours does.

Char ids: a token becomes ``[X, its characters (at most max_characters_per_token - 2, unknown ones <oov>), Y,
<pad>, ...]`` where X is char.dic's ``<eow>`` id and Y its ``<bow>`` id: their create_one_batch swaps the two names,
and their models were trained that way. The sentence tokens ``<bos>``/``<eos>`` are ``[X, <bos>|<eos>, Y, <pad>...]``
and get the word ids of ``<bos>``/``<eos>`` (``<oov>`` when absent); a word is looked up after that truncation.

Output layers: ELMoForManyLangs' ``sents2elmo(output_layer=-2)`` returns (L+1, n, 2P): the char-CNN token vector
twice, then each biLSTM layer's [forward; backward]; ``-1`` is their mean over the L+1 layers, ``k >= 0`` one layer.
The runtime's layers are the same L+1 in the same order. Their ``ElmobiLm`` is stateful: each call starts from the
states the previous call left behind (per batch row, their batches sorted by length); ours is stateless, from
zero, which is exactly their first call of a fresh ``Embedder`` on one batch (up to ``batch_size`` sentences).

Not supported (one clear error): ``encoder.name`` "lstm" (a plain nn.LSTM with one shared projection, top layer
only) and ``token_embedder.name`` "lstm" (a char biLSTM), and models without a char embedder (``char_dim`` 0).
The published ELMoForManyLangs models are all "elmo" + "cnn" with chars.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from elmo.errors import ConfigError, ModelFileError
from elmo.importers.budget import (
    DEFAULT_MAX_WEIGHT_BYTES,
    add_budget_argument,
    check_budget,
    checked_budget,
    describe,
)
from elmo.importers.torch_state import StateFile, read_declarations
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import save_model
from elmo.model.config import ModelConfig
from elmo.runtime.repository import readable_by_all
from elmo.text.chars import VocabScheme

log = logging.getLogger(__name__)

PEER_CONFIG = "config.json"
CHAR_DIC = "char.dic"
WORD_DIC = "word.dic"
TOKEN_EMBEDDER = "token_embedder.pkl"
ENCODER = "encoder.pkl"
DIC_ID = re.compile(r"[0-9]+")  # a .dic line's id: ASCII digits, >= 0
MAX_CONFIG_BYTES = 1 << 20  # their config.json and network JSON are a few hundred bytes
# A .dic line is ~15 bytes and becomes a Python dict entry of ~100: the published word.dic files are tens of MB.
MAX_DIC_BYTES = 128 << 20

# The network config that ELMoForManyLangs 0.0.4 ships (elmoformanylangs/configs/cnn_{0,50}_100_512_4096_sample.json,
# identical) and falls back to when a model folder lacks it, as the published English model does.
PACKAGED_CONFIG = {
    "encoder": {"name": "elmo", "projection_dim": 512, "cell_clip": 3, "proj_clip": 3, "dim": 4096, "n_layers": 2},
    "token_embedder": {
        "name": "cnn",
        "activation": "relu",
        "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]],
        "n_highway": 2,
        "word_dim": 100,
        "char_dim": 50,
        "max_characters_per_token": 50,
    },
    "classifier": {"name": "sampled_softmax", "n_samples": 8192},
    "dropout": 0.1,
}
PACKAGED_CONFIG_NAMES = ("cnn_0_100_512_4096_sample.json", "cnn_50_100_512_4096_sample.json")
CHAR_SPECIAL_NAMES = {"<eow>": "begin_of_word", "<bow>": "end_of_word", "<pad>": "padding", "<oov>": "unknown"}
SENTENCE_TOKENS = ("<bos>", "<eos>")


# -- the folder's text files ---------------------------------------------------------------------------------------
def read_dic(path: Path, max_bytes: int | None = None) -> dict[str, int]:
    """A char.dic / word.dic (``token<TAB>id`` lines) parsed exactly as ELMoForManyLangs parses it: each line
    stripped, a line left with one field is the ideographic space U+3000 (stripped as whitespace), later lines win.
    A file over ``max_bytes`` (default MAX_DIC_BYTES) is refused unread."""
    if not path.is_file():
        raise ModelFileError(f"{path}: file not found")
    _check_file_size(path, MAX_DIC_BYTES if max_bytes is None else max_bytes, "a .dic file")
    table: dict[str, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: not UTF-8 text ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        if len(fields) != 2 or not DIC_ID.fullmatch(fields[1]):  # ASCII digits only: "²".isdigit() breaks int()
            raise ModelFileError(f"{path}: line {number} is not 'token<TAB>id' with an id >= 0: {line!r}")
        table[fields[0]] = int(fields[1])
    if not table:
        raise ModelFileError(f"{path}: empty")
    return table


def _check_file_size(path: Path, max_bytes: int, limit: str) -> None:
    size = path.stat().st_size
    if size > max_bytes:
        raise ModelFileError(
            f"{path}: {size:,} bytes, over the {max_bytes:,} this file may have ({limit}): refused unread"
        )


def _read_json(path: Path, what: str) -> dict:
    _check_file_size(path, MAX_CONFIG_BYTES, "a model folder's JSON config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} must be a JSON object")
    return data


def read_network_config(model_dir: Path) -> tuple[dict, str]:
    """The folder's ``config.json`` -> (the network config it names, where it came from)."""
    path = model_dir / PEER_CONFIG
    if not path.is_file():
        raise ConfigError(f"{path}: file not found (an ELMoForManyLangs model folder has config.json)")
    top = _read_json(path, "config.json")
    name = top.get("config_path")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: field 'config_path' missing or not a string")
    inside = model_dir.resolve()
    # never outside the folder: not absolute, no `..` past it, no symlink out of it (resolved before the check)
    candidates = [model_dir / name, model_dir / Path(name).name]
    for candidate in candidates:
        if not candidate.resolve().is_relative_to(inside) or candidate.is_symlink():
            continue
        if candidate.is_file():
            return _read_json(candidate, "the network config"), str(candidate)
    if Path(name).name in PACKAGED_CONFIG_NAMES:
        log.warning("%s: %s is not in the folder; using ELMoForManyLangs' packaged copy", path, Path(name).name)
        return json.loads(json.dumps(PACKAGED_CONFIG)), f"elmoformanylangs/configs/{Path(name).name}"
    raise ConfigError(f"{path}: config_path {name!r}: no such file in {model_dir} (nor a packaged config)")


def network_to_config(net: dict, source: str, n_chars: int, n_words: int) -> ModelConfig:
    """Their network config -> ModelConfig (char_scheme "vocab"); ConfigError names the field."""

    def fail(field: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: field '{field}': {why}")

    def section(name: str) -> dict:
        value = net.get(name)
        if not isinstance(value, dict):
            raise fail(name, "missing or not an object")
        return value

    def integer(sec: dict, field: str, minimum: int = 1) -> int:
        value = sec.get(field.rsplit(".", 1)[-1])
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise fail(field, f"must be an integer >= {minimum} (got {value!r})")
        return value

    def clip(sec: dict, field: str) -> float:
        value = sec.get(field.rsplit(".", 1)[-1])
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise fail(field, f"must be a number >= 0 or null (got {value!r})")
        return float(value)  # their `if clip:` means 0 = no clipping, as ours

    encoder, embedder = section("encoder"), section("token_embedder")
    if str(encoder.get("name", "")).lower() != "elmo":
        raise fail(
            "encoder.name", f"only 'elmo' (LstmCellWithProjection stacks) is supported (got {encoder.get('name')!r})"
        )
    if str(embedder.get("name", "")).lower() != "cnn":
        raise fail("token_embedder.name", f"only 'cnn' is supported (got {embedder.get('name')!r})")
    char_dim = integer(embedder, "token_embedder.char_dim", minimum=0)
    if char_dim == 0:
        raise fail("token_embedder.char_dim", "models without a char embedder are not supported (got 0)")
    activation = embedder.get("activation")
    if activation not in ("relu", "tanh"):
        raise fail("token_embedder.activation", f"must be 'relu' or 'tanh' (got {activation!r})")
    max_chars = integer(embedder, "token_embedder.max_characters_per_token", minimum=3)
    filters = embedder.get("filters")
    ok = isinstance(filters, list) and bool(filters)
    ok = ok and all(
        isinstance(p, list) and len(p) == 2 and all(type(v) is int and v > 0 for v in p) and p[0] <= max_chars
        for p in filters
    )
    if not ok:
        raise fail(
            "token_embedder.filters", f"must be a non-empty list of [width <= {max_chars}, count] (got {filters!r})"
        )
    word_dim = integer(embedder, "token_embedder.word_dim", minimum=0)
    cfg = ModelConfig(
        char_dim=char_dim,
        filters=[list(p) for p in filters],
        n_highway=integer(embedder, "token_embedder.n_highway", minimum=0),
        activation=activation,
        projection_dim=integer(encoder, "encoder.projection_dim"),
        cell_dim=integer(encoder, "encoder.dim"),
        n_layers=integer(encoder, "encoder.n_layers"),
        cell_clip=clip(encoder, "encoder.cell_clip"),
        proj_clip=clip(encoder, "encoder.proj_clip"),
        residual=True,
        n_chars=n_chars,
        max_chars=max_chars,
        vocab_size=0,
        dropout=0.0,
        char_scheme="vocab",
        word_dim=word_dim,
        n_words=n_words if word_dim > 0 else 0,
    )
    return cfg.validate()


def build_scheme(model_dir: Path, max_chars: int, with_words: bool) -> VocabScheme:
    """char.dic (+ word.dic) -> the char-vocabulary scheme, checked for the special entries their code needs."""
    char_path = model_dir / CHAR_DIC
    chars = read_dic(char_path)
    needed = [*CHAR_SPECIAL_NAMES, *SENTENCE_TOKENS]
    missing = [name for name in needed if name not in chars]
    if missing:
        raise ModelFileError(f"{char_path}: special entries {missing} missing")
    specials = {ours: chars[theirs] for theirs, ours in CHAR_SPECIAL_NAMES.items()}
    specials |= {"sentence_begin": chars["<bos>"], "sentence_end": chars["<eos>"]}
    words = word_specials = None
    if with_words:
        word_path = model_dir / WORD_DIC
        words = read_dic(word_path)
        missing = [name for name in ("<oov>", "<pad>") if name not in words]
        if missing:
            raise ModelFileError(f"{word_path}: special entries {missing} missing")
        word_specials = {"unknown": words["<oov>"], "padding": words["<pad>"]}
    return VocabScheme(chars, specials, max_chars, SENTENCE_TOKENS, words, word_specials, source=str(char_path))


# -- the state dicts -----------------------------------------------------------------------------------------------
def _our_name(theirs: str, file_index: int) -> str:
    """Their state dict key (token_embedder.pkl: 0, encoder.pkl: 1) -> the BiLM parameter it becomes."""
    if file_index == 0:
        ours = theirs.replace("char_emb_layer.embedding.", "char_embedding.")
        ours = ours.replace("word_emb_layer.embedding.", "word_embedding.")
        ours = ours.replace("convolutions.", "convs.").replace("highways._layers.", "highway.layers.")
        return f"encoder.{ours}"
    head, _, rest = theirs.partition(".")
    direction, _, layer = head.rpartition("_layer_")
    return f"{direction}_layers.{layer}.{rest}"


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every float parameter of the BiLM ``cfg`` describes (vocab_size 0) -> its shape, from the config alone: no
    model is built before the files are checked (tests/importers/test_declared_sizes.py holds it to BiLM's own)."""
    nf, p, c = cfg.n_filters, cfg.projection_dim, cfg.cell_dim
    shapes = {"encoder.char_embedding.weight": (cfg.n_chars, cfg.char_dim)}
    if cfg.word_dim > 0:
        shapes["encoder.word_embedding.weight"] = (cfg.n_words, cfg.word_dim)
    for i, (width, count) in enumerate(cfg.filters):
        shapes[f"encoder.convs.{i}.weight"] = (count, cfg.char_dim, width)
        shapes[f"encoder.convs.{i}.bias"] = (count,)
    for k in range(cfg.n_highway):
        shapes[f"encoder.highway.layers.{k}.weight"] = (2 * nf, nf)
        shapes[f"encoder.highway.layers.{k}.bias"] = (2 * nf,)
    shapes["encoder.projection.weight"] = (p, nf + cfg.word_dim)
    shapes["encoder.projection.bias"] = (p,)
    for stack in ("forward_layers", "backward_layers"):
        for layer in range(cfg.n_layers):
            shapes[f"{stack}.{layer}.input_linearity.weight"] = (4 * c, p)
            shapes[f"{stack}.{layer}.state_linearity.weight"] = (4 * c, p)
            shapes[f"{stack}.{layer}.state_linearity.bias"] = (4 * c,)
            shapes[f"{stack}.{layer}.state_projection.weight"] = (p, c)
    return shapes


def check_declarations(cfg: ModelConfig, files: tuple[StateFile, StateFile], max_bytes: int) -> None:
    """Their two files' declared tensors against the network ``cfg`` describes, before any is read: every name
    known, every shape and dtype (float32) as the config and vocabularies imply, none missing, and the config's
    weights and the storages to read within ``max_bytes``. Errors name the file and the tensor."""
    expected = expected_shapes(cfg)
    check_budget(str(files[0].path.parent), expected.values(), max_bytes, "the network config with the vocabularies")
    seen: set[str] = set()
    for index, state_file in enumerate(files):
        for theirs, decl in state_file.tensors.items():
            ours = _our_name(theirs, index)
            if ours not in expected:
                raise ModelFileError(
                    f"{state_file.path}: unexpected tensor '{theirs}' (not part of the network its config describes)"
                )
            want = expected[ours]
            if ours in ("encoder.char_embedding.weight", "encoder.word_embedding.weight"):
                want = (want[0] - 1, *want[1:])  # their table has no row for our "no token here" id 0
            if decl.shape != want or decl.dtype != "float32":
                declared, implied = describe(decl.shape, decl.dtype), describe(want, "float32")
                raise ModelFileError(
                    f"{state_file.path}: tensor '{theirs}' is declared {declared}, the config and "
                    f"vocabularies imply {implied}: refused before reading"
                )
            seen.add(ours)
        stored = sum(storage.nbytes for storage in state_file.storages(state_file.tensors).values())
        if stored > max_bytes:
            raise ModelFileError(
                f"{state_file.path}: its tensors' storages declare {stored:,} bytes, over the "
                f"{max_bytes:,}-byte budget (--max-weight-bytes): refused before reading"
            )
    missing = sorted(set(expected) - seen)
    if missing:
        path = files[1].path if missing[0].startswith(("forward", "backward")) else files[0].path
        raise ModelFileError(f"{path}: tensors missing for {missing[:4]} (the config describes them)")


def load_tensors(state_file: StateFile) -> dict[str, torch.Tensor]:
    """The declared tensors of a checked file, read (numpy, no pickle) -> {their name: tensor}."""
    arrays = state_file.read(list(state_file.tensors))
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def convert_state(cfg: ModelConfig, token_embedder: dict, encoder: dict, paths: tuple[Path, Path]) -> dict:
    """Their two state dicts -> BiLM state dict; every key and shape checked, errors name the file and key."""
    expected = BiLM(cfg).state_dict()
    renamed: dict[str, tuple[str, Path, torch.Tensor]] = {}  # ours -> (theirs, file, tensor)
    for index, state in enumerate((token_embedder, encoder)):
        for theirs, tensor in state.items():
            renamed[_our_name(theirs, index)] = (theirs, paths[index], tensor)
    state: dict[str, torch.Tensor] = {}
    for ours, (theirs, path, tensor) in renamed.items():
        if ours not in expected:
            raise ModelFileError(f"{path}: unexpected tensor '{theirs}' (not part of the network its config describes)")
        want = tuple(expected[ours].shape)
        if ours in ("encoder.char_embedding.weight", "encoder.word_embedding.weight") and tensor.ndim == 2:
            tensor = torch.cat([torch.zeros(1, tensor.shape[1], dtype=tensor.dtype), tensor])  # row 0: no token
        if tuple(tensor.shape) != want:
            shape = tuple(tensor.shape)
            if ours.endswith("embedding.weight"):  # report their shape, without our zero row
                shape, want = (shape[0] - 1, *shape[1:]), (want[0] - 1, *want[1:])
            raise ModelFileError(
                f"{path}: tensor '{theirs}' has shape {shape}, the config and vocabularies imply {want}"
            )
        if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
            raise ModelFileError(f"{path}: tensor '{theirs}' is not finite floating-point")
        state[ours] = tensor.float()
    missing = sorted(set(expected) - set(state) - {"encoder.boundary_ids"})
    if missing:
        path = paths[1] if missing[0].startswith(("forward", "backward")) else paths[0]
        raise ModelFileError(f"{path}: tensors missing for {missing[:4]} (the config describes them)")
    return state


# -- the command ---------------------------------------------------------------------------------------------------
def import_manylangs(model_dir: str | Path, out: str | Path, max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES) -> BiLM:
    """ELMoForManyLangs model folder -> model directory ``out``. Returns the model. ``max_weight_bytes`` bounds the
    weights the config and vocabularies may imply, checked with every declared tensor before any is read."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFileError(f"{model_dir}: model folder not found")
    net, net_source = read_network_config(model_dir)
    embedder = net.get("token_embedder")
    embedder = embedder if isinstance(embedder, dict) else {}
    max_chars, word_dim = embedder.get("max_characters_per_token"), embedder.get("word_dim", 0)
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 3:
        raise ConfigError(f"{net_source}: field 'token_embedder.max_characters_per_token': must be an integer >= 3")
    with_words = isinstance(word_dim, int) and not isinstance(word_dim, bool) and word_dim > 0
    scheme = build_scheme(model_dir, max_chars, with_words)
    paths = (model_dir / TOKEN_EMBEDDER, model_dir / ENCODER)
    files = (read_declarations(paths[0]), read_declarations(paths[1]))
    # The tables' sizes come from the weights (their EmbeddingLayer has len(dic) rows); the dic ids must fit them.
    n_chars = _table_rows(files[0], "char_emb_layer.embedding.weight", scheme.chars, model_dir / CHAR_DIC)
    n_words = 0
    if with_words:
        n_words = _table_rows(files[0], "word_emb_layer.embedding.weight", scheme.words, model_dir / WORD_DIC)
    cfg = network_to_config(net, net_source, n_chars + 1, n_words + 1)
    check_declarations(cfg, files, max_weight_bytes)
    state = convert_state(cfg, load_tensors(files[0]), load_tensors(files[1]), paths)
    # one array first: a list of arrays makes torch warn (slow path) on every import
    state["encoder.boundary_ids"] = torch.as_tensor(np.stack([scheme.bos_ids, scheme.eos_ids]), dtype=torch.int64)
    model = BiLM(cfg)
    model.load_state_dict(state, strict=True)
    model.eval()
    out = Path(out)
    save_model(model, out)
    scheme.save(out, source=f"ELMoForManyLangs {CHAR_DIC}" + (f" + {WORD_DIC}" if with_words else ""))
    _write_model_card(out, model_dir, cfg, net_source, model.num_parameters())
    readable_by_all(out)  # whatever the umask: a server running as another user must read the model
    return model


def _table_rows(state_file: StateFile, key: str, table: dict[str, int], dic: Path) -> int:
    """Rows of an embedding table as declared: ELMoForManyLangs builds it with one row per dic entry (ids
    0..len - 1)."""
    decl = state_file.tensors.get(key)
    if decl is None or len(decl.shape) != 2:
        raise ModelFileError(f"{state_file.path}: tensor '{key}' missing or not a 2-D table")
    rows = decl.shape[0]
    if rows != len(table) or max(table.values()) >= rows:
        raise ModelFileError(
            f"{state_file.path}: tensor '{key}' has {rows} rows but {dic} has {len(table)} entries with ids up to "
            f"{max(table.values())} (mismatched files)"
        )
    return rows


def _write_model_card(out: Path, source: Path, cfg: ModelConfig, net_source: str, n_params: int) -> None:
    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"

    files = [PEER_CONFIG, CHAR_DIC, *([WORD_DIC] if cfg.word_dim else []), TOKEN_EMBEDDER, ENCODER]
    lines = [
        f"# {out.name}",
        "",
        "ELMo biLM imported from an ELMoForManyLangs model folder with `elmo import-manylangs` (embedding only).",
        "",
        *[f"- `{name}`: sha256 {digest(source / name)}" for name in files],
        f"- network config: `{net_source}`",
        f"- shape: {cfg.n_layers} layers, cell {cfg.cell_dim}, projection {cfg.projection_dim}, char-CNN "
        f"{cfg.n_filters} ({cfg.activation}), {cfg.n_highway} highway, word embedding {cfg.word_dim or 'none'}; "
        f"{n_params / 1e6:.1f} M parameters",
        "- input: tokens as the model was trained on (Chinese models: segmented words, not single characters); "
        "use pre-tokenized input (docs/how-to/pretrained.md)",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="ELMoForManyLangs model folder (config.json, char.dic, *.pkl)")
    parser.add_argument("--out", required=True, help="model directory to write")
    add_budget_argument(parser)


def run(args: argparse.Namespace) -> int:
    with torch.no_grad():
        model = import_manylangs(args.model, args.out, checked_budget(args))
    cfg = model.cfg
    summary = {
        "out": str(args.out),
        "n_layers": cfg.n_output_layers,
        "dim": cfg.output_dim,
        "cell_dim": cfg.cell_dim,
        "word_dim": cfg.word_dim,
        "max_chars": cfg.max_chars,
        "parameters": model.num_parameters(),
    }
    print(json.dumps(summary))
    return 0
