"""Feature extraction: the numpy API (local and remote, same numbers), the scikit-learn transformer, the feature
cache, and the labelled-data readers of elmo.mix.task_data."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline

from elmo.errors import DataError, InputError
from elmo.features import ElmoVectorizer, Features, cache_features, select_layer
from elmo.mix.task_data import (
    bmes_entities,
    brown_to_universal,
    entity_f1,
    read_brown_file,
    read_conll,
    read_user_data,
    sentiment_texts,
)
from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, TaskStore, save_task

SENTENCES = [["The", "cat", "sat", "."], ["苹", "果", "很", "甜"], ["a"]]


@pytest.fixture(scope="module")
def model_with_task(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model with one stored task ("demo": a fixed, uneven mix)."""
    directory = tmp_path_factory.mktemp("features") / "model"
    shutil.copytree(tiny_model_dir, directory)
    save_task(directory, Task("demo", "tagging", 3, 16, [0.5, -1.0, 1.5], 1.3, layer_norm=True))
    return directory


@pytest.fixture(scope="module")
def local(model_with_task):
    return Features(model=model_with_task, intra_op_threads=1)


def test_local_layers_are_the_runtime_output(local, model_with_task):
    reference = Embedder(model_with_task, intra_op_threads=1).embed_tokens(SENTENCES)
    for got, expected in zip(local.layers(SENTENCES), reference):
        np.testing.assert_array_equal(got, expected)
    assert (local.n_layers, local.dim) == (3, 16)


def test_raw_text_goes_through_the_one_tokenizer(local):
    assert local.tokens(["The cat sat.", ["pre", "tokenized"]]) == [["The", "cat", "sat", "."], ["pre", "tokenized"]]
    np.testing.assert_array_equal(local.layers(["The cat sat."])[0], local.layers([SENTENCES[0]])[0])
    with pytest.raises(InputError, match="one string"):
        local.layers("The cat sat.")
    with pytest.raises(InputError, match="sentence 0"):
        local.layers([3])


def test_mix_by_task_name_by_task_and_by_weights_agree(local, model_with_task):
    task = TaskStore(model_with_task).get("demo")
    by_name = local.mix(SENTENCES, task="demo")
    by_task = local.mix(SENTENCES, task=task)
    by_weights = local.mix(SENTENCES, weights=[0.5, -1.0, 1.5], gamma=1.3, layer_norm=True)
    for a, b, c in zip(by_name, by_task, by_weights):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    with pytest.raises(InputError, match="unknown task 'nope'"):
        local.mix(SENTENCES, task="nope")


def test_layer_selection_and_sentence_vectors(local):
    layers = local.layers(SENTENCES)[0]
    np.testing.assert_array_equal(select_layer(layers, "top"), layers[2])
    np.testing.assert_allclose(select_layer(layers, "average"), layers.mean(axis=0))
    assert select_layer(layers, "all").shape == (4, 48)
    with pytest.raises(InputError, match="layer 5 does not exist"):
        select_layer(layers, 5)
    vectors = local.sentence_vectors(SENTENCES, layer=1, pooling="mean+max")
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(vectors[0, :16], layers[1].mean(axis=0), atol=1e-6)
    np.testing.assert_allclose(vectors[0, 16:], layers[1].max(axis=0), atol=1e-6)


def test_sklearn_pipeline_just_works(model_with_task):
    positive = ["good happy great", "happy good day", "great good fun", "a happy great time"]
    negative = ["bad sad awful", "sad bad day", "awful bad mess", "a sad awful time"]
    texts, labels = positive + negative, [1] * 4 + [0] * 4
    pipeline = Pipeline(
        [
            ("elmo", ElmoVectorizer(model=str(model_with_task), layer="all", pooling="mean")),
            ("clf", LogisticRegression(C=100.0, max_iter=2000)),
        ]
    )
    pipeline.fit(texts, labels)
    assert pipeline.named_steps["elmo"].n_features_out_ == 48
    assert pipeline.predict(texts).shape == (8,)
    assert pipeline.score(texts, labels) > 0.5  # training data; the random tiny model still separates some
    # scikit-learn conventions: clone keeps the parameters, pickling leaves the onnxruntime session behind.
    assert clone(pipeline.named_steps["elmo"]).get_params()["layer"] == "all"
    restored = pickle.loads(pickle.dumps(pipeline))
    np.testing.assert_allclose(restored.predict_proba(texts), pipeline.predict_proba(texts), atol=1e-6)


