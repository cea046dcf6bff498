"""``elmo adapt``: a model trained on Brown adapted to this project's own documentation (technical English it never
saw), an imported AllenNLP-format model adapted after a softmax fit, resume after a stop, and the clear errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from elmo.cli import main
from elmo.mix.cli import results_table
from elmo.model.checkpoint import load_state
from elmo.model.config import tiny
from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, TaskStore, save_task
from elmo.train.adapt import split_heldout
from tests.lm_fixtures import ADAPT_FAST, REPO, write_domain_text

FAST = ADAPT_FAST
DOMAIN_CHARS = 100_000


@pytest.fixture(scope="module")
def domain_text(tmp_path_factory) -> Path:
    # a third of the docs-sized text (as tests/train/test_adapt_cli.py): every step of `elmo adapt` still runs and
    # the held-out slice still holds thousands of tokens, at a third of the training and scoring
    return write_domain_text(tmp_path_factory.mktemp("domain") / "docs.txt", max_chars=DOMAIN_CHARS)


def _run(capsys, *args: str) -> dict:
    assert main(["adapt", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _eval_lm(capsys, model: Path, text: Path) -> dict:
    assert main(["eval-lm", "--model", str(model), "--text", str(text)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _import_bilm_tf(fixture: Path, out: Path) -> None:
    """The bilm-tf reference weights as a model directory (`elmo import-allennlp`)."""
    weights = ["--options", str(fixture / "options.json"), "--weights", str(fixture / "lm_weights.hdf5")]
    assert main(["import-allennlp", *weights, "--out", str(out)]) == 0


def _model_copy(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
    return target


def test_split_holds_out_a_contiguous_tail():
    sentences = [["w"] * 10 for _ in range(300)]  # 3,000 tokens
    train, heldout = split_heldout(sentences, share=0.1, max_tokens=20000)
    assert (len(train), len(heldout)) == (270, 30)
    train, heldout = split_heldout(sentences, share=0.4, max_tokens=105)
    assert (len(train), len(heldout)) == (289, 11)  # the cap wins: 11 sentences reach 105 tokens
    with pytest.raises(Exception, match="at least 2000"):
        split_heldout(sentences[:100], share=0.1, max_tokens=20000)


def test_adapting_lowers_heldout_perplexity_and_leaves_a_model_directory(
    trained_tiny_lm, domain_text, tmp_path, capsys
):
    source = _model_copy(trained_tiny_lm, tmp_path / "source")
    save_task(source, Task("pos_demo", "tagging", 3, 32, [0.4, -0.9, 1.7], 0.8))
    out = tmp_path / "adapted"
    result = _run(capsys, "--model", str(source), "--text", str(domain_text), "--out", str(out), *FAST)

    assert result["after_ppl"] < result["before_ppl"]
    heldout = out / "adapt" / "heldout.txt"
    # the figures are those of `elmo eval-lm` on the held-out slice, before (source) and after (out)
    assert _eval_lm(capsys, source, heldout)["avg_ppl"] == result["before_ppl"]
    assert _eval_lm(capsys, out, heldout)["avg_ppl"] == result["after_ppl"]
    record = json.loads((out / "adapt.json").read_text())
    assert result["tokens"] == record["adapt"]["tokens"] == json.loads((out / "train_state.json").read_text())["tokens"]
    assert not record["split"]["new_softmax"] and result["softmax_fitted"] is False
    assert (out / "vocab.txt").read_text() == (source / "vocab.txt").read_text()
    for language in ("en", "zh"):  # the sense change comes with a paired interval and a verdict
        change = result["senses_change"][language]
        before, after = result["senses_before"][language], result["senses_after"][language]
        assert change["difference"] == pytest.approx(after - before, abs=2e-4)
        assert change["ci95"][0] <= change["difference"] <= change["ci95"][1]
        assert change["verdict"] in ("better", "worse", "inconclusive", "tie (within ±0.01)")

    # exported and verified; the runtime embeds with it; no optimizer state is left behind
    assert json.loads((out / "onnx.json").read_text())["verification"]["passed"] is True
    (embedded,) = Embedder(out, intra_op_threads=1).embed(["The package manager installs it."])
    assert embedded.layers.shape == (3, len(embedded.tokens), 32) and np.isfinite(embedded.layers).all()
    assert not (out / "optimizer.safetensors").exists()

    # the source's task came along, marked stale; the source's own copy is not
    assert result["stale_tasks"] == ["pos_demo"]
    assert TaskStore(out).stale_names() == ["pos_demo"] and TaskStore(source).stale_names() == []
    assert "pos_demo (stale)" in results_table(TaskStore(out).all())
    assert main(["mix", "list", "--model", str(out)]) == 0
    assert "STALE: trained on the weights of source before `elmo adapt`" in capsys.readouterr().out
    save_task(out, replace(TaskStore(out).get("pos_demo"), stale=""))  # what `elmo mix train` writing it does
    assert TaskStore(out).stale_names() == []


def test_a_stopped_adaptation_resumes_with_replayed_general_text(
    trained_tiny_lm, brown_corpus, domain_text, tmp_path, capsys
):
    out = tmp_path / "adapted"
    args = [
        "--model",
        str(trained_tiny_lm),
        "--text",
        str(domain_text),
        "--out",
        str(out),
        *FAST,
        "--no-export",
        "--replay",
        str(brown_corpus / "train.txt"),
    ]
    assert _run(capsys, *args, "--stop-after", "5")["stopped_at"] == 5
    assert json.loads((out / "train_state.json").read_text())["step"] == 5

    assert main(["adapt", *args]) == 2
    assert "already holds an adaptation" in capsys.readouterr().err
    other = tmp_path / "other.txt"
    other.write_text(domain_text.read_text() + "one more line\n")
    assert main(["adapt", *args[:2], "--text", str(other), *args[4:], "--resume"]) == 2
    assert "same --model and --text" in capsys.readouterr().err

    result = _run(capsys, *args, "--resume")
    record = json.loads((out / "adapt.json").read_text())
    split = record["split"]  # a quarter of the training tokens are Brown sentences, taken as they are
    assert abs(split["replay_tokens"] / (split["replay_tokens"] + split["train_tokens"]) - 0.25) < 0.02
    brown = set((brown_corpus / "train.txt").read_text().splitlines())
    assert set((out / "adapt" / "replay.txt").read_text().splitlines()) <= brown
    assert record["adapt"]["steps"] == math.ceil(0.5 * record["split"]["batches_per_epoch"])  # half an epoch, as asked
    assert result["after_ppl"] < result["before_ppl"]
    assert not (out / "model.onnx").exists()  # --no-export


def test_an_imported_allennlp_model_gets_a_softmax_fitted_first(bilm_tf_fixture, domain_text, tmp_path, capsys):
    imported = tmp_path / "imported"
    _import_bilm_tf(bilm_tf_fixture, imported)
    capsys.readouterr()
    out = tmp_path / "adapted"
    result = _run(capsys, "--model", str(imported), "--text", str(domain_text), "--out", str(out), *FAST)
    assert result["softmax_fitted"] is True
    assert result["after_ppl"] < result["before_ppl"]

    original = load_state(imported / "model.safetensors")
    fitted = load_state(out / "adapt" / "softmax-fit" / "model.safetensors")
    adapted = load_state(out / "model.safetensors")
    assert "softmax.weight" not in original and "softmax.weight" in fitted
    for name, tensor in original.items():  # the biLM stayed frozen while the softmax was fitted, then learned
        assert np.array_equal(fitted[name].float().numpy(), tensor.float().numpy()), name
    assert any(not np.array_equal(adapted[n].float().numpy(), t.float().numpy()) for n, t in original.items())
    # "before" is the frozen imported biLM with the fitted softmax
    heldout = out / "adapt" / "heldout.txt"
    assert _eval_lm(capsys, out / "adapt" / "softmax-fit", heldout)["avg_ppl"] == result["before_ppl"]
    assert json.loads((out / "onnx.json").read_text())["verification"]["passed"] is True


def test_an_imported_manylangs_model_keeps_its_char_vocabulary(domain_text, tmp_path, capsys):
    """ELMoForManyLangs imports read tokens through their own char (and word) vocabulary: training, scoring, the
    sense benchmark and the export all use it, and the adapted directory carries it."""
    from tests.importers.test_manylangs import write_synthetic_folder

    imported = tmp_path / "imported"
    folder = write_synthetic_folder(tmp_path / "zhs.model", word_dim=6)
    assert main(["import-manylangs", "--model", str(folder), "--out", str(imported)]) == 0
    capsys.readouterr()
    out = tmp_path / "adapted"
    result = _run(capsys, "--model", str(imported), "--text", str(domain_text), "--out", str(out), *FAST)
    assert result["softmax_fitted"] is True and result["after_ppl"] < result["before_ppl"]
    for name in ("char_vocab.json", "word_vocab.json"):
        assert (out / name).read_bytes() == (imported / name).read_bytes()
    assert json.loads((out / "config.json").read_text())["char_scheme"] == "vocab"
    assert json.loads((out / "onnx.json").read_text())["verification"]["passed"] is True


def test_clear_errors(trained_tiny_lm, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too little text to adapt anything.\n" * 20)
    assert main(["adapt", "--model", str(trained_tiny_lm), "--text", str(short), "--out", str(tmp_path / "a")]) == 2
    assert "adapting needs at least 2000" in capsys.readouterr().err

    no_vocab_file = tmp_path / "manylangs"  # config.json says char vocabulary, the folder has none
    no_vocab_file.mkdir()
    replace(tiny(), char_scheme="vocab", n_chars=40, max_chars=20).validate().save(no_vocab_file)
    long_text = tmp_path / "long.txt"
    long_text.write_text("Enough words here to pass the size check of the text .\n" * 300)
    assert main(["adapt", "--model", str(no_vocab_file), "--text", str(long_text), "--out", str(tmp_path / "b")]) == 2
    assert "config.json says char_scheme 'vocab'" in capsys.readouterr().err

    assert (
        main(
            [
                "adapt",
                "--model",
                str(trained_tiny_lm),
                "--text",
                str(tmp_path / "missing.txt"),
                "--out",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "missing.txt: text file not found" in capsys.readouterr().err
    assert (
        main(
            [
                "adapt",
                "--model",
                str(trained_tiny_lm),
                "--text",
                str(long_text),
                "--out",
                str(tmp_path / "d"),
                "--resume",
            ]
        )
        == 2
    )
    assert "nothing to resume" in capsys.readouterr().err


def test_the_fresh_softmax_depends_on_the_seed_only(bilm_tf_fixture, tmp_path):
    # `elmo adapt --seed` must repeat itself whatever the process drew before: the new softmax of an imported
    # model is initialised from the seed, and the caller's global generator is left as it was.
    import torch

    from elmo.train.adapt import write_start_with_new_softmax

    imported = tmp_path / "imported"
    _import_bilm_tf(bilm_tf_fixture, imported)
    vocab, train = ["<S>", "</S>", "<UNK>", "the", "cat"], [["the", "cat"]]
    softmax = {}
    for run, (global_seed, seed) in enumerate([(1, 0), (2, 0), (1, 5)]):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        write_start_with_new_softmax(imported, tmp_path / f"start{run}", vocab, train, seed=seed)
        assert torch.equal(torch.get_rng_state(), state)
        softmax[run] = load_state(tmp_path / f"start{run}" / "model.safetensors")["softmax.weight"]
    assert torch.equal(softmax[0], softmax[1])  # another global state, the same seed: the same softmax
    assert not torch.equal(softmax[0], softmax[2])  # another seed: another softmax


def _random_lm(directory: Path, text: Path) -> Path:
    """A tiny untrained model with a softmax over the text's 500 commonest words: enough to stop and resume."""
    import torch

    from elmo.model.bilm import BiLM
    from elmo.model.checkpoint import save_model
    from elmo.train.vocab import SPECIALS, count_tokens, read_sentences

    words = [w for w, _ in count_tokens(read_sentences(text, tokenized=False)).most_common(500) if w not in SPECIALS]
    torch.manual_seed(0)
    vocab = [*SPECIALS, *words]
    save_model(BiLM(tiny(vocab_size=len(vocab))), directory, vocab)
    return directory


