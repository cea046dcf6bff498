"""The char-CNN as one MatMul over windows (export.graphs.EncoderGraph) is the model's encoder, cut rows included;
bench/runtime/char_cnn_forms.py runs it beside the Conv form on the runtime's path."""

from __future__ import annotations

import numpy as np
import torch
from elmo.export.graphs import EncoderGraph

from bench.runtime.char_cnn_forms import compare, distinct_rows, export_forms, render
from elmo.model.checkpoint import load_model
from elmo.runtime import CPU, Embedder

LINES = ["The cat sat on the mat .", "苹果很好吃 , 苹果公司发布了新手机 。", "a " + "b" * 60 + " c", "naïve café → ici"]


def test_the_windows_form_is_the_encoder_on_every_row_width(tiny_model_dir):
    """Full 50-id rows (tokens that fill them: windows past the row's end must not count) and rows cut short."""
    model = load_model(tiny_model_dir).float().eval()
    graph = EncoderGraph(model)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(1, 259, (16, model.cfg.token_width), generator=generator)
    with torch.no_grad():
        for width in (model.cfg.token_width, 12, max(w for w, _ in model.cfg.filters)):
            cut = rows[:, :width]
            expected = model.encoder(cut.unsqueeze(0)).squeeze(0)
            scale = float(expected.abs().max())
            assert float((graph(cut) - expected).abs().max()) <= 1e-5 * max(scale, 1.0)


def test_both_forms_run_on_the_runtimes_path_and_agree(tiny_model_dir, tmp_path):
    embedder = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    rows = distinct_rows(embedder, LINES)
    embedder.close()
    forms = export_forms(tiny_model_dir, tmp_path)
    run = compare(tiny_model_dir, forms, rows, threads=1, repeat=1)
    assert set(run["tokens_per_s"]) == {"conv", "windows"} and run["windows_cut_rows_bit_identical"]
    assert run["max_abs_difference"] <= 1e-4
    result = {"model": "tiny", "corpus": "four lines", "distinct_tokens": len(rows), "repeat": 1, "runs": [run]}
    assert "| 1 |" in render(result) and np.isfinite(run["windows_over_conv"])
