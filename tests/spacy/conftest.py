"""Fixtures of the spaCy tests: a writable copy of the tiny model, a toy tagging set, a pipeline trained on it by a
real `spacy train`, and a real `elmo serve` of the copy."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.serve_process import ServeProcess

# A toy tag set the tiny random model can tell apart: the tag follows the word, three tags in about equal shares.
TOY_WORDS = {
    "DET": ["the", "a", "this", "every"],
    "NOUN": ["cat", "dog", "bird", "fish", "cow", "tree"],
    "VERB": ["runs", "eats", "sees", "jumps", "likes"],
}
TOY_PATTERN = ("DET", "NOUN", "VERB", "DET", "NOUN", "VERB")
TAGGER_CONFIG = REPO / "configs" / "spacy" / "tagger_elmo.cfg"


def toy_sentences(n: int, seed: int) -> list[list[tuple[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(3, len(TOY_PATTERN))
        out.append([(rng.choice(TOY_WORDS[tag]), tag) for tag in TOY_PATTERN[:length]])
    return out


def write_toy_docbin(path: Path, n: int, seed: int) -> Path:
    from spacy.tokens import Doc, DocBin
    from spacy.vocab import Vocab

    vocab, docs = Vocab(), DocBin(attrs=["ORTH", "TAG"])
    for sentence in toy_sentences(n, seed):
        doc = Doc(vocab, words=[w for w, _ in sentence])
        for token, (_, tag) in zip(doc, sentence):
            token.tag_ = tag
        docs.add(doc)
    docs.to_disk(path)
    return path


@pytest.fixture(scope="session")
def spacy_model(tmp_path_factory, tiny_model_dir) -> Path:
    """A copy of the tiny model that the task-export tests may write tasks into."""
    target = tmp_path_factory.mktemp("spacy_model") / "tiny"
    shutil.copytree(tiny_model_dir, target)
    return target


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("toy_tags")
    write_toy_docbin(folder / "train.spacy", 160, seed=1)
    write_toy_docbin(folder / "dev.spacy", 40, seed=2)
    return folder


def spacy_train(config: Path, data: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m spacy train` as a user runs it (a real process), on the toy data."""
    command = [
        sys.executable,
        "-m",
        "spacy",
        "train",
        str(config),
        "--output",
        str(out),
        "--paths.train",
        str(data / "train.spacy"),
        "--paths.dev",
        str(data / "dev.spacy"),
        *overrides,
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def trained_pipeline(tmp_path_factory, spacy_model, toy_data) -> Path:
    """configs/spacy/tagger_elmo.cfg trained for 15 epochs on the toy tags with the tiny model (a few seconds)."""
    out = tmp_path_factory.mktemp("spacy_trained")
    spacy_train(
        TAGGER_CONFIG,
        toy_data,
        out,
        "--paths.elmo_model",
        str(spacy_model),
        "--training.max_epochs",
        "15",
        "--training.eval_frequency",
        "20",
        "--components.tagger.model.tok2vec.width",
        "32",
    )
    return out / "model-last"


@pytest.fixture(scope="session")
def spacy_server(tmp_path_factory, spacy_model) -> Iterator[str]:
    """A real `elmo serve` of the writable tiny model copy on 127.0.0.1."""
    with ServeProcess(["--model", str(spacy_model)], tmp_path_factory.mktemp("spacy_serve")) as server:
        yield server.wait_serving()
