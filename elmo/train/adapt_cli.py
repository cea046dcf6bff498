"""``elmo adapt``: continue training a model on the user's text (elmo.train.adapt), then export and verify the
result (elmo.export.onnx_export, a stage below training) and, when asked, publish it.

``--publish ROOT/NAME`` adds a last step: the exported, verified directory is copied in as the next version of NAME
in the model repository ROOT (elmo.runtime.repository.publishing: a hidden folder renamed to the next number, so a
server polling ROOT sees the whole version or nothing). ``--out`` stays the run folder (checkpoints, the split text,
adapt.json: what ``--resume`` continues); without ``--out`` the run lives in ``ROOT/NAME/.adapting`` (hidden, never
taken for a version), which is removed once the version is published.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
from pathlib import Path

from elmo.errors import ConfigError
from elmo.export.onnx_export import STAGING, export_model
from elmo.flags import DeprecatedAlias, add_alias
from elmo.runtime.repository import check_model_name, is_complete, publish_copy
from elmo.train.adapt import WORK_DIR, AdaptSettings, adapt, settings_from
from elmo.train.loop import OPTIMIZER_FILE

RUN_FOLDER = ".adapting"  # inside ROOT/NAME: the run of `elmo adapt --publish ROOT/NAME` without --out


def export_adapted(model_dir: Path, threads: int | None) -> dict:
    """Export the adapted model directory in place; its verification summary goes into adapt.json."""
    export_model(model_dir, threads=threads)
    return json.loads((model_dir / "onnx.json").read_text())["verification"]["summary"]


def publish_target(value: Path) -> tuple[Path, str]:
    """``--publish ROOT/NAME`` -> (ROOT, NAME), checked before any training."""
    if len(value.parts) < 2:
        raise ConfigError(
            f"--publish {value}: give the model repository's folder and the model's name, ROOT/NAME "
            f"(e.g. models/repo/{value.name or 'NAME'})"
        )
    return value.parent, check_model_name(value.name)


def run_folder(args: argparse.Namespace) -> Path:
    """Where the adaptation runs: --out, or with --publish alone ROOT/NAME/.adapting. Checked before training: a
    run folder inside the repository that is not hidden would be taken for a model or a version by a server."""
    if args.publish is None:
        if args.out is None:
            raise ConfigError("give --out DIR (the adapted model directory), --publish ROOT/NAME, or both")
        return args.out
    if args.no_export:
        raise ConfigError("--publish needs the export (a version is an exported, verified model): drop --no-export")
    root, name = publish_target(args.publish)
    if args.out is None:
        return root / name / RUN_FOLDER
    inside = _relative_to(args.out, root)
    if inside is not None and not any(part.startswith(".") for part in inside.parts):
        raise ConfigError(
            f"--out {args.out} is inside the model repository {root}, where a polling server would "
            f"take it for a model or a version; choose a folder outside it, or leave --out out (the "
            f"run then lives in {root / name / RUN_FOLDER})"
        )
    return args.out


def _relative_to(path: Path, folder: Path) -> Path | None:
    try:
        return path.resolve().relative_to(folder.resolve())
    except ValueError:
        return None


def _not_published(directory: str, names: list[str]) -> set[str]:
    """What stays in the run folder: the split text and the softmax fit (adapt/), optimizer state, temporary and
    hidden files (an export's staging folder)."""
    return {n for n in names if n in (WORK_DIR, OPTIMIZER_FILE, STAGING) or n.startswith(".") or n.endswith(".tmp")}


def publisher(target: Path):
    """The last step of `elmo adapt --publish ROOT/NAME`: the finished model directory as NAME's next version; a
    resume after it was published keeps that version rather than publishing it again."""
    root, name = publish_target(target)

    def publish(model_dir: Path, earlier: dict | None) -> dict:
        if earlier and Path(earlier["path"]).resolve().parent == (root / name).resolve():
            if is_complete(Path(earlier["path"])):  # published by an earlier run of this adaptation (and still there)
                return earlier
        publication = publish_copy(model_dir, root, name, ignore=_not_published)
        return {"model": str(target), "name": name, "version": publication.version, "path": str(publication.path)}

    return publish


def resume_command(args: argparse.Namespace) -> str:
    out = f" --out {args.out}" if args.out is not None else ""
    publish = f" --publish {args.publish}" if args.publish is not None else ""
    return f"elmo adapt --model {args.model} --text {args.text}{out}{publish} --resume"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AdaptSettings()
    parser.add_argument("--model", required=True, type=Path, help="model directory to start from")
    parser.add_argument("--text", required=True, type=Path, help="the domain's text, one sentence or paragraph a line")
    parser.add_argument("--tokenized", action="store_true", help="lines are already tokens separated by spaces")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the adapted model directory and its run (new, or --resume); optional with --publish",
    )
    parser.add_argument(
        "--publish",
        type=Path,
        default=None,
        metavar="ROOT/NAME",
        help="also publish the exported model as the next version of NAME in the model repository "
        "ROOT (atomic: a server polling ROOT picks it up); without --out the run lives in "
        f"ROOT/NAME/{RUN_FOLDER} until then",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the adaptation recorded in --out (or ROOT/NAME/.adapting)"
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=d.minutes * 60,
        help=f"time budget in seconds, all steps (default {d.minutes * 60:g})",
    )
    parser.add_argument(
        "--minutes",
        action=DeprecatedAlias,
        dest="time_budget_s",
        new="--time-budget-s",
        type=lambda value: float(value) * 60,
    )  # the older flag, in minutes
    parser.add_argument("--epochs", type=float, default=d.epochs, help=f"at most this many passes (default {d.epochs})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    parser.add_argument(
        "--heldout-share",
        type=float,
        default=d.heldout_share,
        help=f"share of the text held out to measure (default {d.heldout_share})",
    )
    parser.add_argument(
        "--heldout-tokens",
        type=int,
        default=d.heldout_tokens,
        help=f"held-out tokens at most (default {d.heldout_tokens})",
    )
    batch = parser.add_argument(
        "--batch-tokens",
        dest="tokens_per_batch",
        type=int,
        default=d.tokens_per_batch,
        help=f"padded tokens per training batch (default {d.tokens_per_batch})",
    )
    add_alias(parser, "--tokens-per-batch", batch)
    parser.add_argument(
        "--calibrate-tokens",
        type=int,
        default=d.calibrate_tokens,
        help=f"softmax bias refit tokens, 0 = none (default {d.calibrate_tokens})",
    )
    parser.add_argument(
        "--replay",
        default=d.replay,
        metavar="FILE",
        help="general text (tokenized lines, e.g. data/corpus/train.txt) to mix in",
    )
    parser.add_argument(
        "--replay-share",
        type=float,
        default=d.replay_share,
        help=f"share of training tokens from --replay (default {d.replay_share})",
    )
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"random seed (default {d.seed})")
    parser.add_argument("--no-export", action="store_true", help="skip the ONNX export (PyTorch weights only)")
    parser.add_argument("--stop-after", type=int, default=None, help="end the training after this step (resumable)")


