"""A domain held out of all training, for ``elmo adapt``: *The Debian Administrator's Handbook*.

Debian's package ``debian-handbook`` (``apt-get download debian-handbook``; version 11.20220922 in Debian 12) ships
the book as HTML in 26 languages, English (``en-US``) and simplified Chinese (``zh-CN``) among them. It is system
administration prose: packages, APT, networks, servers, security. None of the shipped model's corpora (State of the
Union, Brown, People's Daily, MSRA, THUCNews headlines, SpamAssassin mail) is anywhere near it. Licence: GPL-2.0+ or
CC-BY-SA-3.0 (Raphaël Hertzog, Roland Mas); it is read locally and never committed.

``elmo data handbook --out DIR`` writes ``handbook.en.txt`` and ``handbook.zh.txt``: raw text, one paragraph per
line (the ``<div class="para">`` blocks, program listings and screen captures left out), in the book's reading
order (the links of ``index.html``), duplicates dropped. The Chinese translation is partial: paragraphs still in
English are left out of the Chinese file.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

LANGUAGES = {"en": "en-US", "zh": "zh-CN"}
HTML_ROOT = "usr/share/doc/debian-handbook/html"  # inside the unpacked .deb
MIN_CJK_SHARE = 0.3  # of a Chinese paragraph's characters; below it the paragraph was not translated
_LINK = re.compile(r'href="([^"#/]+\.html)')
_CJK = re.compile(r"[\u4e00-\u9fff]")


class _Paragraphs(HTMLParser):
    """The text of every outermost ``<div class="para">``, without ``<pre>`` blocks."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._divs: list[bool] = []  # for every open <div>: does it start a paragraph?
        self._text: list[str] | None = None
        self._pre = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "div":
            starts = self._text is None and ("class", "para") in attrs
            self._divs.append(starts)
            if starts:
                self._text = []
        elif tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._divs:
            if self._divs.pop() and self._text is not None:
                text = " ".join("".join(self._text).split())
                if text:
                    self.paragraphs.append(text)
                self._text = None
        elif tag == "pre" and self._pre:
            self._pre -= 1

    def handle_data(self, data: str) -> None:
        if self._text is not None and not self._pre:
            self._text.append(data)


def html_paragraphs(html: str) -> list[str]:
    parser = _Paragraphs()
    parser.feed(html)
    parser.close()
    return parser.paragraphs


def reading_order(folder: Path) -> list[Path]:
    """The book's pages in the order ``index.html`` links them (index first)."""
    index = folder / "index.html"
    names = dict.fromkeys(["index.html", *_LINK.findall(index.read_text(encoding="utf-8"))])
    return [folder / name for name in names if (folder / name).is_file()]


def is_chinese(paragraph: str) -> bool:
    return len(_CJK.findall(paragraph)) >= MIN_CJK_SHARE * len(paragraph.replace(" ", ""))


def book_paragraphs(html_root: Path, language: str) -> list[str]:
    """One language's paragraphs in reading order, first occurrence only."""
    seen: dict[str, None] = {}
    for page in reading_order(html_root / LANGUAGES[language]):
        for paragraph in html_paragraphs(page.read_text(encoding="utf-8")):
            if language != "zh" or is_chinese(paragraph):
                seen.setdefault(paragraph)
    return list(seen)


def write_handbook(html_root: Path, out: Path) -> dict:
    """``<out>/handbook.<lang>.txt`` for en and zh; returns their paragraph and character counts."""
    out.mkdir(parents=True, exist_ok=True)
    stats = {}
    for language in LANGUAGES:
        paragraphs = book_paragraphs(html_root, language)
        (out / f"handbook.{language}.txt").write_text("".join(p + "\n" for p in paragraphs), encoding="utf-8")
        stats[f"handbook.{language}"] = {"paragraphs": len(paragraphs), "characters": sum(map(len, paragraphs))}
    return stats
