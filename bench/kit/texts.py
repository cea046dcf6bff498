"""The benches' input text, deterministic: short load-test sentences (:func:`make_texts`), real English sentences
of a chosen length (:func:`sentences`) and the first lines of a corpus (:func:`corpus_lines`). ``elmo bench``'s own
Zipf text is elmo.bench.run.synthetic_sentences (installed)."""

from __future__ import annotations

import random
import re
from pathlib import Path

from bench.kit.revision import REPO

CORPUS = REPO / "data" / "corpus" / "test.txt"  # `elmo data`, when it has run
HANDBOOK = REPO / "data" / "handbook" / "handbook.en.txt"  # `elmo data handbook`, when it has run
SENSES = REPO / "elmo" / "senses" / "en.tsv"  # shipped: hand-written English sentences

_WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which but have an they "
    "you were her she there been one all we their its new said would more will if has can two language model word "
    "vectors river bank money apple company fruit market people government year time service network context layer"
).split()
_CJK = "苹果公司发布了新手机我们今天去市场买很好吃的水果银行河岸经济人民政府时间语言模型"


def make_texts(n: int, seed: int = 0, min_tokens: int = 4, max_tokens: int = 40) -> list[str]:
    """Deterministic sentences, 4-40 tokens, about one in five Chinese (every CJK character is a token)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = rng.randint(min_tokens, max_tokens)
        if rng.random() < 0.2:
            texts.append("".join(rng.choices(_CJK, k=length - 1)) + "。")
        else:
            words = rng.choices(_WORDS, k=length - 1)
            texts.append(" ".join([words[0].capitalize(), *words[1:]]) + " .")
    return texts


def _source_sentences(text: Path | None) -> tuple[list[str], str]:
    if text is None and HANDBOOK.is_file():
        text = HANDBOOK
    if text is not None:
        paragraphs = [line.strip() for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
        found = [s.strip() for p in paragraphs for s in re.split(r"(?<=[.!?])\s+", p) if s.strip()]
        return found, str(text.relative_to(REPO) if text.is_relative_to(REPO) else text)
    rows = SENSES.read_text(encoding="utf-8").splitlines()[1:]
    found = [row.split("\t")[2].replace("[[", "").replace("]]", "") for row in rows if row.count("\t") == 2]
    return found, str(SENSES.relative_to(REPO))


def sentences(
    n: int, seed: int = 0, min_words: int = 15, max_words: int = 25, text: Path | None = None
) -> tuple[list[str], str]:
    """``n`` real English sentences of ``min_words``-``max_words`` words (deterministic): from ``text``, else the
    Debian handbook when `elmo data handbook` has run (data/handbook/handbook.en.txt), else the shipped word-sense
    sentences (elmo/senses/en.tsv; shorter ones joined in pairs to reach the range). Cycled when fewer exist."""
    found, source = _source_sentences(text)
    rng = random.Random(seed)
    fits = [s for s in found if min_words <= len(s.split()) <= max_words]
    shuffled = found[:]
    rng.shuffle(shuffled)
    for first, second in zip(shuffled[::2], shuffled[1::2]):  # two short ones make one of the right length
        joined = f"{first} {second}"
        if len(first.split()) < min_words and min_words <= len(joined.split()) <= max_words:
            fits.append(joined)
    if not fits:
        raise SystemExit(f"no sentence of {min_words}-{max_words} words in {source}")
    rng.shuffle(fits)
    picked = [fits[i % len(fits)] for i in range(n)]
    return picked, f"{source} ({len(set(picked))} distinct sentences of {min_words}-{max_words} words)"


def corpus_lines(n: int, text: Path | None = None) -> tuple[list[str], str]:
    """The first ``n`` non-blank lines of ``text``, else real held-out text when `elmo data` has run
    (data/corpus/test.txt, English + Chinese), else a synthetic text; a shorter text is repeated up to ``n``.
    ValueError when the text has no non-blank line."""
    source = text or CORPUS
    if source.is_file():
        with open(source, encoding="utf-8") as handle:
            lines = [line.rstrip("\n") for line in handle if line.strip()][:n]
        if not lines:  # nothing to repeat up to n: say so rather than loop for ever
            raise ValueError(f"{source}: no non-blank lines")
        while len(lines) < n:
            lines += lines[: n - len(lines)]
        return lines, f"{source.name} (first {n} non-blank lines)"
    import numpy as np

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(5000)]
    lines = [" ".join(rng.choice(words, size=max(1, int(rng.lognormal(3.0, 0.6))))) for _ in range(n)]
    return lines, f"synthetic ({n} lines, log-normal lengths)"