def test_vectorizer_with_a_task(model_with_task):
    vectorizer = ElmoVectorizer(model=str(model_with_task), task="demo", pooling="max")
    out = vectorizer.fit_transform(["The cat sat .", "苹果很甜"])
    expected = Features(model=model_with_task).sentence_vectors(
        ["The cat sat .", "苹果很甜"], task="demo", pooling="max"
    )
    np.testing.assert_allclose(out, expected, atol=1e-6)
    with pytest.raises(InputError, match="pooling"):
        ElmoVectorizer(model=str(model_with_task), pooling="median").fit(["x"])


def test_features_needs_exactly_one_source():
    with pytest.raises(InputError, match="exactly one"):
        Features()
    with pytest.raises(InputError, match="exactly one"):
        Features(model="m", server="h:1")


# -- feature cache ---------------------------------------------------------------------------------------------
def test_cache_embeds_once_and_recomputes_for_another_model(local, tmp_path):
    calls = []

    def embed(batch):
        calls.append(len(batch))
        return local.layers(batch)

    first = cache_features(embed, SENTENCES, tmp_path, "demo.train", "model-a", chunk=2)
    n_calls = len(calls)
    again = cache_features(embed, SENTENCES, tmp_path, "demo.train", "model-a")
    assert len(calls) == n_calls  # cached: no embedding at all
    for i, expected in enumerate(local.layers(SENTENCES)):
        np.testing.assert_allclose(again.sentence(i), expected, atol=2e-3, rtol=1e-3)  # float16 storage
    assert first.offsets.tolist() == [0, 4, 8, 9]
    cache_features(embed, SENTENCES, tmp_path, "demo.train", "model-b")
    assert len(calls) > n_calls  # another model: recomputed
    n_calls = len(calls)
    cache_features(embed, SENTENCES[:2], tmp_path, "demo.train", "model-b")
    assert len(calls) > n_calls  # other sentences: recomputed


# -- labelled data ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tag", "universal"),
    [
        ("nn", "NOUN"),
        ("nns-tl", "NOUN"),
        ("np$", "NOUN"),
        ("vbd", "VERB"),
        ("bez*", "VERB"),
        ("hvz", "VERB"),
        ("pps+bez", "PRON"),
        ("pp$", "PRON"),
        ("at", "DET"),
        ("in", "ADP"),
        ("cc", "CONJ"),
        ("cd", "NUM"),
        ("jjr", "ADJ"),
        ("rb", "ADV"),
        ("ql", "ADV"),
        ("to", "PRT"),
        ("fw-nn", "X"),
        (",", "."),
        ("--", "."),
        ("``", "."),
        ("md*", "VERB"),
        ("nn-hl", "NOUN"),
    ],
)
def test_brown_tags_map_to_the_universal_set(tag, universal):
    assert brown_to_universal(tag) == universal


def test_read_brown_file(tmp_path):
    path = tmp_path / "ca01"
    path.write_text("\n\n\tThe/at jury/nn said/vbd ``/`` yes/rb ''/'' ./.\n\n\tA/at b/c/nn\n")
    rows = read_brown_file(path)
    assert rows[0] == (["The", "jury", "said", '"', "yes", '"', "."], ["DET", "NOUN", "VERB", ".", "ADV", ".", "."])
    assert rows[1][0] == ["A", "b/c"]


