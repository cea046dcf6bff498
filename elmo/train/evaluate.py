"""``elmo eval-lm``: forward and backward perplexity of a model directory on a text file.

Every sentence is scored stateless as ``[<S>, tokens..., </S>]``: the forward LM predicts ``tokens..., </S>``
from the left, the backward LM predicts ``tokens..., <S>`` from the right, so both count ``n + 1`` targets per
sentence of ``n`` tokens. Targets outside the vocabulary are scored as ``<UNK>`` (the usual convention: the
perplexity then depends on the vocabulary, which is why the n-gram baseline uses the very same one).
Full softmax, no dropout. ``avg_ppl`` is exp of the mean of the two directions' mean log-losses
(the geometric mean of the two perplexities, as bilm-tf reports).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from elmo.errors import DataError, InputError
from elmo.flags import add_alias
from elmo.model.bilm import BiLM, backward_targets
from elmo.senses.benchmark import run_benchmark, summary
from elmo.text.chars import BYTES, load_char_scheme
from elmo.train.vocab import IGNORE, Vocab, length_batches, lm_arrays, read_sentences

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.json"


@dataclass
class LMScore:
    forward_nll: float
    backward_nll: float
    tokens: int

    def __add__(self, other: LMScore) -> LMScore:
        return LMScore(
            self.forward_nll + other.forward_nll, self.backward_nll + other.backward_nll, self.tokens + other.tokens
        )

    def report(self) -> dict:
        fwd, bwd = self.forward_nll / self.tokens, self.backward_nll / self.tokens
        return {
            "forward_ppl": round(math.exp(fwd), 3),
            "backward_ppl": round(math.exp(bwd), 3),
            "avg_ppl": round(math.exp((fwd + bwd) / 2), 3),
            "tokens": self.tokens,
        }


def summed_nll(logits_source: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of full-softmax NLL over the non-padding targets. ``logits_source`` (N, P), ``targets`` (N,)."""
    keep = targets != IGNORE
    if not bool(keep.any()):
        return 0.0
    logits = F.linear(logits_source[keep], weight, bias)
    return float(F.cross_entropy(logits, targets[keep], reduction="sum"))


