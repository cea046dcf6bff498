"""What `elmo embed-file` may replace or remove: only what it wrote itself. ``--overwrite`` replaces an earlier
embed-file output (Parquet folder or hdf5 file) and refuses anything else at OUTPUT or OUTPUT.partial, leaving it
as it was; a job that fails before committing a shard leaves nothing behind; a line over the sentence limit is
refused by the scan, naming the line, before any embedding.

Real runs of the CLI (``elmo.cli.main``, and one subprocess as a user runs it) on the tiny model, real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import elmo.batch.plan as plan
from elmo.errors import InputError
from elmo.text.tokenize import tokenize
from tests.batch.test_job import assert_same_output, corpus, embed_file, error_lines, write_lines
from tests.conftest import REPO

USER_FILES = {"notes.txt": b"my notes\n", "sub/important.csv": b"a,b\n1,2\n"}


def make_user_folder(folder: Path) -> None:
    for name, content in USER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)


def user_files_intact(folder: Path) -> bool:
    found = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    return found == USER_FILES


def assert_refused_untouched(err: str, path: Path) -> None:
    """The refusal says what OUTPUT is and what to do, and never suggests deleting or overwriting it."""
    assert f"{path} already exists and is not an embed-file" in err
    assert "choose another OUTPUT path" in err
    for advice in ("remove it", "delete", "pass --overwrite", "add --overwrite"):
        assert advice not in err


# -- --overwrite refuses what embed-file did not write -------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [["--overwrite"], []])
def test_a_folder_of_user_files_is_never_replaced(tmp_path, tiny_model_dir, capsys, overwrite):
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "out.parquet"
    make_user_folder(output)
    capsys.readouterr()
    assert embed_file(source, output, "--model", tiny_model_dir, *overwrite) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert_refused_untouched(err, output)
    assert "without embed-file's _manifest.json" in err
    assert user_files_intact(output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.parquet"]  # no OUTPUT.partial either


@pytest.mark.parametrize("name", ["out.h5", "out"])
def test_a_user_file_is_never_replaced(tmp_path, tiny_model_dir, capsys, name):
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / name
    output.write_bytes(b"a user's file, not hdf5\n")
    capsys.readouterr()
    assert embed_file(source, output, "--model", tiny_model_dir, "--format", "hdf5", "--overwrite") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert_refused_untouched(err, output)
    assert output.read_bytes() == b"a user's file, not hdf5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", name]


def test_an_hdf5_file_embed_file_did_not_write_is_never_replaced(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "theirs.h5"
    with h5py.File(output, "w") as handle:
        handle["0"] = np.arange(6, dtype=np.float32).reshape(2, 3)
        handle.attrs["made_by"] = "allennlp elmo"
    before = output.read_bytes()
    capsys.readouterr()
    assert embed_file(source, output, "--model", tiny_model_dir, "--overwrite") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert_refused_untouched(err, output)
    assert "an hdf5 file that embed-file did not write" in err
    assert output.read_bytes() == before


def test_an_embed_file_output_with_a_user_file_added_is_not_replaced(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "out.parquet"
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "top") == 0
    (output / "notes.txt").write_bytes(b"mine\n")
    files = sorted(p.name for p in output.iterdir())
    capsys.readouterr()
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "average", "--overwrite") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "holds notes.txt, which embed-file did not write" in err and "choose another OUTPUT path" in err
    assert sorted(p.name for p in output.iterdir()) == files and (output / "notes.txt").read_bytes() == b"mine\n"


def test_a_user_folder_named_like_the_job_folder_is_never_touched(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "out.h5"
    partial = tmp_path / "out.h5.partial"
    make_user_folder(partial)
    for overwrite in ([], ["--overwrite"]):
        capsys.readouterr()
        assert embed_file(source, output, "--model", tiny_model_dir, *overwrite) == 2
        (err,) = error_lines(capsys.readouterr().err)
        assert f"{partial} already exists and is not an unfinished embed-file job" in err
        assert "notes.txt" in err and "choose another OUTPUT path" in err
        assert user_files_intact(partial)
        assert not output.exists()


# -- --overwrite replaces an earlier embed-file output -------------------------------------------------------------
@pytest.mark.parametrize("name", ["out.parquet", "out.h5"])
def test_overwrite_replaces_an_earlier_embed_file_output(tmp_path, tiny_model_dir, capsys, name):
    source = write_lines(tmp_path / "in.txt", corpus(40))
    model = ["--model", tiny_model_dir, "--shard-lines", "10"]
    output_format = "parquet" if name.endswith(".parquet") else "hdf5"
    reference = tmp_path / f"reference-{name}"
    assert embed_file(source, reference, *model, "--layers", "average") == 0
    output = tmp_path / name
    assert embed_file(source, output, *model, "--layers", "top", "--shard-lines", "7") == 0

    capsys.readouterr()
    assert embed_file(source, output, *model, "--layers", "average", "--overwrite") == 0
    assert "40 sentences" in capsys.readouterr().out
    assert_same_output(output, reference, output_format)
    assert not (tmp_path / f"{name}.partial").exists()
    if output_format == "parquet":  # the earlier output's shards are gone, only the new ones are there
        assert sorted(p.name for p in output.iterdir()) == sorted(p.name for p in reference.iterdir())


def test_a_failed_overwrite_keeps_the_earlier_output(tmp_path, tiny_model_dir, capsys):
    """The earlier output is replaced when the new one is complete, not before: a job that fails keeps it."""
    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "out.h5"
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "top") == 0
    before = output.read_bytes()
    long_source = write_lines(tmp_path / "long.txt", ["word " * 300])
    capsys.readouterr()
    args = ["--model", tiny_model_dir, "--max-sentence-tokens", "100", "--overwrite"]
    assert embed_file(long_source, output, *args) == 2
    assert "line 1 has 300 tokens" in error_lines(capsys.readouterr().err)[0]
    assert output.read_bytes() == before
    assert not (tmp_path / "out.h5.partial").exists()


# -- over-long lines: refused in the scan ------------------------------------------------------------------------------
def test_a_long_line_is_refused_by_the_scan_then_truncate_completes(tmp_path, tiny_model_dir):
    """One line over the limit, run as a user runs the command: one error line with the line number and the way out,
    exit 2, nothing left behind; the rerun with the --overflow truncate it suggests runs to completion."""
    source = write_lines(tmp_path / "in.txt", ["the cat sat . " * 1000], final_newline=True)  # 4,000 tokens
    output = tmp_path / "out.h5"
    command = [
        sys.executable,
        "-m",
        "elmo.cli",
        "embed-file",
        str(source),
        str(output),
        "--model",
        str(tiny_model_dir),
        "--max-sentence-tokens",
        "500",
        "--no-progress",
        "--threads",
        "1",
    ]
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    (err,) = error_lines(refused.stderr)
    assert f"{source}: line 1 has 4,000 tokens, over the limit of 500 tokens per line (--max-sentence-tokens)" in err
    assert "use --overflow truncate" in err and "--overflow window" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # no OUTPUT, no OUTPUT.partial

    done = subprocess.run([*command, "--overflow", "truncate"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 sentences (0 blank, 500 tokens)" in done.stdout
    with h5py.File(output, "r") as handle:
        assert handle["0"].shape[1] == 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.h5"]


def test_the_scan_names_the_first_line_over_the_limit(tmp_path):
    lines = ["short", "a b c d e f", "x", "苹果很好吃" * 3]
    source = write_lines(tmp_path / "in.txt", lines)
    with pytest.raises(InputError, match=r"line 2 has 6 tokens, over the limit of 5 tokens per line"):
        plan.scan_input(source, "text", 2, limit=plan.LineLimit(5))
    scanned = plan.scan_input(source, "text", 2, limit=plan.LineLimit(15))
    assert scanned.n_lines == 4  # within the limit: the same plan as without one
    with pytest.raises(InputError, match=r"line 4 has 15 tokens, over the limit of 14"):
        plan.scan_input(source, "text", 2, limit=plan.LineLimit(14))
    jsonl = write_lines(tmp_path / "in.jsonl", ['{"tokens": ["a", "b"]}', '{"tokens": ["a", "b", "c"]}'])
    with pytest.raises(InputError, match=r"line 2 has 3 tokens, over the limit of 2"):
        plan.scan_input(jsonl, "jsonl", 2, limit=plan.LineLimit(2))
    with pytest.raises(InputError, match=r"line 2 has 6 tokens, over the limit of 5"):
        plan.scan_input(source, "text", 2, limit=plan.LineLimit(5), tokenized=True)


@pytest.mark.parametrize("limit", [1, 7, 60, 333, 5000])
@pytest.mark.parametrize("tokenized", [False, True])
def test_counting_a_prefix_agrees_with_counting_the_whole_line(limit, tokenized):
    """The scan counts a long line only as far as it must (prefixes of doubling size): the same verdict as
    tokenizing the whole line, for lines just under, at and over the limit, in mixed scripts."""
    rng = np.random.default_rng(limit)
    words = ["the", "cat", "苹果", "很", "好吃", ",", ".", "naïve", "co-op", "😀", "x"]
    for n_words in (limit // 2, limit - 1, limit, limit + 1, 3 * limit + 5):
        line = " ".join(rng.choice(words, size=max(n_words, 1)))
        whole = len(line.split() if tokenized else tokenize(line).tokens)
        verdict = plan.tokens_over_limit(line, limit, tokenized, exact_count_chars=0)  # always the prefix path
        assert (verdict is not None) == (whole > limit), (line[:80], whole, verdict)
        if verdict is not None and not verdict.startswith("more than"):
            assert verdict == f"{whole:,}"


def test_a_huge_line_without_spaces_is_refused_with_a_bound(tmp_path):
    """A 6-million-character line of Chinese (6 million tokens, no space to cut at) is refused without counting
    it whole: the message says it has more than the limit."""
    source = tmp_path / "huge.txt"
    source.write_text("苹果很好吃" * 1_200_000 + "\n", encoding="utf-8")
    with pytest.raises(InputError, match=r"line 1 has more than 100,000 tokens, over the limit of 100,000"):
        plan.scan_input(source, "text", 1000, limit=plan.LineLimit(100_000))


def test_truncate_tokenizes_a_long_line_only_as_far_as_it_keeps(tmp_path):
    """--overflow truncate keeps a line's first tokens: tokenizing may stop there, the tokens kept are the same."""
    line = " ".join(["the cat sat on the mat", "苹果很好吃", "co-op, naïve!"] * 2000)  # ~80,000 characters
    source = write_lines(tmp_path / "in.txt", ["short", line])
    scanned = plan.scan_input(source, "text", 10)
    whole = plan.read_shard(scanned, scanned.shards[0], tokenized=False)[1].tokens
    kept = plan.read_shard(scanned, scanned.shards[0], tokenized=False, keep=1000)[1].tokens
    assert len(whole) > 20_000 and 1000 < len(kept) < len(whole)  # stopped early
    assert kept[:1000] == whole[:1000]


