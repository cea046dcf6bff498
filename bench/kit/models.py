"""The model a bench measures: ``--model DIR`` as given, or random weights of a published shape (``--preset``),
exported once and kept under runs/bench-models/."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.kit.revision import REPO

DEFAULT_MODEL = REPO / "models" / "default"
MODELS_CACHE = REPO / "runs" / "bench-models"


def prepare_model(args: argparse.Namespace) -> tuple[Path, str]:
    """(model directory, how the report names it) from ``args.model`` or ``args.preset``."""
    if args.model:
        return Path(args.model), str(args.model)
    from elmo.bench.random_model import cached_random_model

    directory = cached_random_model(MODELS_CACHE / f"elmo-{args.preset}", args.preset)
    return directory, f"ELMo-{args.preset} shape, random weights ({directory.relative_to(REPO)})"
