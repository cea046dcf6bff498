"""``elmo adapt --publish ROOT/NAME`` (elmo/train/adapt_cli.py): the adapted, exported, verified model becomes the next
version of NAME in a model repository, whole or not at all; a stopped run resumes and publishes once; the errors
come before any training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elmo.cli import main
from elmo.runtime import Embedder
from elmo.runtime.repository import scan
from tests.lm_fixtures import ADAPT_FAST, write_domain_text

FAST = ADAPT_FAST


@pytest.fixture(scope="module")
def domain_text(tmp_path_factory) -> Path:
    """100 KB of the docs: the publishing, stopping and resuming are under test here, not the adaptation's gain."""
    return write_domain_text(tmp_path_factory.mktemp("domain") / "docs.txt", max_chars=100_000)


@pytest.fixture(scope="module")
def source_model(tmp_path_factory, domain_text) -> Path:
    """A tiny untrained model with a softmax over the text's 500 commonest words: enough to adapt and export."""
    import torch

    from elmo.model.bilm import BiLM
    from elmo.model.checkpoint import save_model
    from elmo.model.config import tiny
    from elmo.train.vocab import SPECIALS, count_tokens, read_sentences

    words = [w for w, _ in count_tokens(read_sentences(domain_text, tokenized=False)).most_common(500)]
    vocab = [*SPECIALS, *(w for w in words if w not in SPECIALS)]
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("source") / "model"
    save_model(BiLM(tiny(vocab_size=len(vocab))), directory, vocab)
    return directory


def _adapt(capsys, *args: str, code: int = 0) -> tuple[dict, str]:
    assert main(["adapt", *args]) == code
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]), captured.err


@pytest.mark.slow  # two adaptations
def test_publish_without_out_stops_resumes_and_publishes_the_next_version(source_model, domain_text, tmp_path, capsys):
    root = tmp_path / "repo"
    args = ["--model", str(source_model), "--text", str(domain_text), "--publish", str(root / "docs"), *FAST]
    stopped, err = _adapt(capsys, *args, "--stop-after", "2")
    run = root / "docs" / ".adapting"  # the run folder: hidden, never a version
    assert stopped["stopped_at"] == 2 and (run / "adapt.json").is_file()
    resume = f"elmo adapt --model {source_model} --text {domain_text} --publish {root / 'docs'} --resume"
    assert stopped["resume"] == resume
    assert scan(root) == {"docs": []}

    result, err = _adapt(capsys, *args, "--resume")
    version = root / "docs" / "1"
    assert result["published"] == {"model": str(root / "docs"), "name": "docs", "version": 1, "path": str(version)}
    assert result["out"] == str(version) and result["after_ppl"] < result["before_ppl"]
    assert f"elmo adapt: published {version}: version 1 of docs (a request names it docs@1" in err
    assert scan(root) == {"docs": [1]} and sorted(p.name for p in (root / "docs").iterdir()) == ["1"]  # run removed
    # a model directory like any other, with its provenance, without the run's working files
    names = {p.name for p in version.iterdir()}
    assert {
        "model.onnx",
        "model.onnx.data",
        "onnx.json",
        "config.json",
        "model.safetensors",
        "vocab.txt",
        "adapt.json",
        "curve.png",
    } <= names
    assert not names & {"adapt", "optimizer.safetensors", ".export-staging"}
    assert json.loads((version / "onnx.json").read_text())["verification"]["passed"] is True
    (embedded,) = Embedder(version, intra_op_threads=1).embed(["The server polls the root ."])
    assert embedded.layers.shape[:2] == (3, 6)

    # with --out: the run stays there, the version is a copy; a resume of the finished run publishes nothing more
    out = tmp_path / "run"
    args = [
        "--model",
        str(source_model),
        "--text",
        str(domain_text),
        "--out",
        str(out),
        "--publish",
        str(root / "docs"),
        *FAST,
    ]
    result, err = _adapt(capsys, *args)
    assert result["published"]["version"] == 2 and result["out"] == str(out)
    assert (out / "adapt" / "heldout.txt").is_file() and (out / "model.onnx").is_file()
    assert (root / "docs" / "2" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    again, err = _adapt(capsys, *args, "--resume")
    assert again["published"] == result["published"] and scan(root) == {"docs": [1, 2]}
    assert json.loads((out / "adapt.json").read_text())["published"]["version"] == 2


def test_publish_errors_come_before_any_training(domain_text, tmp_path, capsys):
    base = ["adapt", "--model", str(tmp_path / "model"), "--text", str(domain_text), *FAST]  # never read
    root = tmp_path / "repo"
    cases = [
        ([], "give --out DIR (the adapted model directory), --publish ROOT/NAME, or both"),
        (["--publish", str(root / "m"), "--no-export"], "--publish needs the export"),
        (["--publish", "m"], "--publish m: give the model repository's folder and the model's name, ROOT/NAME"),
        (["--publish", str(root / ".m")], "model name '.m': letters, digits"),
        (["--publish", str(root / "m"), "--out", str(root / "runs" / "x")], "is inside the model repository"),
        (["--publish", str(root / "m"), "--resume"], "nothing to resume (no adaptation in"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not root.exists()  # nothing written
