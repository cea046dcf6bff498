"""A listener's mix exported as a task and served by a real `elmo serve`; a stored task starting a listener."""

from __future__ import annotations

import json

import numpy as np
import pytest
import spacy
from spacy.tokens import Doc
from spacy.training import Example

from elmo.cli import main
from elmo.client import EmbedderClient
from elmo.errors import ElmoError
from elmo.runtime.tasks import TaskStore
from elmo.spacy.component import ElmoSpacyError
from elmo.spacy.listener import find_mix
from elmo.spacy.tasks import export_task


def one_example(nlp: spacy.Language) -> list[Example]:
    reference = Doc(nlp.vocab, words=["the", "cat"], tags=["DET", "NOUN"])
    return [Example(nlp.make_doc("the cat"), reference)]


SENTENCES = [["the", "cat", "runs"], ["a", "dog", "sees", "every", "bird"], ["Apple", "shares", "rose", "."]]


def test_the_exported_mix_is_served_equal_to_the_listeners_output(
    trained_pipeline, spacy_model, spacy_server, capsys
) -> None:
    assert (
        main(
            [
                "spacy",
                "export-task",
                str(trained_pipeline),
                "--component",
                "tagger",
                "--model",
                str(spacy_model),
                "--task",
                "spacy_toy_tags",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["task"] == "spacy_toy_tags"
    nlp = spacy.load(trained_pipeline)
    mix = find_mix(nlp.get_pipe("tagger").model)
    stored = TaskStore(spacy_model).get("spacy_toy_tags")
    assert stored.weights == [float(w) for w in mix.get_param("W")] and stored.data["component"] == "tagger"
    docs = [nlp.get_pipe("elmo")(Doc(nlp.vocab, words=words)) for words in SENTENCES]
    listener_output = mix.predict(docs)
    with EmbedderClient(spacy_server) as client:
        served = [e.mix for e in client.embed(SENTENCES, task="spacy_toy_tags", omit_layers=True)]
    for words, own, answer in zip(SENTENCES, listener_output, served):
        assert answer.shape == own.shape == (len(words), mix.get_dim("nD"))
        assert float(np.abs(answer - own).max()) <= 1e-5


def test_a_stored_task_starts_a_listener(trained_pipeline, spacy_model) -> None:
    export_task(trained_pipeline, "tagger", spacy_model, "spacy_start")
    stored = TaskStore(spacy_model).get("spacy_start")
    nlp = spacy.blank("en")
    nlp.add_pipe("elmo", config={"model": str(spacy_model)})
    tagger = nlp.add_pipe(
        "tagger",
        config={
            "model": {
                "@architectures": "spacy.Tagger.v2",
                "tok2vec": {
                    "@architectures": "elmo.ElmoListener.v1",
                    "init_task": str(spacy_model / "tasks" / "spacy_start"),
                },
            }
        },
    )
    nlp.initialize(lambda: one_example(nlp))
    mix = find_mix(tagger.model)
    np.testing.assert_array_equal(mix.get_param("W"), np.array(stored.weights, np.float32))
    assert float(mix.get_param("g")[0]) == pytest.approx(stored.gamma, rel=1e-6)


def test_export_names_what_is_wrong(trained_pipeline, spacy_model, tmp_path) -> None:
    with pytest.raises(ElmoSpacyError, match=r"nowhere: not a saved spaCy pipeline \(no config.cfg"):
        export_task(tmp_path / "nowhere", "tagger", spacy_model, "x")
    with pytest.raises(ElmoError, match=r"task name 'bad name!' is not valid"):
        export_task(trained_pipeline, "tagger", spacy_model, "bad name!")
    with pytest.raises(ElmoSpacyError, match=r"no component 'ner'; it has elmo, tagger"):
        export_task(trained_pipeline, "ner", spacy_model, "x")
    with pytest.raises(ElmoSpacyError, match=r"has no elmo.ElmoListener.v1 layer"):
        nlp = spacy.blank("en")
        nlp.add_pipe("tagger")
        nlp.initialize(lambda: one_example(nlp))
        nlp.to_disk(tmp_path / "plain")
        export_task(tmp_path / "plain", "tagger", spacy_model, "x")
