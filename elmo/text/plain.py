"""The tokenizer's fast path: texts whose every character's treatment is fixed by the pipeline's rules, tokenized
by one regular expression with the same result as ``tokenizers`` (elmo.text.pipeline).

BertNormalizer (clean text, Chinese characters apart, no lower-casing, accents kept) and BertPreTokenizer treat each
character on its own, whatever its neighbours: whitespace separates tokens; a punctuation character or a CJK
ideograph is a token of its own; a control or format character is dropped; every other character joins its
neighbours into a word. Which character is which depends on the Unicode tables ``tokenizers`` was built with, which
are not Python's (``unicodedata`` follows the interpreter's Unicode version): so the classes are asked of
``tokenizers`` itself, once, for every character of the blocks below (probes ``a?b``, 2,048 a call). A character
the pipeline drops or changes, and anything outside the blocks, is left to the ``tokenizers`` path.
tests/text/test_plain.py checks every character of every class against ``tokenizers`` in six positions.
"""

from __future__ import annotations

import re
from functools import lru_cache

from elmo.text.pipeline import pipeline_tokens

# Blocks whose characters the fast path may decide: the alphabets, symbols and East Asian scripts people write,
# up to the emoji. Each character's class comes from the pipeline (character_classes).
PLAIN_BLOCKS = (
    (0x0009, 0x000D),  # tab, newline, vertical tab, form feed, carriage return
    (0x0020, 0x007E),  # printable ASCII
    (0x00A0, 0x1FFF),  # Latin-1 .. Greek extended: Latin, IPA, combining marks, Greek, Cyrillic, Hebrew, Arabic, ...
    (0x2000, 0x2BFF),  # spaces, dashes, quotes, super/subscripts, currency, letterlike, arrows, math, box drawing, ...
    (0x3000, 0x30FF),  # CJK symbols and punctuation, hiragana, katakana
    (0x3400, 0x4DBF),  # CJK unified ideographs extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7A3),  # Hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF01, 0xFFEF),  # full-width and half-width forms
    (0x1F300, 0x1FAFF),  # pictographs, emoticons, emoji
)
_PROBE = "a{}b"  # each character between two letters: alone, joined, a separator, or dropped/changed
_SHAPES = {((0, 1), (2, 3)): "space", ((0, 1), (1, 2), (2, 3)): "alone", ((0, 3),): "word"}
# Probes per tokenizers call: all 53,000 at once held ~80 MB of tokens and spans for a moment, which the allocator
# kept as the process's memory (a served model's RSS baseline moved when it was finally trimmed).
_PROBE_CHUNK = 2048
# Rent, then buy: the fast path's tables cost ~0.2 s to build, the ``tokenizers`` path ~25 us a text. A process that
# tokenizes a few thousand texts (a short `elmo embed-file`, a CLI call) is done sooner without them, so texts take
# the ``tokenizers`` path until this many have (about the tables' cost), then the tables are built: never more than
# about twice the better choice's time. A server builds them in its warm-up (prepare_fast_path), before any request.
TEXTS_BEFORE_TABLES = 8192
_texts_without_tables = 0


def _candidates() -> list[str]:
    return [chr(code) for low, high in PLAIN_BLOCKS for code in range(low, high + 1)]


@lru_cache(maxsize=1)
def character_classes() -> dict[str, list[str]]:
    """Every character of the blocks whose treatment the pipeline fixes, by what ``tokenizers`` does with it
    between two letters: ``space`` (separates tokens), ``alone`` (a token of its own: punctuation, CJK
    ideographs), ``word`` (joins its neighbours). A character it drops or changes is in none."""
    classes: dict[str, list[str]] = {"space": [], "alone": [], "word": []}
    chars = _candidates()
    for start in range(0, len(chars), _PROBE_CHUNK):
        chunk = chars[start : start + _PROBE_CHUNK]
        for char, shape in zip(chunk, _probe_shapes(chunk)):
            name = _SHAPES.get(shape)
            if name is not None:
                classes[name].append(char)
    return classes


def _probe_shapes(chars: list[str]) -> list[tuple[tuple[int, int], ...]]:
    """Per character, the spans of the tokens ``tokenizers`` makes of its probe, relative to the probe; (-1, -1)
    for a token that is not the text it spans (the normalizer changed a character)."""
    text = " ".join(_PROBE.format(char) for char in chars)
    width = len(_PROBE.format("x")) + 1  # a probe and the space after it
    pieces: list[list[tuple[int, int]]] = [[] for _ in chars]
    for token, (start, end) in zip(*pipeline_tokens(text)):
        probe = start // width
        unchanged = token == text[start:end]
        pieces[probe].append((start - probe * width, end - probe * width) if unchanged else (-1, -1))
    return [tuple(spans) for spans in pieces]


def _char_class(chars: list[str]) -> str:
    """A regular-expression character class body for ``chars``, as ranges of consecutive code points."""
    parts, codes, i = [], sorted(map(ord, chars)), 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        low, high = re.escape(chr(codes[i])), re.escape(chr(codes[j]))
        parts.append(low if i == j else f"{low}-{high}")
        i = j + 1
    return "".join(parts)


@lru_cache(maxsize=1)
def _patterns() -> tuple[re.Pattern, re.Pattern]:
    classes = character_classes()
    known = _char_class(classes["space"] + classes["alone"] + classes["word"])
    other = re.compile(f"[^{known}]")
    token = re.compile(f"[{_char_class(classes['alone'])}]|[{_char_class(classes['word'])}]+")
    return other, token


def fast_path_ready() -> bool:
    """Whether :func:`plain_tokens` should be asked (the tables are built, or the next call builds them); counts the
    texts that took the ``tokenizers`` path before (TEXTS_BEFORE_TABLES). Threads may race on the count: at worst a
    few more texts take the ``tokenizers`` path, with the same tokens."""
    global _texts_without_tables
    if _texts_without_tables >= TEXTS_BEFORE_TABLES:
        return True
    _texts_without_tables += 1
    return False


def prepare_fast_path() -> None:
    """Build the fast path's tables now (~0.2 s), so that every text from here on may take it."""
    global _texts_without_tables
    _patterns()
    _texts_without_tables = TEXTS_BEFORE_TABLES


def plain_tokens(text: str) -> tuple[list[str], list[tuple[int, int]]] | None:
    """``text``'s tokens and their ``[start, end)`` offsets when every character of it is one the fast path
    decides, else None."""
    other, token = _patterns()
    if other.search(text) is not None:
        return None
    matches = list(token.finditer(text))
    return [match.group() for match in matches], [match.span() for match in matches]


__all__ = ["PLAIN_BLOCKS", "character_classes", "fast_path_ready", "plain_tokens", "prepare_fast_path"]
