"""bench/service/swap.py end to end on tiny models and a short run: swaps and a broken version under load, 0 failed."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # a server subprocess under load for 9 s, three tiny exports: ~30 s on 2 busy cores


def test_swap_benchmark_counts_no_failure_and_writes_its_results(tmp_path):
    from elmo.export.random_model import write_random_model

    from bench.service import swap

    cache = tmp_path / "models"
    for seed in (1, 2, 3):  # the conftest fixture's settings: the export's verification passes at tiny size
        write_random_model(
            cache / f"tiny-seed{seed}", "tiny", seed=seed, scale=0.3, export=True, cell_clip=0.5, proj_clip=0.5
        )
    out = tmp_path / "out"
    code = swap.main(
        [
            "--preset",
            "tiny",
            "--models",
            str(cache),
            "--duration",
            "9",
            "--clients",
            "4",
            "--rss-model",
            str(cache / "tiny-seed2"),
            "--out",
            str(out),
        ]
    )
    result = json.loads((out / "swap.json").read_text())
    assert code == 0 and result["swaps"]["failed"] == 0 and result["swaps"]["requests"] > 0
    assert set(result["swaps"]["answers_by_version"]) == {"1", "2", "4"}  # 3 is the broken one: refused
    assert result["swaps"]["final_versions"] == {"1": "unloaded", "2": "unloaded", "3": "failed", "4": "ready"}
    assert result["rss"]["rss_after_unload_mib"] > 0
    assert "failed: 0" in (out / "swap.md").read_text()
