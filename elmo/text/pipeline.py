"""``tokenizers``' own pipeline, the tokenizer's reference: BertNormalizer (clean text, CJK characters split apart, no
lower-casing, accents kept) then BertPreTokenizer (whitespace and punctuation), offsets in code points into the
original text. Any text takes it; elmo.text.plain is a faster path with the same answers for most texts, and asks
this pipeline how it treats each character (so the two agree whatever Unicode tables each was built with)."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import PreTokenizedString, normalizers, pre_tokenizers

TOKENIZER_SETTINGS = {
    "normalizer": "BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False)",
    "pre_tokenizer": "BertPreTokenizer",
    "offsets": "unicode code points into the original text, [start, end)",
}


@lru_cache(maxsize=1)
def _pipeline() -> tuple[normalizers.Normalizer, pre_tokenizers.PreTokenizer]:
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False
    )
    return normalizer, pre_tokenizers.BertPreTokenizer()


def pipeline_tokens(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """``text``'s tokens and their ``[start, end)`` code-point offsets into it, by ``tokenizers`` (~25 us a call)."""
    normalizer, pre_tokenizer = _pipeline()
    pretokenized = PreTokenizedString(text)
    pretokenized.normalize(lambda normalized: normalizer.normalize(normalized))
    pre_tokenizer.pre_tokenize(pretokenized)
    tokens: list[str] = []
    offsets: list[tuple[int, int]] = []
    for token, span, _ in pretokenized.get_splits(offset_referential="original", offset_type="char"):
        if token:
            tokens.append(token)
            offsets.append(span)
    return tokens, offsets


__all__ = ["TOKENIZER_SETTINGS", "pipeline_tokens"]
