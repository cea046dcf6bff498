from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo.cli import main
from elmo.model.bilm import BiLM
from elmo.model.checkpoint import load_model_and_vocab, load_state
from elmo.model.config import ModelConfig, tiny
from elmo.train.config import DataConfig, OptimConfig, load_train_config, read_train_sentences
from elmo.train.evaluate import score_sentences
from elmo.train.loop import VALID_KEYS, expected_last_step, lr_at, plot_stages, resume_line
from elmo.train.objective import LMObjective, NegativeSampler, target_frequencies, use_distinct_token_encoder
from elmo.train.vocab import BOS_ID, EOS_ID, SPECIALS, Vocab, read_sentences, slice_by_tokens
from tests.lm_fixtures import REPO, train_with_torchrun, write_train_config


def _history(model_dir):
    return json.loads((model_dir / "train_state.json").read_text())["history"]


def test_ci_training_run_learns_and_writes_a_model_directory(trained_tiny_lm):
    for name in (
        "config.json",
        "model.safetensors",
        "vocab.txt",
        "optimizer.safetensors",
        "train_state.json",
        "train_config.json",
        "curve.png",
    ):
        assert (trained_tiny_lm / name).is_file(), name
    assert (trained_tiny_lm / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    valid = [h for h in _history(trained_tiny_lm) if "valid_avg_ppl" in h]
    assert [h["step"] for h in valid] == [50, 100, 150, 200]
    # the word-sense benchmark is tracked at every validation; layer 0 (context-blind) scores chance
    assert all(0 <= h["sense_zh_best"] <= 1 and h["sense_en_best"] >= h["sense_en_layer1"] for h in valid)
    assert len({h["sense_en_layer0"] for h in valid}) == 1
    assert valid[-1]["valid_avg_ppl"] < valid[0]["valid_avg_ppl"]
    train = [h["loss"] for h in _history(trained_tiny_lm) if "loss" in h]
    assert train[-1] < train[0] - 0.1  # (the bias starts at log unigram frequencies: the loss starts low)
    model, vocab = load_model_and_vocab(trained_tiny_lm)
    assert model.cfg.vocab_size == len(vocab) <= 3000
    assert valid[-1]["valid_avg_ppl"] < len(vocab) / 10  # far better than uniform


def test_resume_continues_exactly(tmp_path, brown_corpus):
    overrides = {"max_steps": 12, "log_every": 1, "valid_every": 6, "checkpoint_every": 6, "warmup_steps": 3}
    config = write_train_config(tmp_path / "c.json", brown_corpus, **overrides)
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "straight")]) == 0
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "split"), "--stop-after", "6"]) == 0
    first_half = _history(tmp_path / "split")
    assert first_half[-1]["step"] == 6
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "split"), "--resume"]) == 0

    def losses(h):
        return [(e["step"], e["loss"]) for e in h if "loss" in e]

    straight, resumed = _history(tmp_path / "straight"), _history(tmp_path / "split")
    assert losses(resumed) == losses(straight)  # step 7 (the next loss after resuming) included
    a = load_state(tmp_path / "straight" / "model.safetensors")
    b = load_state(tmp_path / "split" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_training_with_a_checkpoint_and_resume_continues_exactly(tmp_path, brown_corpus, capsys, sig):
    # issue 30: stopped before its first checkpoint (step 250 of configs/default.json), a run left nothing to resume
    overrides = {"max_steps": 100000, "log_every": 1, "valid_every": 100000, "checkpoint_every": 100000}
    config = write_train_config(tmp_path / "c.json", brown_corpus, **overrides)
    stopped_dir = tmp_path / "stopped"
    cmd = [sys.executable, "-m", "elmo.cli", "train", "--config", str(config), "--out", str(stopped_dir)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # the model's size is logged when the data is read, just before the first step
        if "parameters" in line:
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + sig, err[-2000:]
    step = json.loads((stopped_dir / "train_state.json").read_text())["step"]
    assert step >= 1 and (stopped_dir / "optimizer.safetensors").is_file()
    assert f"stopped by {sig.name} at step {step} of 100000; checkpoint in {stopped_dir}" in err
    assert f"elmo train --config {config} --out {stopped_dir} --resume" in err and "Traceback" not in err
    assert "Warning" not in err  # nothing a user cannot act on (issue 30)

    end = str(step + 2)
    assert main(["train", "--config", str(config), "--out", str(stopped_dir), "--resume", "--stop-after", end]) == 0
    assert f"resuming {stopped_dir} from step {step} of 100000" in capsys.readouterr().err
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "straight"), "--stop-after", end]) == 0
    runs = (stopped_dir, tmp_path / "straight")
    losses = [[(e["step"], e["loss"]) for e in _history(run) if "loss" in e] for run in runs]
    assert losses[0] == losses[1] and len(losses[0]) == step + 2
    a, b = (load_state(run / "model.safetensors") for run in runs)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_progress_bar_ends_where_the_time_budget_does():
    # configs/default.json: 6,000 steps or 4,800 s; the bar showed 6,000 steps' ETA (23-33 h on a busy machine)
    budget = OptimConfig(max_steps=6000, max_time_s=4800)
    state = {"step": 100, "elapsed_s": 800.0}  # 8 s a step so far: 4,000 s left are 500 more steps
    assert expected_last_step(state, budget, 6000, run_steps=100, run_s=800.0) == 600
    assert expected_last_step(state, budget, 300, run_steps=100, run_s=800.0) == 300  # --stop-after comes first
    assert expected_last_step(state, OptimConfig(max_steps=6000), 6000, 100, 800.0) == 6000  # no time budget
    assert expected_last_step(state, budget, 6000, run_steps=0, run_s=0.0) == 6000  # no pace yet
    line = resume_line(Path("runs/x"), {"step": 100, "tokens": 2048, "elapsed_s": 800.0}, budget)
    assert line == (
        "resuming runs/x from step 100 of 6000 (2,048 tokens seen; 800 s of the 4800 s time budget used, 4000 s left)"
    )