def test_only_a_folder_with_the_jobs_mark_is_taken_as_its_own(tmp_path, tiny_model_dir, capsys):
    """OUTPUT.partial without the job's _job.json is refused even when its files are named like the job's; an empty
    one (killed between making it and writing _job.json) and one killed while a Parquet output was being finished
    (its complete manifest, no _job.json) are the job's own: the rerun completes."""
    source = write_lines(tmp_path / "in.txt", corpus(30))
    model = ["--model", tiny_model_dir, "--shard-lines", "10"]
    lookalike = tmp_path / "a.h5.partial"
    lookalike.mkdir()
    (lookalike / "part-000000.h5").write_bytes(b"someone's file")
    capsys.readouterr()
    assert embed_file(source, tmp_path / "a.h5", *model, "--overwrite") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "a.h5.partial already exists and is not an unfinished embed-file job (it has no _job.json)" in err
    assert (lookalike / "part-000000.h5").read_bytes() == b"someone's file" and not (tmp_path / "a.h5").exists()

    (tmp_path / "b.h5.partial").mkdir()
    assert embed_file(source, tmp_path / "b.h5", *model) == 0
    assert not (tmp_path / "b.h5.partial").exists()

    reference = tmp_path / "reference.parquet"
    assert embed_file(source, reference, *model) == 0
    finishing = tmp_path / "c.parquet.partial"
    finishing.mkdir()
    for file in reference.iterdir():  # the state between the final manifest and the rename
        (finishing / file.name).write_bytes(file.read_bytes())
    assert embed_file(source, tmp_path / "c.parquet", *model) == 0
    assert_same_output(tmp_path / "c.parquet", reference, "parquet")
    assert not finishing.exists()


def test_replacing_an_output_removes_only_files_inside_it(tmp_path, tiny_model_dir):
    """A manifest naming a file outside its folder (edited by hand, or crafted) never makes --overwrite remove it."""
    import json

    source = write_lines(tmp_path / "in.txt", corpus(20))
    output = tmp_path / "out.parquet"
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "top") == 0
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me\n")
    manifest = json.loads((output / "_manifest.json").read_text())
    manifest["shards"].append({"file": "../victim.txt"})
    (output / "_manifest.json").write_text(json.dumps(manifest))
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "average", "--overwrite") == 0
    assert victim.read_bytes() == b"keep me\n"
