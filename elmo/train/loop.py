"""``elmo train --config FILE --out DIR [--resume]``: train the biLM language model.

The forward and backward LMs share the char-CNN token encoder and the softmax (as in the paper); the loss is
the mean of the two directions' losses. Sampled softmax (log-uniform negatives, TF-style expected-count
correction, accidental hits removed) when ``n_negatives`` is set and smaller than the vocabulary; full softmax
otherwise and always for validation. Sentences are batched by a token budget (stateless, one sentence per row,
the model adds ``<S>``/``</S>`` itself).

``DIR`` is a model directory (config.json, model.safetensors, vocab.txt) plus the training state:
``optimizer.safetensors``, ``train_state.json`` (step, elapsed time, history), ``train_config.json`` and
``curve.png``. ``--resume`` continues exactly: the batch order is a function of (seed, epoch) and the random
state (dropout, negatives) is re-derived from (seed, step, rank) at every step, so an interrupted and resumed
run takes the same steps as an uninterrupted one.

Data parallel: started with ``torchrun --nproc_per_node N -m elmo.cli train ...`` the ranks are detected from
``RANK``/``WORLD_SIZE`` (gloo on CPU, nccl on GPU); each rank takes every N-th batch of the epoch order.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from elmo.errors import ConfigError, DataError
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_state, load_vocab, save_model, save_state
from elmo.model.config import ModelConfig, read_json_config
from elmo.text.chars import BYTES, load_char_scheme
from elmo.train.config import OptimConfig, TrainConfig, load_train_config, read_train_sentences
from elmo.train.evaluate import score_sentences, sense_scores
from elmo.train.objective import (
    LMObjective,
    NegativeSampler,
    calibrate_softmax_bias,
    init_bias_from_unigram,
    target_frequencies,
    use_distinct_token_encoder,
)
from elmo.train.stopping import StopRequest
from elmo.train.vocab import IGNORE, Vocab, evenly_spaced, length_batches, lm_arrays, read_sentences, slice_by_tokens

log = logging.getLogger(__name__)


OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "train_state.json"
TRAIN_CONFIG_FILE = "train_config.json"
CURVE_FILE = "curve.png"
_warned_no_plot = False  # plot_curve warns once per process when matplotlib is missing


# -- distributed -----------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def setup_distributed() -> Dist:
    """nanoGPT-style: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        return Dist(device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return Dist(rank, world, device)


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    if not d.active:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return t.tolist()


# -- data ------------------------------------------------------------------------------------------------------
class Batches:
    """Fixed length-bucketed batches; the epoch order is a permutation seeded by (seed, epoch); rank r takes
    every world-th batch so all ranks run the same number of steps."""

    def __init__(self, sentences: list[list[str]], tokens_per_batch: int, seed: int, d: Dist) -> None:
        self.sentences = sentences
        self.batches = length_batches([len(s) for s in sentences], tokens_per_batch)
        self.seed, self.d = seed, d
        self.per_rank = len(self.batches) // d.world
        if self.per_rank == 0:
            raise DataError(f"only {len(self.batches)} batches for {d.world} processes: more data needed")

    def for_step(self, step: int) -> list[list[str]]:
        epoch, index = divmod(step, self.per_rank)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.batches))
        batch = self.batches[order[index * self.d.world + self.d.rank]]
        return [self.sentences[i] for i in batch]


# -- optimizer state -------------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, t: OptimConfig) -> torch.optim.Optimizer:
    if t.optimizer == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=t.lr, initial_accumulator_value=1.0)
    return torch.optim.Adam(model.parameters(), lr=t.lr)


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


