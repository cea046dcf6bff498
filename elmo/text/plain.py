"""The tokenizer's fast path: texts whose every character's treatment is fixed by the pipeline's rules, tokenized
by one regular expression with the same result as ``tokenizers`` (elmo.text.tokenize).

BertNormalizer (clean text, Chinese characters apart, no lower-casing, accents kept) and BertPreTokenizer split a
text by four rules: whitespace separates tokens; a punctuation character (ASCII punctuation, Unicode category P*)
is a token of its own; a CJK ideograph is a token of its own; every other character joins its neighbours into a
word. Control and format characters (dropped from inside words) and anything outside the blocks below take the
``tokenizers`` path, so the regular expression never has to decide them. The classes are built from ``unicodedata``
at import; tests/text/test_plain.py checks every character of every class against ``tokenizers`` itself.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

# Blocks whose characters the fast path decides (the rest, and the Cc/Cf/Cn/Co characters inside these, do not).
PLAIN_BLOCKS = (
    (0x0009, 0x000A),  # tab, newline
    (0x000D, 0x000D),  # carriage return
    (0x0020, 0x007E),  # printable ASCII
    (0x00A0, 0x024F),  # Latin-1 supplement, Latin extended A and B
    (0x2010, 0x2027),  # dashes, quotes, ellipsis
    (0x2030, 0x205E),  # per mille, primes, ...
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3400, 0x4DBF),  # CJK unified ideographs extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xFF01, 0xFF60),  # full-width ASCII forms
)
# BERT's "Chinese character" ranges inside the blocks above: each such character is a token.
CJK_IDEOGRAPHS = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF))
WHITESPACE_CONTROLS = "\t\n\r"  # control characters the normalizer turns into spaces


def _in(code: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(low <= code <= high for low, high in ranges)


def character_classes() -> dict[str, list[str]]:
    """Every character the fast path decides, by what the pipeline does with it: ``space`` (separates tokens),
    ``alone`` (a token of its own: punctuation, CJK ideographs), ``word`` (joins its neighbours)."""
    classes: dict[str, list[str]] = {"space": [], "alone": [], "word": []}
    for low, high in PLAIN_BLOCKS:
        for code in range(low, high + 1):
            char = chr(code)
            category = unicodedata.category(char)
            if char in WHITESPACE_CONTROLS or category == "Zs":
                classes["space"].append(char)
            elif category[0] == "C":  # control, format, unassigned, private use: tokenizers decides
                continue
            elif _in(code, CJK_IDEOGRAPHS) or category[0] == "P" or (code < 0x80 and not char.isalnum()):
                classes["alone"].append(char)
            else:
                classes["word"].append(char)
    return classes


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


def plain_tokens(text: str) -> tuple[list[str], list[tuple[int, int]]] | None:
    """``text``'s tokens and their ``[start, end)`` offsets when every character of it is one the fast path
    decides, else None."""
    other, token = _patterns()
    if other.search(text) is not None:
        return None
    matches = list(token.finditer(text))
    return [match.group() for match in matches], [match.span() for match in matches]


__all__ = ["CJK_IDEOGRAPHS", "PLAIN_BLOCKS", "character_classes", "plain_tokens"]
