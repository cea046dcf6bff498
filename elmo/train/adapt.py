"""``elmo adapt --model DIR --text FILE --out DIR``: continue training a model's biLM on a user's own text.

The idea of bilm-tf's ``restart.py`` as one command. The text is split once: its last ``heldout_share`` (at most
``heldout_tokens`` tokens) is held out, a contiguous slice so that no held-out sentence has its neighbours in
training; the rest is the training text. Then, each step recorded in ``<out>/adapt.json`` so that ``--resume``
after a kill picks up where it stopped:

1. **before**: the model's held-out perplexity and word-sense benchmark (elmo.senses).
2. **softmax fit**, only for a model without a softmax (imported AllenNLP / bilm-tf and ELMoForManyLangs weights are
   embedding models; the latter keep their char and word vocabulary, elmo.text.chars.load_char_scheme):
   a vocabulary is built from the training text, a fresh softmax is trained with the biLM frozen
   (``softmax_share`` of the time), and its held-out perplexity is the "before" figure: the imported biLM as it is,
   scored with the best softmax this text allows.
3. **adapt**: both LM directions train from those weights (elmo.train.loop: sampled softmax, cosine schedule that
   follows the time budget, checkpoints; the training state lives in ``<out>``, so ``<out>`` is a run folder too).
4. **after**: held-out perplexity and senses again; task mixes of the source model are copied, marked stale.
5. **export**: ONNX export verified against PyTorch, like ``elmo export``.
6. **publish** (``elmo adapt --publish ROOT/NAME``): the finished directory copied in as the next version of NAME in a
   model repository (elmo.runtime.repository), recorded so that a resume does not publish it twice.

Words outside the vocabulary: the model's vocabulary is kept (the softmax rows are tied to it), so an unknown word
is predicted, and scored, as ``<UNK>`` both before and after, which keeps the two perplexities comparable; its
*input* vector still comes from its characters, so its embeddings do adapt. ``oov_rate`` in the result says how
much of the held-out text that concerns.

``--replay FILE`` mixes general text into training (``replay_share`` of the tokens) so the model keeps what it knew;
the result's ``senses_change`` says, with a paired bootstrap over the benchmark's sentences, whether it did.

The last line on stdout is one JSON object: ``{"before_ppl", "after_ppl", "tokens", ...}``.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from elmo.errors import ConfigError, DataError
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_config, load_model, load_state, load_vocab, save_model
from elmo.model.config import ModelConfig
from elmo.runtime.modeldir import sha256_of
from elmo.runtime.tasks import TASKS_DIR, mark_tasks_stale
from elmo.significance import paired_bootstrap, verdict
from elmo.text.chars import load_char_scheme
from elmo.train.budget import CommandClock, reserve_s, spent_in_earlier_runs, training_time_s
from elmo.train.config import DataConfig, OptimConfig, TrainConfig
from elmo.train.evaluate import score_sentences, sense_results
from elmo.train.loop import OPTIMIZER_FILE, STATE_FILE, read_train_state, train
from elmo.train.objective import init_bias_from_unigram, target_frequencies
from elmo.train.stopping import StopRequest
from elmo.train.vocab import Vocab, build_vocab, chunk_long, length_batches, read_sentences, write_vocab_file

log = logging.getLogger(__name__)

ADAPT_FILE = "adapt.json"
WORK_DIR = "adapt"  # inside --out: the text split, the vocabulary, the softmax-fit run
MIN_TOKENS = 2000  # less text than this cannot both adapt a model and measure it


@dataclass
class AdaptSettings:
    minutes: float = 30.0  # the whole command: split, training, scoring, export
    epochs: float = 4.0  # passes over the training text at most (small texts would be overfit otherwise)
    lr: float = 4e-4
    heldout_share: float = 0.1
    heldout_tokens: int = 20000
    softmax_share: float = 0.25  # of the training time, spent fitting a softmax to a model that has none
    softmax_lr: float = 3e-3
    max_vocab: int = 30000  # vocabulary of a new softmax
    min_count: int = 2
    tokens_per_batch: int = 4096
    n_negatives: int = 2048
    calibrate_tokens: int = 0  # > 0: refit the softmax bias on this many training tokens at the end (slow, rarely wins)
    replay: str = ""  # general text (tokenized lines) mixed into training, so the model keeps what it knew
    replay_share: float = 0.25  # of the training tokens, when replay is given
    threads: int = 0
    seed: int = 0


# -- the text --------------------------------------------------------------------------------------------------
def split_heldout(sentences: list[list[str]], share: float, max_tokens: int) -> tuple[list, list]:
    """The contiguous tail of the text (``share`` of its tokens, at most ``max_tokens``) is held out."""
    total = sum(len(s) for s in sentences)
    if total < MIN_TOKENS:
        raise DataError(f"the text has {total} tokens; adapting needs at least {MIN_TOKENS}")
    wanted = min(max_tokens, share * total)
    cut, held = len(sentences), 0
    while cut > 1 and held < wanted:
        cut -= 1
        held += len(sentences[cut])
    return sentences[:cut], sentences[cut:]


def _write_lines(path: Path, sentences: list[list[str]]) -> None:
    path.write_text("".join(" ".join(s) + "\n" for s in sentences), encoding="utf-8")


# -- the source model ------------------------------------------------------------------------------------------
def check_source(model_dir: Path) -> ModelConfig:
    """The source's config, its char scheme checked readable (a bad char vocabulary fails here, not mid-run)."""
    cfg = load_config(model_dir)
    if load_char_scheme(model_dir).name != cfg.char_scheme:
        raise ConfigError(f"{model_dir}: config.json says char_scheme {cfg.char_scheme!r}, the folder holds another")
    return cfg


