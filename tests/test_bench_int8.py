"""bench/export/int8.py's speed table: the whole embed-file job and the runtime, each model in turn, ratios to
float32 (the tiny model under two names here: what is checked is the bench's plumbing, not int8's speed)."""

from __future__ import annotations

import argparse

from bench.export.int8 import speed


def test_speed_times_each_model_in_turn_and_sets_it_against_float32(tiny_model_dir, capsys):
    args = argparse.Namespace(
        speed_lines=20,
        repeat=2,
        threads=1,
        batch_tokens=None,
        shard_lines=1000,
        layers="all",
        format="hdf5",
        dtype="float32",
    )
    result = speed({"float32": tiny_model_dir, "u8u8": tiny_model_dir}, args)
    assert [len(runs) for runs in result["runs"].values()] == [2, 2] and result["tokens"] > 0
    assert set(result["ratio"]) == {"u8u8"}
    for key in ("embed_file", "runtime"):
        best = max(run[key] for run in result["runs"]["u8u8"])
        assert result["ratio"]["u8u8"][key] == best / result["best"]["float32"][key]
    printed = capsys.readouterr().out
    assert printed.count("speed float32: embed-file") == 2 and printed.count("speed u8u8: embed-file") == 2
