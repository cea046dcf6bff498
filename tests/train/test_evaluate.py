from __future__ import annotations

import json
import math

import pytest
import torch

from elmo.cli import main
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_model_and_vocab, save_model
from elmo.model.config import tiny
from elmo.text.chars import batch_to_char_ids
from elmo.train.evaluate import score_sentences
from elmo.train.vocab import UNK_ID, Vocab

TOKENS = ["<S>", "</S>", "<UNK>", "the", "cat", "sat", "猫"]


def _eval(capsys, *argv) -> dict:
    assert main(["eval-lm", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_uniform_softmax_gives_vocabulary_size_perplexity(tmp_path, capsys):
    torch.manual_seed(0)
    model = BiLM(tiny(vocab_size=len(TOKENS)))
    with torch.no_grad():
        model.softmax.weight.zero_()
        model.softmax.bias.zero_()
    save_model(model, tmp_path, TOKENS)
    (tmp_path / "t.txt").write_text("the cat sat\nunknownword 猫\n")
    result = _eval(capsys, "--model", str(tmp_path), "--text", str(tmp_path / "t.txt"), "--tokenized")
    assert result["tokens"] == 4 + 3
    for key in ("forward_ppl", "backward_ppl", "avg_ppl"):
        assert result[key] == pytest.approx(len(TOKENS), rel=1e-4)


def test_sums_match_the_models_own_full_softmax_loss(tmp_path):
    """score_sentences (batched by length, OOV -> <UNK>) equals BiLM.lm_loss sentence by sentence."""
    torch.manual_seed(1)
    model = BiLM(tiny(vocab_size=len(TOKENS))).eval()
    vocab = Vocab(TOKENS)
    sentences = [["the", "cat", "sat"], ["猫"], ["dog", "the"], ["sat", "sat", "cat", "the", "猫"]]
    score = score_sentences(model, vocab, sentences, tokens_per_batch=6)
    fwd = bwd = 0.0
    for sentence in sentences:
        char_ids = torch.from_numpy(batch_to_char_ids([sentence])).long()
        targets = torch.from_numpy(vocab.ids(sentence)).view(1, -1)
        f, b = model.lm_loss(char_ids, targets)
        fwd += f.item() * (len(sentence) + 1)
        bwd += b.item() * (len(sentence) + 1)
    assert score.tokens == sum(len(s) + 1 for s in sentences)
    assert score.forward_nll == pytest.approx(fwd, rel=1e-5)
    assert score.backward_nll == pytest.approx(bwd, rel=1e-5)
    assert vocab.ids(["dog"])[1] == UNK_ID


def test_eval_lm_on_the_ci_model_raw_and_tokenized(trained_tiny_lm, brown_corpus, capsys, tmp_path):
    test_file = brown_corpus / "test.txt"
    tokenized = _eval(capsys, "--model", str(trained_tiny_lm), "--text", str(test_file), "--tokenized")
    assert tokenized["tokens"] == sum(len(line.split()) + 1 for line in test_file.read_text().splitlines())
    _, vocab = load_model_and_vocab(trained_tiny_lm)
    assert 1 < tokenized["forward_ppl"] < len(vocab) / 4 and 1 < tokenized["backward_ppl"] < len(vocab) / 4
    avg = math.exp((math.log(tokenized["forward_ppl"]) + math.log(tokenized["backward_ppl"])) / 2)
    assert tokenized["avg_ppl"] == pytest.approx(avg, rel=1e-3)
    # raw text goes through elmo.text.tokenize: "Hello, world." is 4 tokens -> 5 targets
    (tmp_path / "raw.txt").write_text("Hello, world.\n")
    raw = _eval(capsys, "--model", str(trained_tiny_lm), "--text", str(tmp_path / "raw.txt"))
    assert raw["tokens"] == 5


def test_eval_lm_bad_inputs(tmp_path, trained_tiny_lm, capsys):
    (tmp_path / "empty.txt").write_text("")
    for argv, needle in (
        (["--model", str(trained_tiny_lm), "--text", str(tmp_path / "empty.txt")], "empty"),
        (["--model", str(trained_tiny_lm), "--text", str(tmp_path / "missing.txt")], "missing.txt"),
        (["--model", str(tmp_path / "nomodel"), "--text", str(tmp_path / "empty.txt")], "nomodel"),
    ):
        assert main(["eval-lm", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_report_compares_both_languages_with_the_trigram(trained_tiny_lm, brown_corpus, capsys, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text((brown_corpus / "train.txt").read_text())
    (corpus / "test.en.txt").write_text((brown_corpus / "test.txt").read_text())
    (corpus / "test.zh.txt").write_text("我 们 的 国 家\n新 华 社 北 京 电\n")
    out = tmp_path / "metrics.json"
    argv = ["--model", str(trained_tiny_lm), "--report", str(corpus), "--report-out", str(out)]
    assert main(["eval-lm", *argv, "--train-dir", str(trained_tiny_lm)]) == 0
    report = json.loads(out.read_text())
    en_targets = sum(len(line.split()) + 1 for line in (corpus / "test.en.txt").read_text().splitlines())
    assert report["test"]["en"]["bilm"]["tokens"] == report["test"]["en"]["kn3_baseline"]["tokens"] == en_targets
    assert report["test"]["zh"]["bilm"]["tokens"] == 13 and report["test"]["zh"]["oov_rate"] == 1.0
    for lang in ("en", "zh"):
        for system in ("bilm", "kn3_baseline"):
            assert report["test"][lang][system]["avg_ppl"] > 1
    assert report["training"]["steps"] == 200 and "init_from" not in report["training"]
    en_by_length = report["test"]["en"]["by_length"]
    assert set(en_by_length) == {"<= 50 tokens", "> 50 tokens"}  # Brown's test split has both
    for system in ("bilm", "kn3_baseline"):
        assert sum(part[system]["tokens"] for part in en_by_length.values()) == en_targets
    assert list(report["test"]["zh"]["by_length"]) == ["<= 50 tokens"]
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["en"]["bilm"] == report["test"]["en"]["bilm"]["avg_ppl"]


def test_report_writes_only_where_the_user_points(tmp_path, capsys):
    """`eval-lm --report` prints; the tracked models/default/metrics.json was rewritten (its `training` section
    dropped) by the README's command before issue 30. --update-metrics merges, --report-out writes a new file."""
    torch.manual_seed(2)
    model_dir = tmp_path / "model"
    save_model(BiLM(tiny(vocab_size=len(TOKENS))), model_dir, TOKENS)
    shipped = {"test": {"en": {"stale": True}}, "training": {"steps": 7, "tokens": 99}, "note": "kept"}
    (model_dir / "metrics.json").write_text(json.dumps(shipped))
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text("the cat sat\nthe cat\n" * 5)
    (corpus / "test.en.txt").write_text("the cat sat\ncat sat the\n")
    (corpus / "test.zh.txt").write_text("猫\n")

    assert main(["eval-lm", "--model", str(model_dir), "--report", str(corpus)]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert set(report["test"]) == {"en", "zh"} and report["test"]["en"]["bilm"]["tokens"] == 8
    assert "biLM test.en" in captured.err  # a progress bar over the sentences, not minutes of silence
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before  # nothing written

    assert main(["eval-lm", "--model", str(model_dir), "--report", str(corpus), "--update-metrics"]) == 0
    merged = json.loads((model_dir / "metrics.json").read_text())
    assert merged["test"] == report["test"] and merged["training"] == shipped["training"] and merged["note"] == "kept"
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["en"]["bilm"] == report["test"]["en"]["bilm"]["avg_ppl"]

    assert main(["eval-lm", "--model", str(model_dir), "--text", str(corpus / "test.zh.txt"), "--update-metrics"]) == 2
    assert "go with --report" in capsys.readouterr().err
