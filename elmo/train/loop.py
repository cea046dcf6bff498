"""``elmo train --config FILE --out DIR [--resume]``: train the biLM language model.

The forward and backward LMs share the char-CNN token encoder and the softmax (as in the paper); the loss is
the mean of the two directions' losses. Sampled softmax (log-uniform negatives, TF-style expected-count
correction, accidental hits removed) when ``n_negatives`` is set and smaller than the vocabulary; full softmax
otherwise and always for validation. Sentences are batched by a token budget (stateless, one sentence per row,
the model adds ``<S>``/``</S>`` itself).

``DIR`` is a model directory (config.json, model.safetensors, vocab.txt) plus the training state:
``optimizer.safetensors``, ``train_state.json`` (step, elapsed time, history), ``train_config.json`` and
``curve.png`` (elmo.train.rundir; what the run reports as it goes is elmo.train.report, its curves
elmo.train.plots). ``--resume`` continues exactly: the batch order is a function of (seed, epoch) and the random
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
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from elmo.errors import ConfigError, DataError
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_vocab
from elmo.model.config import ModelConfig
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
from elmo.train.plots import plot_curve, plot_stages  # noqa: F401  (plot_stages re-exported: the loop's public names)
from elmo.train.report import TrainingReport, expected_last_step, resume_line  # noqa: F401  (re-exported)
from elmo.train.rundir import (  # noqa: F401  (re-exported: the run folder's names)
    CURVE_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    TRAIN_CONFIG_FILE,
    init_from,
    load_optimizer_tensors,
    optimizer_tensors,
    read_train_state,
    restore,
    write_checkpoint,
)
from elmo.train.stopping import StopRequest
from elmo.train.vocab import IGNORE, Vocab, evenly_spaced, length_batches, lm_arrays, read_sentences, slice_by_tokens

log = logging.getLogger(__name__)


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
# -- the loop ----------------------------------------------------------------------------------------------------
def seed_step(seed: int, step: int, rank: int) -> None:
    """Dropout masks and negatives depend only on (seed, step, rank): resume is exact without saved RNG state."""
    torch.manual_seed((seed * 1_000_003 + step * 7_919 + rank) % (2**63))


VALID_KEYS = ("valid_forward_ppl", "valid_backward_ppl", "valid_avg_ppl", "valid_tokens")  # what validate returns


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


def train(
    cfg: TrainConfig,
    out: Path,
    resume: bool,
    stop_after: int | None = None,
    d: Dist | None = None,
    stop: StopRequest | None = None,
) -> dict:
    """Run (or continue) training; returns the final train state. ``stop_after`` ends the process after that
    global step (for tests and for splitting a run) without changing the schedule. Ctrl-C / SIGTERM (``stop``, or
    one of its own) end it after the step in progress with a checkpoint; the state returned then says
    ``stopped_by`` (the signal's name)."""
    if stop is not None:
        return _train(cfg, out, resume, stop_after, d or Dist(), stop)
    with StopRequest("elmo train") as own:
        return _train(cfg, out, resume, stop_after, d or Dist(), own)


@dataclass
class _Run:
    """What one training run works with (:func:`_set_up`)."""

    cfg: TrainConfig
    out: Path
    d: Dist
    vocab_tokens: list[str]
    vocab: Vocab
    char_scheme: object
    train_sentences: list[list[str]]
    valid_sentences: list[list[str]]
    batches: Batches
    bilm: BiLM
    objective: nn.Module
    optimizer: torch.optim.Optimizer
    sampler: NegativeSampler | None
    freqs: object
    state: dict


class _Step(NamedTuple):
    lr: float
    grad_norm: float
    loss_sum: float  # all ranks' summed loss over their target tokens
    tokens: int  # all ranks' target tokens
    stop: bool  # a rank was asked to stop


def _train(cfg: TrainConfig, out: Path, resume: bool, stop_after: int | None, d: Dist, stop: StopRequest) -> dict:
    t = cfg.train
    run = _set_up(cfg, out, resume, d)
    last_step = min(t.max_steps, stop_after) if stop_after is not None else t.max_steps
    report = TrainingReport(run.state, t, last_step, d.main, run.sampler is not None)
    try:
        stopped = _steps(run, report, last_step, stop)
    finally:
        report.close()
    if stopped:  # not written into train_state.json: a resumed run is not a stopped one
        return {**run.state, "stopped_by": stop.name or "a signal on another rank"}
    done = run.state["step"] >= t.max_steps or _out_of_time(run.state, t, d)
    if done and t.calibrate_bias_tokens > 0 and not run.state.get("bias_calibrated"):
        _calibrate_bias(run)
    if d.active:
        dist.barrier()
    return run.state


def _set_up(cfg: TrainConfig, out: Path, resume: bool, d: Dist) -> _Run:
    """The data, the model, its optimizer and objective, and the state: fresh, resumed or from another run."""
    t = cfg.train
    if t.threads:
        torch.set_num_threads(t.threads)
    vocab_tokens = load_vocab(cfg.data.vocab)
    # a later stage or an adaptation reads tokens as the model it starts from does (its char vocabulary, if any)
    char_scheme = load_char_scheme(t.init_from) if t.init_from else BYTES
    vocab = Vocab(vocab_tokens, char_scheme)
    model_cfg = ModelConfig.from_dict({**cfg.model.to_dict(), "vocab_size": len(vocab_tokens)}, source="model")
    cfg.model = model_cfg
    train_sentences = evenly_spaced(read_train_sentences(cfg.data), cfg.data.train_sentences)
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
        state = restore(out, bilm, optimizer, names)
        if d.main:
            print(resume_line(out, state, t), file=sys.stderr, flush=True)
    elif t.init_from:
        state["init_from"] = init_from(Path(t.init_from), bilm, vocab_tokens)
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
            bilm.num_parameters() / 1e6,
            (bilm.num_parameters(True) - bilm.num_parameters()) / 1e6,
            len(vocab_tokens),
            len(train_sentences),
            batches.per_rank,
            d.world,
            f"sampled ({t.n_negatives})" if sampled else "full",
        )
    return _Run(
        cfg,
        out,
        d,
        vocab_tokens,
        vocab,
        char_scheme,
        train_sentences,
        valid_sentences,
        batches,
        bilm,
        objective,
        optimizer,
        sampler,
        freqs,
        state,
    )


