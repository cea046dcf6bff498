"""The LM softmax vocabulary: ``<S>``, ``</S>``, ``<UNK>`` then train-split tokens by falling frequency.

Only the softmax uses it (the char-CNN still sees every word). Frequency order matters: sampled softmax draws
negatives from a log-uniform (Zipf) distribution over ids. Out-of-vocabulary targets are scored as ``<UNK>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from elmo.errors import DataError
from elmo.model.config import IGNORE
from elmo.text.chars import BOS_TOKEN, EOS_TOKEN
from elmo.text.files import read_user_lines

UNK_TOKEN = "<UNK>"
SPECIALS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2


def read_sentences(path: Path, tokenized: bool = True) -> list[list[str]]:
    """A text file with one sentence per line -> token lists (blank lines skipped).

    ``tokenized``: tokens separated by whitespace; otherwise each line goes through elmo.text.tokenize.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: text file not found (run `elmo data fetch` for the corpus)")
    if tokenized:
        split = str.split
    else:
        from elmo.text.tokenize import tokenize

        def split(line: str) -> list[str]:
            return tokenize(line).tokens

    sentences = [tokens for line in read_user_lines(path) if (tokens := split(line))]
    if not sentences:
        raise DataError(f"{path}: file has no sentences (empty)")
    return sentences


def count_tokens(sentences: Iterable[Sequence[str]]) -> Counter:
    counts: Counter = Counter()
    for sentence in sentences:
        counts.update(sentence)
    return counts


def build_vocab(train_file: Path, min_count: int = 3, max_size: int = 30000) -> list[str]:
    """Specials first, then tokens with count >= ``min_count`` by falling count (ties by token), capped."""
    counts = count_tokens(read_sentences(train_file))
    for special in SPECIALS:
        counts.pop(special, None)
    ranked = sorted((c, t) for t, c in counts.items() if c >= min_count)
    ranked.sort(key=lambda ct: (-ct[0], ct[1]))
    words = [t for _, t in ranked][: max(0, max_size - len(SPECIALS))]
    return list(SPECIALS) + words


def write_vocab_file(vocab: Sequence[str], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    return path


class Vocab:
    """Token <-> id with ``<UNK>`` for everything unknown, for the softmax (targets); ``char_scheme`` is how the same
    model reads a token (inputs): the ELMo byte scheme, or the model directory's char vocabulary
    (elmo.text.chars.load_char_scheme)."""

    def __init__(self, tokens: Sequence[str], char_scheme=None) -> None:
        if list(tokens[: len(SPECIALS)]) != list(SPECIALS):
            raise DataError(f"vocabulary must start with {list(SPECIALS)} (got {list(tokens[:3])})")
        self.tokens = list(tokens)
        self.index = {t: i for i, t in enumerate(self.tokens)}
        if char_scheme is None:
            from elmo.text.chars import BYTES

            char_scheme = BYTES
        self.char_scheme = char_scheme

    def __len__(self) -> int:
        return len(self.tokens)

    def ids(self, sentence: Sequence[str]) -> np.ndarray:
        """Tokens -> ids of ``[<S>, tokens..., </S>]`` (int64, length n + 2)."""
        get = self.index.get
        return np.array([BOS_ID, *(get(t, UNK_ID) for t in sentence), EOS_ID], dtype=np.int64)

    def oov_rate(self, sentences: Iterable[Sequence[str]]) -> float:
        total = unknown = 0
        for sentence in sentences:
            total += len(sentence)
            unknown += sum(t not in self.index for t in sentence)
        return unknown / max(total, 1)


# -- LM batches (shared by training and evaluation) ---------------------------------------------------------------
class Piece(list):
    """The tokens of one training piece of a sentence. ``cut_before`` / ``cut_after``: a cut made by
    ``chunk_long`` bounds the piece there, not the sentence's own start / end, so ``lm_arrays`` does not ask the
    backward LM to predict ``<S>`` (or the forward LM ``</S>``) at that cut."""

    def __init__(self, tokens: Iterable[str], cut_before: bool = False, cut_after: bool = False) -> None:
        super().__init__(tokens)
        self.cut_before, self.cut_after = cut_before, cut_after


def chunk_long(sentences: Iterable[Sequence[str]], max_tokens: int, mark_cuts: bool = True) -> list[Piece]:
    """Split sentences longer than ``max_tokens`` into consecutive pieces (bounds memory and the LSTM loop).

    ``mark_cuts``: flag the cuts so their boundary targets are masked. Unmasked, every long sentence teaches the
    forward LM that ``</S>`` follows token ``max_tokens``; measured on the stage-3 default model (cut at 50, unmasked),
    Chinese test sentences over 50 tokens scored forward perplexity 104 against 64 backward.
    """
    out: list[Piece] = []
    for sentence in sentences:
        for start in range(0, len(sentence), max_tokens):
            end = start + max_tokens
            out.append(Piece(sentence[start:end], mark_cuts and start > 0, mark_cuts and end < len(sentence)))
    return out


def boundary_targets(sentence: Sequence[str]) -> tuple[bool, bool]:
    """Whether the ``<S>`` and ``</S>`` targets of a sentence (or piece) are real, i.e. not at a marked cut."""
    return not getattr(sentence, "cut_before", False), not getattr(sentence, "cut_after", False)


def length_batches(lengths: Sequence[int], tokens_per_batch: int) -> list[np.ndarray]:
    """Group sentence indices of similar length so that ``batch_size * longest <= tokens_per_batch``.

    Deterministic: indices sorted by (length, index). A sentence longer than the budget gets a batch of its own.
    """
    order = np.lexsort((np.arange(len(lengths)), np.asarray(lengths)))
    batches, current, longest = [], [], 0
    for index in order:
        n = int(lengths[index])
        if current and max(longest, n) * (len(current) + 1) > tokens_per_batch:
            batches.append(np.array(current))
            current, longest = [], 0
        current.append(int(index))
        longest = max(longest, n)
    if current:
        batches.append(np.array(current))
    return batches


def lm_arrays(sentences: Sequence[Sequence[str]], vocab: Vocab) -> tuple[np.ndarray, np.ndarray]:
    """Sentences -> (char ids (B, T, 50) int64, targets (B, T + 2) int64 of ``[<S>, ..., </S>]``, -100 padding).

    A ``Piece``'s boundary target at a marked cut is -100 too: no direction is trained or scored on it."""
    char_ids = vocab.char_scheme.batch(sentences).astype(np.int64)
    targets = np.full((len(sentences), char_ids.shape[1] + 2), IGNORE, dtype=np.int64)
    for row, sentence in enumerate(sentences):
        ids = vocab.ids(sentence)
        targets[row, : len(ids)] = ids
        real_start, real_end = boundary_targets(sentence)
        if not real_start:
            targets[row, 0] = IGNORE
        if not real_end:
            targets[row, len(ids) - 1] = IGNORE
    return char_ids, targets


def evenly_spaced(items: list, n: int) -> list:
    if n <= 0 or n >= len(items):
        return items
    return [items[i] for i in np.linspace(0, len(items) - 1, n).round().astype(int)]


def slice_by_tokens(sentences: list[list[str]], n_tokens: int) -> list[list[str]]:
    if n_tokens <= 0:
        return sentences
    mean = sum(len(s) for s in sentences) / len(sentences)
    return evenly_spaced(sentences, max(1, int(n_tokens / mean)))
