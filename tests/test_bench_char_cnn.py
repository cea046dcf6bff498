"""bench/runtime/char_cnn_forms.py: both forms of the char-CNN run on the runtime's path and agree (that the
windows form is the model's encoder: tests/export/test_graphs.py)."""

from __future__ import annotations

import numpy as np

from bench.runtime.char_cnn_forms import compare, export_forms, render
from bench.runtime.cpu_profile import distinct_rows
from elmo.runtime import CPU, Embedder
from elmo.text.tokenize import tokenize

LINES = ["The cat sat on the mat .", "苹果很好吃 , 苹果公司发布了新手机 。", "a " + "b" * 60 + " c", "naïve café → ici"]


def test_both_forms_run_on_the_runtimes_path_and_agree(tiny_model_dir, tmp_path):
    embedder = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    rows = distinct_rows(embedder, [tokenize(line).tokens for line in LINES])
    embedder.close()
    forms = export_forms(tiny_model_dir, tmp_path)
    run = compare(tiny_model_dir, forms, rows, threads=1, repeat=1)
    assert set(run["tokens_per_s"]) == {"conv", "windows"} and run["windows_cut_rows_bit_identical"]
    assert run["max_abs_difference"] <= 1e-4
    result = {"model": "tiny", "corpus": "four lines", "distinct_tokens": len(rows), "repeat": 1, "runs": [run]}
    assert "| 1 |" in render(result) and np.isfinite(run["windows_over_conv"])
