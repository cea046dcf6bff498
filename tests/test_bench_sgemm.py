"""bench.runtime.sgemm_bound: the model's unavoidable arithmetic on a text, counted by hand here, and the bench end to
end on the tiny model (it measures onnxruntime's MatMul; nothing asserts a speed)."""

from __future__ import annotations

import json

import pytest

from bench.runtime import sgemm_bound

CONFIG = {
    "filters": [[1, 2], [2, 3]],
    "char_dim": 4,
    "n_highway": 1,
    "projection_dim": 8,
    "cell_dim": 16,
    "n_layers": 2,
    "max_chars": 50,
}


def test_work_counts_every_position_once_and_every_distinct_token_once():
    work = sgemm_bound.text_work(CONFIG, ["a bb a"])
    assert (work["sentences"], work["tokens"], work["distinct_tokens"]) == (1, 3, 2)
    # 2 directions x 2 FLOPs a multiply-add: 5 positions (3 tokens, <S>, </S>) x (2 layers x (recurrent gates 8 x 64
    # + projection 16 x 8) + layer 1's input gates 8 x 64), and layer 0's input gates once per distinct row (a, bb,
    # <S>, </S>)
    per_position = 2 * 2 * (2 * (8 * 64 + 16 * 8) + 8 * 64)
    assert work["lstm_gflop"] * 1e9 == pytest.approx(5 * per_position + 4 * 2 * 2 * 8 * 64)
    # "a": 3 char ids (BOW, a, EOW); "bb": 4. Conv 2 x char_dim x width x channels x (length - width + 1) per width,
    # then per distinct token the highway (S=5 -> 2S) and the projection (S -> 8), 2 FLOPs a multiply-add
    conv = (2 * 4 * 1 * 2 * 3 + 2 * 4 * 2 * 3 * 2) + (2 * 4 * 1 * 2 * 4 + 2 * 4 * 2 * 3 * 3)
    assert work["encoder_gflop"] * 1e9 == pytest.approx(conv + 2 * (2 * 5 * 10 + 2 * 5 * 8))


def test_a_chinese_token_counts_its_utf8_bytes_as_the_char_ids_do():
    one, three = sgemm_bound.text_work(CONFIG, ["a"]), sgemm_bound.text_work(CONFIG, ["苹"])
    assert three["encoder_gflop"] > one["encoder_gflop"]  # 3 bytes + BOW/EOW = 5 ids against 3


def test_sgemm_bound_reports_the_rate_and_the_fraction_reached(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat .\n苹果 公司 发布 了 新 手机 。\n")
    out = tmp_path / "sgemm.json"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--text",
        str(text),
        "--lines",
        "2",
        "--threads",
        "1",
        "--repeat",
        "1",
        "--tokens-per-s",
        "1000",
        "--out",
        str(out),
    ]
    assert sgemm_bound.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["matmul_gflop_per_s"]["square"] > 0 and result["tokens"] > 0
    assert result["fraction_of_bound"] == pytest.approx(1000 / result["tokens_per_s_at_bound"])
    assert "% of the bound" in capsys.readouterr().out
