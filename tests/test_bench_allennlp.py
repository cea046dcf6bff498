"""bench/runtime/allennlp_side_by_side.py and allennlp_stand_ins.py, without AllenNLP itself (its venv is built by
scripts/allennlp-venv.sh, not by the test suite): the weights the bench hands AllenNLP are the model's own, and the
stand-in modules stand in only for what is not installed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from bench.runtime.allennlp_side_by_side import agreement, allennlp_datasets, batches_of, per_round_ratios
from bench.runtime.allennlp_stand_ins import MODULE, install
from elmo.bench.random_model import random_bilm
from elmo.importers.allennlp import convert_weights


def test_the_allennlp_layout_imports_back_to_the_same_weights():
    """Written in bilm-tf's layout and read back by the project's importer, every weight is the model's own (gate
    order, forget bias, highway carry sign, kernel layout): AllenNLP is handed the model being compared."""
    model = random_bilm("tiny", seed=3, scale=0.5)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    cfg = model.cfg
    datasets = allennlp_datasets(state, cfg.n_filters, cfg.n_layers, cfg.cell_dim)
    back = convert_weights(cfg, datasets)
    assert set(back) <= set(state)
    for name, tensor in back.items():
        np.testing.assert_allclose(tensor.numpy(), state[name], rtol=0, atol=1e-6, err_msg=name)
    assert not torch.equal(back["forward_layers.0.state_linearity.bias"], torch.zeros(4 * cfg.cell_dim))


def test_agreement_reports_the_largest_difference_and_the_lowest_cosine():
    a = [np.ones((3, 2, 4), np.float32), np.full((3, 1, 4), 2.0, np.float32)]
    b = [a[0].copy(), a[1].copy()]
    b[1][0, 0, 0] = -2.0  # one token's vector turned partly around
    figures = agreement(a, b)
    assert figures["max_abs_difference"] == 4.0
    assert figures["lowest_token_cosine"] == 0.5
    assert batches_of(10, 5, 2) == [(10, 2), (12, 2), (14, 1)]
    row = {"this runtime": {"per_round": [100.0, 90.0]}, "AllenNLP": {"per_round": [20.0, 30.0]}}
    assert per_round_ratios(row) == [5.0, 3.0]  # round by round, not the medians' ratio


def test_stand_ins_answer_for_missing_packages_only(tmp_path):
    install(tmp_path)
    assert "import elmo_bench_stand_ins" in (tmp_path / "elmo_bench_stand_ins.pth").read_text()
    assert "NAMES" in MODULE
    script = (
        "import importlib.util, sys; sys.path.insert(0, sys.argv[1]); real = importlib.util.find_spec('tqdm')\n"
        "import elmo_bench_stand_ins\n"
        "import transformers, transformers.models.bert as bert, tqdm, cached_path\n"
        "@transformers.overrides\n"
        "def f(): return 7\n"
        "class Model(bert.BertModel): pass\n"
        "assert f() == 7 and cached_path.cached_path('/x/weights.hdf5') == '/x/weights.hdf5'\n"
        "assert (type(tqdm).__name__ == 'module') == (real is not None)  # installed: the real one\n"
        "try:\n    import not_a_stand_in_package\nexcept ModuleNotFoundError:\n    print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr
