"""Every training-side command that reads a user's file reads it through elmo.text.files: a file that is not UTF-8
(Chinese text saved as GB18030, the issue-30 crash) is one line naming the file, exit 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elmo.cli import main
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import save_model
from elmo.model.config import tiny

CHINESE = "我买了一台苹果电脑。它很好用，我每天都用它写东西。\n"
ENGLISH = "the apple fell from the tree and the man ate it .\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A GB18030 file, UTF-8 text long enough to adapt on, a tiny corpus and a tiny model with a softmax."""
    root = tmp_path_factory.mktemp("user_files")
    gb = root / "notes.gb18030.txt"
    gb.write_bytes((ENGLISH + CHINESE * 3).encode("gb18030"))
    text = root / "text.txt"
    text.write_text(ENGLISH * 300, encoding="utf-8")
    vocab = ["<S>", "</S>", "<UNK>", *sorted(set(ENGLISH.split()))]
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text(ENGLISH * 50, encoding="utf-8")
    (corpus / "vocab.txt").write_text("".join(t + "\n" for t in vocab), encoding="utf-8")
    torch.manual_seed(0)
    save_model(BiLM(tiny(vocab_size=len(vocab))), root / "model", vocab)
    return {"gb": gb, "text": text, "corpus": corpus, "model": root / "model"}


def _refused(capsys, argv: list[str], path: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(f"elmo {argv[0]}: error:")]
    assert len(errors) == 1, err
    assert str(path) in errors[0] and "not UTF-8" in errors[0] and "iconv" in errors[0]
    assert "Traceback" not in err and "UnicodeDecodeError" not in err


def test_eval_lm_text(files, capsys):
    _refused(capsys, ["eval-lm", "--model", str(files["model"]), "--text", str(files["gb"])], files["gb"])


def test_eval_lm_report_corpus(files, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text(ENGLISH * 20, encoding="utf-8")
    (corpus / "test.en.txt").write_bytes(files["gb"].read_bytes())
    _refused(capsys, ["eval-lm", "--model", str(files["model"]), "--report", str(corpus)], corpus / "test.en.txt")


def test_baseline_text_and_corpus(files, tmp_path, capsys):
    corpus = files["corpus"]
    _refused(capsys, ["baseline", "--corpus", str(corpus), "--text", str(files["gb"])], files["gb"])
    own = tmp_path / "corpus"  # the corpus' own test split in another encoding
    own.mkdir()
    for name in ("train.txt", "vocab.txt"):
        (own / name).write_bytes((corpus / name).read_bytes())
    (own / "test.zh.txt").write_bytes(files["gb"].read_bytes())
    _refused(capsys, ["baseline", "--corpus", str(own)], own / "test.zh.txt")
    _refused(capsys, ["baseline", "--corpus", str(corpus), "--train", str(files["gb"])], files["gb"])


def test_adapt_text_and_replay(files, tmp_path, capsys):
    model, gb = str(files["model"]), str(files["gb"])
    _refused(capsys, ["adapt", "--model", model, "--text", gb, "--out", str(tmp_path / "a")], files["gb"])
    _refused(
        capsys,
        [
            "adapt",
            "--model",
            model,
            "--text",
            str(files["text"]),
            "--out",
            str(tmp_path / "b"),
            "--replay",
            gb,
            "--no-export",
        ],
        files["gb"],
    )


def test_train_text_and_config(files, tmp_path, capsys):
    corpus = files["corpus"]
    config = {
        "model": {
            "char_dim": 4,
            "filters": [[1, 8], [2, 8]],
            "n_highway": 1,
            "projection_dim": 8,
            "cell_dim": 16,
            "n_layers": 2,
        },
        "data": {"train": str(files["gb"]), "valid": str(corpus / "train.txt"), "vocab": str(corpus / "vocab.txt")},
        "train": {"max_steps": 1},
    }
    path = tmp_path / "train.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    _refused(capsys, ["train", "--config", str(path), "--out", str(tmp_path / "run")], files["gb"])
    gb_config = tmp_path / "train.gb.json"  # a config whose comment-free JSON holds GB18030 text
    gb_config.write_bytes(json.dumps({**config, "note": "苹果"}, ensure_ascii=False).encode("gb18030"))
    _refused(capsys, ["train", "--config", str(gb_config), "--out", str(tmp_path / "run")], gb_config)
