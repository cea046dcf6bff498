"""The training configuration (``elmo train --config FILE``): data, model and optimisation sections, read
from JSON with one clear error per bad field, and the training text it names.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from elmo.errors import ConfigError
from elmo.model.config import ModelConfig, read_json_config
from elmo.train.vocab import chunk_long, read_sentences

log = logging.getLogger(__name__)


# -- configuration ---------------------------------------------------------------------------------------------
@dataclass
class DataConfig:
    # one file, or a list of files read one after another; a file listed twice is seen twice per epoch
    train: str | list[str] = "data/corpus/train.txt"
    valid: str = "data/corpus/valid.txt"
    vocab: str = "data/corpus/vocab.txt"
    max_sentence_tokens: int = 128  # longer sentences are cut into pieces for training
    # no <S>/</S> target at a cut (see vocab.chunk_long); the shipped default stages were trained without it
    mask_cut_boundaries: bool = True
    train_sentences: int = 0  # 0 = all; otherwise an evenly spaced slice (CI-sized runs)
    valid_tokens: int = 20000  # periodic validation on an evenly spaced slice of about this many tokens
    sense_benchmark: bool = True  # also score the word-sense benchmark (elmo.senses) at every validation


@dataclass
class OptimConfig:
    optimizer: str = "adam"  # "adam" or "adagrad" (bilm-tf: adagrad lr 0.2, initial accumulator 1.0)
    lr: float = 2e-3
    schedule: str = "cosine"  # "constant" or "cosine" (to min_lr_ratio * lr at max_steps), after warmup
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    clip: float = 10.0
    tokens_per_batch: int = 2048  # per process, padded tokens
    n_negatives: int = 0  # sampled softmax negatives; 0 (or >= vocab) = full softmax
    max_steps: int = 1000
    max_time_s: float = 0.0  # 0 = no time budget; otherwise stop (and save) once this much training time passed
    anneal_by_time: bool = False  # cosine progress = max(step / max_steps, elapsed / max_time_s): a wall-clock budget
    seed: int = 0
    log_every: int = 10
    valid_every: int = 200
    checkpoint_every: int = 200
    threads: int = 0  # torch threads per process (0 = leave torch's default)
    fp16_weights: bool = False  # store model.safetensors as float16 (the optimizer state stays float32)
    init_bias_unigram: bool = True  # start the softmax bias at log unigram frequencies of the train targets
    calibrate_bias_tokens: int = 0  # > 0: after training, refit the softmax bias on this many train tokens
    init_from: str = ""  # a model directory (same config and vocab) whose weights start this run; fresh optimizer
    softmax_only: bool = False  # train the softmax alone, the biLM frozen (fitting a softmax to an imported model)


@dataclass
class TrainConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "data": asdict(self.data), "train": asdict(self.train)}


def _section(cls, values: dict, name: str, source: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: section '{name}' must be a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {unknown} in '{name}'; known: {sorted(known)}")
    return cls(**values)


def load_train_config(path: str | Path) -> TrainConfig:
    path = Path(path)
    raw = read_json_config(path, "training config")
    unknown = sorted(set(raw) - {"model", "data", "train"})
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {unknown}; expected 'model', 'data', 'train'")
    model_values = dict(raw.get("model", {}))
    model_values.setdefault("vocab_size", 0)  # set from the vocabulary file
    cfg = TrainConfig(
        model=ModelConfig.from_dict(model_values, source=f"{path} [model]"),
        data=_section(DataConfig, raw.get("data", {}), "data", str(path)),
        train=_section(OptimConfig, raw.get("train", {}), "train", str(path)),
    )
    t = cfg.train
    if t.optimizer not in ("adam", "adagrad"):
        raise ConfigError(f"{path}: train.optimizer must be 'adam' or 'adagrad' (got {t.optimizer!r})")
    if t.schedule not in ("constant", "cosine"):
        raise ConfigError(f"{path}: train.schedule must be 'constant' or 'cosine' (got {t.schedule!r})")
    for name in ("tokens_per_batch", "max_steps", "log_every", "valid_every", "checkpoint_every"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"{path}: train.{name} must be > 0 (got {getattr(t, name)})")
    if not isinstance(cfg.data.max_sentence_tokens, int) or cfg.data.max_sentence_tokens <= 0:
        raise ConfigError(f"{path}: data.max_sentence_tokens must be an integer > 0")
    if not isinstance(cfg.data.mask_cut_boundaries, bool):
        raise ConfigError(f"{path}: data.mask_cut_boundaries must be true or false")
    files = train_files(cfg.data)
    if not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{path}: data.train must be a file path or a non-empty list of file paths")
    return cfg


def train_files(data: DataConfig) -> list[str]:
    """The train file(s) as a list; [] when data.train is neither a path nor a list."""
    if isinstance(data.train, str):
        return [data.train]
    return list(data.train) if isinstance(data.train, list) else []


def read_train_sentences(data: DataConfig) -> list[list[str]]:
    """Every train file's sentences in the listed order; Batches shuffles them, so repeating a file oversamples it."""
    sentences = [s for path in train_files(data) for s in read_sentences(Path(path))]
    return chunk_long(sentences, data.max_sentence_tokens, mark_cuts=data.mask_cut_boundaries)
