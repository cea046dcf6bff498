"""The `elmo` spaCy component with the real spaCy, the real runtime and a real `elmo serve`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import spacy

from elmo.runtime import Embedder
from elmo.runtime.tasks import Task, save_task
from elmo.spacy.component import ElmoSpacyError
from elmo.text.overflow import embed_windowed
from tests.conftest import REPO
from tests.serve_process import ServeProcess

TEXTS = [
    "The apple fell from the tree.",
    "Apple  shares rose\n\nafter the report.",
    "A",
    "   ",
    "",
    "Stocks fell , then rose again , and fell once more before the bell rang at four .",
    "我买了一台苹果电脑。",
]


def runtime_layers(model_dir, sentences: list[list[str]]) -> list[np.ndarray]:
    return Embedder(model_dir).embed_tokens(sentences)


def elmo_nlp(lang: str = "en", **config) -> spacy.Language:
    nlp = spacy.blank(lang)
    nlp.add_pipe("elmo", config=config)
    return nlp


def words(doc) -> list[str]:
    return [t.text for t in doc if not t.is_space]


def test_add_pipe_by_entry_point_without_importing_the_package(tiny_model_dir) -> None:
    """A fresh interpreter that imports only spaCy finds the factory through the package's entry points."""
    script = (
        "import sys, spacy\n"
        "assert not any(m == 'elmo' or m.startswith('elmo.') for m in sys.modules)\n"
        "nlp = spacy.blank('en')\n"
        f"nlp.add_pipe('elmo', config={{'model': {str(tiny_model_dir)!r}}})\n"
        "doc = nlp('The apple fell.')\n"
        "print(list(doc._.elmo_layers.shape), list(doc.tensor.shape))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    n_layers, dim = Embedder(tiny_model_dir).info.n_layers, Embedder(tiny_model_dir).info.dim
    assert result.stdout.split("\n")[0] == f"[{n_layers}, 4, {dim}] [4, {dim}]"


def test_layers_are_the_runtimes_on_spacys_own_tokens_and_spaces_get_zeros(tiny_model_dir) -> None:
    nlp = elmo_nlp(model=str(tiny_model_dir))
    doc = nlp("Apple  shares rose\n\nafter the report.")
    spaces = [t.i for t in doc if t.is_space]
    assert spaces, [t.text for t in doc]  # spaCy made whitespace tokens of the double space and the blank line
    expected = runtime_layers(tiny_model_dir, [words(doc)])[0]
    layers = doc._.elmo_layers
    assert layers.dtype == np.float32 and layers.shape == (expected.shape[0], len(doc), expected.shape[2])
    kept = [t.i for t in doc if not t.is_space]
    np.testing.assert_array_equal(layers[:, kept], expected)
    assert not layers[:, spaces].any()
    np.testing.assert_allclose(doc.tensor, layers.mean(axis=0), atol=1e-7)
    np.testing.assert_array_equal(doc[0].vector, doc.tensor[0])


def test_pipe_batches_equal_single_calls(tiny_model_dir) -> None:
    nlp = elmo_nlp(model=str(tiny_model_dir))
    single = [nlp(text)._.elmo_layers for text in TEXTS]
    fresh = elmo_nlp(model=str(tiny_model_dir))  # no cache shared with the single calls
    batched = [doc._.elmo_layers for doc in fresh.pipe(TEXTS * 3, batch_size=4)]
    assert len(batched) == 3 * len(TEXTS)
    for index, layers in enumerate(batched):
        want = single[index % len(TEXTS)]
        assert layers.shape == want.shape
        assert float(np.abs(layers - want).max(initial=0.0)) <= 1e-6, TEXTS[index % len(TEXTS)]


def test_chinese_needs_no_segmenter_and_contexts_differ(tiny_model_dir) -> None:
    nlp = elmo_nlp("zh", model=str(tiny_model_dir), output="top")
    fruit, company = nlp("我吃了一个苹果。"), nlp("我买了一台苹果电脑。")
    assert words(fruit) == list("我吃了一个苹果。")
    np.testing.assert_array_equal(fruit._.elmo_layers, runtime_layers(tiny_model_dir, [list("我吃了一个苹果。")])[0])
    # layer 0 is context-free: the same vector for 苹 in both; the top layer is not, and similarity says so
    np.testing.assert_array_equal(fruit._.elmo_layers[0, 5], company._.elmo_layers[0, 5])
    assert fruit[5].text == company[5].text == "苹"
    assert fruit[5].similarity(company[5]) < 0.9999  # spaCy's own rule would answer 1.0 for the same text
    assert fruit[5:7].similarity(fruit[5:7]) == pytest.approx(1.0)


def test_output_choices_fill_doc_tensor(tiny_model_dir, spacy_model) -> None:
    text = "The apple fell ."
    layers = elmo_nlp(model=str(tiny_model_dir))(text)._.elmo_layers
    assert np.array_equal(elmo_nlp(model=str(tiny_model_dir), output="top")(text).tensor, layers[-1])
    assert np.array_equal(elmo_nlp(model=str(tiny_model_dir), output="layer:1")(text).tensor, layers[1])
    untouched = elmo_nlp(model=str(tiny_model_dir), output="none")(text)
    assert untouched.tensor.size == 0 and untouched._.elmo_layers is not None
    task = Task("spacy_demo_mix", "tagging", layers.shape[0], layers.shape[2], [0.5, -1.0, 2.0], 1.5)
    save_task(spacy_model, task)
    mixed = elmo_nlp(model=str(spacy_model), output="task:spacy_demo_mix")(text).tensor
    np.testing.assert_allclose(mixed, task.apply(layers), atol=1e-6)


def test_remote_backend_equals_the_local_one(spacy_server, spacy_model) -> None:
    local = [d._.elmo_layers for d in elmo_nlp(model=str(spacy_model)).pipe(TEXTS)]
    remote = [d._.elmo_layers for d in elmo_nlp(server=spacy_server).pipe(TEXTS, batch_size=3)]
    for a, b in zip(local, remote):
        assert a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) <= 1e-6


