"""A training run's folder: the model directory (config.json, model.safetensors, vocab.txt) plus the state that
lets ``--resume`` continue exactly (``optimizer.safetensors``, ``train_state.json``, ``train_config.json``) and the
curve (``curve.png``, drawn by elmo.train.plots); written whole or not at all (a temporary file renamed over the
old one)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from elmo.errors import ConfigError, DataError
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_state, load_vocab, save_model, save_state
from elmo.model.config import read_json_config
from elmo.train.config import TrainConfig

log = logging.getLogger("elmo.train.loop")  # the training's logger: its lines read as the loop's

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "train_state.json"
TRAIN_CONFIG_FILE = "train_config.json"
CURVE_FILE = "curve.png"


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Tensor]:
    """Optimizer state -> flat ``{param_name/key: tensor}`` (safetensors, no pickle)."""
    out = {}
    for index, per_param in optimizer.state_dict()["state"].items():
        for key, value in per_param.items():
            out[f"{names[index]}/{key}"] = torch.as_tensor(value).clone()
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, names: list[str], tensors: dict[str, Tensor]) -> None:
    state_dict = optimizer.state_dict()
    position = {name: i for i, name in enumerate(names)}
    state: dict[int, dict] = {}
    for flat, value in tensors.items():
        name, key = flat.rsplit("/", 1)
        state.setdefault(position[name], {})[key] = value
    state_dict["state"] = state
    optimizer.load_state_dict(state_dict)


def write_checkpoint(out: Path, bilm: BiLM, vocab: list[str], optimizer, state: dict, cfg: TrainConfig) -> None:
    names = [n for n, _ in bilm.named_parameters()]
    save_model(bilm, out, vocab, fp16=cfg.train.fp16_weights)
    save_state(optimizer_tensors(optimizer, names), out / (OPTIMIZER_FILE + ".tmp"))
    os.replace(out / (OPTIMIZER_FILE + ".tmp"), out / OPTIMIZER_FILE)
    (out / TRAIN_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (out / (STATE_FILE + ".tmp")).write_text(json.dumps(state) + "\n")
    os.replace(out / (STATE_FILE + ".tmp"), out / STATE_FILE)


def load_weights(path: Path, bilm: BiLM) -> None:
    try:
        bilm.load_state_dict({k: v.float() for k, v in load_state(path).items()})
    except RuntimeError as exc:
        raise ConfigError(f"{path}: does not match the config ({str(exc).splitlines()[0]})") from None


def init_from(model_dir: Path, bilm: BiLM, vocab_tokens: list[str]) -> dict:
    """Start from another run's weights (a later stage of a staged recipe); returns what the state records."""
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise DataError(f"{weights}: init_from needs a model directory with model.safetensors")
    if load_vocab(model_dir) != vocab_tokens:
        raise ConfigError(f"{model_dir}: init_from model has another vocabulary than data.vocab")
    load_weights(weights, bilm)
    prior = read_train_state(model_dir) if (model_dir / STATE_FILE).is_file() else {}
    log.info("starting from the weights of %s (%s tokens seen there)", model_dir, prior.get("tokens", "?"))
    return {
        "dir": str(model_dir),
        "steps": prior.get("step"),
        "tokens": prior.get("tokens"),
        "elapsed_s": prior.get("elapsed_s"),
    }


def read_train_state(run_dir: Path) -> dict:
    """A run folder's train_state.json; missing or bad JSON is a DataError naming the file."""
    return read_json_config(run_dir / STATE_FILE, "train state", DataError)


def restore(out: Path, bilm: BiLM, optimizer, names: list[str]) -> dict:
    state_file = out / STATE_FILE
    if not state_file.is_file():
        raise DataError(f"{state_file}: nothing to resume (no train state in {out})")
    load_weights(out / "model.safetensors", bilm)
    load_optimizer_tensors(optimizer, names, load_state(out / OPTIMIZER_FILE))
    return read_train_state(out)