def test_a_signal_stops_an_adaptation_that_resumes_on_the_same_clock(domain_text, tmp_path, capsys):
    """issue 30: a kill + --resume of `adapt --minutes 3` took 4.3 minutes and never said that it resumed."""
    model, out = _random_lm(tmp_path / "model", domain_text), tmp_path / "adapted"
    args = [
        "--model",
        str(model),
        "--text",
        str(domain_text),
        "--out",
        str(out),
        "--time-budget-s",
        "1800",
        "--epochs",
        "50",
        "--batch-tokens",
        "400",
        "--threads",
        "1",
        "--no-export",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "elmo.cli", "adapt", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    for line in proc.stderr:  # the training loop logs the model's size as it starts (split and "before" are done)
        if "parameters" in line:
            break
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert json.loads(stdout.strip().splitlines()[-1])["stopped_by"] == "SIGTERM"
    assert f"continue with: elmo adapt --model {model} --text {domain_text} --out {out} --resume" in err
    assert "Warning" not in err and "Traceback" not in err
    first = json.loads((out / "adapt.json").read_text())
    stopped = json.loads((out / "train_state.json").read_text())
    step = stopped["step"]
    assert step >= 1 and first["spent_s"] > 0 and "before" in first and "adapt" not in first

    assert main(["adapt", *args, "--resume", "--stop-after", str(step + 2)]) == 0
    err = capsys.readouterr().err
    assert f"elmo adapt: resuming {out} (done: split, before; training trained" in err
    assert "of the 1800 s budget used" in err and f"from step {step} of" in err
    second = json.loads((out / "adapt.json").read_text())
    trained = json.loads((out / "train_state.json").read_text())["elapsed_s"] - stopped["elapsed_s"]
    # the clock went on from where the stopped run left it, and counts the training this run did
    assert second["spent_s"] >= first["spent_s"] + trained
