"""``elmo mix train / list / report`` end to end on the tiny exported model, and the CLI's error messages."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from elmo.cli import main
from elmo.runtime import Embedder
from elmo.runtime.tasks import TaskStore

WORDS = {"DET": ["the", "a", "this"], "NOUN": ["cat", "dog", "house", "tree"], "VERB": ["sees", "likes", "runs"]}


def _tagging_files(directory, n: int = 40, seed: int = 0):
    """A tiny synthetic tagging set (DET NOUN VERB DET NOUN) as tokens + labels files."""
    rng = np.random.default_rng(seed)
    pattern = ["DET", "NOUN", "VERB", "DET", "NOUN"]
    tokens, labels = directory / "train.txt", directory / "train.labels"
    lines = [" ".join(str(rng.choice(WORDS[t])) for t in pattern) for _ in range(n)]
    tokens.write_text("\n".join(lines) + "\n")
    labels.write_text("\n".join(" ".join(pattern) for _ in range(n)) + "\n")
    return tokens, labels


@pytest.fixture()
def model_dir(tiny_model_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    return directory


def _train(model_dir, tmp_path, *extra: str) -> int:
    return main(
        [
            "mix",
            "train",
            "--model",
            str(model_dir),
            "--cache",
            str(tmp_path / "cache"),
            "--epochs",
            "2",
            "--threads",
            "1",
            *extra,
        ]
    )


def test_train_tagging_stores_a_servable_task(model_dir, tmp_path, capsys):
    tokens, labels = _tagging_files(tmp_path)
    assert (
        _train(
            model_dir,
            tmp_path,
            "--task",
            "toy_pos",
            "--data",
            str(tokens),
            "--labels",
            str(labels),
            "--kind",
            "tagging",
            "--compare",
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["task"] == "toy_pos" and summary["metric"] == "accuracy"
    assert set(summary) >= {"layer0", "layer1", "layer2", "mix", "stored"}
    task_metrics = json.loads((model_dir / "tasks" / "toy_pos" / "task.json").read_text())["metrics"]
    # the mix also started from the best single layer; the dev score chose between the starts
    assert any("from layer" in name for name in task_metrics["mix"]["dev_by_config"])
    assert task_metrics["mix"]["start"] in ("uniform", "layer0", "layer1", "layer2")
    task = TaskStore(model_dir).get("toy_pos")
    assert task.labels == ["DET", "NOUN", "VERB"] and task.kind == "tagging"
    assert task.metrics["eval_split"] == "dev" and "layer0" in task.metrics and task.metrics["mix_history"]
    assert (model_dir / "tasks" / "toy_pos" / "head.safetensors").is_file()
    layers = Embedder(model_dir, intra_op_threads=1).embed_tokens([["the", "cat", "sees", "a", "dog"]])[0]
    assert task.apply(layers).shape == (5, 16) and len(task.predict(layers)) == 5
    assert main(["mix", "list", "--model", str(model_dir)]) == 0
    assert capsys.readouterr().out.startswith("toy_pos\ttagging\tweights [")


def test_train_classification_from_tsv_with_test_file(model_dir, tmp_path, capsys):
    rows = [f"pos\t{w} 很好 {i}" for i, w in enumerate(["真", "非常", "特别"] * 5)]
    rows += [f"neg\t{w} 很差 {i}" for i, w in enumerate(["真", "非常", "特别"] * 5)]
    train = tmp_path / "train.tsv"
    train.write_text("\n".join(rows) + "\n")
    test = tmp_path / "test.tsv"
    test.write_text("pos\t很好\nneg\t很差\n")
    options = ["--kind", "classification", "--pooling", "mean", "--no-compare", "--layer-norm", "on"]
    assert _train(model_dir, tmp_path, "--task", "toy_sent", "--data", str(train), "--test", str(test), *options) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary) >= {"mix", "stored"} and "layer0" not in summary
    task = TaskStore(model_dir).get("toy_sent")
    assert task.kind == "classification" and task.pooling == "mean" and task.metrics["eval_split"] == "test"
    assert task.layer_norm and task.metrics["mix"]["layer_norm"]
    layers = Embedder(model_dir, intra_op_threads=1).embed_texts(["很好"])[0]
    assert task.predict(layers)[0] in ("neg", "pos")


def test_dry_run_stores_nothing(model_dir, tmp_path):
    tokens, labels = _tagging_files(tmp_path, n=12)
    assert (
        _train(
            model_dir,
            tmp_path,
            "--task",
            "x",
            "--data",
            str(tokens),
            "--labels",
            str(labels),
            "--kind",
            "tagging",
            "--dry-run",
        )
        == 0
    )
    assert TaskStore(model_dir).names() == []


def test_labels_that_do_not_match_the_tokens(model_dir, tmp_path, capsys):
    tokens, labels = _tagging_files(tmp_path, n=5)
    labels.write_text("DET NOUN VERB DET NOUN\nDET NOUN\n" + "DET NOUN VERB DET NOUN\n" * 3)
    code = _train(
        model_dir, tmp_path, "--task", "x", "--data", str(tokens), "--labels", str(labels), "--kind", "tagging"
    )
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "elmo mix: error: labels file" in err and "line 2: 2 labels for 5 tokens" in err


def test_empty_training_set(model_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code = _train(model_dir, tmp_path, "--task", "x", "--data", str(empty), "--kind", "tagging")
    err = capsys.readouterr().err
    assert code == 2 and "no labelled sentences (empty training set)" in err


def test_a_single_label_is_not_a_task(model_dir, tmp_path, capsys):
    tokens, labels = tmp_path / "t.txt", tmp_path / "t.labels"
    tokens.write_text("a b\nc d\ne f\n")
    labels.write_text("X X\nX X\nX X\n")
    code = _train(
        model_dir, tmp_path, "--task", "x", "--data", str(tokens), "--labels", str(labels), "--kind", "tagging"
    )
    assert code == 2 and "only 1 distinct label" in capsys.readouterr().err


def test_bad_task_name_and_missing_kind(model_dir, tmp_path, capsys):
    tokens, labels = _tagging_files(tmp_path, n=5)
    assert _train(model_dir, tmp_path, "--task", "../up", "--data", str(tokens), "--kind", "tagging") == 2
    assert "task name '../up' is not valid" in capsys.readouterr().err
    assert _train(model_dir, tmp_path, "--task", "x", "--data", str(tokens)) == 2
    assert "--kind tagging|classification is needed" in capsys.readouterr().err
    assert _train(model_dir, tmp_path, "--task", "x", "--data", str(tmp_path / "missing.txt"), "--kind", "tagging") == 2
    assert "missing.txt: file not found" in capsys.readouterr().err


def test_report_writes_table_and_plots(model_dir, tmp_path, capsys):
    tokens, labels = _tagging_files(tmp_path, n=20)
    (tmp_path / "test").mkdir()
    test_tokens, test_labels = _tagging_files(tmp_path / "test", n=10, seed=1)
    assert (
        _train(
            model_dir,
            tmp_path,
            "--task",
            "toy_pos",
            "--data",
            str(tokens),
            "--labels",
            str(labels),
            "--test",
            str(test_tokens),
            "--test-labels",
            str(test_labels),
            "--kind",
            "tagging",
            "--compare",
        )
        == 0
    )
    comparison = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["mix_vs_best_layer"]
    assert comparison["layer"] in ("layer0", "layer1", "layer2") and comparison["resamples"] == 1000
    assert comparison["ci95"][0] <= comparison["difference"] <= comparison["ci95"][1]
    assert comparison["verdict"] in ("better", "worse", "inconclusive", "tie (within ±0.01)")
    out = tmp_path / "report"
    assert main(["mix", "report", "--model", str(model_dir), "--out", str(out), "--threads", "1"]) == 0
    for name in ("report.md", "report.json", "mix_weights.png", "apple_similarity.png", "senses.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "| toy_pos | accuracy (dev) |" in md and "苹果" in md
    assert f"vs {comparison['layer']} [" in md  # the test table states the comparison with its interval
    assert "## Word-sense benchmark" in md and "mix toy_pos" in md
    senses = json.loads((out / "report.json").read_text())["senses"]
    assert set(senses) == {"en", "zh"} and set(senses["zh"]["mixes"]) == {"toy_pos"}
    apple = json.loads((out / "report.json").read_text())["apple"]
    # Layer 0 is context-free: every 苹果 is the same vector, whatever the sentence.
    assert apple["layers"][0]["within_sense"] == pytest.approx(1.0, abs=1e-5)
    assert apple["layers"][0]["across_sense"] == pytest.approx(1.0, abs=1e-5)
    assert len(apple["layers"]) == 3 and len(apple["sentences"]) == 8


# Every user file `elmo mix train` reads, saved as GB18030 (Chinese text from Windows tools often is): one line
# naming the file, the byte, the line and iconv; exit 2, nothing stored, nothing cached. Was a UnicodeDecodeError.
CHINESE_FILES = {  # case -> (files: name -> text, the arguments); the last file in the arguments is in GB18030
    "conll --data": ({"train.conll": "苹果 NN\n很 AD\n\n好 VA\n"}, ["--data", "train.conll", "--kind", "tagging"]),
    "tokens --data": (
        {"t.labels": "DET NOUN\nNN AD\n", "t.txt": "the cat\n苹果 很\n"},
        ["--labels", "t.labels", "--data", "t.txt", "--kind", "tagging"],
    ),
    "tsv --data": ({"s.tsv": "pos\tgood\nneg\t很难吃\n"}, ["--data", "s.tsv", "--kind", "classification"]),
    "--labels": (
        {"s.txt": "good\nbad\n", "s.labels": "正面\n负面\n"},
        ["--data", "s.txt", "--labels", "s.labels", "--kind", "classification"],
    ),
    "--dev": (
        {"s.tsv": "pos\tgood\nneg\tbad\n", "dev.tsv": "pos\t好吃\n"},
        ["--data", "s.tsv", "--dev", "dev.tsv", "--kind", "classification"],
    ),
    "--test": (
        {"s.tsv": "pos\tgood\nneg\tbad\n", "test.tsv": "pos\tfine\nneg\t难吃\n"},
        ["--data", "s.tsv", "--test", "test.tsv", "--kind", "classification"],
    ),
}


@pytest.mark.parametrize("case", list(CHINESE_FILES))
def test_a_gb18030_file_is_one_line_naming_it(model_dir, tmp_path, capsys, case):
    files, args = CHINESE_FILES[case]
    chinese = [name for name in args if name in files][-1]
    for name, text in files.items():
        (tmp_path / name).write_bytes(text.encode("gb18030" if name == chinese else "utf-8"))
    arguments = [str(tmp_path / value) if value in files else value for value in args]
    code = _train(model_dir, tmp_path, "--task", "zh", *arguments)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    path = tmp_path / chinese
    bad = files[chinese].encode("gb18030")
    with pytest.raises(UnicodeDecodeError) as decoding:  # (some GB18030 byte pairs are valid UTF-8 by chance)
        bad.decode("utf-8")
    start = decoding.value.start
    line = bad.count(b"\n", 0, start) + 1
    assert err.splitlines() == [
        f"elmo mix: error: {path}: not UTF-8 (byte 0x{bad[start]:02x} on line {line}); convert it first, e.g. "
        f"`iconv -f GB18030 -t UTF-8 {path} > {path.stem}.utf8{path.suffix}` for Chinese text"
    ]
    assert not (model_dir / "tasks" / "zh").exists() and not (tmp_path / "cache").exists()


def test_features_show_a_progress_bar_unless_asked_not_to(model_dir, tmp_path, capsys):
    """The biLM pass over each split (minutes on a real data set) was silent: a tqdm bar per split on stderr."""
    tokens, labels = _tagging_files(tmp_path, n=300)  # dev: every 10th sentence (30), train: the other 270
    args = ["--task", "bar", "--data", str(tokens), "--labels", str(labels), "--kind", "tagging", "--dry-run"]
    assert _train(model_dir, tmp_path, *args) == 0
    err = capsys.readouterr().err.replace("\r", "\n")
    assert "features train: 100%" in err and "270/270" in err and "features dev: 100%" in err and "30/30" in err
    assert _train(model_dir, tmp_path, *args, "--no-progress") == 0  # from the cache: a bar would be 100 % at once
    assert "features train:" not in capsys.readouterr().err
