"""`elmo export` says nothing a user cannot act on (issue 30: TracerWarnings "might cause the trace to be incorrect"
and the exporter's "Only steps=1 can be constant folded" on every export and adapt), while a warning raised by
anything else still shows."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from elmo.export.onnx_export import _trace, build_graphs

from elmo.bench.random_model import write_random_model
from elmo.model.bilm import add_sentence_boundaries
from elmo.text.chars import BOS_IDS, EOS_IDS, batch_to_char_ids

REPO = Path(__file__).resolve().parents[2]


def test_building_the_graphs_raises_no_tracer_or_folding_warning(tmp_path):
    model_dir = write_random_model(tmp_path / "model", "tiny", seed=1, scale=0.3, cell_clip=0.5, proj_clip=0.5)
    from elmo.model.checkpoint import load_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_graphs(load_model(model_dir).eval(), tmp_path)
    shown = [w for w in caught if not issubclass(w.category, DeprecationWarning)]  # Python hides those by default
    assert [str(w.message)[:80] for w in shown] == []


def test_the_filter_is_scoped_to_the_tracer_and_the_trace(tmp_path):
    class Warns(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            warnings.warn("a warning of the model's own", UserWarning, stacklevel=1)
            return x * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trace(Warns(), (torch.ones(2),), tmp_path / "w.onnx", {"x": {0: "n"}}, {"y": {0: "n"}})
        warnings.warn("after the trace", torch.jit.TracerWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert "a warning of the model's own" in messages and "after the trace" in messages


def test_boundaries_are_the_same_without_f_pad():
    # add_sentence_boundaries concatenates zero rows now (F.pad exported an unfoldable Slice); the values are as before
    ids = torch.from_numpy(batch_to_char_ids([["ab", "c"], ["d"]])).long()
    padded, lengths = add_sentence_boundaries(ids)
    assert lengths.tolist() == [4, 3] and padded.shape == (2, 4, ids.shape[-1])
    assert padded[0, 0].tolist() == list(BOS_IDS) and padded[0, 3].tolist() == list(EOS_IDS)
    assert padded[1, 2].tolist() == list(EOS_IDS) and int(padded[1, 3].abs().sum()) == 0
    assert torch.equal(padded[0, 1:3], ids[0])


def test_the_export_command_prints_no_warning(tmp_path):
    model_dir = write_random_model(tmp_path / "model", "tiny", seed=2, scale=0.3, cell_clip=0.5, proj_clip=0.5)
    proc = subprocess.run(
        [sys.executable, "-m", "elmo.cli", "export", "--model", str(model_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Warning" not in proc.stderr, proc.stderr
