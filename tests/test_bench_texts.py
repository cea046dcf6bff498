"""bench.kit.texts.corpus_lines: the first lines of a text, repeated when it is short."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.kit.texts import corpus_lines


def test_corpus_lines_repeat_a_short_text_and_refuse_an_empty_one(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("one\n\ntwo\n", encoding="utf-8")
    assert corpus_lines(5, short)[0] == ["one", "two", "one", "two", "one"]
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="blank.txt: no non-blank lines"):
        corpus_lines(5, blank)  # it looped for ever
