"""bench.service.tricks: how a variant's rounds are judged against today's, and the table made of a run."""

from __future__ import annotations

import pytest

from bench.service import tricks


def test_a_trick_pays_only_when_the_medians_differ_by_more_than_the_spread():
    today, close, far = [0.90, 0.95, 1.00], [0.88, 0.93, 0.99], [0.70, 0.72, 0.75]
    assert not tricks.judge(today, close, higher_is_better=True)["pays"]  # 0.02 apart, half-range 0.05
    judged = tricks.judge(today, far, higher_is_better=True)
    assert judged["pays"] and judged["gain"] == pytest.approx(0.23) and judged["spread"] == pytest.approx(0.05)
    assert not tricks.judge(today, far, higher_is_better=False)["pays"]  # a latency lower without the trick
    assert tricks.judge([3.0, 3.1, 3.2], [4.0, 4.1, 4.3], higher_is_better=False)["pays"]


def test_the_table_reads_each_server_s_rounds():
    def served(ratio: float) -> dict:
        return {"served_over_in_process": ratio}

    rounds = [
        {
            "today_grpc": served(0.9 + i / 100),
            "today_http": served(0.8),
            "today_one": {"grpc_p50_ms": 3.0, "http_p50_ms": 4.0, "http_beside_load_p50_ms": 5.0 + i},
            "gc-freeze_grpc": served(0.5 + i / 100),
            "gc-freeze_http": served(0.8),
            "gc-freeze_one": {"grpc_p50_ms": 3.0, "http_p50_ms": 4.0, "http_beside_load_p50_ms": 5.0 + i},
        }
        for i in range(3)
    ]
    judged = tricks.table({"variants": {"gc-freeze": "rev"}, "models": {"tiny": {"rounds": rounds}}})
    rows = judged["gc-freeze"]["tiny"]
    assert rows["gRPC load: served ÷ in-process"]["without"] == [0.5, 0.51, 0.52]
    assert [row["pays"] for row in rows.values()] == [True, False, False, False, False]
    text = tricks.markdown(judged)
    assert "| today | 0.91 (0.90–0.92) | 0.80 (0.80–0.80) | 3.00 (3.00–3.00) |" in text
    assert "| without gc-freeze | **0.51 (0.50–0.52)** | 0.80 (0.80–0.80) | 3.00 (3.00–3.00) |" in text


def test_variants_are_name_equals_revision():
    assert tricks.parse_variants(["gc-freeze=trick/gc-freeze"]) == [("gc-freeze", "trick/gc-freeze")]
    for bad in (["gc-freeze"], ["=rev"], ["today=rev"]):
        with pytest.raises(SystemExit):
            tricks.parse_variants(bad)
