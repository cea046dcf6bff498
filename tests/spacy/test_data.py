"""Labelled sets as spaCy DocBin files: tags and BMES entities on the set's own tokens."""

from __future__ import annotations

from spacy.vocab import Vocab

from elmo.mix.task_data import LabelledSet
from elmo.spacy.data import to_docbin


def test_tags_and_bmes_entities_become_spacy_annotations() -> None:
    tags = LabelledSet("tagging", [["The", "cat", "sat"]], [["DET", "NOUN", "VERB"]], "toy")
    doc = next(to_docbin(tags, "tag", spaces=True).get_docs(Vocab()))
    assert [(t.text, t.tag_) for t in doc] == [("The", "DET"), ("cat", "NOUN"), ("sat", "VERB")]
    assert doc.text == "The cat sat "
    chars = list("我在北京见到王小明")
    bmes = ["O", "O", "B-LOC", "E-LOC", "O", "O", "B-PER", "M-PER", "E-PER"]
    ner = LabelledSet("tagging", [chars], [bmes], "toy")
    doc = next(to_docbin(ner, "ents", spaces=False).get_docs(Vocab()))
    assert [t.text for t in doc] == chars and doc.text == "我在北京见到王小明"
    assert [(e.text, e.label_) for e in doc.ents] == [("北京", "LOC"), ("王小明", "PER")]
