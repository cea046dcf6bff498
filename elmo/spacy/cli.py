"""``elmo spacy``: ``data`` (a built-in labelled set as spaCy DocBin files) and ``export-task`` (a trained
listener's mix into a model directory as a served task)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    data = sub.add_parser("data", help="write a built-in labelled set as train/dev/test .spacy files")
    data.add_argument("name", choices=("brown-pos", "msra-ner"), help="the built-in set (as `elmo mix train` uses it)")
    data.add_argument("--out", type=Path, required=True, help="folder for train.spacy, dev.spacy, test.spacy")
    for split in ("train", "dev", "test"):
        data.add_argument(f"--{split}", type=int, help=f"keep this many {split} sentences (a seeded subsample)")
    data.add_argument("--seed", type=int, default=0, help="seed of the subsample (default 0)")
    data.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="where `elmo data` keeps packages")
    export = sub.add_parser("export-task", help="store a spaCy component's learned ELMo mix as a task of a model")
    export.add_argument("pipeline", type=Path, help="a saved spaCy pipeline (e.g. training/model-best)")
    export.add_argument("--component", required=True, help="the component whose elmo listener to export (tagger)")
    export.add_argument("--model", type=Path, required=True, help="the model directory to store the task in")
    export.add_argument("--task", required=True, help="the task's name (what `task=NAME` asks the server for)")


def run(args: argparse.Namespace) -> int:
    if args.action == "data":
        from elmo.spacy.data import write_splits

        sizes = {"train": args.train, "dev": args.dev, "test": args.test}
        print(json.dumps(write_splits(args.name, args.out, sizes, args.corpus, args.seed), ensure_ascii=False))
        return 0
    from elmo.spacy.tasks import export_task

    folder = export_task(args.pipeline, args.component, args.model, args.task)
    print(json.dumps({"task": args.task, "stored": str(folder)}))
    return 0
