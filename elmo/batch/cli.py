"""``elmo embed-file``: the command line of the batch job."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from elmo.batch.job import run_job
from elmo.batch.layout import DTYPES, HDF5, PARQUET, output_format, parse_layers
from elmo.batch.options import DEFAULT_SHARD_LINES, JobOptions
from elmo.batch.plan import JSONL, TEXT
from elmo.flags import add_alias
from elmo.text.overflow import DEFAULT_WINDOW_OVERLAP, Overflow

log = logging.getLogger("elmo.batch")


# -- the command ---------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", type=Path, help="text file (one sentence per line) or JSONL with 'id' and 'text'")
    # a str, not a Path: Path("out/") drops the trailing slash that says "a directory" (Parquet)
    parser.add_argument("output", help="output .h5/.hdf5 file, or Parquet directory (.parquet, or a name ending in /)")
    source = parser.add_argument_group("where vectors come from (one of)")
    source.add_argument("--model", type=Path, help="model directory (local onnxruntime)")
    source.add_argument("--server", help="HOST:PORT of a running `elmo serve` (remote mode)")
    source.add_argument("--server-model", default="", help="model name on the server (default: its default model)")
    wait = source.add_argument(
        "--server-wait-s", type=float, default=30.0, help="seconds to wait for the server to say SERVING (default 30)"
    )
    add_alias(source, "--server-wait", wait)
    from elmo.client import add_connection_arguments

    add_connection_arguments(source)  # the same --tls-ca / --tls-server-name / --auth-token as `elmo embed`
    parser.add_argument(
        "--layers", default="all", help="all (n_layers, n, dim) | top | average | mix:TASK -> (n, dim); default all"
    )
    parser.add_argument(
        "--format",
        choices=[HDF5, PARQUET],
        help="default: from OUTPUT's name (.h5/.hdf5: hdf5; .parquet, a trailing / or a directory: parquet)",
    )
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="vector number type (default float32)")
    parser.add_argument("--tokenized", action="store_true", help="lines are whitespace-separated tokens, untouched")
    parser.add_argument("--input-format", choices=["auto", TEXT, JSONL], default="auto", help="auto: .jsonl -> jsonl")
    batch = parser.add_argument(
        "--runtime-batch-tokens",
        type=int,
        default=None,
        help="rows x longest sentence per onnxruntime run (default: the runtime's, 4096 on CPU, 16384 on CUDA)",
    )
    add_alias(parser, "--batch-tokens", batch)
    parser.add_argument(
        "--shard-lines", type=int, default=DEFAULT_SHARD_LINES, help="lines per shard (unit of commit and sorting)"
    )
    parser.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process; ray: Ray actors on a cluster (the `batch` extra) (default local)",
    )
    actors = parser.add_argument(
        "--ray-actors", type=int, help="with --engine ray: Ray actors (default: one per GPU, else CPUs / --threads)"
    )
    add_alias(parser, "--workers", actors)
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads per session")
    parser.add_argument("--ray-address", help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier output of embed-file at OUTPUT, or discard its unfinished job (never anything else)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    long_lines = parser.add_argument_group("long lines")
    long_lines.add_argument(
        "--overflow",
        choices=[o.value for o in Overflow],
        default=Overflow.REJECT.value,
        help="lines over --max-sentence-tokens: stop the job naming the line (reject, default), keep the first "
        "tokens (truncate), or embed overlapping windows stitched back (window)",
    )
    long_lines.add_argument(
        "--max-sentence-tokens",
        type=int,
        default=None,
        help="tokens the model runs at once per line (default: the server's limit, or 100,000 locally)",
    )
    overlap = long_lines.add_argument(
        "--window-overlap-tokens",
        type=int,
        default=DEFAULT_WINDOW_OVERLAP,
        help=f"tokens shared by neighbouring windows (default {DEFAULT_WINDOW_OVERLAP}, capped at half a window)",
    )
    add_alias(long_lines, "--window-overlap", overlap)


def options_from_args(args: argparse.Namespace) -> JobOptions:
    from elmo.client import connection_from_args

    if getattr(args, "flag_sources", {}).get("auth_token", "").startswith("$"):
        # ELMO_AUTH_TOKEN, as before: elmo.client.Connection reads it itself, for --server only (a local job with the
        # variable set is no mistake, unlike a job given --auth-token without --server)
        args.auth_token = None

    return JobOptions(
        input=args.input,
        output=Path(args.output),
        model=args.model,
        server=args.server,
        server_model=args.server_model,
        spec=parse_layers(args.layers),
        output_format=output_format(str(args.output), args.format),
        dtype=args.dtype,
        tokenized=args.tokenized,
        input_format=args.input_format,
        batch_tokens=args.runtime_batch_tokens,
        shard_lines=args.shard_lines,
        engine=args.engine,
        workers=args.ray_actors,
        threads=args.threads,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        ray_address=args.ray_address,
        server_wait=args.server_wait_s,
        connection=connection_from_args(args),
        overflow=args.overflow,
        max_sentence_tokens=args.max_sentence_tokens,
        window_overlap=args.window_overlap_tokens,
    )


def run(args: argparse.Namespace) -> int:
    result = run_job(options_from_args(args))
    print(result.summary(), file=sys.stdout, flush=True)
    return 0
