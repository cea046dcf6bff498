"""bench.kit.texts.brown_lines: the batch job's bench text from a Brown package laid out as the fetched one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.kit.revision import REPO
from bench.kit.texts import brown_lines, corpus_lines

EIGHT = " ".join(f"w{i}/nn" for i in range(8))


def write_package(root: Path) -> Path:
    package = root / "package"
    package.mkdir()
    short = "The/at jury/nn said/vbd so/rb ./."
    (package / "cb01").write_text(f"\n\n\t{short}\n\n\t{EIGHT} ``/`` ok/jj\n", encoding="utf-8")
    (package / "ca01").write_text(f"\n\tAtlanta's/np$ {EIGHT}\n", encoding="utf-8")
    (package / "cc01").write_text(f"\t{EIGHT}\n", encoding="utf-8")
    (package / "README").write_text("not a text file of the corpus\n", encoding="utf-8")
    return package


def test_brown_lines_drop_tags_keep_length_range_in_file_order(tmp_path: Path) -> None:
    package = write_package(tmp_path)
    words = " ".join(f"w{i}" for i in range(8))
    # ca01 before cb01 (name order); the 5-word sentence is below the range; cc01 is past `files`.
    assert brown_lines(package, files=2) == [f"Atlanta's {words}", f"{words} `` ok"]
    assert brown_lines(package, files=2, max_words=9) == [f"Atlanta's {words}"]
    assert len(brown_lines(package, files=3)) == 3


def test_brown_lines_without_the_package_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="elmo data fetch"):
        brown_lines(tmp_path / "missing")


def test_brown_command_writes_one_sentence_a_line(tmp_path: Path) -> None:
    package = write_package(tmp_path)
    out = tmp_path / "brown.txt"
    command = [sys.executable, "-m", "bench.kit.texts", "--brown", str(out), "--package", str(package)]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    assert out.read_text(encoding="utf-8").splitlines() == brown_lines(package)


def test_corpus_lines_repeat_a_short_text_and_refuse_an_empty_one(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("one\n\ntwo\n", encoding="utf-8")
    assert corpus_lines(5, short)[0] == ["one", "two", "one", "two", "one"]
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(ValueError, match="blank.txt: no non-blank lines"):
        corpus_lines(5, blank)  # it looped for ever
