"""``elmo adapt``: continue training a model on the user's text (elmo.train.adapt), then export and verify the
result here, in the export stage, so that training never imports up the pipeline (tests/test_layout.py)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from elmo.export.onnx_export import export_model

from elmo.train.adapt import AdaptSettings, adapt, settings_from


def export_adapted(model_dir: Path, threads: int | None) -> dict:
    """Export the adapted model directory in place; its verification summary goes into adapt.json."""
    export_model(model_dir, threads=threads)
    return json.loads((model_dir / "onnx.json").read_text())["verification"]["summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AdaptSettings()
    parser.add_argument("--model", required=True, type=Path, help="model directory to start from")
    parser.add_argument("--text", required=True, type=Path, help="the domain's text, one sentence or paragraph a line")
    parser.add_argument("--tokenized", action="store_true", help="lines are already tokens separated by spaces")
    parser.add_argument("--out", required=True, type=Path, help="the adapted model directory (new, or --resume)")
    parser.add_argument("--resume", action="store_true", help="continue the adaptation recorded in --out")
    parser.add_argument("--minutes", type=float, default=d.minutes, help=f"time budget, all steps ({d.minutes})")
    parser.add_argument("--epochs", type=float, default=d.epochs, help=f"at most this many passes (default {d.epochs})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    parser.add_argument("--heldout-share", type=float, default=d.heldout_share,
                        help=f"share of the text held out to measure (default {d.heldout_share})")  # fmt: skip
    parser.add_argument("--heldout-tokens", type=int, default=d.heldout_tokens,
                        help=f"held-out tokens at most (default {d.heldout_tokens})")  # fmt: skip
    parser.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch,
                        help=f"padded tokens per training batch (default {d.tokens_per_batch})")  # fmt: skip
    parser.add_argument("--calibrate-tokens", type=int, default=d.calibrate_tokens,
                        help=f"softmax bias refit tokens, 0 = none (default {d.calibrate_tokens})")  # fmt: skip
    parser.add_argument("--replay", default=d.replay, metavar="FILE",
                        help="general text (tokenized lines, e.g. data/corpus/train.txt) to mix in")  # fmt: skip
    parser.add_argument("--replay-share", type=float, default=d.replay_share,
                        help=f"share of training tokens from --replay (default {d.replay_share})")  # fmt: skip
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--no-export", action="store_true", help="skip the ONNX export (PyTorch weights only)")
    parser.add_argument("--stop-after", type=int, default=None, help="end the training after this step (resumable)")


def run(args: argparse.Namespace) -> int:
    exporter = None if args.no_export else export_adapted
    result = adapt(args.model, args.text, args.out, args.tokenized, settings_from(args), args.resume,
                   export=exporter, stop_after=args.stop_after)  # fmt: skip
    print(json.dumps(result, ensure_ascii=False))
    if "stopped_by" not in result:
        return 0
    print(f"elmo adapt: stopped by {result['stopped_by']}; the adaptation so far is saved in {args.out} "
          f"({result['spent_s']:.0f} s of the budget used); continue with: {result['resume']}",
          file=sys.stderr)  # fmt: skip
    return 128 + int(getattr(signal, result["stopped_by"]))