def lr_at(step: int, t: OptimConfig, elapsed_s: float = 0.0) -> float:
    """Linear warm-up, then constant or cosine decay. With ``anneal_by_time`` the decay also follows the share of
    the time budget used, so a run cut by its wall-clock budget still ends annealed (that run is not
    bit-reproducible, since wall time varies; step-budget runs are)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps))
    if t.anneal_by_time and t.max_time_s > 0:
        progress = max(progress, min(1.0, elapsed_s / t.max_time_s))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# -- checkpoints -------------------------------------------------------------------------------------------------
def write_checkpoint(out: Path, bilm: BiLM, vocab: list[str], optimizer, state: dict, cfg: TrainConfig) -> None:
    names = [n for n, _ in bilm.named_parameters()]
    save_model(bilm, out, vocab, fp16=cfg.train.fp16_weights)
    save_state(optimizer_tensors(optimizer, names), out / (OPTIMIZER_FILE + ".tmp"))
    os.replace(out / (OPTIMIZER_FILE + ".tmp"), out / OPTIMIZER_FILE)
    (out / TRAIN_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (out / (STATE_FILE + ".tmp")).write_text(json.dumps(state) + "\n")
    os.replace(out / (STATE_FILE + ".tmp"), out / STATE_FILE)
    plot_curve(state["history"], out / CURVE_FILE)


def plot_stages(run_dirs: list[Path], path: Path) -> None:
    """One curve for a staged recipe: each run's history shifted by the tokens of the runs before it."""
    history: list[dict] = []
    boundaries: list[float] = []
    offset = 0
    for run_dir in run_dirs:
        state = read_train_state(Path(run_dir))
        history += [{**h, "tokens": h["tokens"] + offset} for h in state["history"]]
        offset += state["tokens"]
        boundaries.append(offset / 1e6)
    plot_curve(history, path, stage_ends=boundaries[:-1])