def test_init_from_starts_from_another_runs_weights(tmp_path, brown_corpus):
    first = write_train_config(tmp_path / "a.json", brown_corpus, max_steps=4, valid_every=4, checkpoint_every=4)
    assert main(["train", "--config", str(first), "--out", str(tmp_path / "a")]) == 0
    # lr 0: the second stage must end with exactly the weights it started from, and record where they came from
    second = write_train_config(
        tmp_path / "b.json",
        brown_corpus,
        max_steps=2,
        valid_every=2,
        checkpoint_every=2,
        lr=0.0,
        init_from=str(tmp_path / "a"),
        init_bias_unigram=False,
    )
    assert main(["train", "--config", str(second), "--out", str(tmp_path / "b")]) == 0
    a = load_state(tmp_path / "a" / "model.safetensors")
    b = load_state(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((tmp_path / "b" / "train_state.json").read_text())
    assert state["step"] == 2 and state["init_from"]["dir"] == str(tmp_path / "a") and state["init_from"]["steps"] == 4
    plot_stages([tmp_path / "a", tmp_path / "b"], tmp_path / "both.png")
    assert (tmp_path / "both.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_init_from_a_missing_or_mismatched_model_is_one_clear_error(tmp_path, capsys, brown_corpus):
    config = write_train_config(tmp_path / "c.json", brown_corpus, init_from=str(tmp_path / "nowhere"))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "nowhere", "init_from")
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"")
    (other / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nzebra\n")
    config = write_train_config(tmp_path / "c.json", brown_corpus, init_from=str(other))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "other", "vocabulary")


