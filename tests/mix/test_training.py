"""``elmo mix train`` learns: on a small learnable tagging set the trained mix beats the majority-class baseline.

tests/mix/test_cli.py checks what training stores (names, files, metric names) after two epochs; a trainer that
never learned anything would pass it. Here each label is a function of the token's identity, which the char-CNN
layer (layer 0) of any model tells apart, the classes are unbalanced (the majority class alone scores about 0.5),
and the held-out test sentences reuse the words in new orders. The stored task must tag them far better than
always answering the majority label, and the score it records must be the one it really reaches.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from elmo.cli import main
from elmo.runtime import CPU, Embedder
from elmo.runtime.tasks import TaskStore

# Three classes of made-up words; the label is the class. Class shares 0.5 / 0.3 / 0.2.
CLASSES = {
    "ALPHA": ["brill", "gimble", "wabe", "mome", "rath", "tove", "borogove", "slithy"],
    "BETA": ["frumious", "vorpal", "manxome", "tulgey", "uffish", "galumph", "beamish", "frabjous"],
    "GAMMA": ["jubjub", "bandersnatch", "tumtum", "callooh", "callay", "chortle", "outgrabe", "burble"],
}
SHARES = {"ALPHA": 0.5, "BETA": 0.3, "GAMMA": 0.2}


def _write_split(directory: Path, name: str, n_sentences: int, seed: int) -> tuple[Path, Path, list[list[str]]]:
    rng = np.random.default_rng(seed)
    labels = list(SHARES)
    tokens_lines, label_lines, gold = [], [], []
    for _ in range(n_sentences):
        tags = [str(t) for t in rng.choice(labels, size=int(rng.integers(5, 11)), p=list(SHARES.values()))]
        words = [str(rng.choice(CLASSES[t])) for t in tags]
        tokens_lines.append(" ".join(words))
        label_lines.append(" ".join(tags))
        gold.append(tags)
    tokens, tag_file = directory / f"{name}.txt", directory / f"{name}.labels"
    tokens.write_text("\n".join(tokens_lines) + "\n")
    tag_file.write_text("\n".join(label_lines) + "\n")
    return tokens, tag_file, gold


@pytest.fixture()
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    return directory


def test_trained_mix_beats_the_majority_baseline_on_held_out_sentences(model_dir: Path, tmp_path: Path, capsys):
    train, train_labels, _ = _write_split(tmp_path, "train", 80, seed=1)
    test, test_labels, gold = _write_split(tmp_path, "test", 40, seed=2)
    argv = [
        "mix",
        "train",
        "--model",
        str(model_dir),
        "--task",
        "made_up",
        "--data",
        str(train),
        "--labels",
        str(train_labels),
        "--kind",
        "tagging",
        "--test",
        str(test),
        "--test-labels",
        str(test_labels),
        "--cache",
        str(tmp_path / "cache"),
        "--epochs",
        "30",
        "--batch-size",
        "8",
        "--no-compare",
        "--threads",
        "1",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # The baseline from the same test data: always answer the most frequent test label.
    flat_gold = [tag for tags in gold for tag in tags]
    majority = Counter(flat_gold).most_common(1)[0][1] / len(flat_gold)
    assert 0.4 < majority < 0.6  # the set is unbalanced as designed, so the baseline is far from chance (1/3)

    # Tag the test sentences with the stored task through the serving path (runtime layers -> numpy mix -> head).
    task = TaskStore(model_dir).get("made_up")
    sentences = [line.split() for line in test.read_text().splitlines()]
    layers = Embedder(model_dir, providers=[CPU], intra_op_threads=1).embed_tokens(sentences)
    predicted = [tag for sentence_layers in layers for tag in task.predict(sentence_layers)]
    accuracy = float(np.mean([p == g for p, g in zip(predicted, flat_gold)]))

    # Learned, not guessed: at least half of the way from the baseline to a perfect score (measured: 0.98 vs 0.51).
    assert accuracy >= majority + 0.5 * (1.0 - majority), (accuracy, majority)
    # The score the task records is the one it reaches (the stored head and mix are the trained ones).
    assert task.metrics["eval_split"] == "test" and summary["metric"] == "accuracy"
    assert summary["mix"]["test"] == pytest.approx(accuracy, abs=1e-4)


def test_a_warm_started_mix_starts_at_the_single_layer_and_keeps_its_dev_score():
    import torch

    from elmo.mix.modules import WARM_START_LOGIT, FeatureData, TaskModel, TrainConfig, predict, train_task_model

    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 8, size=60)
    layers = rng.normal(size=(3, int(lengths.sum()), 8)).astype(np.float32)
    targets = (layers[2, :, 0] > 0).astype(np.int64)  # only layer 2 carries the label
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    train = FeatureData(layers, offsets, targets, "tagging")
    cfg = TrainConfig(hidden=8, epochs=3, batch_size=8)

    def score(predicted):
        return float((np.concatenate(predicted) == targets).mean())

    single, single_hist = train_task_model("tagging", train, train, 2, cfg, score, layer=2)
    mix = TaskModel("tagging", 3, 8, 2, cfg).warm_start_from(single, 2)
    assert all(torch.equal(a, b) for a, b in zip(mix.head.state_dict().values(), single.head.state_dict().values()))
    weights = mix.mix.normalized_weights()
    assert weights[2] == pytest.approx(np.exp(WARM_START_LOGIT) / (np.exp(WARM_START_LOGIT) + 2), abs=1e-6)

    start_score = score(predict(mix, train))
    warm, warm_hist = train_task_model("tagging", train, train, 2, cfg, score, warm_start=(single, 2))
    assert warm_hist["best_dev"] >= start_score  # the untrained start is epoch 0: the kept mix is never worse on dev
