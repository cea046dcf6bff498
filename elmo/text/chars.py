"""The char schemes: token -> ids for the char-CNN, numpy only. The one owner of char mapping.

The ELMo byte scheme (AllenNLP ``ELMoCharacterMapper`` / bilm-tf) is the module functions below; a model directory
may instead hold a char vocabulary (``VocabScheme``, near the end): ``load_char_scheme(directory)`` picks.

A token becomes 50 ids: ``[BOW, utf-8 bytes (at most 48), EOW, PAD, PAD, ...]`` and then every id is
shifted by +1 so that 0 means "no token here". Table size 262: 1..256 bytes, 257 sentence BOS,
258 sentence EOS, 259 begin-of-word, 260 end-of-word, 261 in-word padding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from elmo.errors import ModelFileError

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


def char_lengths(rows: np.ndarray, pad_id: int) -> np.ndarray:
    """``(n, width)`` token rows -> ``(n,)`` columns up to and including each row's last non-padding id."""
    return rows.shape[1] - np.argmax(rows[:, ::-1] != pad_id, axis=1)


def lengths_of(char_ids: np.ndarray) -> np.ndarray:
    """``(batch, tokens, 50)`` char ids -> ``(batch,)`` number of real tokens per sentence."""
    return (char_ids > 0).any(axis=-1).sum(axis=-1)


# -- char schemes: how a model directory maps a token to its ids ---------------------------------------------------
# A model directory holds either no scheme file (the byte scheme above, what this project trains) or a char
# vocabulary (CHAR_VOCAB_FILE, e.g. imported from ELMoForManyLangs), optionally with a word vocabulary
# (WORD_VOCAB_FILE) when the model also has a word embedding. Export, runtime, service and batch job all get the
# scheme through load_char_scheme(directory) and never map characters themselves.
CHAR_VOCAB_FILE = "char_vocab.json"
WORD_VOCAB_FILE = "word_vocab.json"
CHAR_VOCAB_FORMAT = "elmo-char-vocab/1"
WORD_VOCAB_FORMAT = "elmo-word-vocab/1"
CHAR_SPECIALS = ("begin_of_word", "end_of_word", "padding", "unknown", "sentence_begin", "sentence_end")
WORD_SPECIALS = ("unknown", "padding")


class ByteScheme:
    """The ELMo byte scheme (module functions above) behind the scheme interface."""

    name = "elmo"
    max_chars = MAX_CHARS
    n_chars = N_CHAR_IDS
    width = MAX_CHARS
    n_words = 0
    files: tuple[str, ...] = ()
    bos_ids = BOS_IDS
    eos_ids = EOS_IDS
    pad_id = PAD_CHAR + 1
    trimmable = True  # every column is a char: rows may be cut after their last non-padding id

    def token_ids(self, token: str) -> np.ndarray:
        return word_to_char_ids(token)

    def batch(self, sentences: Sequence[Sequence[str]], pad_to: int | None = None) -> np.ndarray:
        return batch_to_char_ids(sentences, pad_to)

    def metadata(self) -> dict:
        return {"name": self.name, "max_chars": MAX_CHARS, "n_chars": N_CHAR_IDS, "shift": 1}


BYTES = ByteScheme()


