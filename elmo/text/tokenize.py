"""The one tokenizer: raw text -> tokens with character offsets into the original string.

Built from the ``tokenizers`` package only (elmo.text.pipeline): ``BertNormalizer`` (clean text, CJK characters
split apart, no lower-casing, accents kept) and ``BertPreTokenizer`` (whitespace and punctuation). Chinese therefore
needs no pre-segmentation: every CJK character is a token, as in BERT. Offsets are code points into the text the
caller sent (control characters are dropped from tokens). Training, the runtime, the batch job and the service all
call :func:`tokenize`; pre-tokenized input bypasses it untouched.

Speed: ``tokenizers`` costs ~25 us a sentence in call overhead, more than the tiny model's whole forward pass. A
text made only of characters whose treatment the pipeline fixes alone (elmo.text.plain: the alphabets, symbols,
Chinese, Japanese and Korean scripts and punctuation, emoji; not control or format characters) is tokenized by one
regular expression instead (8 sentences: 195 -> 68 us); any other text takes the ``tokenizers`` path. Both give the
same tokens and offsets: tests/text/test_plain.py checks every such character against ``tokenizers`` itself. The
fast path's tables take ~0.2 s to build, so a process's first 8,192 texts take the ``tokenizers`` path unless
something builds them first (the runtime's warm-up does: elmo.text.plain.prepare_fast_path).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from elmo.text.pipeline import TOKENIZER_SETTINGS, pipeline_tokens
from elmo.text.plain import fast_path_ready, plain_tokens

# Long texts are tokenized in pieces of about this many code points, cut after a space, tab or newline (always a
# token boundary, never part of a token): ``tokenizers`` holds the GIL for a whole call, so pieces let other threads
# run in between, and let :func:`tokenize` stop as soon as a token limit is crossed.
PIECE_CHARS = 4096
_CUTS = (" ", "\n", "\t", "\r")


@dataclass(frozen=True)
class Tokenized:
    """Tokens of one text and their ``[start, end)`` code-point offsets into it. ``complete`` is False when
    tokenizing stopped early (``stop_after``): then ``tokens`` holds more than that many tokens, not all of them."""

    tokens: list[str]
    offsets: list[tuple[int, int]]
    complete: bool = True


def tokenize(text: str, stop_after: int | None = None, piece_chars: int = PIECE_CHARS) -> Tokenized:
    """Split raw text (any language) into tokens with offsets into ``text``.

    ``stop_after``: stop once the text is known to have more than this many tokens (a limit's check needs no more);
    the result is then marked incomplete. A text of N code points has at most N tokens, so a short one is done
    in one call."""
    if len(text) <= piece_chars:
        return Tokenized(*_piece_tokens(text))
    tokens: list[str] = []
    offsets: list[tuple[int, int]] = []
    for start, end in _pieces(text, piece_chars):
        piece_tokens, piece_offsets = _piece_tokens(text[start:end])
        tokens.extend(piece_tokens)
        offsets.extend((first + start, last + start) for first, last in piece_offsets)
        if stop_after is not None and len(tokens) > stop_after and end < len(text):
            return Tokenized(tokens, offsets, complete=False)
    return Tokenized(tokens, offsets)


def _pieces(text: str, piece_chars: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` spans covering ``text``, each ending just after a cut character near ``piece_chars`` long
    (a piece grows past that until a cut character comes: one long word is never split)."""
    start = 0
    while len(text) - start > piece_chars:
        end = max(text.rfind(cut, start, start + piece_chars) for cut in _CUTS)
        if end < 0:
            end = min((i for cut in _CUTS if (i := text.find(cut, start + piece_chars)) >= 0), default=len(text) - 1)
        yield start, end + 1
        start = end + 1
    if start < len(text) or not text:
        yield start, len(text)


def _piece_tokens(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """A text's tokens and offsets into it: by the fast path when it applies (elmo.text.plain) and its tables are
    worth building by now (fast_path_ready), else by ``tokenizers``."""
    plain = plain_tokens(text) if fast_path_ready() else None
    return plain if plain is not None else pipeline_tokens(text)


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


__all__ = ["PIECE_CHARS", "TOKENIZER_SETTINGS", "Tokenized", "tokenize", "tokenize_many", "whitespace_tokens"]
