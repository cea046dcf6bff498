"""The labelled sets of ``elmo mix`` (:mod:`elmo.mix.task_data`) as spaCy ``DocBin`` files for ``spacy train``.

Tagging sets become Docs with ``token.tag_`` (Brown POS: the 12 universal tags), BMES-tagged sets (MSRA NER) Docs
with ``doc.ents``; the tokens are the data set's own (Chinese: one per character), so both systems of a comparison
see the same tokens (train with ``gold_preproc = true``). The splits are the ones ``elmo mix train`` uses.
"""

from __future__ import annotations

from pathlib import Path

from spacy.tokens import Doc, DocBin, Span
from spacy.vocab import Vocab

from elmo.mix.task_data import DEFAULT_CORPUS, LabelledSet, bmes_entities, load_builtin

# built-in set -> (spaCy language, what its labels become)
SETS = {"brown-pos": ("en", "tag"), "msra-ner": ("zh", "ents")}


def to_doc(vocab: Vocab, tokens: list[str], labels: list[str], annotation: str, spaces: bool) -> Doc:
    """One labelled sentence -> a Doc with its tags or its entities."""
    doc = Doc(vocab, words=tokens, spaces=[spaces] * len(tokens))
    if annotation == "tag":
        for token, tag in zip(doc, labels):
            token.tag_ = tag
    else:
        doc.ents = [Span(doc, start, end, label=kind) for start, end, kind in sorted(bmes_entities(labels))]
    return doc


def to_docbin(data: LabelledSet, annotation: str, spaces: bool) -> DocBin:
    vocab = Vocab()
    docs = DocBin(attrs=["ORTH", "TAG", "ENT_IOB", "ENT_TYPE"], store_user_data=False)
    for tokens, labels in zip(data.sentences, data.labels):
        docs.add(to_doc(vocab, tokens, labels, annotation, spaces))
    return docs


def write_splits(
    name: str, out: Path, sizes: dict[str, int | None] | None = None, corpus: Path = DEFAULT_CORPUS, seed: int = 0
) -> dict[str, dict]:
    """``<out>/{train,dev,test}.spacy`` for built-in set ``name``; returns what each split holds."""
    if name not in SETS:
        raise ValueError(f"no spaCy conversion for {name!r}; sets: {', '.join(SETS)}")
    lang, annotation = SETS[name]
    data = load_builtin(name, corpus, sizes=sizes, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    described = {}
    for split, part in data.splits.items():
        to_docbin(part, annotation, spaces=(lang == "en")).to_disk(out / f"{split}.spacy")
        described[split] = {"sentences": len(part), "tokens": part.n_tokens, "source": part.source}
    return {"set": name, "lang": lang, **described}
