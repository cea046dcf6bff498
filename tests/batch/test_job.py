"""The batch job (elmo.batch): AllenNLP's hdf5 layout, Parquet shards, resume after SIGKILL, bad input, Ray.

Everything runs the real runtime on the tiny exported model (tests/conftest.py) and real files under tmp_path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pyarrow.dataset as pads
import pytest

from elmo.batch.cli import add_arguments, options_from_args
from elmo.batch.engines import LOCAL_MAX_TOKENS_PER_SENTENCE, make_backend
from elmo.batch.jobdir import JobDirectory
from elmo.batch.layout import Layout, parse_layers
from elmo.batch.options import JobOptions, job_fingerprint
from elmo.batch.pipeline import prefetched, write_shard
from elmo.batch.plan import plan_call_groups, read_shard, scan_input
from elmo.batch.writers import iter_parquet
from elmo.cli import main as cli
from elmo.errors import ElmoError, InputError
from elmo.runtime import CPU, Embedder
from elmo.text.tokenize import tokenize
from tests.conftest import REPO

LINES = [
    "The cat sat on the mat.",
    "",
    "苹果很好吃，我很喜欢。",
    "   padded with spaces   ",
    "The cat sat on the mat.",  # a duplicate sentence: sentence_to_index keeps the last index, as AllenNLP's dict did
    "A much longer sentence, with punctuation; numbers like 3.14 and an emoji 😀 at the end!",
    "x",
    "",
    "Last line without a newline",
]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)


def write_lines(path: Path, lines: list[str], final_newline: bool = False) -> Path:
    path.write_text("\n".join(lines) + ("\n" if final_newline else ""), encoding="utf-8")
    return path


def embed_file(*args: str) -> int:
    return cli(["embed-file", *map(str, args), "--no-progress", "--threads", "1"])


def error_lines(stderr: str) -> list[str]:
    """The CLI's own error lines (onnxruntime and logging may add lines of theirs); never a traceback."""
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("elmo embed-file: error: ")]


def read_hdf5(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path, "r") as handle:
        return {key: handle[key][...] for key in handle.keys()}


def expected_layers(embedder: Embedder, line: str, tokenized: bool = False) -> np.ndarray:
    tokens = line.split() if tokenized else tokenize(line.strip()).tokens
    return embedder.embed_tokens([tokens])[0]


# -- AllenNLP's hdf5 layout ----------------------------------------------------------------------------------------
def test_hdf5_reads_back_with_allennlp_conventions(tmp_path, tiny_model_dir, embedder):
    source = write_lines(tmp_path / "in.txt", LINES)
    output = tmp_path / "out.hdf5"
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", "all", "--shard-lines", "4") == 0

    n_layers, dim = embedder.info.n_layers, embedder.info.dim
    with h5py.File(output, "r") as handle:
        # the keys AllenNLP wrote: one dataset per 0-based line index, plus sentence_to_index, nothing else
        assert set(handle.keys()) == {str(i) for i in range(len(LINES))} | {"sentence_to_index"}
        index_dataset = handle["sentence_to_index"]
        assert index_dataset.shape == (1,)
        sentence_to_index = json.loads(index_dataset[0])
        for i, line in enumerate(LINES):
            vectors = handle[str(i)][...]
            assert vectors.dtype == np.float32
            n_tokens = len(tokenize(line.strip()).tokens)
            assert vectors.shape == (n_layers, n_tokens, dim)
            np.testing.assert_allclose(vectors, expected_layers(embedder, line), atol=1e-6, rtol=0)
    # {stripped sentence: "index"}, later duplicates win exactly as AllenNLP's dict assignment did
    allennlp_style = {}
    for i, line in enumerate(LINES):
        allennlp_style[line.strip()] = str(i)
    assert sentence_to_index == allennlp_style
    blank = read_hdf5(output)
    assert blank["1"].shape == blank["7"].shape == (n_layers, 0, dim)  # blank lines: kept, empty


