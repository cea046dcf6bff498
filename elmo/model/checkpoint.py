"""Save and load a model directory: ``config.json`` + ``model.safetensors`` + ``vocab.txt`` (no pickle).

``load_model(dir) -> BiLM`` and ``save_model(model, dir, vocab)`` are the one way every component (training,
evaluation, export, tasks) reads and writes models. Weights may be stored as float16 to halve the folder; they
are always loaded back as float32. Missing or corrupt files raise :class:`ModelFileError` naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from elmo.errors import ConfigError, ModelFileError
from elmo.model.bilm import BiLM
from elmo.model.config import CONFIG_FILE, ModelConfig, read_json_config

WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.txt"


# -- vocabulary ------------------------------------------------------------------------------------------------
def save_vocab(vocab: Sequence[str], directory: str | Path) -> Path:
    """One token per line; line index = id. Tokens never contain whitespace (they come from the tokenizer)."""
    bad = [t for t in vocab if not t or any(c.isspace() for c in t)]
    if bad:
        raise ModelFileError(f"vocabulary token(s) {bad[:3]!r} are empty or contain whitespace")
    path = Path(directory) / VOCAB_FILE
    path.write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    return path


def load_vocab(directory_or_file: str | Path) -> list[str]:
    """``vocab.txt`` (or a directory holding it) -> list of tokens, index = id."""
    path = Path(directory_or_file)
    if path.is_dir():
        path = path / VOCAB_FILE
    if not path.is_file():
        raise ModelFileError(f"{path}: vocabulary file not found")
    try:
        tokens = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise ModelFileError(f"{path}: not UTF-8 text ({exc})") from None
    if tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise ModelFileError(f"{path}: vocabulary file is empty")
    if len(set(tokens)) != len(tokens):
        raise ModelFileError(f"{path}: vocabulary has duplicate tokens")
    return tokens


# -- weights ---------------------------------------------------------------------------------------------------
def save_state(state: dict[str, torch.Tensor], path: str | Path, fp16: bool = False, metadata: dict | None = None):
    """Write a flat tensor dict as safetensors; floating tensors become float16 when ``fp16``."""
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if fp16 and tensor.is_floating_point():
            tensor = tensor.to(torch.float16)
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={k: str(v) for k, v in (metadata or {}).items()})
    return Path(path)


def load_state(path: str | Path) -> dict[str, torch.Tensor]:
    """safetensors file -> tensor dict (floating tensors as float32)."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: weights file not found")
    try:
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelFileError(f"{path}: not a readable safetensors file ({exc})") from None
    return {k: (v.float() if v.is_floating_point() else v) for k, v in state.items()}


# -- model directories -----------------------------------------------------------------------------------------
def save_model(model: BiLM, directory: str | Path, vocab: Sequence[str] | None = None, fp16: bool = False) -> Path:
    """Write ``config.json``, ``model.safetensors`` (float16 storage when ``fp16``) and ``vocab.txt``.

    A model with a softmax needs a vocabulary of exactly ``vocab_size`` tokens.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if cfg.vocab_size > 0:
        if vocab is None:
            raise ModelFileError(f"{directory}: a model with a softmax (vocab_size={cfg.vocab_size}) needs a vocab")
        if len(vocab) != cfg.vocab_size:
            raise ModelFileError(f"{directory}: vocab has {len(vocab)} tokens but config vocab_size={cfg.vocab_size}")
    cfg.save(directory)
    state = _unwrapped(model).state_dict()
    save_state(state, directory / WEIGHTS_FILE, fp16=fp16, metadata={"format": "pt", "dtype": _dtype_name(fp16)})
    if vocab is not None:
        save_vocab(vocab, directory)
    return directory


def load_config(directory: str | Path) -> ModelConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelFileError(f"{directory}: model directory not found")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ModelFileError(f"{path}: config file not found")
    try:
        return ModelConfig.load(path)
    except ConfigError as exc:
        raise ModelFileError(str(exc)) from None


def load_model(directory: str | Path, device: str | torch.device = "cpu") -> BiLM:
    """Model directory -> BiLM in eval mode (float32). Checks every tensor's name and shape against the config."""
    directory = Path(directory)
    cfg = load_config(directory)
    model = BiLM(cfg)
    path = directory / WEIGHTS_FILE
    state = load_state(path)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelFileError(
            f"{path}: tensors do not match config.json (missing {missing[:4]}, unexpected {unexpected[:4]})"
        )
    for name, tensor in expected.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelFileError(
                f"{path}: tensor '{name}' has shape {tuple(state[name].shape)}, "
                f"config.json implies {tuple(tensor.shape)}"
            )
    model.load_state_dict(state)
    return model.to(device).eval()


def load_model_and_vocab(directory: str | Path, device: str | torch.device = "cpu") -> tuple[BiLM, list[str]]:
    """For LM scoring: the model plus its softmax vocabulary (consistent with ``vocab_size``)."""
    model = load_model(directory, device)
    vocab = load_vocab(directory)
    if len(vocab) != model.cfg.vocab_size:
        raise ModelFileError(
            f"{Path(directory) / VOCAB_FILE}: {len(vocab)} tokens but config vocab_size={model.cfg.vocab_size}"
        )
    return model, vocab


def read_json(path: str | Path) -> dict:
    return read_json_config(Path(path), "file", ModelFileError)


def _unwrapped(model: torch.nn.Module) -> BiLM:
    """DDP wraps the model in ``.module``; the directory always holds the plain BiLM keys."""
    return getattr(model, "module", model)


def _dtype_name(fp16: bool) -> str:
    return "float16" if fp16 else "float32"


__all__ = [
    "VOCAB_FILE",
    "WEIGHTS_FILE",
    "load_config",
    "load_model",
    "load_model_and_vocab",
    "load_state",
    "load_vocab",
    "read_json",
    "save_model",
    "save_state",
    "save_vocab",
]