def write_start_with_new_softmax(
    source: Path, start: Path, vocab: list[str], train: list[list[str]], seed: int = 0
) -> None:
    """A model directory with the source's biLM and a fresh softmax over ``vocab`` (initialised from ``seed``, so
    that ``elmo adapt --seed`` repeats itself), its bias at the log unigram frequencies of the training targets."""
    cfg = ModelConfig.from_dict({**load_config(source).to_dict(), "vocab_size": len(vocab)}, source=str(source))
    with torch.random.fork_rng():  # the caller's global generator is left as it was
        torch.manual_seed(seed)
        bilm = BiLM(cfg)
    weights = {k: v.float() for k, v in load_state(source / "model.safetensors").items()}
    missing, unexpected = bilm.load_state_dict(weights, strict=False)
    if unexpected or any(not name.startswith("softmax.") for name in missing):
        raise ConfigError(f"{source}: weights do not match its config (missing {missing[:4]}, extra {unexpected[:4]})")
    with torch.no_grad():
        init_bias_from_unigram(bilm, target_frequencies(train, Vocab(vocab)))
    save_model(bilm, start, vocab)
    for name in load_char_scheme(source).files:
        shutil.copyfile(source / name, start / name)


# -- scoring ---------------------------------------------------------------------------------------------------
def measure(model_dir: Path, vocab: list[str], heldout: list[list[str]]) -> dict:
    """Held-out perplexity (full softmax) and the word-sense benchmark's best layer per language (its accuracy, and
    per sentence its share of same-sense neighbours for the paired comparison)."""
    bilm = load_model(model_dir)
    char_scheme = load_char_scheme(model_dir)
    scores = score_sentences(bilm, Vocab(vocab, char_scheme), heldout).report()
    senses = sense_results(bilm, char_scheme)
    return {
        **scores,
        "senses": {lang: round(r["best_layer"]["accuracy"], 4) for lang, r in senses.items()},
        "sense_hits": {lang: r["best_layer"]["hits"] for lang, r in senses.items()},
    }


def senses_change(before: dict, after: dict) -> dict:
    """Per language: best-layer accuracy after minus before, with a paired bootstrap 95 % interval over the
    benchmark's sentences and its verdict (elmo.significance.verdict)."""
    out = {}
    for language, hits_before in before["sense_hits"].items():
        counts = [
            np.stack([np.asarray(h, dtype=np.float64), np.ones(len(h)), np.ones(len(h))], axis=1)
            for h in (after["sense_hits"][language], hits_before)
        ]
        comparison = paired_bootstrap("accuracy", *counts)
        out[language] = {
            "difference": round(comparison["difference"], 4),
            "ci95": [round(v, 4) for v in comparison["ci95"]],
            "verdict": verdict(comparison),
        }
    return out


