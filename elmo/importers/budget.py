"""The byte budget every importer checks before it reads a weight: what a configuration implies, in float32 bytes.

A published file is hostile until checked: a few KB of HDF5 or pickle can declare gigabytes (chunked, compressed or
never-written storage), and a config can ask for a network of any size. So each importer first works out every
tensor's shape from the config, checks the file's declared shapes and dtypes against them, and checks their total
against the budget here; only then does it read (and the model it builds is as large as that total). Torch-free.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

from elmo.errors import ConfigError, ModelFileError

# The largest published ELMo (AllenNLP "original" / 5.5B) holds 93.6 M float32 = 374 MB; ELMoForManyLangs' models
# with their word tables ~ 0.3-1 GB. 2 GiB leaves room for bigger models of one's own and bounds a hostile file.
DEFAULT_MAX_WEIGHT_BYTES = 2 << 30
FLOAT32_BYTES = 4


def float32_bytes(shapes: Iterable[tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes) * FLOAT32_BYTES


def check_budget(source: str, shapes: Iterable[tuple[int, ...]], max_bytes: int, implied_by: str) -> int:
    """Raise ModelFileError when the tensors ``implied_by`` the config exceed ``max_bytes``; returns their bytes."""
    total = float32_bytes(shapes)
    if total > max_bytes:
        raise ModelFileError(
            f"{source}: {implied_by} implies {total:,} bytes of float32 weights, over the "
            f"{max_bytes:,}-byte budget (--max-weight-bytes): refused before reading"
        )
    return total


def describe(shape: tuple[int, ...], dtype: object) -> str:
    return f"{tuple(shape)} {dtype}"


def add_budget_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-weight-bytes",
        type=int,
        default=DEFAULT_MAX_WEIGHT_BYTES,
        metavar="N",
        help="refuse a model whose config implies more than N bytes of float32 weights, before reading any "
        f"(default {DEFAULT_MAX_WEIGHT_BYTES:,})",
    )


def checked_budget(args: argparse.Namespace) -> int:
    if args.max_weight_bytes < 1:
        raise ConfigError(f"--max-weight-bytes must be at least 1 (got {args.max_weight_bytes})")
    return int(args.max_weight_bytes)