@torch.no_grad()
def score_sentences(
    model: BiLM,
    vocab: Vocab,
    sentences: Sequence[Sequence[str]],
    tokens_per_batch: int = 4000,
    progress: str | None = None,
) -> LMScore:
    """Full-softmax forward/backward NLL sums over tokenized sentences (model put in eval mode temporarily).
    ``progress``: the label of a progress bar over the sentences (a command's; training's validation has none)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    weight, bias = model.softmax.weight, model.softmax.bias
    fwd_total = bwd_total = 0.0
    tokens = 0
    batches = length_batches([len(s) for s in sentences], tokens_per_batch)
    for batch in _with_bar(batches, progress, len(sentences)):
        char_ids, targets = (torch.from_numpy(a).to(device) for a in lm_arrays([sentences[i] for i in batch], vocab))
        fwd_h, bwd_h, lengths = model.lm_hidden(char_ids)
        fwd_total += summed_nll(fwd_h[:, :-1].flatten(0, 1), weight, bias, targets[:, 1:].flatten())
        bwd_total += summed_nll(bwd_h[:, 1:].flatten(0, 1), weight, bias, backward_targets(targets, lengths).flatten())
        tokens += int((lengths - 1).sum())
    model.train(was_training)
    return LMScore(fwd_total, bwd_total, tokens)


def _with_bar(batches: list, label: str | None, sentences: int):
    """The batches, with a tqdm bar counting their sentences when ``label`` is given (a test split of the default
    model takes minutes on 2 cores: without a bar the command looked hung)."""
    if label is None:
        yield from batches
        return
    from tqdm import tqdm

    with tqdm(total=sentences, desc=label, unit="sentence", mininterval=2, dynamic_ncols=True) as bar:
        for batch in batches:
            yield batch
            bar.update(len(batch))


def sense_scores(model: BiLM, char_scheme=BYTES, sentences_per_batch: int = 64) -> dict:
    """The word-sense benchmark (:mod:`elmo.senses`) on the model's own layers, as a flat record for the training
    history: ``{"sense_en_layer0": accuracy, ..., "sense_zh_best": accuracy}``."""
    return summary(sense_results(model, char_scheme, sentences_per_batch))


@torch.no_grad()
def sense_results(model: BiLM, char_scheme=BYTES, sentences_per_batch: int = 64) -> dict:
    """The word-sense benchmark's full result (elmo.senses.benchmark.run_benchmark) on the model's own layers."""
    device = next(model.parameters()).device

    def embed(sentences: list[list[str]]) -> list:
        layers_out = []
        for start in range(0, len(sentences), sentences_per_batch):
            batch = sentences[start : start + sentences_per_batch]
            layers, _ = model(torch.from_numpy(char_scheme.batch(batch)).long().to(device))  # (B, L+1, T, 2P)
            layers_out += [layers[i, :, : len(s)].float().cpu().numpy() for i, s in enumerate(batch)]
        return layers_out

    was_training = model.training
    model.eval()
    try:
        return run_benchmark(embed)
    finally:
        model.train(was_training)


LONG_SENTENCE = 50  # tokens: the report also scores shorter and longer test sentences apart


def split_by_length(sentences: list[list[str]], limit: int = LONG_SENTENCE) -> dict[str, list[list[str]]]:
    """``{"<= limit tokens": ..., "> limit tokens": ...}``, empty parts left out."""
    parts = {
        f"<= {limit} tokens": [s for s in sentences if len(s) <= limit],
        f"> {limit} tokens": [s for s in sentences if len(s) > limit],
    }
    return {name: part for name, part in parts.items() if part}


def test_report(
    model: BiLM,
    vocab: Vocab,
    corpus: Path,
    model_dir: Path,
    tokens_per_batch: int = 4000,
    train_dir: Path | None = None,
) -> dict:
    """Test-split perplexity per language for the biLM and the Kneser-Ney trigram baseline (trained on the
    corpus' train split with the model's own vocabulary), also split at ``LONG_SENTENCE`` tokens (a model trained
    on cut sentences can fail past the cut only), plus the training summary when the directory has one."""
    from elmo.train.ngram import Directional

    train_text = read_sentences(corpus / "train.txt")
    log.info("training the Kneser-Ney trigram baseline on %s (%d sentences)", corpus / "train.txt", len(train_text))
    baseline = Directional.train(vocab, train_text, order=3)
    del train_text
    report: dict = {"test": {}, "vocab_size": len(vocab), "oov": "targets outside vocab.txt are scored as <UNK>"}
    for lang in ("en", "zh"):
        path = corpus / f"test.{lang}.txt"
        sentences = read_sentences(path)
        parts = split_by_length(sentences)
        scores = {
            name: score_sentences(model, vocab, part, tokens_per_batch, progress=f"biLM test.{lang} {name}")
            for name, part in parts.items()
        }
        report["test"][lang] = {
            "file": str(path),
            "oov_rate": round(vocab.oov_rate(sentences), 5),
            "bilm": sum(scores.values(), LMScore(0.0, 0.0, 0)).report(),
            "kn3_baseline": baseline.score(vocab, sentences),
            "by_length": {
                name: {
                    "sentences": len(part),
                    "bilm": scores[name].report(),
                    "kn3_baseline": baseline.score(vocab, part),
                }
                for name, part in parts.items()
            },
        }
    state_file = Path(train_dir or model_dir) / "train_state.json"
    if state_file.is_file():
        state = json.loads(state_file.read_text())
        train_entries = [h for h in state["history"] if "loss" in h]
        report["training"] = {
            "steps": state["step"],
            "tokens": state["tokens"],
            "elapsed_s": round(state["elapsed_s"], 1),
            "tokens_per_s": round(state["tokens"] / max(state["elapsed_s"], 1e-9), 1),
            "world_size": state.get("world_size", 1),
            "last_train_loss": train_entries[-1]["loss"] if train_entries else None,
            "valid": [h for h in state["history"] if "valid_avg_ppl" in h],
        }
        if "init_from" in state:  # a later stage of a staged recipe: what the starting weights had already seen
            report["training"]["init_from"] = state["init_from"]
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, vocab.txt)")
    parser.add_argument("--text", nargs="+", help="text file(s), one sentence per line")
    parser.add_argument(
        "--report",
        metavar="CORPUS",
        help="instead of --text: test.{en,zh}.txt of this corpus folder, biLM vs KN trigram; the report is printed "
        "(one JSON line) unless --report-out or --update-metrics says where to write it",
    )
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--report-out", default=None, metavar="FILE", help="--report: write the report to FILE")
    out.add_argument(
        "--update-metrics",
        action="store_true",
        help="--report: merge the report into MODEL/metrics.json (other sections are kept)",
    )
    parser.add_argument("--train-dir", default=None, help="--report: training run folder with train_state.json")
    parser.add_argument("--tokenized", action="store_true", help="lines are already tokens separated by spaces")
    batch = parser.add_argument(
        "--batch-tokens", dest="tokens_per_batch", type=int, default=4000, help="padded tokens per batch (default 4000)"
    )
    add_alias(parser, "--tokens-per-batch", batch)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")


def run(args: argparse.Namespace) -> int:
    from elmo.model.checkpoint import load_model_and_vocab

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.text and not args.report:
        raise InputError("give --text FILE [FILE ...] or --report CORPUS")
    if (args.report_out or args.update_metrics) and not args.report:
        raise InputError("--report-out and --update-metrics go with --report CORPUS")
    model, tokens = load_model_and_vocab(args.model)
    vocab = Vocab(tokens, load_char_scheme(args.model))
    if args.report:
        report = test_report(
            model,
            vocab,
            Path(args.report),
            Path(args.model),
            args.tokens_per_batch,
            args.train_dir and Path(args.train_dir),
        )
        return _write_report(report, args)
    for text in args.text:
        sentences = read_sentences(Path(text), tokenized=args.tokenized)
        label = f"biLM {Path(text).name}"
        result = score_sentences(model, vocab, sentences, args.tokens_per_batch, progress=label).report()
        if len(args.text) > 1:
            result["file"] = text
        result["oov_rate"] = round(vocab.oov_rate(sentences), 5)
        print(json.dumps(result), flush=True)
    return 0


def _write_report(report: dict, args: argparse.Namespace) -> int:
    """Only where the user pointed: stdout by default, ``--report-out FILE``, or merged into the model's own
    metrics.json (``--update-metrics``). The summary (avg ppl per language and system) ends stdout when the report
    went to a file."""
    if args.report_out is None and not args.update_metrics:
        print(json.dumps(report, ensure_ascii=False))
        return 0
    if args.update_metrics:
        out = Path(args.model) / METRICS_FILE
        report = merge_metrics(out, report)
    else:
        out = Path(args.report_out)
    write_json_atomically(out, report)
    log.info("report written to %s", out)
    systems = ("bilm", "kn3_baseline")
    print(json.dumps({lang: {k: r[k]["avg_ppl"] for k in systems} for lang, r in report["test"].items()}))
    return 0


def merge_metrics(path: Path, report: dict) -> dict:
    """``path``'s sections with the report's in their place: a section the report lacks (``training`` when the
    model folder has no train_state.json, as the shipped models/default) is kept, never dropped."""
    if not path.is_file():
        return report
    try:
        existing = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a JSON metrics file ({exc}); move it away or use --report-out") from None
    if not isinstance(existing, dict):
        raise DataError(f"{path}: not a JSON object; move it away or use --report-out")
    return {**existing, **report}


def write_json_atomically(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


__all__ = ["LMScore", "merge_metrics", "score_sentences", "test_report"]