@pytest.mark.parametrize("layers", ["top", "average"])
def test_top_and_average_are_n_by_dim(tmp_path, tiny_model_dir, embedder, layers):
    source = write_lines(tmp_path / "in.txt", LINES)
    output = tmp_path / "out.h5"
    assert embed_file(source, output, "--model", tiny_model_dir, "--layers", layers, "--dtype", "float16") == 0
    vectors = read_hdf5(output)
    for i, line in enumerate(LINES):
        full = expected_layers(embedder, line)
        want = full[-1] if layers == "top" else full.mean(axis=0)
        assert vectors[str(i)].dtype == np.float16
        assert vectors[str(i)].shape == want.shape
        np.testing.assert_allclose(vectors[str(i)].astype(np.float32), want, atol=2e-3, rtol=1e-3)


def test_task_mix_and_unknown_task(tmp_path, tiny_model_dir, embedder, capsys):
    from elmo.runtime.tasks import Task, TaskStore, apply_task, save_task

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    n_layers, dim = embedder.info.n_layers, embedder.info.dim
    task = Task("demo", "tagging", n_layers, dim, weights=[0.5, -1.0, 2.0][:n_layers], gamma=1.7, labels=["A"])
    save_task(model, task)
    source = write_lines(tmp_path / "in.txt", LINES)
    output = tmp_path / "mix.h5"
    assert embed_file(source, output, "--model", model, "--layers", "mix:demo") == 0
    stored = TaskStore(model).get("demo")
    vectors = read_hdf5(output)
    for i, line in enumerate(LINES):
        np.testing.assert_allclose(vectors[str(i)], apply_task(expected_layers(embedder, line), stored), atol=1e-6)

    capsys.readouterr()
    assert embed_file(source, tmp_path / "nope.h5", "--model", model, "--layers", "mix:nope") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "unknown task 'nope'" in err and "demo" in err


