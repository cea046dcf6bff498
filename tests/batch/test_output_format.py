"""`elmo embed-file`'s OUTPUT: the format comes from its name (or --format that agrees with it), never a guess; an
empty INPUT, or one not in UTF-8, is one clear line. Real runs of the CLI on the tiny model, real files under
tmp_path."""

from __future__ import annotations

from pathlib import Path

import h5py
import pytest

from elmo.batch.layout import HDF5, PARQUET, output_format
from elmo.batch.writers import iter_parquet
from elmo.cli import main as cli
from elmo.errors import InputError

LINES = ["The cat sat on the mat.", "", "苹果很好吃。"]


def embed_file(*args: object) -> int:
    return cli(["embed-file", *map(str, args), "--no-progress", "--threads", "1"])


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("elmo embed-file: error: ")]


def written(directory: Path, source: Path) -> list[str]:
    """Everything in ``directory`` but the input: what the job left behind."""
    return sorted(p.name for p in directory.iterdir() if p != source)


@pytest.mark.parametrize(
    ("name", "requested", "expected"),
    [
        ("out.h5", None, HDF5),
        ("out.HDF5", None, HDF5),
        ("out.hdf5", HDF5, HDF5),
        ("out.parquet", None, PARQUET),
        ("out.pq", PARQUET, PARQUET),
        ("out/", None, PARQUET),
        ("out/", PARQUET, PARQUET),
        ("out", HDF5, HDF5),
        ("out", PARQUET, PARQUET),
    ],
)
def test_the_name_decides_and_format_may_confirm(tmp_path, name, requested, expected):
    assert output_format(f"{tmp_path}/{name}", requested) == expected


def test_existing_paths_say_what_they_are(tmp_path):
    (tmp_path / "a_directory").mkdir()
    (tmp_path / "a_file").write_bytes(b"")
    assert output_format(str(tmp_path / "a_directory"), None) == PARQUET  # no trailing slash, but a directory
    assert output_format(str(tmp_path / "a_file"), None) == HDF5  # a Parquet output is never a file


@pytest.mark.parametrize(
    ("name", "requested", "message"),
    [
        ("out", None, "cannot tell the output format from the name"),
        ("out.bin", None, "cannot tell the output format from the name"),
        ("out/", HDF5, "--format hdf5 contradicts OUTPUT"),
        ("out.parquet", HDF5, "--format hdf5 contradicts OUTPUT"),
        ("out.h5", PARQUET, "--format parquet contradicts OUTPUT"),
        ("out.h5/", None, "an hdf5 name (.h5) for a directory"),
    ],
)
def test_ambiguous_or_contradictory_names_are_refused(tmp_path, name, requested, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        output_format(f"{tmp_path}/{name}", requested)


def test_a_trailing_slash_writes_a_parquet_directory(tmp_path, tiny_model_dir):
    """The README's `elmo embed-file corpus.txt out/`: before the fix, an hdf5 FILE named `out`."""
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES), encoding="utf-8")
    assert embed_file(source, f"{tmp_path / 'out'}/", "--model", tiny_model_dir) == 0
    assert (tmp_path / "out").is_dir() and (tmp_path / "out" / "_manifest.json").is_file()
    assert [row[0] for row in iter_parquet(tmp_path / "out")] == [0, 1, 2]
    assert written(tmp_path, source) == ["out"]


@pytest.mark.parametrize(
    ("output", "extra", "message"),
    [
        ("out", [], "cannot tell the output format from the name"),
        ("out/", ["--format", "hdf5"], "--format hdf5 contradicts OUTPUT"),
        ("out.h5", ["--format", "parquet"], "--format parquet contradicts OUTPUT"),
    ],
)
def test_the_cli_refuses_with_one_line_and_writes_nothing(tmp_path, tiny_model_dir, capsys, output, extra, message):
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES), encoding="utf-8")
    code = embed_file(source, f"{tmp_path}/{output}", "--model", tiny_model_dir, *extra)
    (line,) = error_lines(capsys.readouterr().err)
    assert code == 2 and message in line
    assert written(tmp_path, source) == []


@pytest.mark.parametrize("output", ["e.h5", "e.parquet", "e/"])
def test_an_empty_input_is_one_line_and_nothing_written(tmp_path, tiny_model_dir, capsys, output):
    source = tmp_path / "empty.txt"
    source.write_bytes(b"")
    code = embed_file(source, f"{tmp_path}/{output}", "--model", tiny_model_dir)
    (line,) = error_lines(capsys.readouterr().err)
    assert code == 2
    assert line == f"elmo embed-file: error: {source}: the input is empty (no lines to embed); nothing written"
    assert written(tmp_path, source) == []


def test_a_blank_line_is_not_an_empty_input(tmp_path, tiny_model_dir):
    """One blank line is one (empty) entry, as documented: only a file without lines is refused."""
    source = tmp_path / "blank.txt"
    source.write_bytes(b"\n")
    assert embed_file(source, tmp_path / "b.h5", "--model", tiny_model_dir) == 0
    with h5py.File(tmp_path / "b.h5", "r") as handle:
        assert sorted(handle.keys()) == ["0", "sentence_to_index"] and handle["0"].shape[1] == 0


def test_a_gb18030_input_is_one_line_with_the_way_out(tmp_path, tiny_model_dir, capsys):
    """Chinese text saved as GB18030: the line and the byte, and iconv's command line; nothing written."""
    source = tmp_path / "zh.txt"
    source.write_bytes("The cat sat.\n苹果很好吃。\n".encode("gb18030"))
    code = embed_file(source, tmp_path / "zh.h5", "--model", tiny_model_dir)
    (line,) = error_lines(capsys.readouterr().err)
    assert code == 2
    assert line == (
        f"elmo embed-file: error: {source}: line 2 is not valid UTF-8 (byte 3 of the line is b'\\xb9'); convert it "
        f"first, e.g. `iconv -f GB18030 -t UTF-8 {source} > zh.utf8.txt` for Chinese text"
    )
    assert written(tmp_path, source) == []


def test_the_input_check_shows_progress(tmp_path, tiny_model_dir, capsys):
    """The scan that checks every line before any work (40 s for a 1 GB corpus) was silent: a bar over its bytes,
    then the embedding's bar; neither with --no-progress."""
    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES), encoding="utf-8")
    assert cli(["embed-file", str(source), str(tmp_path / "a.h5"), "--model", str(tiny_model_dir)]) == 0
    err = capsys.readouterr().err
    assert "checking input" in err and "embed-file" in err and "sent/s" in err
    assert embed_file(source, tmp_path / "b.h5", "--model", tiny_model_dir) == 0
    assert "checking input" not in capsys.readouterr().err
