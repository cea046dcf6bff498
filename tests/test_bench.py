import json

from elmo.bench.run import synthetic_sentences

from elmo.cli import main


def test_bench_writes_json_and_a_markdown_table(tiny_model_dir, tmp_path, capsys):
    argv = ["bench", "--model", str(tiny_model_dir), "--shapes", "--batch-sizes", "1", "4", "--threads", "1"]
    argv += ["--seconds", "0", "--min-batches", "1", "--sentences", "12", "--name", "t", "--out", str(tmp_path)]
    assert main(argv) == 0
    results = json.loads((tmp_path / "t.json").read_text())
    (model,) = results["models"]
    assert [row["batch_size"] for row in model["rows"]] == [1, 4]
    for row in model["rows"]:
        for engine in ("torch eager", "torch sorted", "ort", "ort+cache"):
            assert row[engine]["tokens_per_s"] > 0 and row[engine]["latency_ms_p50"] > 0
    table = (tmp_path / "t.md").read_text()
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