def test_bias_calibration_is_kept_only_when_it_helps_on_valid(tmp_path, brown_corpus):
    config = write_train_config(
        tmp_path / "c.json", brown_corpus, max_steps=6, valid_every=6, checkpoint_every=6, calibrate_bias_tokens=2000
    )
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o")]) == 0
    state = json.loads((tmp_path / "o" / "train_state.json").read_text())
    calibration = state["bias_calibrated"]
    before, after = calibration["valid_before"]["valid_avg_ppl"], calibration["valid_after"]["valid_avg_ppl"]
    assert calibration["kept"] == (after <= before)
    assert state["history"][-1]["valid_avg_ppl"] == min(before, after)
    final_step = [h for h in state["history"] if "valid_avg_ppl" in h and "after" not in h][-1]
    assert final_step["step"] == 6 and calibration["valid_before"] == {key: final_step[key] for key in VALID_KEYS}
    # the saved weights are the ones that score that perplexity
    model, vocab = load_model_and_vocab(tmp_path / "o")
    cfg = load_train_config(config)
    valid = slice_by_tokens(read_sentences(Path(cfg.data.valid)), cfg.data.valid_tokens)
    assert score_sentences(model, Vocab(vocab), valid).report()["avg_ppl"] == pytest.approx(
        min(before, after), rel=1e-4
    )


def test_two_process_data_parallel_with_torchrun(tmp_path, brown_corpus):
    overrides = {"max_steps": 6, "log_every": 3, "valid_every": 6, "checkpoint_every": 6}
    config = write_train_config(tmp_path / "c.json", brown_corpus, **overrides)
    train_with_torchrun(config, tmp_path / "ddp")
    state = json.loads((tmp_path / "ddp" / "train_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 6
    # each step's token count is the sum over both ranks' different batches
    single = tmp_path / "single"
    assert main(["train", "--config", str(config), "--out", str(single)]) == 0
    assert state["tokens"] > 1.5 * json.loads((single / "train_state.json").read_text())["tokens"]
    assert np.isfinite([h["valid_avg_ppl"] for h in state["history"] if "valid_avg_ppl" in h]).all()


def test_sampled_softmax_with_all_ids_as_negatives_equals_full_softmax():
    """Corrected sampled softmax over the whole vocabulary (no expected-count correction) is the full softmax."""
    torch.manual_seed(0)
    model = BiLM(tiny(vocab_size=12)).eval()
    objective = LMObjective(model)
    objective.log_q = torch.zeros(12)
    char_ids = torch.randint(1, 200, (3, 5, 50))
    targets = torch.randint(0, 12, (3, 7))
    full = objective(char_ids, targets, None, None)
    sampled = objective(char_ids, targets, torch.arange(12), torch.zeros(12))
    for a, b in zip(full, sampled):
        torch.testing.assert_close(a, b)
    reference = model.lm_loss(char_ids, targets)
    for a, b in zip(full, reference):
        torch.testing.assert_close(a, b)


def test_negative_sampler_prefers_frequent_ids():
    torch.manual_seed(0)
    ids, log_q = NegativeSampler(1000, 200, torch.device("cpu")).sample()
    assert len(ids) == len(torch.unique(ids)) and (ids < 200).float().mean() > 0.5
    assert torch.all(log_q <= 0)


def test_distinct_token_encoder_keeps_outputs_and_keys():
    torch.manual_seed(0)
    model = BiLM(tiny(vocab_size=5)).eval()
    keys = list(model.state_dict())
    char_ids = torch.randint(1, 100, (2, 4, 50))
    char_ids[1] = char_ids[0]
    char_ids[0, 3] = 0
    before = model(char_ids)[0]
    use_distinct_token_encoder(model)
    torch.testing.assert_close(model(char_ids)[0], before)
    assert list(model.state_dict()) == keys


def test_learning_rate_schedule():
    t = OptimConfig(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(110, t) == pytest.approx(0.1)
    timed = OptimConfig(lr=1.0, warmup_steps=0, max_steps=1000, max_time_s=100, anneal_by_time=True, min_lr_ratio=0)
    assert lr_at(5, timed, elapsed_s=100) == pytest.approx(0.0)


# -- bad input: one clear line, exit 2, no traceback -------------------------------------------------------------
def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_missing_corpus_is_one_clear_error(tmp_path, capsys, brown_corpus):
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    cfg = json.loads(config.read_text())
    cfg["data"]["train"] = str(tmp_path / "nowhere" / "train.txt")
    config.write_text(json.dumps(cfg))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "nowhere/train.txt", "not found")


def test_empty_train_file_is_one_clear_error(tmp_path, capsys, brown_corpus):
    (tmp_path / "empty.txt").write_text("\n\n")
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    cfg = json.loads(config.read_text())
    cfg["data"]["train"] = str(tmp_path / "empty.txt")
    config.write_text(json.dumps(cfg))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "empty.txt", "empty")


def test_train_files_are_read_in_order_and_a_repeated_file_is_oversampled(tmp_path):
    (tmp_path / "en.txt").write_text("the cat sat\nit ran\n")
    (tmp_path / "zh.txt").write_text("苹 果\n" + " ".join("字" * 7) + "\n")
    files = [str(tmp_path / "en.txt"), str(tmp_path / "zh.txt"), str(tmp_path / "zh.txt")]
    sentences = read_train_sentences(DataConfig(train=files, max_sentence_tokens=4))
    zh = [["苹", "果"], ["字"] * 4, ["字"] * 3]
    assert sentences == [["the", "cat", "sat"], ["it", "ran"], *zh, *zh]


@pytest.mark.parametrize("mask", [True, False])
def test_cut_boundaries_are_no_training_targets_when_masked(tmp_path, mask):
    (tmp_path / "t.txt").write_text(" ".join("x" * 5) + "\n")
    pieces = read_train_sentences(
        DataConfig(train=str(tmp_path / "t.txt"), max_sentence_tokens=2, mask_cut_boundaries=mask)
    )
    vocab = Vocab([*SPECIALS, "x"])
    freqs = target_frequencies(pieces, vocab).numpy()
    boundaries = 1 if mask else 3  # <S> and </S> targets each: the sentence's own, or one per piece
    assert freqs[BOS_ID] == freqs[EOS_ID] == pytest.approx(boundaries / (2 * 5 + 2 * boundaries))


@pytest.mark.parametrize("value", [[], 3, ["ok.txt", ""]])
def test_bad_train_file_list_is_one_clear_error(tmp_path, capsys, brown_corpus, value):
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    cfg = json.loads(config.read_text())
    cfg["data"]["train"] = value
    config.write_text(json.dumps(cfg))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "data.train")