def _steps(run: _Run, report: TrainingReport, last_step: int, stop: StopRequest) -> bool:
    """Step until ``last_step``, the time budget or a stop request (True: stopped by one), validating and writing
    checkpoints on their schedules."""
    t, d, state = run.cfg.train, run.d, run.state
    elapsed_before = state["elapsed_s"]  # wall time, validation and checkpoints included
    run.bilm.train()
    while state["step"] < last_step and not _out_of_time(state, t, d):
        step = _step(run, stop)
        state["elapsed_s"] = _shared_elapsed(elapsed_before + time.time() - report.run_start, t, d)
        report.step_done(step.loss_sum, step.tokens, step.lr, step.grad_norm)
        out_of_time = _out_of_time(state, t, d)
        finished = state["step"] >= last_step or out_of_time or step.stop
        if state["step"] % t.valid_every == 0 or (finished and state["step"] >= t.max_steps) or out_of_time:
            report.validated(_scores(run))
        if d.main and (state["step"] % t.checkpoint_every == 0 or finished):
            _checkpoint(run)
        if out_of_time:
            if d.main:
                log.info("time budget of %.0f s reached at step %d", t.max_time_s, state["step"])
            return False
        if step.stop:
            return True
    return False


def _step(run: _Run, stop: StopRequest) -> _Step:
    """One optimizer step on this rank's batch; the loss, tokens and stop request summed over the ranks."""
    t, d, state = run.cfg.train, run.d, run.state
    step = state["step"]
    seed_step(t.seed, step, d.rank)
    lr = lr_at(step, t, state["elapsed_s"])
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    char_ids, targets = (torch.from_numpy(a).to(d.device) for a in lm_arrays(run.batches.for_step(step), run.vocab))
    negatives, neg_log_q = run.sampler.sample() if run.sampler else (None, None)
    fwd_loss, bwd_loss = run.objective(char_ids, targets, negatives, neg_log_q)
    loss = (fwd_loss + bwd_loss) / 2
    fwd_share, bwd_share = _target_shares(LMObjective.target_counts(char_ids, targets), d)
    run.optimizer.zero_grad(set_to_none=True)
    ((fwd_loss * fwd_share + bwd_loss * bwd_share) / 2).backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.bilm.parameters(), t.clip))
    run.optimizer.step()

    n_tokens = int((targets[:, 1:] != IGNORE).sum())
    # the stop request travels with the step's sums, so that every rank stops after the same step
    loss_sum, step_tokens, stops = all_reduce_sum([loss.item() * n_tokens, float(n_tokens), float(stop.requested)], d)
    state["step"] = step + 1
    state["tokens"] += int(step_tokens)
    return _Step(lr, grad_norm, loss_sum, int(step_tokens), stops > 0)