def test_to_disk_and_load_by_reference_from_another_folder(tmp_path, tiny_model_dir) -> None:
    nlp = elmo_nlp(model=os.path.relpath(tiny_model_dir, REPO), output="top")
    nlp.to_disk(tmp_path / "pipeline")
    script = (
        "import spacy, numpy\n"
        f"nlp = spacy.load({str(tmp_path / 'pipeline')!r})\n"
        "numpy.save('layers.npy', nlp('The apple fell .')._.elmo_layers)\n"
    )  # run from tmp_path: the saved relative path would not resolve there, the saved absolute one does
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        want = nlp("The apple fell .")._.elmo_layers
    finally:
        os.chdir(cwd)
    np.testing.assert_array_equal(np.load(tmp_path / "layers.npy"), want)


def test_a_bundled_pipeline_no_longer_needs_the_model_directory(tmp_path, tiny_model_dir) -> None:
    source = tmp_path / "model"
    shutil.copytree(tiny_model_dir, source)
    nlp = elmo_nlp(model=str(source), bundle=True)
    want = nlp("The apple fell .")._.elmo_layers
    nlp.to_disk(tmp_path / "pipeline")
    shutil.rmtree(source)
    assert json.loads((tmp_path / "pipeline" / "elmo" / "cfg.json").read_text())["bundled"] is True
    loaded = spacy.load(tmp_path / "pipeline")
    np.testing.assert_array_equal(loaded("The apple fell .")._.elmo_layers, want)
    assert loaded.get_pipe("elmo").model_path == str(tmp_path / "pipeline" / "elmo" / "model")


def test_a_long_document_is_windowed_like_the_runtime_or_refused(tiny_model_dir) -> None:
    text = " ".join(f"w{i % 37}" for i in range(1100))  # over the runtime's 1,024 tokens per sentence
    doc = elmo_nlp(model=str(tiny_model_dir))(text)
    embedder = Embedder(tiny_model_dir)
    want = embed_windowed(embedder.embed_tokens, [words(doc)], embedder.info.max_tokens_per_sentence)[0]
    np.testing.assert_array_equal(doc._.elmo_layers, want)
    with pytest.raises(ElmoSpacyError, match=r"the document starting 'w0 w1 w2 .*' has 1100 tokens, over the limit "):
        elmo_nlp(model=str(tiny_model_dir), overflow="reject")(text)
    truncated = elmo_nlp(model=str(tiny_model_dir), overflow="truncate")(text)._.elmo_layers
    assert truncated[:, :1024].any() and not truncated[:, 1024:].any()


def test_bad_configuration_names_the_cause(tmp_path, tiny_model_dir) -> None:
    with pytest.raises(ElmoSpacyError, match=r"exactly one of config model=DIR .* or server=HOST:PORT"):
        elmo_nlp()
    with pytest.raises(ElmoSpacyError, match=r"output 'middle' is not one of"):
        elmo_nlp(model=str(tiny_model_dir), output="middle")
    missing = elmo_nlp(model=str(tmp_path / "nowhere"))
    with pytest.raises(ElmoSpacyError, match=r"cannot open model directory .*nowhere.*not found"):
        missing("text")
    with pytest.raises(ElmoSpacyError, match=r"output task:no_such_task: unknown task 'no_such_task'.*available tasks"):
        elmo_nlp(model=str(tiny_model_dir), output="task:no_such_task")("text")
    with pytest.raises(ElmoSpacyError, match=r"output layer:7: layer 7 does not exist: the model has layers 0\.\.2"):
        elmo_nlp(model=str(tiny_model_dir), output="layer:7")("text")


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_is_named(tmp_path) -> None:
    nlp = elmo_nlp(server=f"127.0.0.1:{unused_port()}")
    with pytest.raises(ElmoSpacyError, match=r"cannot open server 127\.0\.0\.1:\d+: UNAVAILABLE"):
        nlp("The apple fell .")