def run(args: argparse.Namespace) -> int:
    out = run_folder(args)
    exporter = None if args.no_export else export_adapted
    publish = None if args.publish is None else publisher(args.publish)
    result = adapt(
        args.model,
        args.text,
        out,
        args.tokenized,
        settings_from(args),
        args.resume,
        export=exporter,
        stop_after=args.stop_after,
        publish=publish,
    )
    if "resume" in result:
        result["resume"] = resume_command(args)
    published = result.get("published")
    if published is not None:
        name, version = published["name"], published["version"]
        print(
            f"elmo adapt: published {published['path']}: version {version} of {name} (a request names it "
            f"{name}@{version}, or {name} for the latest)",
            file=sys.stderr,
            flush=True,
        )
        if args.out is None:  # the run folder was ours: the version holds the model, adapt.json and the curve
            shutil.rmtree(out)
            result["out"] = published["path"]
    print(json.dumps(result, ensure_ascii=False))
    if "stopped_by" not in result:
        return 0
    print(
        f"elmo adapt: stopped by {result['stopped_by']}; the adaptation so far is saved in {out} "
        f"({result['spent_s']:.0f} s of the budget used); continue with: {result['resume']}",
        file=sys.stderr,
    )
    return 128 + int(getattr(signal, result["stopped_by"]))
