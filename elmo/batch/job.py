"""One batch job from start to finish: check the options, scan, resume, embed the pending shards (local or Ray
engine), finish the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from elmo.batch.engines import Backend, make_backend
from elmo.batch.jobdir import JobDirectory
from elmo.batch.layout import HDF5, Layout
from elmo.batch.options import JobOptions, describe_differences, job_fingerprint
from elmo.batch.pipeline import Progress, embed_events, line_limit, prefetched, write_shards
from elmo.batch.plan import JSONL, InputPlan, check_input_path, detect_input_format, scan_input
from elmo.batch.writers import Hdf5Assembly, ShardStats, earlier_output, finish_parquet
from elmo.errors import InputError, ModelFileError
from elmo.sizes import human_bytes
from elmo.text.overflow import Overflow

log = logging.getLogger("elmo.batch")


# -- the job -------------------------------------------------------------------------------------------------------
@dataclass
class JobResult:
    output: Path
    lines: int = 0
    blank: int = 0
    tokens: int = 0
    resumed_lines: int = 0
    embedded_lines: int = 0
    embedded_tokens: int = 0
    seconds: float = 0.0
    already_complete: bool = False
    steady_tokens_per_s: float | None = None  # between this run's first and last commit (3+ shards)

    def summary(self) -> str:
        if self.already_complete:
            return f"embed-file: {self.output} is already complete ({self.lines} sentences); nothing to do"
        rate = self.embedded_lines / self.seconds if self.seconds else 0.0
        token_rate = self.embedded_tokens / self.seconds if self.seconds else 0.0
        resumed = f"; {self.resumed_lines} resumed from an earlier run" if self.resumed_lines else ""
        return (
            f"embed-file: {self.lines} sentences ({self.blank} blank, {self.tokens} tokens) -> {self.output} "
            f"({_size(self.output)}); this run embedded {self.embedded_lines} sentences in {self.seconds:.1f} s: "
            f"{rate:,.1f} sentences/s, {token_rate:,.0f} tokens/s{resumed}"
        )


def _size(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    return human_bytes(total)


def check_options(options: JobOptions) -> None:
    """Everything that can be checked before the model loads or the input is read, each named by its flag."""
    if options.model is None and not options.server:
        raise InputError("give --model DIR (local runtime) or --server HOST:PORT (remote)")
    if options.model is not None and options.server:
        raise InputError("give either --model DIR or --server HOST:PORT, not both")
    if options.connection is not None and options.connection.flags() and not options.server:
        raise InputError(f"{', '.join(options.connection.flags())} only apply with --server HOST:PORT")
    if options.model is not None and not options.model.is_dir():
        raise ModelFileError(f"{options.model}: model directory not found")
    if options.batch_tokens is not None and options.batch_tokens < 1:
        raise InputError(f"--runtime-batch-tokens must be >= 1, got {options.batch_tokens}")
    if options.shard_lines < 1:
        raise InputError(f"--shard-lines must be >= 1, got {options.shard_lines}")
    if options.max_sentence_tokens is not None and options.max_sentence_tokens < 1:
        raise InputError(f"--max-sentence-tokens must be >= 1, got {options.max_sentence_tokens}")
    if options.window_overlap < 0:
        raise InputError(f"--window-overlap-tokens must be >= 0, got {options.window_overlap}")
    check_input_path(options.input)
    if options.output.resolve() == options.input.resolve():
        raise InputError(f"{options.output}: OUTPUT would overwrite INPUT")
    if not options.output.parent.is_dir():
        raise InputError(f"{options.output.parent}: output directory does not exist")


def run_job(options: JobOptions) -> JobResult:
    """The whole job: scan, resume or start, embed the pending shards (local or Ray), finish. Idempotent.

    What is already at OUTPUT and OUTPUT.partial is checked first: the job replaces or resumes only its own."""
    check_options(options)
    job = JobDirectory(options.output)
    earlier = earlier_output(options.output)  # refuses what embed-file did not write
    job.check_ours()
    input_format = detect_input_format(options.input, options.input_format)
    backend = make_backend(options)
    try:
        limit = line_limit(options, backend) if Overflow.parse(options.overflow) is Overflow.REJECT else None
        plan = scan_input(options.input, input_format, options.shard_lines, options.progress, limit, options.tokenized)
        if plan.n_lines == 0:  # an empty output that exits 0 reads as success; a wrong or truncated INPUT is likelier
            raise InputError(f"{options.input}: the input is empty (no lines to embed); nothing written")
        layout = Layout(options.spec, backend.n_layers, backend.dim, options.dtype)
        fingerprint = job_fingerprint(options, plan, backend.identity(), layout)
        if earlier is not None and not options.overwrite:
            if earlier != fingerprint:
                raise InputError(
                    f"{options.output} already exists, made by embed-file with other options or input "
                    f"({describe_differences(earlier, fingerprint)}); add --overwrite to replace it, or choose "
                    "another OUTPUT path"
                )
            job.remove()  # killed between the final rename and the clean-up
            return JobResult(options.output, lines=plan.n_lines, already_complete=True)
        job.open(fingerprint, options.overwrite)
        try:
            return _embed_pending(options, plan, backend, layout, job, fingerprint)
        except BaseException:
            job.discard_if_nothing_committed()  # a failed job that committed nothing leaves nothing behind
            raise
    finally:
        backend.close()


def _embed_pending(
    options: JobOptions, plan: InputPlan, backend: Backend, layout: Layout, job: JobDirectory, fingerprint: dict
) -> JobResult:
    pending = [shard for shard in plan.shards if shard.number not in job.committed]
    resumed = sum(entry["n_lines"] for entry in job.committed.values())
    if resumed:
        log.info("resuming %s: %d of %d lines already committed", job.path, resumed, plan.n_lines)
    progress = Progress(plan.n_lines, resumed, options.progress)
    with_ids = plan.input_format == JSONL
    assembly = Hdf5Assembly(job, fingerprint, layout, with_ids) if options.output_format == HDF5 else None
    job.on_commit = assembly.add if assembly else None
    try:
        if options.engine == "ray" and pending:
            backend.close()  # the actors hold their own sessions
            from elmo.batch.ray_engine import embed_shards_on_ray

            embed_shards_on_ray(plan, pending, options, layout, job, progress)
        else:
            events = prefetched(embed_events(plan, pending, options, backend))
            for entry in write_shards(events, options, layout, job.path, plan.input_format == JSONL, progress):
                job.commit(entry)
        totals = ShardStats()
        for entry in job.committed.values():
            totals.add(ShardStats(entry["n_lines"], entry["blank"], entry["tokens"]))
        if assembly:
            assembly.finish(plan)
        else:
            finish_parquet(job, plan, fingerprint, totals)
        seconds = progress.elapsed  # start to finished OUTPUT
    finally:
        progress.close()
        if assembly:
            assembly.close()
    return JobResult(
        options.output,
        lines=totals.lines,
        blank=totals.blank,
        tokens=totals.tokens,
        resumed_lines=resumed,
        embedded_lines=progress.sentences,
        embedded_tokens=progress.tokens,
        seconds=seconds,
        steady_tokens_per_s=_steady_rate(job.timeline),
    )


def _steady_rate(timeline: list[tuple[float, int]]) -> float | None:
    """Tokens/s while shards stream, start-up and the final flush left out: what a long input runs at."""
    if len(timeline) < 3 or timeline[-1][0] <= timeline[0][0]:
        return None
    return sum(tokens for _, tokens in timeline[1:]) / (timeline[-1][0] - timeline[0][0])
