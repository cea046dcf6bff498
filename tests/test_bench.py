import json
from pathlib import Path

import elmo.bench.run
from elmo.bench.run import synthetic_sentences
from elmo.cli import main


def test_bench_writes_json_and_a_markdown_table(tiny_model_dir, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_model_dir), "--shapes", "--batch-sizes", "1", "4", "--threads", "1"]
    argv += ["--time-budget-s", "0", "--min-batches", "1", "--sentences", "12", "--name", "t", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "t.json").read_text())
    environment = results["environment"]  # the machine in every figure (elmo.runtime.host)
    assert environment["cpu"] and "AVX2" in environment["cpu_flags"] and "AVX-512 VNNI" in environment["cpu_flags"]
    assert environment["cores"] >= 1 and "onnxruntime" in environment["libraries"]
    (model,) = results["models"]
    assert [row["batch_size"] for row in model["rows"]] == [1, 4]
    for row in model["rows"]:
        for engine in ("torch eager", "torch sorted", "ort", "ort+cache"):
            assert row[engine]["tokens_per_s"] > 0 and row[engine]["latency_ms_p50"] > 0
    table = (tmp_path / "t.md").read_text()
    assert table.startswith(f"CPU: {environment['cpu']}, ")
    assert table.count(f"\n| {model['name']} |") == 8 and "vs torch eager" in table
    assert "tokens/s" in capsys.readouterr().out


def test_synthetic_text_is_deterministic_and_text_like():
    first, again = synthetic_sentences(300, seed=0), synthetic_sentences(300, seed=0)
    assert first == again
    lengths = [len(s) for s in first]
    assert 3 <= min(lengths) and max(lengths) <= 81 and 12 < sum(lengths) / len(lengths) < 30
    tokens = [t for s in first for t in s]
    assert len(set(tokens)) < len(tokens) / 2  # Zipfian: tokens repeat, which the token cache relies on
    assert any("\u4e00" <= t[0] <= "\u9fff" for t in tokens)


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}


def test_bench_writes_where_it_is_run_and_never_overwrites_unasked(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Before the fix the default name overwrote the committed bench/results/cpu.* inside the package. Now the
    default is ./bench-results/ of the current directory, an existing result is refused before anything is measured
    (one line, exit 2) unless --force, and the command says where it wrote."""
    package_results = Path(elmo.bench.run.__file__).parent / "results"
    before = _snapshot(package_results)
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--model", str(tiny_model_dir), "--shapes", "--batch-sizes", "1", "--threads", "1"]
    argv += ["--time-budget-s", "0", "--min-batches", "1", "--sentences", "4", "--check-sentences", "2"]
    assert main(argv) == 0
    written = tmp_path / "bench-results" / "cpu.json"
    assert json.loads(written.read_text())["models"][0]["rows"][0]["batch_size"] == 1
    assert f"wrote {written} and {written.with_suffix('.md')}" in capsys.readouterr().out
    assert _snapshot(package_results) == before
    stamp = written.stat().st_mtime_ns
    assert main(argv) == 2  # the same command again: refused before it measures anything
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"elmo bench: error: {Path('bench-results') / 'cpu.json'} already exists; pass --force to overwrite it, or "
        "choose another --name"
    ]
    assert "tok/s" not in captured.out and written.stat().st_mtime_ns == stamp
    written.write_text("{}")
    assert main([*argv, "--force"]) == 0 and json.loads(written.read_text())["models"]
    assert main([*argv, "--name", "../cpu"]) == 2
    assert "--name '../cpu': a file name, without folders" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-results"]