# -- Parquet -------------------------------------------------------------------------------------------------------
def test_jsonl_tokenized_to_parquet_shards(tmp_path, tiny_model_dir, embedder):
    records = [
        {"id": "doc-a", "text": "Hello there , world"},
        {"id": 7, "tokens": ["pre", "tokenized", "input"]},
        {"id": "blank", "text": ""},
        {"text": "no id given"},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n\n", encoding="utf-8")
    output = tmp_path / "out.parquet"
    assert embed_file(source, output, "--model", tiny_model_dir, "--tokenized", "--shard-lines", "2") == 0

    rows = list(iter_parquet(output))
    assert [r[0] for r in rows] == [0, 1, 2, 3, 4]
    assert [r[1] for r in rows] == ["doc-a", "7", "blank", "3", "4"]  # missing id / blank line -> the line index
    tokens = [["Hello", "there", ",", "world"], ["pre", "tokenized", "input"], [], ["no", "id", "given"], []]
    assert [r[2] for r in rows] == tokens
    for (_, _, _, vectors), want in zip(rows, tokens):
        assert vectors.shape == (embedder.info.n_layers, len(want), embedder.info.dim)
        if want:
            np.testing.assert_allclose(vectors, embedder.embed_tokens([want])[0], atol=1e-6, rtol=0)

    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["lines"] == 5 and manifest["blank"] == 2
    assert [s["file"] for s in manifest["shards"]] == [
        "part-000000.parquet",
        "part-000001.parquet",
        "part-000002.parquet",
    ]
    assert sorted(p.name for p in output.iterdir()) == ["_manifest.json"] + [s["file"] for s in manifest["shards"]]
    # any Parquet reader sees the rows in order (files starting with '_' are ignored)
    table = pads.dataset(output, format="parquet").to_table()
    assert table.column("index").to_pylist() == [0, 1, 2, 3, 4]

    # the same input to hdf5: keys are line indices, each line's JSONL id rides along as an attribute
    assert embed_file(source, tmp_path / "out.h5", "--model", tiny_model_dir, "--tokenized", "--shard-lines", "2") == 0
    with h5py.File(tmp_path / "out.h5", "r") as handle:
        assert [handle[str(i)].attrs["id"] for i in range(5)] == ["doc-a", "7", "blank", "3", "4"]
        assert json.loads(handle["sentence_to_index"][0]) == {
            "Hello there , world": "0",
            "pre tokenized input": "1",
            "": "4",
            "no id given": "3",
        }
        for index, _, _, vectors in rows:
            np.testing.assert_array_equal(handle[str(index)][...], vectors)


def test_parquet_top_matches_hdf5(tmp_path, tiny_model_dir):
    source = write_lines(tmp_path / "in.txt", LINES, final_newline=True)
    assert embed_file(source, tmp_path / "a.h5", "--model", tiny_model_dir, "--layers", "top") == 0
    assert embed_file(source, tmp_path / "b.parquet", "--model", tiny_model_dir, "--layers", "top") == 0
    hdf5 = read_hdf5(tmp_path / "a.h5")
    rows = list(iter_parquet(tmp_path / "b.parquet"))
    assert len(rows) == len(LINES)
    for index, _, _, vectors in rows:
        np.testing.assert_array_equal(vectors, hdf5[str(index)])


# -- streaming pieces ----------------------------------------------------------------------------------------------
def test_call_groups_are_sorted_bounded_and_cover_every_sentence():
    lengths = [5, 0, 1, 40, 7, 7, 3, 0, 12, 2, 9]
    groups = plan_call_groups(lengths, group_tokens=16)
    order = [p for g in groups for p in g]
    assert sorted(order) == [i for i, n in enumerate(lengths) if n > 0]
    assert [lengths[p] for p in order] == sorted(lengths[p] for p in order)  # sorted: little padding per batch
    for group in groups:
        assert sum(lengths[p] for p in group[:-1]) < 16  # closes as soon as it reaches the budget


def test_scan_streams_and_shards_cover_the_file(tmp_path):
    import tracemalloc

    source = tmp_path / "big.txt"
    with open(source, "w", encoding="utf-8") as handle:
        for i in range(200_000):
            handle.write(f"line {i} of a file that is much larger than what the scan keeps in memory\n")
    tracemalloc.start()
    plan = scan_input(source, "text", shard_lines=1000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert source.stat().st_size > 15_000_000 and peak < 2_000_000  # memory: one entry per shard, not per line
    assert plan.n_lines == 200_000 and len(plan.shards) == 200
    assert plan.shards[-1].byte_end == source.stat().st_size
    record = read_shard(plan, plan.shards[123], tokenized=True)[0]
    assert record.index == 123_000 and record.tokens[:2] == ["line", "123000"]


# -- bad input: one clear line -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (None, [], "input file not found"),
        (b"fine\n\xff\xfe broken\n", [], "line 2 is not valid UTF-8"),
        (b"fine\n", ["--layers", "middle"], "--layers: expected all, top, average or mix:TASK, got 'middle'"),
        (b'{"id": 1, "text": "ok"}\n{"id": 2, "text": \n', ["--input-format", "jsonl"], "line 2 is not valid JSON"),
        (b'{"id": 1}\n', ["--input-format", "jsonl"], "exactly one of 'text'"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, tiny_model_dir, capsys, content, extra, message):
    source = tmp_path / "in.txt"
    if content is not None:
        source.write_bytes(content)
    code = embed_file(source, tmp_path / "out.h5", "--model", tiny_model_dir, *extra)
    (err,) = error_lines(capsys.readouterr().err)
    assert code == 2 and message in err
    assert not (tmp_path / "out.h5").exists()


def test_parse_layers():
    assert parse_layers("all").kind == "all" and parse_layers("mix:pos").task == "pos"
    for bad in ("", "mix:", "ALL", "top,average"):
        with pytest.raises(InputError):
            parse_layers(bad)


# -- resumability --------------------------------------------------------------------------------------------------
def corpus(n: int) -> list[str]:
    words = "the a cat dog sat ran on under mat tree 苹果 很 好 . , !".split()
    rng = np.random.default_rng(0)
    lines = []
    for i in range(n):
        length = 0 if i % 97 == 5 else int(rng.integers(1, 14))
        lines.append(" ".join(rng.choice(words, size=length)))
    return lines


def assert_same_output(a: Path, b: Path, output_format: str, atol: float = 0.0) -> None:
    """The same lines, tokens and vectors: bit for bit, or within ``atol`` (outputs of different context graphs:
    the local engine's in_step one against a server's separate one sum in another order)."""
    if output_format == "hdf5":
        left, right = read_hdf5(a), read_hdf5(b)
        assert left.keys() == right.keys()
        pairs = [(left[key], right[key], key) for key in left]
    else:
        left, right = list(iter_parquet(a)), list(iter_parquet(b))
        assert [r[:3] for r in left] == [r[:3] for r in right]
        pairs = [(x[3], y[3], str(x[:3])) for x, y in zip(left, right)]
    for x, y, name in pairs:
        if atol:
            np.testing.assert_allclose(x, y, rtol=0, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("output_format", ["hdf5", "parquet"])
def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir, output_format, capsys):
    source = write_lines(tmp_path / "in.txt", corpus(1500), final_newline=True)
    args = ["--model", tiny_model_dir, "--format", output_format, "--shard-lines", "25", "--layers", "all"]
    reference = tmp_path / "reference.out"
    assert embed_file(source, reference, *args) == 0

    output = tmp_path / "killed.out"
    log = tmp_path / "killed.out.partial" / "_manifest.jsonl"
    command = [sys.executable, "-m", "elmo.cli", "embed-file", str(source), str(output), *map(str, args)]
    process = subprocess.Popen(
        [*command, "--no-progress", "--threads", "1"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and log.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    assert not output.exists(), "killed mid-run: the output must not exist yet"
    committed = log.read_bytes().count(b"\n")
    assert 3 <= committed < 60

    capsys.readouterr()
    assert embed_file(source, output, *args) == 0
    summary = capsys.readouterr().out
    assert "resumed from an earlier run" in summary and "1500 sentences" in summary
    assert not (tmp_path / "killed.out.partial").exists()
    assert_same_output(output, reference, output_format)


def test_the_local_engine_runs_the_in_step_graph_on_cpu(tmp_path, tiny_model_dir):
    source = write_lines(tmp_path / "in.txt", corpus(4))
    options = options_from_args(_parsed(source, tmp_path / "out.h5", ["--model", tiny_model_dir]))
    assert make_backend(options).embedder.context_layout == "in_step"  # its calls are wide: modeldir.CONTEXT_LAYOUTS


def test_every_crash_state_resumes_to_the_same_output(tmp_path, tiny_model_dir):
    """The states a kill can leave, made on purpose: a torn last log line, a renamed shard never committed, a
    stray temporary, a half-assembled hdf5; and a kill after the final rename (clean-up not done)."""
    source = write_lines(tmp_path / "in.txt", corpus(120))
    reference = tmp_path / "reference.h5"
    args = ["--model", tiny_model_dir, "--shard-lines", "10", "--layers", "average"]
    assert embed_file(source, reference, *args) == 0

    output = tmp_path / "out.h5"
    options = options_from_args(_parsed(source, output, args))
    plan = scan_input(source, "text", 10)
    backend = make_backend(options)
    layout = Layout(options.spec, backend.n_layers, backend.dim, options.dtype)
    fingerprint = job_fingerprint(options, plan, backend.identity(), layout)
    job = JobDirectory(output)
    job.open(fingerprint, overwrite=False)
    for shard in plan.shards[:4]:
        job.commit(write_shard(plan, shard, options, backend, layout, job.path))
    write_shard(plan, plan.shards[4], options, backend, layout, job.path)  # renamed, never committed
    (job.path / ".part-000005.deadbeef.h5.tmp").write_bytes(b"half a shard")
    (job.path / "_assembled.h5.tmp").write_bytes(b"half an assembly")
    with open(job.path / "_manifest.jsonl", "ab") as handle:
        handle.write(b'{"shard": 9, "file": "part-0000')  # torn append

    assert embed_file(source, output, *args) == 0
    assert_same_output(output, reference, "hdf5")

    # killed after the final rename, before removing OUTPUT.partial: a rerun only cleans up
    job.path.mkdir()
    (job.path / "_job.json").write_text(json.dumps(fingerprint))
    assert embed_file(source, output, *args) == 0
    assert not job.path.exists()
    assert_same_output(output, reference, "hdf5")


def _parsed(source: Path, output: Path, args: list) -> object:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([str(source), str(output), *map(str, args), "--no-progress", "--threads", "1"])


def unfinished_job(source: Path, output: Path, args: list, shards: int) -> JobDirectory:
    """OUTPUT.partial as a job run with ``args`` leaves it when killed after committing ``shards`` shards."""
    options = options_from_args(_parsed(source, output, args))
    plan = scan_input(source, "text", options.shard_lines)
    backend = make_backend(options)
    layout = Layout(options.spec, backend.n_layers, backend.dim, options.dtype)
    job = JobDirectory(output)
    job.open(job_fingerprint(options, plan, backend.identity(), layout), overwrite=False)
    for shard in plan.shards[:shards]:
        job.commit(write_shard(plan, shard, options, backend, layout, job.path))
    return job


def test_resume_refuses_other_arguments_and_existing_outputs(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", corpus(30))
    output = tmp_path / "out.h5"
    model = ["--model", tiny_model_dir, "--shard-lines", "10"]
    job = unfinished_job(source, output, [*model, "--dtype", "float16"], shards=1)
    before = sorted(p.name for p in job.path.iterdir())
    capsys.readouterr()
    assert embed_file(source, output, *model) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "holds an unfinished job with 1 shards committed" in err
    assert "--dtype float16 -> --dtype float32" in err and "--overwrite" in err  # in the words of the command line
    assert "'dtype'" not in err and "float16' ->" not in err
    assert sorted(p.name for p in job.path.iterdir()) == before  # the committed shard is kept

    assert embed_file(source, output, *model, "--overwrite") == 0
    capsys.readouterr()
    assert embed_file(source, output, *model) == 0  # same job again: nothing to do
    assert "already complete" in capsys.readouterr().out
    assert embed_file(source, output, *model, "--layers", "top") == 2  # another job's output
    (err,) = error_lines(capsys.readouterr().err)
    assert "already exists, made by embed-file with other options or input (--layers all -> --layers top)" in err
    assert "add --overwrite to replace it" in err
    other = tmp_path / "other.h5"
    other.write_bytes(b"not hdf5 at all")
    assert embed_file(source, other, *model) == 2  # someone else's file: never overwritten
    (err,) = error_lines(capsys.readouterr().err)
    assert "already exists and is not an embed-file output" in err and "choose another OUTPUT path" in err
    assert other.read_bytes() == b"not hdf5 at all"


def test_other_options_on_a_job_that_committed_nothing_start_again(tmp_path, tiny_model_dir, capsys):
    """Killed before its first commit, a job run again with other options simply starts again; with committed
    shards the refusal names the options as typed (``--overflow reject -> --overflow truncate``)."""
    source = write_lines(tmp_path / "in.txt", corpus(30))
    model = ["--model", tiny_model_dir, "--shard-lines", "10"]
    reference = tmp_path / "reference.h5"
    assert embed_file(source, reference, *model, "--overflow", "truncate") == 0

    output = tmp_path / "out.h5"
    unfinished_job(source, output, model, shards=0)
    assert embed_file(source, output, *model, "--overflow", "truncate") == 0
    assert_same_output(output, reference, "hdf5")

    again = tmp_path / "again.h5"
    unfinished_job(source, again, model, shards=2)
    capsys.readouterr()
    assert embed_file(source, again, *model, "--overflow", "truncate", "--max-sentence-tokens", "64") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "with 2 shards committed" in err
    changed = "--overflow reject -> --overflow truncate, --max-sentence-tokens (not given) -> --max-sentence-tokens 64"
    assert changed in err
    assert "[" not in err and "None" not in err  # never the fingerprint's own fields


def test_progress_bar_and_summary(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", LINES)
    code = cli(["embed-file", str(source), str(tmp_path / "o.h5"), "--model", str(tiny_model_dir), "--threads", "1"])
    assert code == 0
    captured = capsys.readouterr()
    assert "sent/s" in captured.err and "tok/s" in captured.err  # tqdm: sentences/s, tokens/s, ETA
    summary = captured.out.strip().splitlines()
    assert len(summary) == 1 and f"{len(LINES)} sentences (2 blank" in summary[0]
    assert "sentences/s" in summary[0] and "tokens/s" in summary[0]


def test_batch_job_imports_no_torch(tmp_path, tiny_model_dir):
    source = write_lines(tmp_path / "in.txt", LINES[:3])
    code = (
        "import sys; from elmo.cli import main; "
        f"rc = main(['embed-file', {str(source)!r}, {str(tmp_path / 'o.parquet')!r}, '--model', "
        f"{str(tiny_model_dir)!r}, '--no-progress']); "
        "import elmo.batch.ray_engine; "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- Ray -----------------------------------------------------------------------------------------------------------
def test_ray_engine_matches_local(tmp_path, tiny_model_dir, capfd):
    """capfd, not capsys: the driver's core worker (C++) writes to file descriptor 2 itself. Its `E... core_worker.cc`
    line (Ray Data's actors restarted with constructor arguments in the object store) came on every job."""
    ray = pytest.importorskip("ray")
    source = write_lines(tmp_path / "in.txt", corpus(90))
    too_long = write_lines(tmp_path / "long.txt", ["fine", "a " * (LOCAL_MAX_TOKENS_PER_SENTENCE + 1)])
    args = ["--model", tiny_model_dir, "--shard-lines", "20", "--layers", "all"]
    assert embed_file(source, tmp_path / "local.parquet", *args) == 0
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        capfd.readouterr()
        assert embed_file(source, f"{tmp_path / 'ray'}/", *args, "--engine", "ray") == 0  # a directory: Parquet
        assert embed_file(source, tmp_path / "ray.h5", *args, "--engine", "ray") == 0
        err = capfd.readouterr().err
        assert "core_worker.cc" not in err and "Progress bars disabled" not in err, err
        assert embed_file(too_long, tmp_path / "long.h5", *args, "--engine", "ray") == 2  # by the scan, before Ray
        (line,) = error_lines(capfd.readouterr().err)
        assert line.startswith(
            f"elmo embed-file: error: {too_long}: line 2 has 100,001 tokens, over the limit of 100,000 tokens per line"
        )
        assert not (tmp_path / "long.h5").exists() and not (tmp_path / "long.h5.partial").exists()
    finally:
        ray.shutdown()
    assert_same_output(tmp_path / "ray", tmp_path / "local.parquet", "parquet")
    manifest = json.loads((tmp_path / "ray" / "_manifest.json").read_text())
    assert [s["first_line"] for s in manifest["shards"]] == [0, 20, 40, 60, 80]
    local_rows = {r[0]: r[3] for r in iter_parquet(tmp_path / "local.parquet")}
    for key, vectors in read_hdf5(tmp_path / "ray.h5").items():
        if key != "sentence_to_index":
            np.testing.assert_array_equal(vectors, local_rows[int(key)])


def test_options_dataclass_is_what_the_cli_builds(tmp_path, tiny_model_dir):
    options = options_from_args(_parsed(tmp_path / "in.txt", tmp_path / "x.parquet", ["--model", tiny_model_dir]))
    assert isinstance(options, JobOptions)
    assert options.output_format == "parquet" and options.spec.kind == "all" and options.dtype == "float32"


# -- remote mode ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers", ["all", "top", "average", "mix:demo"])
def test_remote_server_gives_the_same_output(tmp_path, tiny_model_dir, layers):
    from elmo.runtime.tasks import Task, save_task
    from tests.service_helpers import EDGE_LIMITS, ServerThread

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    save_task(model, Task("demo", "tagging", 3, 16, weights=[0.1, 0.7, -0.4], gamma=0.9, labels=["A"]))
    server = ServerThread({"tiny": Embedder(model, providers=[CPU], intra_op_threads=1)}, EDGE_LIMITS)
    try:
        server.warm_up()
        source = write_lines(tmp_path / "in.txt", corpus(60))  # EDGE_LIMITS: 8 inputs, 8 KiB per response
        assert embed_file(source, tmp_path / "local.h5", "--model", model, "--layers", layers) == 0
        assert embed_file(source, tmp_path / "remote.h5", "--server", server.target, "--layers", layers) == 0
    finally:
        server.stop()
    local, remote = read_hdf5(tmp_path / "local.h5"), read_hdf5(tmp_path / "remote.h5")
    assert local.keys() == remote.keys()
    assert local.pop("sentence_to_index") == remote.pop("sentence_to_index")
    for key in local:
        assert local[key].shape == remote[key].shape
        np.testing.assert_allclose(remote[key], local[key], atol=1e-6, rtol=0, err_msg=key)


def test_remote_unknown_task_and_unreachable_server(tmp_path, tiny_model_dir, capsys):
    from tests.service_helpers import EDGE_LIMITS, ServerThread

    source = write_lines(tmp_path / "in.txt", LINES)
    server = ServerThread({"tiny": Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)}, EDGE_LIMITS)
    try:
        capsys.readouterr()
        # not warmed up yet: the job waits for SERVING (--server-wait-s), then fails on the unknown task
        server.loop.call_later(0.5, lambda: server.loop.create_task(server.server.warm_up()))
        assert embed_file(source, tmp_path / "o.h5", "--server", server.target, "--layers", "mix:nope") == 2
        assert "unknown task 'nope'" in capsys.readouterr().err
    finally:
        server.stop()
    assert embed_file(source, tmp_path / "o.h5", "--server", server.target, "--server-wait-s", "0.5") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "is not serving after 0.5 s" in err and "UNAVAILABLE" in err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make a certificate")
def test_remote_server_over_tls_with_a_token(tmp_path, tiny_model_dir, embedder, capsys, monkeypatch):
    from tests.service_helpers import EDGE_LIMITS, ServerThread, self_signed_cert

    monkeypatch.delenv("ELMO_AUTH_TOKEN", raising=False)
    tls = self_signed_cert(tmp_path)  # names localhost and 127.0.0.1
    source = write_lines(tmp_path / "in.txt", corpus(30))  # within EDGE_LIMITS' 20 tokens per sentence
    server = ServerThread({"tiny": embedder}, EDGE_LIMITS, tls=tls, auth_token="s3cret")
    try:
        server.warm_up()
        secure = ["--server", server.target, "--tls-ca", tls.cert]
        assert embed_file(source, tmp_path / "remote.h5", *secure, "--auth-token", "s3cret") == 0
        capsys.readouterr()
        # Without the token: health (exempt) passes, the first real RPC is refused; one line, nothing written.
        assert embed_file(source, tmp_path / "anonymous.h5", *secure) == 2
        (err,) = error_lines(capsys.readouterr().err)
        assert "UNAUTHENTICATED" in err and "--auth-token" in err and server.target in err
        assert list(tmp_path.glob("anonymous*")) == []
        # --tls-server-name is the name checked: the certificate's own name passes (token from the environment
        # this time), another fails the handshake, so the server never reports SERVING to this client.
        monkeypatch.setenv("ELMO_AUTH_TOKEN", "s3cret")
        assert embed_file(source, tmp_path / "named.h5", *secure, "--tls-server-name", "localhost") == 0
        capsys.readouterr()
        wrong = ["--tls-server-name", "elmo.invalid", "--server-wait-s", "0.5"]
        assert embed_file(source, tmp_path / "wrong.h5", *secure, *wrong) == 2
        (err,) = error_lines(capsys.readouterr().err)
        assert "is not serving after 0.5 s" in err and "UNAVAILABLE" in err
    finally:
        server.stop()
    assert embed_file(source, tmp_path / "local.h5", "--model", tiny_model_dir) == 0
    local = read_hdf5(tmp_path / "local.h5")
    for name in ("remote.h5", "named.h5"):
        remote = read_hdf5(tmp_path / name)
        assert local.keys() == remote.keys()
        for key in local:
            if key == "sentence_to_index":
                assert remote[key] == local[key]
            else:
                np.testing.assert_allclose(remote[key], local[key], atol=1e-6, rtol=0, err_msg=f"{name} {key}")


def test_connection_flags_need_a_server(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", LINES)
    assert embed_file(source, tmp_path / "o.h5", "--model", tiny_model_dir, "--auth-token", "t") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert err.endswith("--auth-token only apply with --server HOST:PORT")
    assert embed_file(source, tmp_path / "o.h5", "--server", "127.0.0.1:1", "--tls-server-name", "x") == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert "--tls-server-name needs --tls-ca" in err
    missing = tmp_path / "missing-ca.pem"
    assert embed_file(source, tmp_path / "o.h5", "--server", "127.0.0.1:1", "--tls-ca", missing) == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert f"{missing}: cannot read the TLS root certificate" in err
    assert list(tmp_path.glob("o.h5*")) == []


def test_ray_actors_ask_for_a_gpu_each_when_the_cluster_has_gpus(tmp_path):
    from elmo.batch.ray_engine import _actor_resources

    options = options_from_args(_parsed(tmp_path / "in.txt", tmp_path / "o.parquet", ["--model", tmp_path]))
    assert _actor_resources(options, {"CPU": 16.0, "GPU": 2.0}) == (2, {"num_gpus": 1, "num_cpus": 1})
    options.threads = 2  # without GPUs: CPUs / threads actors of `threads` CPUs each
    assert _actor_resources(options, {"CPU": 16.0}) == (8, {"num_gpus": 0, "num_cpus": 2})
    options.workers = 3
    assert _actor_resources(options, {"CPU": 16.0, "GPU": 8.0})[0] == 3


def test_ray_restarts_actors_only_where_another_node_can_take_them():
    """On 2+ nodes Ray restarts a lost node's actors elsewhere (bounded) and resubmits their shards; on one
    node nothing restarts (no ray#53727 error line). The full behaviour: tests/batch/test_ray_cluster.py (slow)."""
    from elmo.batch.ray_engine import ACTOR_RESTARTS, restart_policy

    assert restart_policy(1) == {"max_restarts": 0}
    assert restart_policy(3) == {"max_restarts": ACTOR_RESTARTS, "max_task_retries": -1}
    assert 0 < ACTOR_RESTARTS < 10  # finite: a shard that kills every actor it meets must end the job


def test_a_ray_cluster_refusing_the_token_is_one_line():
    """ray.init's refusal (AuthenticationError, chained under a ConnectionError or quoted in a RuntimeError) and an
    unreachable address become one ElmoError line each, naming the way out."""
    exceptions = pytest.importorskip("ray.exceptions")
    from elmo.batch.ray_engine import _connect

    def fake(exc: BaseException):
        def init(**kwargs):
            raise exc

        return type("FakeRay", (), {"init": staticmethod(init)})

    chained = ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")
    chained.__cause__ = exceptions.AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing")
    quoted = RuntimeError("Failed to connect to GCS. Last connection error: ... InvalidAuthToken ...")
    for exc in (chained, quoted):
        with pytest.raises(ElmoError, match="refused this driver: token authentication is on.*RAY_AUTH_MODE=token"):
            _connect(fake(exc), "10.0.0.1:6379", "10.0.0.1:6379")
    with pytest.raises(ElmoError, match="cannot connect to the Ray cluster at 10.0.0.1:6379: Failed to connect"):
        _connect(fake(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")), None, "10.0.0.1:6379")


def test_a_torn_commit_line_is_dropped_before_the_next_append(tmp_path):
    job = JobDirectory(tmp_path / "out.h5")
    job.open({"version": 1}, overwrite=False)
    shard = job.path / "part-000000.h5"
    shard.write_bytes(b"x" * 10)
    job.commit({"shard": 0, "file": shard.name, "first_line": 0, "n_lines": 5, "blank": 0, "tokens": 9, "bytes": 10})
    with open(job.path / "_manifest.jsonl", "ab") as handle:
        handle.write(b'{"shard": 1, "fi')  # killed mid-append
    (job.path / "part-000001.h5").write_bytes(b"renamed, never committed")

    again = JobDirectory(tmp_path / "out.h5")
    again.open({"version": 1}, overwrite=False)
    assert list(again.committed) == [0]
    assert sorted(p.name for p in again.path.iterdir()) == ["_job.json", "_manifest.jsonl", "part-000000.h5"]
    again.commit({"shard": 1, "file": shard.name, "first_line": 5, "n_lines": 5, "blank": 0, "tokens": 9, "bytes": 10})
    lines = (again.path / "_manifest.jsonl").read_text().splitlines()
    assert [json.loads(line)["shard"] for line in lines] == [0, 1]  # every line parses: nothing glued to the tear


def test_prefetch_keeps_order_raises_the_producers_error_and_stops_when_left():
    import threading

    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise InputError("line 3 is bad")

    with pytest.raises(InputError, match="line 3 is bad"):
        list(prefetched(failing()))

    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]

    items = prefetched(endless(), depth=2)
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    items.close()  # the consumer leaves early (an error while writing, Ctrl-C)
    assert not any(t.name == "embed-file-prefetch" for t in threading.enumerate())
    assert len(produced) <= 3 + 2 + 1  # the producer never ran more than `depth` items ahead


def test_rays_notice_about_its_own_token_default_is_dropped_and_nothing_else():
    """A local instance: Ray turns token authentication on and says so on every job; only that notice goes, from the
    logger Ray really emits it on (a Ray that moves it fails here)."""
    import logging

    from ray._private.authentication import authentication_token_setup

    from elmo.batch.ray_engine import TOKEN_NOTICE_LOGGER, _not_the_default_notice

    assert authentication_token_setup.logger.name == TOKEN_NOTICE_LOGGER

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(TOKEN_NOTICE_LOGGER, logging.WARNING, __file__, 1, message, None, None)

    assert not _not_the_default_notice(record("Token authentication is enabled for this Ray cluster. Set X."))
    assert _not_the_default_notice(record("Token authentication is disabled for this Ray cluster. Anyone ..."))