def test_non_boolean_mask_cut_boundaries_is_one_clear_error(tmp_path, capsys, brown_corpus):
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    cfg = json.loads(config.read_text())
    cfg["data"]["mask_cut_boundaries"] = "yes"
    config.write_text(json.dumps(cfg))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "mask_cut_boundaries")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("projection_dim", 0, "projection_dim"),
        ("filters", [[1, 8], [60, 4]], "filters"),
        ("cell_dim", "big", "cell_dim"),
    ],
)
def test_config_with_wrong_dimensions_is_one_clear_error(tmp_path, capsys, brown_corpus, field, value, needle):
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    cfg = json.loads(config.read_text())
    cfg["model"][field] = value
    config.write_text(json.dumps(cfg))
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], needle)


def test_unknown_training_field_and_missing_config(tmp_path, capsys, brown_corpus):
    config = write_train_config(tmp_path / "c.json", brown_corpus, learning_rate=3)
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o")], "learning_rate")
    _fails(capsys, ["train", "--config", str(tmp_path / "no.json"), "--out", str(tmp_path / "o")], "no.json")


def test_resume_without_state_is_one_clear_error(tmp_path, capsys, brown_corpus):
    config = write_train_config(tmp_path / "c.json", brown_corpus)
    _fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "o"), "--resume"], "nothing to resume")


@pytest.mark.parametrize(
    "name",
    [
        "default.json",
        "default-stage2.json",
        "default-stage3.json",
        "default-stage4.json",
        "default-stage5.json",
        "default-gpu.json",
        "tiny.json",
    ],
)
def test_shipped_configs_are_valid(name):
    cfg = load_train_config(REPO / "configs" / name)
    assert cfg.train.n_negatives > 0
    if name.startswith("default"):  # the same shape as the shipped model, so downstream artifacts stay valid
        shipped = ModelConfig.from_dict(json.loads((REPO / "models" / "default" / "config.json").read_text()))
        assert {k: v for k, v in cfg.model.to_dict().items() if k not in ("vocab_size", "dropout")} == {
            k: v for k, v in shipped.to_dict().items() if k not in ("vocab_size", "dropout")
        }
