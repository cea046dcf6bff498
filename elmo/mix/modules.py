"""The trainable side of scalar mixes (PyTorch): ``ScalarMix``, the AllenNLP-style ``Elmo`` module, and the light
task heads trained on frozen, cached biLM features by ``elmo mix train``.

Shapes: B = batch, L = biLM output layers (token layer + LSTM layers), T = tokens (padded), D = layer width.
The numpy twin used for serving is :mod:`elmo.runtime.tasks`; both compute exactly the same function (tested).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo.errors import ConfigError, DataError
from elmo.runtime.tasks import LAYER_NORM_EPS, POOLINGS, Task
from elmo.text.chars import batch_to_char_ids

log = logging.getLogger(__name__)


class ScalarMix(nn.Module):
    """``gamma * sum_j softmax(w)_j * h_j`` (Peters et al. 2018, eq. 1), as AllenNLP's ``ScalarMix``.

    ``w`` starts at 0 (an equal average; or ``initial`` raw weights), ``gamma`` at 1. ``layer_norm`` first
    normalises each layer to mean 0 / variance 1 over its unmasked elements (no affine) — per sentence by default
    (``norm_scope="sentence"``: a sentence's output never depends on its batch, which is what serving needs),
    or over the whole batch as AllenNLP does (``norm_scope="batch"``, not servable). ``l2`` is the weight of
    ``l2 * sum(w**2)`` returned by :meth:`penalty` (the paper's lambda = 0.001); ``dropout`` acts on the output.
    ``trainable_weights=False`` freezes ``w`` (single-layer baselines use a one-hot ``initial``).
    """

    def __init__(
        self,
        n_layers: int,
        layer_norm: bool = False,
        l2: float = 0.0,
        dropout: float = 0.0,
        initial: Sequence[float] | None = None,
        gamma: float = 1.0,
        trainable_weights: bool = True,
        norm_scope: str = "sentence",
    ) -> None:
        super().__init__()
        if n_layers < 1:
            raise ConfigError(f"ScalarMix needs n_layers >= 1, got {n_layers}")
        if initial is not None and len(initial) != n_layers:
            raise ConfigError(f"ScalarMix: {len(initial)} initial weights for {n_layers} layers")
        if norm_scope not in ("sentence", "batch"):
            raise ConfigError(f"ScalarMix: norm_scope must be 'sentence' or 'batch', got {norm_scope!r}")
        init = torch.zeros(n_layers) if initial is None else torch.tensor(list(initial), dtype=torch.float32)
        self.weights = nn.Parameter(init, requires_grad=trainable_weights)
        self.gamma = nn.Parameter(torch.tensor(float(gamma)))
        self.n_layers = n_layers
        self.layer_norm = layer_norm
        self.norm_scope = norm_scope
        self.l2 = float(l2)
        self.dropout = nn.Dropout(dropout)

    def forward(self, layers: Tensor | Sequence[Tensor], mask: Tensor | None = None) -> Tensor:
        """``layers``: (B, L, T, D) or a list of L tensors (B, T, D); ``mask``: (B, T) bool (needed for layer norm;
        default all valid). Returns (B, T, D), zero at masked positions when a mask is given."""
        x = layers if isinstance(layers, Tensor) else torch.stack(list(layers), dim=1)
        if x.dim() != 4 or x.shape[1] != self.n_layers:
            raise ConfigError(f"ScalarMix expects (B, {self.n_layers}, T, D) layers, got shape {tuple(x.shape)}")
        if mask is None:
            mask = torch.ones(x.shape[0], x.shape[2], dtype=torch.bool, device=x.device)
        m = mask.to(x.dtype)[:, None, :, None]  # (B, 1, T, 1)
        if self.layer_norm:
            x = self._normalize(x, m)
        scale = torch.softmax(self.weights, dim=0) * self.gamma  # (L,)
        mixed = torch.einsum("l,bltd->btd", scale.to(x.dtype), x) * m[:, 0]
        return self.dropout(mixed)

    def _normalize(self, x: Tensor, m: Tensor) -> Tensor:
        """Mean/variance over the unmasked elements of each layer (of each sentence, or of the batch)."""
        dims = (2, 3) if self.norm_scope == "sentence" else (0, 2, 3)
        count = (m.sum(dim=dims, keepdim=True) * x.shape[3]).clamp_min(1.0)
        mean = (x * m).sum(dim=dims, keepdim=True) / count
        var = (((x - mean) * m) ** 2).sum(dim=dims, keepdim=True) / count
        return (x - mean) / torch.sqrt(var + LAYER_NORM_EPS)

    def penalty(self) -> Tensor:
        """``l2 * sum(w**2)``: add it to the loss (zero when l2 = 0)."""
        return self.l2 * (self.weights**2).sum()

    def normalized_weights(self) -> list[float]:
        return [float(v) for v in torch.softmax(self.weights.detach().float(), dim=0)]


# A warm-started mix gives its single layer exp(2) / (exp(2) + L - 1) of the weight (0.79 for 3 layers): close to
# the trained single-layer model it starts from, far enough from saturation for the softmax to pass gradient.
WARM_START_LOGIT = 2.0


def one_hot_logits(n_layers: int, layer: int) -> list[float]:
    """Raw weights whose softmax is exactly one-hot in float32 (exp(-1e4) underflows to 0)."""
    if not 0 <= layer < n_layers:
        raise ConfigError(f"layer {layer} does not exist: the model has layers 0..{n_layers - 1}")
    return [0.0 if j == layer else -1e4 for j in range(n_layers)]


# -- the AllenNLP-style module ---------------------------------------------------------------------------------
class ElmoOutput(NamedTuple):
    representations: list[Tensor]  # k tensors (B, T, D)
    mask: Tensor  # (B, T) bool


class Elmo(nn.Module):
    """k task-specific mixes of the biLM layers, as AllenNLP's ``Elmo(options, weights, num_output_representations)``.

    Built on our :class:`elmo.model.bilm.BiLM` (``Elmo.from_model_dir(dir, k)``; frozen unless ``requires_grad``) or
    on precomputed features only (``Elmo(None, k, n_layers=L)`` and :meth:`mix_layers`, e.g. on layers from the
    runtime, the server or an hdf5 file written by ``elmo embed-file --layers all``).
    ``forward(char_ids)`` or ``forward(sentences)`` -> :class:`ElmoOutput` (representations, mask).
    """

    def __init__(
        self,
        bilm: nn.Module | None,
        num_output_representations: int = 1,
        dropout: float = 0.5,
        requires_grad: bool = False,
        layer_norm: bool = False,
        l2: float = 0.0,
        n_layers: int | None = None,
    ) -> None:
        super().__init__()
        if bilm is None and n_layers is None:
            raise ConfigError("Elmo needs a BiLM or, for precomputed features, n_layers")
        if num_output_representations < 1:
            raise ConfigError("num_output_representations must be >= 1")
        self.bilm = bilm
        self.n_layers = int(n_layers if n_layers is not None else bilm.cfg.n_output_layers)
        if bilm is not None:
            for p in bilm.parameters():
                p.requires_grad_(requires_grad)
        self.mixes = nn.ModuleList(
            ScalarMix(self.n_layers, layer_norm=layer_norm, l2=l2, dropout=dropout)
            for _ in range(num_output_representations)
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, num_output_representations: int = 1, **kwargs) -> Elmo:
        from elmo.model.checkpoint import load_model

        return cls(load_model(model_dir), num_output_representations, **kwargs)

    @staticmethod
    def batch_to_ids(sentences: Sequence[Sequence[str]]) -> Tensor:
        """Tokenized sentences -> char ids (B, T, 50) long, as AllenNLP's ``batch_to_ids``."""
        return torch.from_numpy(batch_to_char_ids(sentences)).long()

    def forward(self, inputs: Tensor | Sequence[Sequence[str]]) -> ElmoOutput:
        """``inputs``: char ids (B, T, 50) or tokenized sentences -> k × (B, T, D) and the mask (B, T)."""
        if self.bilm is None:
            raise ConfigError("this Elmo has no BiLM (built for features): call mix_layers(layers, mask)")
        char_ids = inputs if isinstance(inputs, Tensor) else self.batch_to_ids(inputs)
        bilm_grad = any(p.requires_grad for p in self.bilm.parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and bilm_grad):
            layers, mask = self.bilm(char_ids.to(next(self.bilm.parameters()).device))
        return self.mix_layers(layers, mask)

    def mix_layers(self, layers: Tensor, mask: Tensor) -> ElmoOutput:
        """Precomputed layers (B, L, T, D) + mask (B, T) -> k mixes."""
        return ElmoOutput([mix(layers, mask) for mix in self.mixes], mask)

    def penalty(self) -> Tensor:
        return sum(mix.penalty() for mix in self.mixes)


# -- task heads on cached features ------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Head + mix training settings (defaults tuned on the dev sets of the three built-in tasks)."""

    hidden: int = 256  # 0 = linear head; >0 = one ReLU hidden layer of this width
    epochs: int = 60
    batch_size: int = 64  # sentences per step
    lr: float = 5e-3  # head (Adam)
    mix_lr: float = 2e-2  # mix weights and gamma (Adam); they are 4 numbers and need to move far
    weight_decay: float = 0.0
    dropout: float = 0.0  # on the mix (0.1-0.2 cost 3-5 points of dev accuracy on the built-in tasks)
    layer_norm: bool = False
    l2: float = 0.001  # on the raw mix weights (the paper's lambda)
    pooling: str = "mean+max"  # classification only
    seed: int = 0
    patience: int = 8  # epochs without dev improvement (score or loss) before stopping

    def validate(self) -> TrainConfig:
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0 or self.mix_lr <= 0 or self.patience < 1:
            raise ConfigError("epochs, batch_size, lr, mix_lr and patience must be positive")
        return self


class TaskModel(nn.Module):
    """ScalarMix + light head on a flat batch of tokens (no padding): ``forward(layers (L, n, D), segments (n,),
    n_sentences)`` -> logits per token (n, K) for tagging, per sentence (B, K) for classification (pooled mix).

    ``layer_norm`` is applied by :class:`FeatureData` when it loads the features (per sentence, no parameters, so it
    is done once instead of every step); the mix here therefore runs without it, and the stored task records it.
    """

    def __init__(self, kind: str, n_layers: int, dim: int, n_labels: int, cfg: TrainConfig, layer: int | None = None):
        super().__init__()
        self.kind = kind
        self.layer_norm = cfg.layer_norm
        self.pooling = cfg.pooling if kind == "classification" else None
        initial = None if layer is None else one_hot_logits(n_layers, layer)
        self.mix = ScalarMix(
            n_layers,
            l2=cfg.l2 if layer is None else 0.0,
            dropout=cfg.dropout,
            initial=initial,
            trainable_weights=layer is None,
        )
        width = dim * (2 if self.pooling == "mean+max" else 1)
        sizes = [width, cfg.hidden, n_labels] if cfg.hidden else [width, n_labels]
        self.head = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    @torch.no_grad()
    def warm_start_from(self, single: TaskModel, layer: int, logit: float = WARM_START_LOGIT) -> TaskModel:
        """Start this mix near a trained single-layer model: its head and gamma, the mix weight of ``layer`` at
        ``logit`` above the others (trainable, so the mix can still move towards the other layers)."""
        self.head.load_state_dict(single.head.state_dict())
        self.mix.gamma.copy_(single.mix.gamma)
        self.mix.weights.copy_(torch.tensor([logit if j == layer else 0.0 for j in range(self.mix.n_layers)]))
        return self

    def forward(self, layers: Tensor, segments: Tensor, n_sentences: int) -> Tensor:
        x = self.mix(layers.unsqueeze(0))[0]  # (n, D)
        if self.kind == "classification":
            x = segment_pool(x, segments, n_sentences, self.pooling)  # (B, D) or (B, 2D)
        for index, linear in enumerate(self.head):
            x = linear(x)
            if index < len(self.head) - 1:
                x = F.relu(x)
        return x

    def head_arrays(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(lin.weight.detach().numpy().copy(), lin.bias.detach().numpy().copy()) for lin in self.head]


def pool_torch(x: Tensor, mask: Tensor, pooling: str) -> Tensor:
    """(B, T, D) + mask (B, T) -> (B, D) or (B, 2D); matches elmo.runtime.tasks.pool (empty sentence -> zeros)."""
    m = mask.to(x.dtype).unsqueeze(-1)
    count = m.sum(dim=1)
    mean = (x * m).sum(dim=1) / count.clamp_min(1.0)
    big = x.masked_fill(~mask.unsqueeze(-1), float("-inf")).max(dim=1).values
    big = torch.where(count > 0, big, torch.zeros_like(big))
    return {"mean": mean, "max": big, "mean+max": torch.cat([mean, big], dim=-1)}[pooling]


def segment_pool(x: Tensor, segments: Tensor, n_sentences: int, pooling: str) -> Tensor:
    """Flat tokens (n, D) with their sentence ids (n,) -> (B, D) or (B, 2D); matches elmo.runtime.tasks.pool."""
    dim = x.shape[1]
    count = torch.zeros(n_sentences, dtype=x.dtype).index_add_(0, segments, torch.ones_like(segments, dtype=x.dtype))
    mean = torch.zeros(n_sentences, dim, dtype=x.dtype).index_add_(0, segments, x) / count.clamp_min(1.0)[:, None]
    index = segments[:, None].expand(-1, dim)
    big = torch.full((n_sentences, dim), float("-inf"), dtype=x.dtype).scatter_reduce(0, index, x, "amax")
    big = torch.where(count[:, None] > 0, big, torch.zeros_like(big))
    return {"mean": mean, "max": big, "mean+max": torch.cat([mean, big], dim=-1)}[pooling]


def normalize_per_sentence(layers: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """elmo.runtime.tasks.normalize_layers for every sentence of a flat (L, N, D) array at once -> float32 (L, N, D)."""
    lengths = np.diff(offsets)
    segment = np.repeat(np.arange(len(lengths)), lengths)
    out = np.empty(layers.shape, dtype=np.float32)
    for j in range(layers.shape[0]):  # one layer at a time keeps the float64 temporaries small
        x = np.asarray(layers[j], dtype=np.float64)  # (N, D)
        count = lengths * x.shape[1]
        mean = np.add.reduceat(x.sum(axis=1), offsets[:-1]) / count  # (n_sentences,)
        centered = x - mean[segment][:, None]
        var = np.add.reduceat((centered**2).sum(axis=1), offsets[:-1]) / count
        out[j] = centered / np.sqrt(var + LAYER_NORM_EPS)[segment][:, None]
    return out


class FeatureData:
    """Cached features of one split in memory, as flat tokens: ``layers`` (L, N_tokens, D) (a memmap is fine),
    ``offsets`` (n_sentences + 1,), ``targets``: int per token (tagging) or per sentence (classification).
    ``layer_norm`` normalises each sentence's layers once, here (see :class:`TaskModel`)."""

    def __init__(
        self, layers: np.ndarray, offsets: np.ndarray, targets: np.ndarray, kind: str, layer_norm: bool = False
    ) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lengths = np.diff(self.offsets)
        if len(self.lengths) == 0:
            raise DataError("no sentences in this split (empty training set)")
        if (self.lengths <= 0).any():
            raise DataError(f"{int((self.lengths <= 0).sum())} sentence(s) without tokens in the features")
        values = normalize_per_sentence(layers, self.offsets) if layer_norm else np.asarray(layers, dtype=np.float32)
        self.layers = torch.from_numpy(values.astype(np.float16))  # half the memory; math is float32 per batch
        self.targets = torch.from_numpy(np.asarray(targets, dtype=np.int64))
        self.kind = kind
        self.layer_norm = layer_norm
        expected = self.offsets[-1] if kind == "tagging" else len(self.lengths)
        if len(self.targets) != expected:
            raise DataError(
                f"{len(self.targets)} targets for {expected} {'tokens' if kind == 'tagging' else 'sentences'}"
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def batch(self, indices: Sequence[int]) -> tuple[Tensor, Tensor, int, Tensor]:
        """-> layers (L, n, D) float32 of the sentences' tokens, their sentence positions in the batch (n,), the
        number of sentences B, targets (n,) for tagging or (B,) for classification."""
        indices = np.asarray(indices)
        lengths = self.lengths[indices]
        starts = self.offsets[indices]
        index = torch.from_numpy(np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)]))
        layers = self.layers.index_select(1, index).float()
        segments = torch.from_numpy(np.repeat(np.arange(len(indices)), lengths))
        targets = self.targets.index_select(0, index) if self.kind == "tagging" else self.targets[indices]
        return layers, segments, len(indices), targets

    def batches(self, batch_size: int, shuffle: bool, generator: np.random.Generator | None = None):
        order = np.arange(len(self))
        if shuffle and generator is not None:
            generator.shuffle(order)
        for start in range(0, len(order), batch_size):
            yield order[start : start + batch_size]


@torch.no_grad()
def evaluate(model: TaskModel, data: FeatureData, batch_size: int = 128) -> tuple[list[np.ndarray], float]:
    """(argmax label ids per sentence — (n_tokens,) for tagging, (1,) for classification — in input order,
    mean cross-entropy)."""
    model.eval()
    out: list[np.ndarray] = []
    total, count = 0.0, 0
    for indices in data.batches(batch_size, shuffle=False):
        layers, segments, n_sentences, targets = data.batch(indices)
        logits = model(layers, segments, n_sentences)
        total += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
        best = logits.argmax(dim=-1).numpy()
        if model.kind == "tagging":
            out.extend(np.split(best, np.cumsum(data.lengths[indices])[:-1]))
        else:
            out.extend(best[:, None])
    return out, total / max(count, 1)


def predict(model: TaskModel, data: FeatureData, batch_size: int = 128) -> list[np.ndarray]:
    """Argmax label ids per sentence: arrays (n_tokens,) for tagging, (1,) for classification; input order."""
    return evaluate(model, data, batch_size)[0]


def train_task_model(
    kind: str,
    train: FeatureData,
    dev: FeatureData,
    n_labels: int,
    cfg: TrainConfig,
    score: Callable[[list[np.ndarray]], float],
    layer: int | None = None,
    warm_start: tuple[TaskModel, int] | None = None,
) -> tuple[TaskModel, dict]:
    """Adam on the head (lr) and the mix (mix_lr); keeps the state with the best dev ``score`` (higher = better);
    stops after ``patience`` epochs without improvement. Returns (model at its best, history).

    ``warm_start`` = (a trained single-layer model, its layer): the mix starts there (:meth:`TaskModel.warm_start_from`)
    and its untrained state is epoch 0, so the kept mix scores on dev at least what its starting point does."""
    cfg.validate()
    if train.layer_norm != cfg.layer_norm or dev.layer_norm != cfg.layer_norm:
        raise ConfigError("the features' layer_norm must match the training config's (FeatureData(layer_norm=...))")
    torch.manual_seed(cfg.seed)
    generator = np.random.default_rng(cfg.seed)
    n_layers, dim = train.layers.shape[0], train.layers.shape[2]
    model = TaskModel(kind, n_layers, dim, n_labels, cfg, layer)
    if warm_start is not None:
        model.warm_start_from(*warm_start)
    mix_params = [p for p in model.mix.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(
        [
            {"params": list(model.head.parameters()), "lr": cfg.lr, "weight_decay": cfg.weight_decay},
            {"params": mix_params, "lr": cfg.mix_lr},
        ]
    )
    best_score, best_state, best_epoch, history = -math.inf, None, 0, []
    best_loss_at_best, lowest_loss, lowest_epoch = math.inf, math.inf, 0
    if warm_start is not None:
        predicted, best_loss_at_best = evaluate(model, dev)
        best_score, lowest_loss = score(predicted), best_loss_at_best
        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for epoch in range(1, cfg.epochs + 1):
        started = time.perf_counter()
        model.train()
        total, steps = 0.0, 0
        for indices in train.batches(cfg.batch_size, shuffle=True, generator=generator):
            layers, segments, n_sentences, targets = train.batch(indices)
            loss = F.cross_entropy(model(layers, segments, n_sentences), targets)
            loss = loss + model.mix.penalty()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            steps += 1
        predicted, dev_loss = evaluate(model, dev)
        dev_score = score(predicted)
        history.append(
            {
                "epoch": epoch,
                "loss": total / max(steps, 1),
                "dev_loss": dev_loss,
                "dev": dev_score,
                "weights": model.mix.normalized_weights(),
                "gamma": model.mix.gamma.item(),
                "seconds": round(time.perf_counter() - started, 2),
            }
        )
        log.info(
            "%s epoch %d: loss %.4f dev loss %.4f score %.4f weights %s gamma %.2f (%.1fs)",
            "mix" if layer is None else f"layer {layer}",
            epoch,
            history[-1]["loss"],
            dev_loss,
            dev_score,
            "/".join(f"{w:.2f}" for w in history[-1]["weights"]),
            history[-1]["gamma"],
            history[-1]["seconds"],
        )
        # Keep the best dev score (ties: lower dev loss). Stop once neither the score nor the loss has improved for
        # `patience` epochs: an entity F1 can sit at 0 for a while as the head leaves the all-"O" solution.
        if dev_score > best_score or (dev_score == best_score and dev_loss < best_loss_at_best):
            best_score, best_epoch, best_loss_at_best = dev_score, epoch, dev_loss
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if dev_loss < lowest_loss:
            lowest_loss, lowest_epoch = dev_loss, epoch
        if epoch - max(best_epoch, lowest_epoch) >= cfg.patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    return model, {"best_epoch": best_epoch, "best_dev": best_score, "epochs": history, "config": asdict(cfg)}


def to_task(
    trained: TaskModel, name: str, labels: list[str], **extra
) -> tuple[Task, list[tuple[np.ndarray, np.ndarray]]]:
    """A trained TaskModel -> the numpy :class:`elmo.runtime.tasks.Task` and its head arrays (for ``save_task``)."""
    mix = trained.mix
    task = Task(
        name=name,
        kind=trained.kind,
        n_layers=mix.n_layers,
        dim=trained.head[0].in_features // (2 if trained.pooling == "mean+max" else 1),
        weights=[float(v) for v in mix.weights.detach()],
        gamma=float(mix.gamma.detach()),
        layer_norm=trained.layer_norm,
        labels=list(labels),
        pooling=trained.pooling,
        **extra,
    )
    return task, trained.head_arrays()