Exporter = Callable[[Path, "int | None"], dict]  # (model directory, threads) -> the verification summary
# (the finished model directory, the record of an earlier publication or None) -> the record of where it is published
Publisher = Callable[[Path, "dict | None"], dict]


# -- the steps -------------------------------------------------------------------------------------------------
class Adaptation:
    """One adaptation in ``out``; every finished step is recorded in adapt.json before the next one starts."""

    def __init__(self, model: Path, text: Path, out: Path, tokenized: bool, settings: AdaptSettings) -> None:
        self.model, self.text, self.out, self.tokenized, self.s = model, text, out, tokenized, settings
        self.work = out / WORK_DIR
        self.record: dict = {}
        self.clock = CommandClock(settings.minutes * 60)
        self.stop = StopRequest("elmo adapt")  # entered by adapt(); a bare Adaptation (the benchmark) ignores it

    # -- the record ----------------------------------------------------------------------------------------
    def open(self, resume: bool) -> None:
        path = self.out / ADAPT_FILE
        if not self.text.is_file():
            raise DataError(f"{self.text}: text file not found")
        if resume:
            if not path.is_file():
                raise DataError(f"{path}: nothing to resume (no adaptation in {self.out})")
            self.record = json.loads(path.read_text())
            if self.record["text_sha256"] != sha256_of(self.text) or self.record["model"] != str(self.model.resolve()):
                raise ConfigError(f"{path}: --resume needs the same --model and --text as the run it continues")
            # the schedule the run started with; only the thread count (which changes no result) may differ
            self.s = replace(AdaptSettings(**self.record["settings"]), threads=self.s.threads)
            mark = self.record.get("training_mark")
            elapsed = _train_elapsed(Path(mark["run"])) if mark else None
            self.clock = CommandClock(self.s.minutes * 60, spent_in_earlier_runs(self.record, elapsed))
            return
        if path.is_file():
            raise ConfigError(
                f"{path}: {self.out} already holds an adaptation: --resume continues it, or choose another --out"
            )
        if self.out.exists() and any(p.name != WORK_DIR for p in self.out.iterdir()):
            raise ConfigError(f"{self.out}: not empty; adapt writes a new model directory")
        shutil.rmtree(self.work, ignore_errors=True)  # a split cut short before the record was written
        self.record = {
            "model": str(self.model.resolve()),
            "text": str(self.text),
            "text_sha256": sha256_of(self.text),
            "tokenized": self.tokenized,
            "settings": asdict(self.s),
            "started": time.time(),
        }

    def save(self) -> None:
        self.record["spent_s"] = round(self.clock.spent_s(), 1)
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (ADAPT_FILE + ".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, ensure_ascii=False) + "\n")
        os.replace(tmp, self.out / ADAPT_FILE)

    # -- steps ---------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Split the text, choose the vocabulary and the starting weights."""
        if "split" in self.record:
            return
        cfg = check_source(self.model)
        sentences = read_sentences(self.text, tokenized=self.tokenized)
        train_part, heldout = split_heldout(sentences, self.s.heldout_share, self.s.heldout_tokens)
        self.work.mkdir(parents=True, exist_ok=True)
        _write_lines(self.work / "train.txt", train_part)
        _write_lines(self.work / "heldout.txt", heldout)
        has_softmax = cfg.vocab_size > 0
        if has_softmax:
            vocab = load_vocab(self.model)
        else:
            vocab = build_vocab(self.work / "train.txt", self.s.min_count, self.s.max_vocab)
            write_start_with_new_softmax(self.model, self.work / "start", vocab, train_part, self.s.seed)
        write_vocab_file(vocab, self.work / "vocab.txt")
        replayed = self._write_replay(sum(map(len, train_part)))
        pieces = chunk_long(train_part + replayed, DataConfig.max_sentence_tokens)
        self.record["split"] = {
            "train_sentences": len(train_part),
            "train_tokens": sum(map(len, train_part)),
            "heldout_sentences": len(heldout),
            "heldout_tokens": sum(map(len, heldout)),
            "batches_per_epoch": len(length_batches([len(p) for p in pieces], self.s.tokens_per_batch)),
            "replay_tokens": sum(map(len, replayed)),
            "vocab": len(vocab),
            "new_softmax": not has_softmax,
            "oov_rate": round(Vocab(vocab).oov_rate(heldout), 4),
        }
        self.save()

    def measure_before(self) -> None:
        if "before" in self.record or self.record["split"]["new_softmax"]:
            return
        self._measure_before(self.model)

    def _measure_before(self, model_dir: Path) -> None:
        """The "before" scores, and how long they took: the final scoring repeats the same work (the reserve)."""
        started = time.monotonic()
        self.record["before"] = measure(model_dir, self._vocab(), self._heldout())
        self.record["scoring_s"] = round(time.monotonic() - started, 1)
        self.save()

    def fit_softmax(self) -> None:
        if not self.record["split"]["new_softmax"] or "before" in self.record:
            return
        run = self.work / "softmax-fit"
        if "softmax_fit_budget_s" not in self.record:  # fixed when the fit starts, so that a resume keeps it
            trainable = training_time_s(self.clock, reserve_s(None, self.clock.budget_s), 0.0)
            self.record["softmax_fit_budget_s"] = round(self.s.softmax_share * trainable, 1)
        cfg = self._train_config(
            self.work / "start",
            lr=self.s.softmax_lr,
            epochs=min(self.s.epochs, 2.0),
            max_time_s=self.record["softmax_fit_budget_s"],
            softmax_only=True,
        )
        state = self._train(cfg, run)
        if "stopped_by" in state:
            return
        self.record["softmax_fit"] = {
            "steps": state["step"],
            "tokens": state["tokens"],
            "elapsed_s": round(state["elapsed_s"], 1),
        }
        self._measure_before(run)

    def adapt(self, stop_after: int | None = None) -> bool:
        """Train; False when ``stop_after`` ended the run early (it is then resumable, like a killed one)."""
        if "adapt" in self.record:
            return True
        cfg = self.adapt_config()
        max_time_s = cfg.train.max_time_s
        state = self._train(cfg, self.out, stop_after)
        if "stopped_by" in state:
            return False
        if stop_after is not None and state["step"] < cfg.train.max_steps and state["elapsed_s"] < max_time_s:
            return False
        self.record["adapt"] = {
            "steps": state["step"],
            "tokens": state["tokens"],
            "elapsed_s": round(state["elapsed_s"], 1),
        }
        self.save()
        return True

    def adapt_config(self) -> TrainConfig:
        """The training configuration of the adapt step (also what the thread-policy study timed). Its time budget
        is what the command's budget still holds after the reserve for the final scoring and the export, plus what
        an earlier run of this adaptation already trained (the loop counts its seconds across a resume)."""
        start = self.work / "softmax-fit" if self.record["split"]["new_softmax"] else self.model
        trained = _train_elapsed(self.out) or 0.0
        reserve = reserve_s(self.record.get("scoring_s"), self.clock.budget_s)
        max_time_s = training_time_s(self.clock, reserve, trained)
        return self._train_config(start, lr=self.s.lr, epochs=self.s.epochs, max_time_s=max_time_s)

    def _train(self, cfg: TrainConfig, run: Path, stop_after: int | None = None) -> dict:
        """The training loop in ``run``, resumed when it holds a state; the record notes where the command's clock
        stood when this training (re)started, so that a run killed mid-training is still counted on resume."""
        elapsed = _train_elapsed(run)
        self.record["training_mark"] = {
            "run": str(run),
            "spent_s": round(self.clock.spent_s(), 1),
            "elapsed_s": elapsed or 0.0,
        }
        self.save()
        state = train(cfg, run, resume=elapsed is not None, stop_after=stop_after, stop=self.stop)
        self.record.pop("training_mark")
        self.save()
        return state

    def resume_line(self) -> str:
        """What a resumed adaptation says first: what is done and what is left of the budget."""
        done = [name for name in ("split", "before", "softmax_fit", "adapt", "after", "export") if name in self.record]
        trained = _train_elapsed(self.out)
        training = f"; training trained {trained:.0f} s so far" if trained is not None and "adapt" not in done else ""
        return (
            f"elmo adapt: resuming {self.out} (done: {', '.join(done) or 'nothing'}{training}); "
            f"{self.clock.spent_s():.0f} s of the {self.clock.budget_s:.0f} s budget used, "
            f"{max(0.0, self.clock.left_s()):.0f} s left"
        )

    def stopped(self) -> dict:
        """The record saved; the result line of a run stopped by Ctrl-C / SIGTERM."""
        self.save()
        return {
            "stopped_by": self.stop.name,
            "out": str(self.out),
            "spent_s": self.record["spent_s"],
            "resume": f"elmo adapt --model {self.model} --text {self.text} --out {self.out} --resume",
        }

    def finish(self, export: Exporter | None = None, publish: Publisher | None = None) -> dict:
        if "after" not in self.record:
            self.record["after"] = measure(self.out, self._vocab(), self._heldout())
            self.save()
        carried = self._carry_tasks()
        if export is not None and "export" not in self.record:
            self.record["export"] = export(self.out, self.s.threads or None)
        (self.out / OPTIMIZER_FILE).unlink(missing_ok=True)  # a finished adaptation is not resumed
        self.record["finished"] = time.time()
        self.save()
        if publish is not None:
            published = publish(self.out, self.record.get("published"))
            if published != self.record.get("published"):
                self.record["published"] = published
                self.save()
        if self.record["spent_s"] > self.clock.budget_s * 1.1:
            log.warning(
                "the adaptation took %.0f s, over the --time-budget-s %g budget: scoring and export alone "
                "took longer than the budget allowed",
                self.record["spent_s"],
                self.s.minutes * 60,
            )
        before, after = self.record["before"], self.record["after"]
        return {
            "before_ppl": before["avg_ppl"],
            "after_ppl": after["avg_ppl"],
            "change": round(after["avg_ppl"] / before["avg_ppl"] - 1, 4),
            "tokens": self.record["adapt"]["tokens"] + self.record.get("softmax_fit", {}).get("tokens", 0),
            "heldout_tokens": self.record["split"]["heldout_tokens"],
            "oov_rate": self.record["split"]["oov_rate"],
            "senses_before": before["senses"],
            "senses_after": after["senses"],
            "senses_change": senses_change(before, after),
            "softmax_fitted": self.record["split"]["new_softmax"],
            "stale_tasks": carried,
            "minutes": round(self.record["spent_s"] / 60, 1),
            "out": str(self.out),
            **({"published": self.record["published"]} if publish is not None else {}),
        }

    # -- helpers -------------------------------------------------------------------------------------------
    def _vocab(self) -> list[str]:
        return load_vocab(self.work / "vocab.txt")

    def _heldout(self) -> list[list[str]]:
        return read_sentences(self.work / "heldout.txt")

    def _write_replay(self, train_tokens: int) -> list[list[str]]:
        """An evenly spaced sample of the replay text, ``replay_share`` of all training tokens, in adapt/replay.txt."""
        if not self.s.replay:
            return []
        general = read_sentences(Path(self.s.replay))
        wanted = self.s.replay_share / (1 - self.s.replay_share) * train_tokens
        step = max(1.0, sum(map(len, general)) / max(wanted, 1.0))
        sample = [general[int(i * step)] for i in range(int(len(general) / step))]
        _write_lines(self.work / "replay.txt", sample)
        return sample

    def _train_config(self, start: Path, lr: float, epochs: float, max_time_s: float, softmax_only: bool = False):
        split = self.record["split"]
        steps = max(1, math.ceil(epochs * split["batches_per_epoch"]))
        train_files = [str(self.work / "train.txt")] + ([str(self.work / "replay.txt")] if self.s.replay else [])
        data = DataConfig(
            train=train_files,
            valid=str(self.work / "heldout.txt"),
            vocab=str(self.work / "vocab.txt"),
            valid_tokens=split["heldout_tokens"],
        )
        optim = OptimConfig(
            lr=lr,
            warmup_steps=min(30, max(1, steps // 10)),
            min_lr_ratio=0.05,
            clip=5.0,
            tokens_per_batch=self.s.tokens_per_batch,
            n_negatives=self.s.n_negatives,
            max_steps=steps,
            max_time_s=max_time_s,
            anneal_by_time=True,
            seed=self.s.seed,
            valid_every=max(1, min(100, steps // 4)),
            checkpoint_every=max(1, min(50, steps // 4)),
            threads=self.s.threads,
            init_bias_unigram=False,
            calibrate_bias_tokens=self.s.calibrate_tokens,
            init_from=str(start),
            softmax_only=softmax_only,
        )
        return TrainConfig(model=load_config(start), data=data, train=optim)

    def _carry_tasks(self) -> list[str]:
        """The source's task mixes, copied and marked stale: trained on the old weights, until retrained."""
        source, target = self.model / TASKS_DIR, self.out / TASKS_DIR
        if not source.is_dir():
            return []
        if not target.is_dir():
            shutil.copytree(source, target)
        reason = f"trained on the weights of {self.model.resolve().name} before `elmo adapt`; retrain: elmo mix train"
        return mark_tasks_stale(self.out, reason)


def adapt(
    model: Path,
    text: Path,
    out: Path,
    tokenized: bool,
    settings: AdaptSettings,
    resume: bool,
    export: Exporter | None = None,
    stop_after: int | None = None,
    publish: Publisher | None = None,
) -> dict:
    """Run (or continue) every step; returns the result line's content (``{"stopped_at": step}`` when
    ``stop_after`` ended the training early). ``export`` and ``publish`` are the last steps, given by the caller
    (`elmo adapt`, elmo.train.adapt_cli, passes the ONNX export): a run without them keeps PyTorch weights only."""
    job = Adaptation(model, text, out, tokenized, settings)
    job.open(resume)
    if resume:
        print(job.resume_line(), file=sys.stderr, flush=True)
    if job.s.threads:
        torch.set_num_threads(job.s.threads)
    with job.stop:  # Ctrl-C / SIGTERM: the step in progress ends, the record is saved, --resume continues
        for step in (job.prepare, job.measure_before, job.fit_softmax):
            step()
            if job.stop.requested:
                return job.stopped()
        finished = job.adapt(stop_after)
        if job.stop.requested:
            return job.stopped()
        if not finished:
            job.save()
            return {"stopped_at": stop_after, "out": str(out), "resume": "elmo adapt ... --resume"}
        return job.finish(export, publish)


def _train_elapsed(run: Path) -> float | None:
    """The training seconds of the run folder's last checkpoint; None when it has none (nothing to resume)."""
    return read_train_state(run)["elapsed_s"] if (run / STATE_FILE).is_file() else None


def settings_from(args: argparse.Namespace) -> AdaptSettings:
    s = AdaptSettings(
        minutes=args.time_budget_s / 60,
        epochs=args.epochs,
        lr=args.lr,
        heldout_share=args.heldout_share,
        heldout_tokens=args.heldout_tokens,
        tokens_per_batch=args.tokens_per_batch,
        calibrate_tokens=args.calibrate_tokens,
        replay=args.replay,
        replay_share=args.replay_share,
        threads=args.threads,
        seed=args.seed,
    )
    if not (s.minutes > 0 and s.epochs > 0 and s.lr > 0 and s.tokens_per_batch > 0 and s.calibrate_tokens >= 0):
        raise ConfigError("--time-budget-s, --epochs, --lr and --batch-tokens must be > 0, --calibrate-tokens >= 0")
    if not 0 < s.replay_share < 1:
        raise ConfigError("--replay-share must be in (0, 1)")
    if not (0 < s.heldout_share < 0.5 and s.heldout_tokens > 0):
        raise ConfigError("--heldout-share must be in (0, 0.5) and --heldout-tokens > 0")
    return s


__all__ = [
    "ADAPT_FILE",
    "WORK_DIR",
    "AdaptSettings",
    "Exporter",
    "Publisher",
    "adapt",
    "settings_from",
    "split_heldout",
]
