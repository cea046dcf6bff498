"""The held-out domain text (elmo/train/handbook.py) read from a small book laid out like debian-handbook's HTML."""

from __future__ import annotations

from pathlib import Path

from elmo.train.handbook import book_paragraphs, html_paragraphs, write_handbook

PAGE = """<html><body><div class="section"><div class="titlepage"><h2>APT</h2></div>
<div class="para">
	The <code class="command">apt</code> tool installs   packages &amp; their dependencies.
</div>
<div class="para">A listing follows: <pre class="screen">$ apt install foo</pre>and ends here.</div>
<div class="para">An outer paragraph <div class="para">with an inner one</div> ends.</div>
<div class="sidebar"><p>Not a para div.</p></div></div></body></html>"""


def test_paragraph_divs_become_lines_without_program_listings():
    assert html_paragraphs(PAGE) == [
        "The apt tool installs packages & their dependencies.",
        "A listing follows: and ends here.",
        "An outer paragraph with an inner one ends.",
    ]


def _book(root: Path, folder: str, pages: dict[str, str], order: list[str]) -> None:
    (root / folder).mkdir(parents=True)
    links = "".join(f'<a href="{name}#top">x</a><a href="{name}">x</a>' for name in order)
    (root / folder / "index.html").write_text(f'<div class="para">Index of {folder}.</div>{links}', encoding="utf-8")
    for name, text in pages.items():
        (root / folder / name).write_text(f'<div class="para">{text}</div>', encoding="utf-8")


def test_reading_order_duplicates_and_untranslated_chinese(tmp_path):
    _book(
        tmp_path,
        "en-US",
        {"b.html": "Second page.", "a.html": "Third page.", "c.html": "Second page."},
        ["b.html", "a.html", "c.html"],
    )
    _book(
        tmp_path,
        "zh-CN",
        {"b.html": "软件包管理系统是核心。", "a.html": "This paragraph was not translated."},
        ["b.html", "a.html"],
    )
    assert book_paragraphs(tmp_path, "en") == ["Index of en-US.", "Second page.", "Third page."]
    assert book_paragraphs(tmp_path, "zh") == ["软件包管理系统是核心。"]
    stats = write_handbook(tmp_path, tmp_path / "out")
    assert stats["handbook.zh"] == {"paragraphs": 1, "characters": 11}
    assert (tmp_path / "out" / "handbook.en.txt").read_text(encoding="utf-8").splitlines()[1] == "Second page."