def _checkpoint(run: _Run) -> None:
    """The run folder as it stands (elmo.train.rundir), and its curve."""
    write_checkpoint(run.out, run.bilm, run.vocab_tokens, run.optimizer, run.state, run.cfg)
    plot_curve(run.state["history"], run.out / CURVE_FILE)


def _scores(run: _Run) -> dict:
    """Validation perplexity (all ranks), and the word-sense benchmark where the config asks for it (rank 0)."""
    state = run.state
    scores = {
        "step": state["step"],
        "tokens": state["tokens"],
        **validate(run.bilm, run.vocab, run.valid_sentences, run.d),
    }
    if run.cfg.data.sense_benchmark and run.d.main:
        scores.update(sense_scores(run.bilm, run.char_scheme))
    return scores


def _calibrate_bias(run: _Run) -> None:
    """Refit the softmax bias to the train sample's unigram counts; kept only where valid does not get worse."""
    t, d, state, bilm = run.cfg.train, run.d, run.state, run.bilm
    before = _final_step_scores(state) or validate(bilm, run.vocab, run.valid_sentences, d)
    trained_bias = bilm.softmax.bias.detach().clone()
    info = calibrate_softmax_bias(bilm, run.vocab, run.train_sentences, run.freqs, t.calibrate_bias_tokens)
    after = validate(bilm, run.vocab, run.valid_sentences, d)
    kept = after["valid_avg_ppl"] <= before["valid_avg_ppl"]
    if not kept:  # a refit on a small train sample can lose on valid: keep the trained bias then
        with torch.no_grad():
            bilm.softmax.bias.copy_(trained_bias)
    state["bias_calibrated"] = {**info, "kept": kept, "valid_before": before, "valid_after": after}
    final = after if kept else before
    state["history"].append({"step": state["step"], "tokens": state["tokens"], "after": "bias calibration", **final})
    if d.main:
        log.info(
            "softmax bias calibration: valid avg ppl %.1f -> %.1f (%s)",
            before["valid_avg_ppl"],
            after["valid_avg_ppl"],
            "kept" if kept else "worse on valid: trained bias kept",
        )
        _checkpoint(run)


def _final_step_scores(state: dict) -> dict | None:
    """The validation scores of the step the run ended on: the loop always validates its last step, and nothing has
    changed the weights since, so they are the calibration's "before" (one validation pass fewer)."""
    last = next((h for h in reversed(state["history"]) if "valid_avg_ppl" in h), None)
    if last is None or last["step"] != state["step"] or "after" in last or not set(VALID_KEYS) <= last.keys():
        return None  # an entry lacking one of them (a run folder of another version): validated again
    return {key: last[key] for key in VALID_KEYS}


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
        print(
            json.dumps(
                {
                    "out": args.out,
                    "step": state["step"],
                    "tokens": state["tokens"],
                    "elapsed_s": round(state["elapsed_s"], 1),
                    **last_valid,
                }
            )
        )
    if "stopped_by" not in state:
        return 0
    if d.main:
        print(
            f"elmo train: stopped by {state['stopped_by']} at step {state['step']} of {cfg.train.max_steps}; "
            f"checkpoint in {args.out}; resume with: elmo train --config {args.config} --out {args.out} --resume",
            file=sys.stderr,
        )
    return stop.exit_code