def plot_curve(history: list[dict], path: Path, stage_ends: list[float] = ()) -> None:
    """Training (sampled) and validation (full softmax) perplexity against tokens seen; ``stage_ends`` (millions
    of tokens) draws where one stage of a staged recipe handed over to the next. Without matplotlib (a borrowed
    training machine) there is no plot: one warning, and training goes on."""
    global _warned_no_plot
    try:
        import matplotlib
    except ImportError:
        if not _warned_no_plot:
            log.warning("matplotlib is not installed: no %s (training goes on)", path.name)
            _warned_no_plot = True
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "loss" in h]
    valid = [h for h in history if "valid_avg_ppl" in h]
    senses = [h for h in valid if "sense_en_best" in h]
    fig, axes = plt.subplots(1, 2 if senses else 1, figsize=(12 if senses else 7, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot([h["tokens"] / 1e6 for h in train], [math.exp(min(h["loss"], 30)) for h in train],
                label="train ppl (sampled softmax)" if train[0].get("sampled") else "train ppl", alpha=0.6)  # fmt: skip
    curves = (("valid_forward_ppl", "valid fwd"), ("valid_backward_ppl", "valid bwd"), ("valid_avg_ppl", "valid avg"))
    for key, label in curves:
        if valid:
            ax.plot([h["tokens"] / 1e6 for h in valid], [h[key] for h in valid], marker="o", ms=3, label=label)
    for end in stage_ends:
        ax.axvline(end, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("perplexity")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run stopped before its first log line has no curve yet
        ax.legend()
    if senses:
        _plot_senses(axes[0][1], senses, stage_ends)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".tmp.png"), dpi=90)
    plt.close(fig)
    os.replace(path.with_suffix(".tmp.png"), path)


def _plot_senses(ax, history: list[dict], stage_ends: list[float]) -> None:
    """Word-sense benchmark accuracy (elmo.senses) of the best layer per language against tokens seen."""
    for language in ("en", "zh"):
        ax.plot([h["tokens"] / 1e6 for h in history], [h[f"sense_{language}_best"] for h in history], marker="o",
                ms=3, label=f"{language}: best layer")  # fmt: skip
    for end in stage_ends:
        ax.axvline(end, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("same-sense nearest neighbour")
    ax.set_title("word-sense benchmark", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()


# -- the loop ----------------------------------------------------------------------------------------------------
def seed_step(seed: int, step: int, rank: int) -> None:
    """Dropout masks and negatives depend only on (seed, step, rank): resume is exact without saved RNG state."""
    torch.manual_seed((seed * 1_000_003 + step * 7_919 + rank) % (2**63))


def validate(bilm: BiLM, vocab: Vocab, valid: list[list[str]], d: Dist) -> dict:
    shard = valid[d.rank :: d.world]
    score = score_sentences(bilm, vocab, shard)
    fwd, bwd, n = all_reduce_sum([score.forward_nll, score.backward_nll, float(score.tokens)], d)
    return {
        "valid_forward_ppl": round(math.exp(fwd / n), 3),
        "valid_backward_ppl": round(math.exp(bwd / n), 3),
        "valid_avg_ppl": round(math.exp((fwd + bwd) / (2 * n)), 3),
        "valid_tokens": int(n),
    }


def train(cfg: TrainConfig, out: Path, resume: bool, stop_after: int | None = None, d: Dist | None = None,
          stop: StopRequest | None = None) -> dict:  # fmt: skip
    """Run (or continue) training; returns the final train state. ``stop_after`` ends the process after that
    global step (for tests and for splitting a run) without changing the schedule. Ctrl-C / SIGTERM (``stop``, or
    one of its own) end it after the step in progress with a checkpoint; the state returned then says
    ``stopped_by`` (the signal's name)."""
    if stop is not None:
        return _train(cfg, out, resume, stop_after, d or Dist(), stop)
    with StopRequest("elmo train") as own:
        return _train(cfg, out, resume, stop_after, d or Dist(), own)


def _train(cfg: TrainConfig, out: Path, resume: bool, stop_after: int | None, d: Dist, stop: StopRequest) -> dict:
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    vocab_tokens = load_vocab(cfg.data.vocab)
    # a later stage or an adaptation reads tokens as the model it starts from does (its char vocabulary, if any)
    char_scheme = load_char_scheme(t.init_from) if t.init_from else BYTES
    vocab = Vocab(vocab_tokens, char_scheme)
    model_cfg = ModelConfig.from_dict({**cfg.model.to_dict(), "vocab_size": len(vocab_tokens)}, source="model")
    cfg.model = model_cfg
    train_sentences = read_train_sentences(cfg.data)
    train_sentences = evenly_spaced(train_sentences, cfg.data.train_sentences)
    valid_sentences = slice_by_tokens(read_sentences(Path(cfg.data.valid)), cfg.data.valid_tokens)
    batches = Batches(train_sentences, t.tokens_per_batch, t.seed, d)

    torch.manual_seed(t.seed)
    bilm = BiLM(model_cfg).to(d.device)
    use_distinct_token_encoder(bilm)
    if t.softmax_only:
        freeze_all_but_softmax(bilm)
    objective: nn.Module = LMObjective(bilm)
    optimizer = make_optimizer(bilm, t)
    names = [n for n, _ in bilm.named_parameters()]
    state = {"step": 0, "tokens": 0, "elapsed_s": 0.0, "history": [], "seed": t.seed, "world_size": d.world}
    freqs = target_frequencies(train_sentences, vocab)
    if resume:
        state = _restore(out, bilm, optimizer, names)
        if d.main:
            print(resume_line(out, state, t), file=sys.stderr, flush=True)
    elif t.init_from:
        state["init_from"] = _init_from(Path(t.init_from), bilm, vocab_tokens)
    elif t.init_bias_unigram:
        init_bias_from_unigram(bilm, freqs)
    if d.active:
        objective = nn.parallel.DistributedDataParallel(objective)
    sampled = 0 < t.n_negatives < len(vocab_tokens)
    sampler = NegativeSampler(len(vocab_tokens), t.n_negatives, d.device) if sampled else None
    if sampler is not None:
        (objective.module if d.active else objective).log_q = sampler.log_q
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        for name in char_scheme.files:  # the model directory carries its char vocabulary
            shutil.copyfile(Path(t.init_from) / name, out / name)
        log.info(
            "model %.2f M parameters (+%.2f M softmax), vocab %d, %d train sentences in %d batches/rank/epoch, "
            "world %d, %s softmax",
            bilm.num_parameters() / 1e6, (bilm.num_parameters(True) - bilm.num_parameters()) / 1e6,
            len(vocab_tokens), len(train_sentences), batches.per_rank, d.world,
            f"sampled ({t.n_negatives})" if sampled else "full",
        )  # fmt: skip

    last_step = min(t.max_steps, stop_after) if stop_after is not None else t.max_steps
    progress = _progress_bar(d, state["step"], last_step)
    window_loss, window_tokens, window_start = 0.0, 0, time.time()
    run_start, elapsed_before = time.time(), state["elapsed_s"]  # wall time, validation and checkpoints included
    first_step, stopping = state["step"], False
    bilm.train()
    while state["step"] < last_step and not _out_of_time(state, t, d):
        step = state["step"]
        seed_step(t.seed, step, d.rank)
        lr = lr_at(step, t, state["elapsed_s"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        char_ids, targets = (torch.from_numpy(a).to(d.device) for a in lm_arrays(batches.for_step(step), vocab))
        negatives, neg_log_q = sampler.sample() if sampler else (None, None)
        fwd_loss, bwd_loss = objective(char_ids, targets, negatives, neg_log_q)
        loss = (fwd_loss + bwd_loss) / 2
        fwd_share, bwd_share = _target_shares(LMObjective.target_counts(char_ids, targets), d)
        optimizer.zero_grad(set_to_none=True)
        ((fwd_loss * fwd_share + bwd_loss * bwd_share) / 2).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(bilm.parameters(), t.clip))
        optimizer.step()

        n_tokens = int((targets[:, 1:] != IGNORE).sum())
        # the stop request travels with the step's sums, so that every rank stops after the same step
        loss_value, step_tokens, stops = all_reduce_sum([loss.item() * n_tokens, float(n_tokens),
                                                         float(stop.requested)], d)  # fmt: skip
        stopping = stops > 0
        state["step"] = step + 1
        state["tokens"] += int(step_tokens)
        state["elapsed_s"] = _shared_elapsed(elapsed_before + time.time() - run_start, t, d)
        window_loss += loss_value
        window_tokens += int(step_tokens)
        if state["step"] % t.log_every == 0 or state["step"] == last_step:
            now = time.time()
            entry = {
                "step": state["step"],
                "tokens": state["tokens"],
                "loss": round(window_loss / max(window_tokens, 1), 5),
                "sampled": sampled,
                "lr": round(lr, 7),
                "grad_norm": round(grad_norm, 4),
                "tokens_per_s": round(window_tokens / max(now - window_start, 1e-9), 1),
                "elapsed_s": round(state["elapsed_s"], 1),
            }
            state["history"].append(entry)
            if progress is not None:
                progress.set_postfix(
                    loss=f"{entry['loss']:.3f}", ppl=f"{math.exp(min(entry['loss'], 30)):.1f}",
                    tok_s=f"{entry['tokens_per_s']:.0f}", refresh=False,
                )  # fmt: skip
            window_loss, window_tokens, window_start = 0.0, 0, now
        if progress is not None:
            _set_total(progress, expected_last_step(state, t, last_step, state["step"] - first_step,
                                                    time.time() - run_start))  # fmt: skip
            progress.update(1)
        out_of_time = _out_of_time(state, t, d)
        finished = state["step"] >= last_step or out_of_time or stopping
        if state["step"] % t.valid_every == 0 or (finished and state["step"] >= t.max_steps) or out_of_time:
            scores = {"step": state["step"], "tokens": state["tokens"], **validate(bilm, vocab, valid_sentences, d)}
            if cfg.data.sense_benchmark and d.main:
                scores.update(sense_scores(bilm, char_scheme))
            state["history"].append(scores)
            if d.main:
                log.info("step %d valid %s", state["step"], json.dumps(scores))
        if d.main and (state["step"] % t.checkpoint_every == 0 or finished):
            write_checkpoint(out, bilm, vocab_tokens, optimizer, state, cfg)
        if out_of_time:
            if d.main:
                log.info("time budget of %.0f s reached at step %d", t.max_time_s, state["step"])
            break
        if stopping:
            break
    if progress is not None:
        progress.close()
    if stopping:  # not written into train_state.json: a resumed run is not a stopped one
        return {**state, "stopped_by": stop.name or "a signal on another rank"}
    done = state["step"] >= t.max_steps or _out_of_time(state, t, d)
    if done and t.calibrate_bias_tokens > 0 and not state.get("bias_calibrated"):
        before = validate(bilm, vocab, valid_sentences, d)
        trained_bias = bilm.softmax.bias.detach().clone()
        info = calibrate_softmax_bias(bilm, vocab, train_sentences, freqs, t.calibrate_bias_tokens)
        after = validate(bilm, vocab, valid_sentences, d)
        kept = after["valid_avg_ppl"] <= before["valid_avg_ppl"]
        if not kept:  # a refit on a small train sample can lose on valid: keep the trained bias then
            with torch.no_grad():
                bilm.softmax.bias.copy_(trained_bias)
        state["bias_calibrated"] = {**info, "kept": kept, "valid_before": before, "valid_after": after}
        final = after if kept else before
        state["history"].append(
            {"step": state["step"], "tokens": state["tokens"], "after": "bias calibration", **final}
        )
        if d.main:
            log.info(
                "softmax bias calibration: valid avg ppl %.1f -> %.1f (%s)", before["valid_avg_ppl"],
                after["valid_avg_ppl"], "kept" if kept else "worse on valid: trained bias kept",
            )  # fmt: skip
            write_checkpoint(out, bilm, vocab_tokens, optimizer, state, cfg)
    if d.active:
        dist.barrier()
    return state


def freeze_all_but_softmax(bilm: BiLM) -> None:
    """The biLM's weights stop learning; the backward pass then ends at the softmax, so a step costs about one
    forward pass of the biLM."""
    if bilm.softmax is None:
        raise ConfigError("train.softmax_only needs a model with a softmax (vocab_size > 0)")
    for name, parameter in bilm.named_parameters():
        parameter.requires_grad_(name.startswith("softmax."))


def _target_shares(counts: tuple[int, int], d: Dist) -> tuple[float, float]:
    """Per direction, this rank's targets x world / all ranks' targets. DDP averages the ranks' gradients and each
    rank's loss is a mean over its own targets, so without these weights a target on a rank with fewer of them
    would count for more; with them a step equals one process on the same global batch. 1.0 on one process."""
    if not d.active:
        return 1.0, 1.0
    totals = all_reduce_sum([float(c) for c in counts], d)
    return tuple(c * d.world / max(total, 1.0) for c, total in zip(counts, totals))


def _shared_elapsed(elapsed: float, t: OptimConfig, d: Dist) -> float:
    """Rank 0's clock, so that every rank anneals and stops at the same step."""
    if t.max_time_s <= 0 or not d.active:
        return elapsed
    return all_reduce_sum([elapsed if d.main else 0.0], d)[0]


def _out_of_time(state: dict, t: OptimConfig, d: Dist) -> bool:
    return t.max_time_s > 0 and state["elapsed_s"] >= t.max_time_s


def _progress_bar(d: Dist, initial: int, total: int):
    if not d.main:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", mininterval=5, dynamic_ncols=True)


def expected_last_step(state: dict, t: OptimConfig, last_step: int, run_steps: int, run_s: float) -> int:
    """The step this run will end at: ``last_step``, or sooner when the time budget runs out first at the pace of
    the ``run_steps`` steps this process took in ``run_s`` seconds. The bar's total, so that its ETA is the time
    budget's and not the step cap's (default.json: 6,000 steps, but 4,800 s)."""
    if t.max_time_s <= 0 or run_steps <= 0 or run_s <= 0:
        return last_step
    left_s = max(0.0, t.max_time_s - state["elapsed_s"])
    return min(last_step, state["step"] + math.ceil(left_s * run_steps / run_s))


def _set_total(progress, total: int) -> None:
    if progress.total != total:
        progress.total = total
        progress.refresh()


def _load_weights(path: Path, bilm: BiLM) -> None:
    try:
        bilm.load_state_dict({k: v.float() for k, v in load_state(path).items()})
    except RuntimeError as exc:
        raise ConfigError(f"{path}: does not match the config ({str(exc).splitlines()[0]})") from None


def _init_from(model_dir: Path, bilm: BiLM, vocab_tokens: list[str]) -> dict:
    """Start from another run's weights (a later stage of a staged recipe); returns what the state records."""
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise DataError(f"{weights}: init_from needs a model directory with model.safetensors")
    if load_vocab(model_dir) != vocab_tokens:
        raise ConfigError(f"{model_dir}: init_from model has another vocabulary than data.vocab")
    _load_weights(weights, bilm)
    prior = read_train_state(model_dir) if (model_dir / STATE_FILE).is_file() else {}
    log.info("starting from the weights of %s (%s tokens seen there)", model_dir, prior.get("tokens", "?"))
    return {"dir": str(model_dir), "steps": prior.get("step"), "tokens": prior.get("tokens"),
            "elapsed_s": prior.get("elapsed_s")}  # fmt: skip


def read_train_state(run_dir: Path) -> dict:
    """A run folder's train_state.json; missing or bad JSON is a DataError naming the file."""
    return read_json_config(run_dir / STATE_FILE, "train state", DataError)


def _restore(out: Path, bilm: BiLM, optimizer, names: list[str]) -> dict:
    state_file = out / STATE_FILE
    if not state_file.is_file():
        raise DataError(f"{state_file}: nothing to resume (no train state in {out})")
    _load_weights(out / "model.safetensors", bilm)
    load_optimizer_tensors(optimizer, names, load_state(out / OPTIMIZER_FILE))
    return read_train_state(out)


def resume_line(out: Path, state: dict, t: OptimConfig) -> str:
    """What a resumed run says first: where it continues and what is left of the step cap and the time budget."""
    line = f"resuming {out} from step {state['step']} of {t.max_steps} ({state['tokens']:,} tokens seen"
    if t.max_time_s > 0:
        left = max(0.0, t.max_time_s - state["elapsed_s"])
        line += f"; {state['elapsed_s']:.0f} s of the {t.max_time_s:.0f} s time budget used, {left:.0f} s left"
    return line + ")"


# -- CLI ---------------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="training config JSON (sections model, data, train)")
    parser.add_argument("--out", required=True, help="output directory (a model directory + training state)")
    parser.add_argument("--resume", action="store_true", help="continue from the state in --out exactly")
    parser.add_argument("--stop-after", type=int, default=None, help="end after this global step (same schedule)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (overrides config)")


def run(args: argparse.Namespace) -> int:
    cfg = load_train_config(args.config)
    if args.threads is not None:
        cfg.train.threads = args.threads
    d = setup_distributed()
    with StopRequest("elmo train") as stop:
        try:
            state = train(cfg, Path(args.out), args.resume, args.stop_after, d, stop)
        finally:
            if d.active:
                dist.destroy_process_group()
    if d.main:
        last_valid = next((h for h in reversed(state["history"]) if "valid_avg_ppl" in h), {})
        print(json.dumps({"out": args.out, "step": state["step"], "tokens": state["tokens"],
                          "elapsed_s": round(state["elapsed_s"], 1), **last_valid}))  # fmt: skip
    if "stopped_by" not in state:
        return 0
    if d.main:
        print(f"elmo train: stopped by {state['stopped_by']} at step {state['step']} of {cfg.train.max_steps}; "
              f"checkpoint in {args.out}; resume with: elmo train --config {args.config} --out {args.out} --resume",
              file=sys.stderr)  # fmt: skip
    return stop.exit_code
