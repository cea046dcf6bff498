"""Hostile weight files: a few KB that declare gigabytes. Every importer checks each declared shape and dtype against
what the config implies, and the total against the byte budget, before it reads anything; datasets it does not use
stay unread. The refusals are one line, and the peak memory of the import (a child process, `elmo import-...`) stays
near the interpreter's own (torch alone is ~220 MiB, the importer's modules ~255 MiB: the 300 MiB bound leaves room
for a small model, not for one declared gigabyte).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from elmo.cli import main as elmo_main
from tests.importers.test_allennlp import SHAPES, random_hdf5_weights, write_allennlp_files

REPO = Path(__file__).resolve().parents[2]
ELMO = Path(sys.executable).with_name("elmo")
PEAK_RSS_LIMIT_MIB = 300
SHAPE = SHAPES[1]  # 2 layers, 1 highway: every kind of dataset


# The child is started by a small Python process that reports its peak: a child forked straight from this test
# process would inherit the test process's own peak (Linux carries the high-water mark of the memory it replaced
# through exec), and pytest with torch loaded is itself near the bound.
MEASURE = (
    "import os, subprocess, sys\n"
    "child = subprocess.Popen(sys.argv[2:])\n"
    "_, status, usage = os.wait4(child.pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def run_import(tmp_path: Path, *argv: str) -> tuple[int, str, float]:
    """``elmo ARGV`` in a child process -> (exit status, stderr, its peak RSS in MiB)."""
    report = tmp_path / "peak_rss_kib"
    done = subprocess.run([sys.executable, "-c", MEASURE, str(report), str(ELMO), *argv], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    return done.returncode, done.stderr, int(report.read_text()) / 1024  # ru_maxrss: KiB on Linux


def declare(weights: Path, name: str, shape: tuple[int, ...], dtype=np.float32) -> None:
    """Replace (or add) ``name`` with a dataset declaring ``shape`` and no stored bytes (chunked, never written)."""
    with h5py.File(weights, "a") as handle:
        if name in handle:
            del handle[name]
        chunk = tuple(min(n, 1024) for n in shape)
        handle.create_dataset(name, shape=shape, dtype=dtype, chunks=chunk)


def valid_files(directory: Path, options: dict | None = None) -> tuple[Path, Path]:
    return write_allennlp_files(directory, options or SHAPE.options(), random_hdf5_weights(SHAPE, seed=3))


def import_argv(options: Path, weights: Path, out: Path, *extra: str) -> list[str]:
    return ["import-allennlp", "--options", str(options), "--weights", str(weights), "--out", str(out), *extra]


def one_error_line(err: str, command: str = "import-allennlp") -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err  # no traceback, no second line
    assert lines[0].startswith(f"elmo {command}: error:"), err
    return lines[0]


# -- in process: what is refused, and how it is said -------------------------------------------------------------
CHAR_EMBED_SHAPE = (261, 4)  # SHAPE's char_cnn.embedding.dim is 4


@pytest.mark.parametrize(
    "name, shape, dtype, says",
    [
        ("char_embed", (1 << 18, 1 << 10), np.float32, "has shape (262144, 1024)"),
        ("char_embed", (1 << 24, 1 << 10), np.float32, "has shape (16777216, 1024)"),  # 64 GiB
        ("char_embed", CHAR_EMBED_SHAPE, np.float64, "is declared (261, 4) float64"),
        ("char_embed", CHAR_EMBED_SHAPE, np.int32, "is declared (261, 4) int32"),
        ("RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0", (16, 48, 1), np.float32, "has shape (16, 48, 1)"),
    ],
    ids=["1-GiB-wrong-shape", "64-GiB", "float64", "int32", "extra-axis"],
)
def test_a_declaration_unlike_the_options_is_refused_naming_both(tmp_path, capsys, name, shape, dtype, says):
    options, weights = valid_files(tmp_path / "src")
    declare(weights, name, shape, dtype)
    out = tmp_path / "out"
    assert elmo_main(import_argv(options, weights, out)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(weights) in line and f"'{name}'" in line and says in line and "refused before reading" in line
    assert "options.json implies" in line and "float32" in line
    assert not out.exists()


def test_options_that_imply_more_than_the_budget_are_refused_before_the_file_is_read(tmp_path, capsys):
    options = SHAPE.options()
    options["char_cnn"]["embedding"]["dim"] = 1 << 28  # char_embed alone: 261 x 2^28 float32 = 261 GiB
    options_path, weights = valid_files(tmp_path / "src", options)
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "options.json implies" in line and "over the 2,147,483,648-byte budget (--max-weight-bytes)" in line

    # the flag moves the bound: the valid small model is refused under a 1 KB budget, imported under the default
    options_path, weights = valid_files(tmp_path / "small")
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out", "--max-weight-bytes", "1000")) == 2
    assert "over the 1,000-byte budget" in one_error_line(capsys.readouterr().err)
    assert elmo_main(import_argv(options_path, weights, tmp_path / "out")) == 0
    assert elmo_main(import_argv(options_path, weights, tmp_path / "o2", "--max-weight-bytes", "0")) == 2
    assert "--max-weight-bytes must be at least 1" in capsys.readouterr().err


def test_a_dataset_the_import_does_not_use_is_never_read(tmp_path, capsys):
    options, weights = valid_files(tmp_path / "src")
    declare(weights, "softmax/W", (1 << 19, 1 << 10))  # 2 GiB declared, no bytes stored
    declare(weights, "junk/float64", (1 << 20, 1 << 10), np.float64)
    assert weights.stat().st_size < 64 << 10
    out = tmp_path / "out"
    assert elmo_main(import_argv(options, weights, out)) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["n_layers"] == SHAPE.n_layers
    assert "ignored 2 dataset(s) not used for embedding (not read)" in captured.err
    assert (out / "model.safetensors").is_file()


# -- in a child process: the peak memory ------------------------------------------------------------------------
@pytest.mark.slow  # four imports in child processes, ~3 s each (torch's import)
def test_kb_files_declaring_gigabytes_stay_under_the_memory_bound(tmp_path):
    cases = {
        "wrong-shape-1GiB": ("char_embed", (1 << 18, 1 << 10), np.float32, 2),
        "float64": ("char_embed", CHAR_EMBED_SHAPE, np.float64, 2),
        "64GiB": ("char_embed", (1 << 24, 1 << 10), np.float32, 2),
        "unused-2GiB": ("softmax/W", (1 << 19, 1 << 10), np.float32, 0),
    }
    peaks = {}
    for case, (name, shape, dtype, status) in cases.items():
        options, weights = valid_files(tmp_path / case)
        if case == "float64":  # right shape, wrong type, and a gigabyte of it: embedding dim 2^20
            big = SHAPE.options()
            big["char_cnn"]["embedding"]["dim"] = 1 << 20
            options.write_text(json.dumps(big))
            shape = (261, 1 << 20)
        declare(weights, name, shape, dtype)
        assert weights.stat().st_size < 64 << 10
        rc, err, peak = run_import(tmp_path / case, *import_argv(options, weights, tmp_path / case / "out"))
        assert rc == status, err
        if status:
            assert f"'{name}'" in one_error_line(err)
        peaks[case] = peak
    assert all(peak < PEAK_RSS_LIMIT_MIB for peak in peaks.values()), peaks
