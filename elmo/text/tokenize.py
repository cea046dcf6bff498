"""The one tokenizer: raw text -> tokens with character offsets into the original string.

Built from the ``tokenizers`` package only: ``BertNormalizer`` (clean text, CJK characters split apart, no
lower-casing, accents kept) and ``BertPreTokenizer`` (whitespace and punctuation). Chinese therefore needs
no pre-segmentation: every CJK character is a token, as in BERT. Offsets are code points into the text the
caller sent (control characters are dropped from tokens). Training, the runtime, the batch job and the
service all call :func:`tokenize`; pre-tokenized input bypasses it untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import PreTokenizedString, normalizers, pre_tokenizers

TOKENIZER_SETTINGS = {
    "normalizer": "BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False)",
    "pre_tokenizer": "BertPreTokenizer",
    "offsets": "unicode code points into the original text, [start, end)",
}


@dataclass(frozen=True)
class Tokenized:
    """Tokens of one text and their ``[start, end)`` code-point offsets into it."""

    tokens: list[str]
    offsets: list[tuple[int, int]]


@lru_cache(maxsize=1)
def _pipeline() -> tuple[normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    return normalizer, pre_tokenizers.BertPreTokenizer()


def tokenize(text: str) -> Tokenized:
    """Split raw text (any language) into tokens with offsets into ``text``."""
    normalizer, pre_tokenizer = _pipeline()
    pretokenized = PreTokenizedString(text)
    pretokenized.normalize(lambda normalized: normalizer.normalize(normalized))
    pre_tokenizer.pre_tokenize(pretokenized)
    tokens: list[str] = []
    offsets: list[tuple[int, int]] = []
    for token, (start, end), _ in pretokenized.get_splits(offset_referential="original", offset_type="char"):
        if token:
            tokens.append(token)
            offsets.append((start, end))
    return Tokenized(tokens, offsets)


def tokenize_many(texts: list[str]) -> list[Tokenized]:
    return [tokenize(t) for t in texts]


def tokenized_lines(sentences: Iterable[str]) -> Iterator[str]:
    """Raw sentences -> ``tok tok tok`` lines (the corpus files' format) through the one tokenizer; empty results
    dropped."""
    for sentence in sentences:
        tokens = tokenize(sentence).tokens
        if tokens:
            yield " ".join(tokens)


def whitespace_tokens(line: str) -> list[str]:
    """Pre-tokenized input (one sentence, tokens separated by whitespace) passes through untouched."""
    return line.split()


__all__ = ["TOKENIZER_SETTINGS", "Tokenized", "tokenize", "tokenize_many", "whitespace_tokens"]
