"""The ELMo character scheme (AllenNLP ``ELMoCharacterMapper`` / bilm-tf), numpy only.

A token becomes 50 ids: ``[BOW, utf-8 bytes (at most 48), EOW, PAD, PAD, ...]`` and then every id is
shifted by +1 so that 0 means "no token here". Table size 262: 1..256 bytes, 257 sentence BOS,
258 sentence EOS, 259 begin-of-word, 260 end-of-word, 261 in-word padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_CHARS = 50
MAX_WORD_BYTES = MAX_CHARS - 2
N_CHAR_IDS = 262

# Raw ids before the +1 shift, as in the published scheme.
BOS_CHAR = 256
EOS_CHAR = 257
BOW_CHAR = 258
EOW_CHAR = 259
PAD_CHAR = 260

BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"


def _boundary(char: int) -> np.ndarray:
    ids = np.full(MAX_CHARS, PAD_CHAR, dtype=np.int64)
    ids[0], ids[1], ids[2] = BOW_CHAR, char, EOW_CHAR
    return (ids + 1).astype(np.int32)


BOS_IDS = _boundary(BOS_CHAR)
EOS_IDS = _boundary(EOS_CHAR)


def word_to_char_ids(word: str) -> np.ndarray:
    """One token -> ``(50,)`` int32 char ids (already +1 shifted). Words over 48 bytes are truncated."""
    if word == BOS_TOKEN:
        return BOS_IDS.copy()
    if word == EOS_TOKEN:
        return EOS_IDS.copy()
    raw = word.encode("utf-8", "ignore")[:MAX_WORD_BYTES]
    ids = np.full(MAX_CHARS, PAD_CHAR + 1, dtype=np.int32)
    ids[0] = BOW_CHAR + 1
    ids[1 : len(raw) + 1] = np.frombuffer(raw, dtype=np.uint8).astype(np.int32) + 1
    ids[len(raw) + 1] = EOW_CHAR + 1
    return ids


def batch_to_char_ids(sentences: Sequence[Sequence[str]], pad_to: int | None = None) -> np.ndarray:
    """Tokenized sentences -> ``(batch, max_tokens, 50)`` int32, padded token slots all 0.

    ``pad_to`` fixes the token axis (for bucketed runtimes); it must be >= the longest sentence.
    """
    longest = max((len(s) for s in sentences), default=0)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sentence ({longest} tokens)")
    out = np.zeros((len(sentences), width, MAX_CHARS), dtype=np.int32)
    for i, sentence in enumerate(sentences):
        for j, token in enumerate(sentence):
            out[i, j] = word_to_char_ids(token)
    return out


def lengths_of(char_ids: np.ndarray) -> np.ndarray:
    """``(batch, tokens, 50)`` char ids -> ``(batch,)`` number of real tokens per sentence."""
    return (char_ids > 0).any(axis=-1).sum(axis=-1)