def test_bmes_entities_are_strict():
    tags = ["B-PER", "M-PER", "E-PER", "O", "S-LOC", "B-ORG", "E-LOC", "B-ORG", "M-ORG"]
    assert bmes_entities(tags) == {(0, 3, "PER"), (4, 5, "LOC")}
    gold = [["B-PER", "E-PER", "O", "S-LOC"]]
    assert entity_f1(gold, gold)["f1"] == 1.0
    half = entity_f1(gold, [["B-PER", "E-PER", "O", "O"]])
    assert half["precision"] == 1.0 and half["recall"] == 0.5 and half["f1"] == pytest.approx(2 / 3)
    assert entity_f1(gold, [["O", "O", "O", "O"]])["f1"] == 0.0


def test_read_conll_and_its_errors(tmp_path):
    path = tmp_path / "ner.txt"
    path.write_bytes("中 B-LOC\r\n国 E-LOC\r\n\r\n好 O\r\n".encode())
    data = read_conll(path)
    assert data.sentences == [["中", "国"], ["好"]] and data.labels == [["B-LOC", "E-LOC"], ["O"]]
    path.write_text("中 B-LOC extra\n")
    with pytest.raises(DataError, match="line 1: expected 'token TAG'"):
        read_conll(path)


def test_user_tagging_files_must_match(tmp_path):
    tokens, labels = tmp_path / "train.txt", tmp_path / "train.labels"
    tokens.write_text("the cat sat\na dog\n")
    labels.write_text("DET NOUN VERB\nDET NOUN\n")
    data = read_user_data(tokens, "tagging", labels)
    assert data.labels == [["DET", "NOUN", "VERB"], ["DET", "NOUN"]]
    labels.write_text("DET NOUN VERB\nDET\n")
    with pytest.raises(DataError, match=r"train.labels line 2: 1 labels for 2 tokens"):
        read_user_data(tokens, "tagging", labels)
    labels.write_text("DET NOUN VERB\n")
    with pytest.raises(DataError, match="has 1 lines but tokens file .* has 2"):
        read_user_data(tokens, "tagging", labels)
    tokens.write_text("")
    labels.write_text("")
    with pytest.raises(DataError, match="empty training set"):
        read_user_data(tokens, "tagging", labels)


def test_user_classification_files(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("pos\t这个很好\nneg\tbad movie\n")
    data = read_user_data(path, "classification", tokenized=False)
    assert data.labels == ["pos", "neg"] and data.sentences[0] == ["这", "个", "很", "好"]
    path.write_text("no tab here\n")
    with pytest.raises(DataError, match="line 1: expected 'label<TAB>text'"):
        read_user_data(path, "classification")


def test_sentiment_dedup_drops_conflicts(tmp_path):
    neg, pos = tmp_path / "neg.txt", tmp_path / "pos.txt"
    neg.write_text("差\n差\n一般\n")
    pos.write_text("好\n一般\n好\n很好\n")
    pairs, counts = sentiment_texts(neg, pos)
    assert pairs == [("好", "pos"), ("差", "neg"), ("很好", "pos")]
    assert sorted(pairs) == sorted([("好", "pos"), ("差", "neg"), ("很好", "pos")])
    assert counts["conflicting_dropped"] == 1 and counts["kept"] == 3


def test_features_import_where_scikit_learn_is_not_installed(tiny_model_dir) -> None:
    """The serving install (and the `spacy` extra) has no scikit-learn: elmo.features still imports and embeds."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class NoSklearn:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'sklearn' or name.startswith('sklearn.'):\n"
        "            raise ImportError('scikit-learn is not installed here')\n"
        "sys.meta_path.insert(0, NoSklearn())\n"
        "from elmo.features import ElmoVectorizer, Features\n"
        f"print(Features(model={str(tiny_model_dir)!r}).layers([['a', 'b']])[0].shape[1])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "2"
