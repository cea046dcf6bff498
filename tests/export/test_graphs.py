"""export/graphs.py's EncoderGraph: the char-CNN as one MatMul over windows is the model's encoder (its Conv per
width), on full rows, cut rows and filters whose every real window scores far below zero; `--fp16` keeps it."""

from __future__ import annotations

import warnings

import torch
from elmo.export.graphs import EncoderGraph
from elmo.export.onnx_export import build_graphs, convert_to_fp16

from elmo.model.checkpoint import load_model


def assert_same_as_the_encoder(model, rows: torch.Tensor) -> None:
    graph = EncoderGraph(model)
    with torch.no_grad():
        expected = model.encoder(rows.unsqueeze(0)).squeeze(0)
        got = graph(rows)
    assert float((got - expected).abs().max()) <= 1e-5 * max(float(expected.abs().max()), 1.0)


def test_the_windows_form_is_the_encoder_on_full_and_cut_rows(tiny_model_dir):
    """Full rows of random ids (tokens that fill them: windows past the row's end must not count) and rows cut to a
    few widths, down to the widest filter."""
    model = load_model(tiny_model_dir).float().eval()
    rows = torch.randint(1, 259, (16, model.cfg.token_width), generator=torch.Generator().manual_seed(0))
    for width in (model.cfg.token_width, 12, max(w for w, _ in model.cfg.filters)):
        assert_same_as_the_encoder(model, rows[:, :width])


def test_windows_past_the_row_lose_to_real_windows_that_score_far_below_zero(tiny_model_dir):
    """Every conv weight negative on positive char vectors: each real tap lowers a window's score, so a window past
    the row (fewer real taps; the taps past it add only the past-the-row weight) would win the max if that weight
    were not low enough. Biases of +1000 keep the maxima above the activation's zero, where the difference shows."""
    model = load_model(tiny_model_dir).float().eval()
    with torch.no_grad():
        model.encoder.char_embedding.weight.abs_()
        for conv in model.encoder.convs:
            conv.weight.copy_(-conv.weight.abs() * 50)
            conv.bias.fill_(1000.0)
    rows = torch.randint(1, 259, (8, model.cfg.token_width), generator=torch.Generator().manual_seed(1))
    assert_same_as_the_encoder(model, rows)


def test_fp16_keeps_the_past_the_row_weight_without_a_warning(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir).float().eval()
    encoder = build_graphs(model, tmp_path)["encoder.onnx"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp16(encoder)
    assert [str(w.message) for w in caught if not issubclass(w.category, DeprecationWarning)] == []