class VocabScheme:
    """A character vocabulary: every Unicode character has its own id (``chars``), unknown ones share ``unknown``.

    A token becomes ``max_chars`` ids ``[begin_of_word, its characters (at most max_chars - 2 code points, longer
    tokens are cut), end_of_word, padding, ...]``, followed, when the model has a word embedding, by one more
    column holding the token's word id (``unknown`` when not in ``words``). Every id is shifted by +1 so that 0
    still means "no token here" (the model's tables get a zero row 0). The sentence boundaries are the tokens
    ``sentence_tokens`` = (begin, end), written ``[begin_of_word, sentence_begin | sentence_end, end_of_word,
    padding, ...]`` with their own word ids. The ids are raw (before the shift), as in the source vocabulary.
    """

    name = "vocab"

    def __init__(
        self,
        chars: dict[str, int],
        specials: dict[str, int],
        max_chars: int,
        sentence_tokens: tuple[str, str] = ("<bos>", "<eos>"),
        words: dict[str, int] | None = None,
        word_specials: dict[str, int] | None = None,
        source: str = CHAR_VOCAB_FILE,
    ) -> None:
        self.chars, self.specials, self.max_chars = dict(chars), dict(specials), int(max_chars)
        self.sentence_tokens = (str(sentence_tokens[0]), str(sentence_tokens[1]))
        self.words = None if words is None else dict(words)
        self.word_specials = dict(word_specials or {})
        _check_ids(source, "chars", self.chars, self.specials, CHAR_SPECIALS)
        if self.max_chars < 3:
            raise ModelFileError(f"{source}: max_chars must be >= 3 (got {self.max_chars})")
        self.n_chars = max([*self.chars.values(), *self.specials.values()]) + 2  # +1 shift, +1 size
        self.n_words = 0
        if self.words is not None:
            _check_ids(source, "words", self.words, self.word_specials, WORD_SPECIALS)
            self.n_words = max([*self.words.values(), *self.word_specials.values()]) + 2
        self.width = self.max_chars + (1 if self.words is not None else 0)
        self.pad_id = self.specials["padding"] + 1
        self.trimmable = self.words is None  # the word-id column sits at the far end of a row
        self.files = (CHAR_VOCAB_FILE,) if self.words is None else (CHAR_VOCAB_FILE, WORD_VOCAB_FILE)
        self.bos_ids = self._row(self.sentence_tokens[0])  # never cut, however short max_chars is
        self.eos_ids = self._row(self.sentence_tokens[1])

    def token_ids(self, token: str) -> np.ndarray:
        """One token -> ``(width,)`` int32 ids, already +1 shifted. The token is cut to max_chars - 2 characters
        first (its word id is that of the cut token); a token that then equals a sentence token gets its row."""
        return self._row(token[: self.max_chars - 2])

    def _row(self, token: str) -> np.ndarray:
        s = self.specials
        ids = np.full(self.width, s["padding"] + 1, dtype=np.int32)
        ids[0] = s["begin_of_word"] + 1
        if token in self.sentence_tokens:
            ids[1] = s["sentence_begin" if token == self.sentence_tokens[0] else "sentence_end"] + 1
            ids[2] = s["end_of_word"] + 1
        else:
            unknown = s["unknown"]
            ids[1 : len(token) + 1] = [self.chars.get(c, unknown) + 1 for c in token]
            ids[len(token) + 1] = s["end_of_word"] + 1
        if self.words is not None:
            ids[self.max_chars] = self.words.get(token, self.word_specials["unknown"]) + 1
        return ids

    def batch(self, sentences: Sequence[Sequence[str]], pad_to: int | None = None) -> np.ndarray:
        """Tokenized sentences -> ``(batch, max_tokens, width)`` int32, padded token slots all 0."""
        longest = max((len(s) for s in sentences), default=0)
        width = longest if pad_to is None else pad_to
        if width < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest sentence ({longest} tokens)")
        out = np.zeros((len(sentences), width, self.width), dtype=np.int32)
        for i, sentence in enumerate(sentences):
            for j, token in enumerate(sentence):
                out[i, j] = self.token_ids(token)
        return out

    def metadata(self) -> dict:
        return {
            "name": self.name,
            "max_chars": self.max_chars,
            "n_chars": self.n_chars,
            "n_words": self.n_words,
            "width": self.width,
            "files": list(self.files),
            "shift": 1,
        }

    # -- files ---------------------------------------------------------------------------------------------------
    def save(self, directory: str | Path, source: str = "") -> None:
        directory = Path(directory)
        chars = {
            "format": CHAR_VOCAB_FORMAT,
            "source": source,
            "max_chars": self.max_chars,
            "sentence_tokens": list(self.sentence_tokens),
            "specials": self.specials,
            "chars": self.chars,
        }
        (directory / CHAR_VOCAB_FILE).write_text(json.dumps(chars, ensure_ascii=False, indent=1) + "\n", "utf-8")
        if self.words is not None:
            words = {"format": WORD_VOCAB_FORMAT, "source": source, "specials": self.word_specials, "words": self.words}
            (directory / WORD_VOCAB_FILE).write_text(json.dumps(words, ensure_ascii=False) + "\n", "utf-8")

    @classmethod
    def load(cls, directory: str | Path) -> VocabScheme:
        directory = Path(directory)
        chars = _read_vocab_file(directory / CHAR_VOCAB_FILE, CHAR_VOCAB_FORMAT, "chars")
        words_path = directory / WORD_VOCAB_FILE
        words = _read_vocab_file(words_path, WORD_VOCAB_FORMAT, "words") if words_path.is_file() else None
        sentence_tokens = chars.get("sentence_tokens", ["<bos>", "<eos>"])
        if not (isinstance(sentence_tokens, list) and len(sentence_tokens) == 2):
            raise ModelFileError(f"{directory / CHAR_VOCAB_FILE}: sentence_tokens must be two strings")
        max_chars = chars.get("max_chars")
        if not isinstance(max_chars, int) or isinstance(max_chars, bool):
            raise ModelFileError(f"{directory / CHAR_VOCAB_FILE}: max_chars must be an integer (got {max_chars!r})")
        return cls(
            chars["chars"],
            chars.get("specials") or {},
            max_chars,
            tuple(sentence_tokens),
            None if words is None else words["words"],
            None if words is None else (words.get("specials") or {}),
            source=str(directory / CHAR_VOCAB_FILE),
        )


def _check_ids(source: str, what: str, table: object, specials: object, names: tuple[str, ...]) -> None:
    if not isinstance(table, dict) or not isinstance(specials, dict):
        raise ModelFileError(f"{source}: '{what}' and its specials must be JSON objects")
    missing = [name for name in names if name not in specials]
    if missing:
        raise ModelFileError(f"{source}: {what} specials {missing} missing")
    for key, value in [*table.items(), *specials.items()]:
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelFileError(f"{source}: {what} entry {key!r}: {value!r} is not an id >= 0")


def _read_vocab_file(path: Path, fmt: str, table: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: vocabulary file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != fmt or not isinstance(data.get(table), dict):
        raise ModelFileError(f"{path}: not a {fmt} file (expected format '{fmt}' and a '{table}' object)")
    return data


def load_char_scheme(directory: str | Path) -> ByteScheme | VocabScheme:
    """The char scheme of a model directory: its char vocabulary when it has one, else the ELMo byte scheme."""
    directory = Path(directory)
    if (directory / CHAR_VOCAB_FILE).is_file():
        return VocabScheme.load(directory)
    if (directory / WORD_VOCAB_FILE).is_file():
        raise ModelFileError(f"{directory / WORD_VOCAB_FILE}: a word vocabulary without {CHAR_VOCAB_FILE}")
    return BYTES