def test_a_server_failure_mid_pipe_keeps_the_documents_already_processed(tmp_path, tiny_model_dir) -> None:
    texts = [f"Sentence number {i} is here ." for i in range(8)]
    with ServeProcess(["--model", str(tiny_model_dir)], tmp_path / "serve") as server:
        nlp = elmo_nlp(server=server.wait_serving())
        stream = nlp.pipe(texts, batch_size=2)
        done = [next(stream) for _ in range(4)]
        kept = [doc._.elmo_layers.copy() for doc in done]
        server.close()  # killed: the next batch's call fails
        with pytest.raises(ElmoSpacyError, match=r"server 127\.0\.0\.1:\d+ failed: UNAVAILABLE"):
            next(stream)
    local = elmo_nlp(model=str(tiny_model_dir))
    for doc, layers in zip(done, kept):
        np.testing.assert_array_equal(doc._.elmo_layers, layers)
        np.testing.assert_allclose(layers, local(doc.text)._.elmo_layers, atol=1e-6)


def test_the_error_handler_lets_the_pipe_go_on(tiny_model_dir) -> None:
    nlp = elmo_nlp(model=str(tiny_model_dir), overflow="reject")
    seen = []
    nlp.set_error_handler(lambda name, proc, docs, error: seen.append((name, len(docs), type(error).__name__)))
    docs = list(nlp.pipe(["short one .", " ".join(["x"] * 1030), "another ."], batch_size=1))
    assert seen == [("elmo", 1, "ElmoSpacyError")]
    assert docs[0]._.elmo_layers is not None and docs[1]._.elmo_layers is None and docs[2]._.elmo_layers is not None


def test_the_cache_answers_a_repeated_sentence_without_the_runtime(tiny_model_dir) -> None:
    nlp = elmo_nlp(model=str(tiny_model_dir), cache_mb=1)
    component = nlp.get_pipe("elmo")
    first = nlp("The apple fell .")._.elmo_layers
    component._backend = None
    component.model_path = "/nonexistent"  # a runtime call would now fail
    second = nlp("The apple fell .")
    np.testing.assert_array_equal(second._.elmo_layers, first)
    assert len(component.cache) == 1 and component.cache.bytes == first.nbytes


def test_the_component_runs_where_torch_cannot_be_imported(tiny_model_dir) -> None:
    """The `spacy` extra brings no torch: with `import torch` failing, spaCy, the component and the listener work."""
    script = (
        "import sys\n"
        "class NoTorch:  # `import torch` raises ImportError, as where it is not installed\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is not installed here')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import spacy\n"
        "nlp = spacy.blank('en')\n"
        f"nlp.add_pipe('elmo', config={{'model': {str(tiny_model_dir)!r}}})\n"
        "nlp.add_pipe('tagger', config={'model': {'@architectures': 'spacy.Tagger.v2', 'tok2vec': {\n"
        "    '@architectures': 'elmo.ElmoListener.v1', 'width': 8}}})\n"
        "from spacy.training import Example\n"
        "from spacy.tokens import Doc\n"
        "gold = Doc(nlp.vocab, words=['a', 'cat'], tags=['DET', 'NOUN'])\n"
        "nlp.initialize(lambda: [Example(nlp.make_doc('a cat'), gold)])\n"
        "print([t.tag_ in ('DET', 'NOUN') for t in nlp('a cat')], 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[True, True] False"


def test_several_processes_give_the_same_layers_and_the_hooks_come_back(tiny_model_dir, capfd) -> None:
    from elmo.spacy.component import add_similarity_hooks

    nlp = elmo_nlp(model=str(tiny_model_dir), output="top")
    texts = [f"Sentence {i} is about the bank ." for i in range(12)]
    one = list(nlp.pipe(texts))
    two = list(nlp.pipe(texts, n_process=2, batch_size=4))
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a._.elmo_layers, b._.elmo_layers)
    assert "W109" not in capfd.readouterr().err  # the workers' warning that hooks were dropped: documented, not noise
    add_similarity_hooks(two[0])
    assert two[0][5].similarity(two[1][5]) == pytest.approx(one[0][5].similarity(one[1][5]))
    assert one[0][5].similarity(one[1][5]) < 0.9999  # "the" in two contexts: not spaCy's 1.0 for equal texts
