"""The embedding loop shared by the local and Ray engines and remote mode: read a shard, embed its call groups a
couple ahead of the writer (in a background thread), write the shard file; and the progress bar.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from queue import Empty, Full, Queue

import numpy as np

from elmo.batch.atomic import fsync_dir, fsync_file
from elmo.batch.engines import Backend
from elmo.batch.layout import DTYPES, Layout
from elmo.batch.options import JobOptions
from elmo.batch.plan import JSONL, InputPlan, LineLimit, Record, ShardSpec, plan_call_groups, read_shard
from elmo.batch.writers import WRITERS, ShardStats
from elmo.errors import ElmoError
from elmo.text.overflow import Overflow, embed_windowed

log = logging.getLogger("elmo.batch")


PREFETCH = 2  # call groups embedded ahead of the writer, in a background thread


@dataclass
class ShardStart:
    shard: ShardSpec
    records: list[Record]


@dataclass
class CallGroup:
    positions: list[int]  # into the current shard's records
    outputs: list[np.ndarray]  # float32, layout.spec's shape


@dataclass
class ShardEnd:
    shard: ShardSpec


def sentence_limit(options: JobOptions, backend: Backend) -> int:
    """Tokens per sentence the model runs at once: --max-sentence-tokens, within the backend's own limit."""
    return min(options.max_sentence_tokens or backend.max_tokens_per_sentence, backend.max_tokens_per_sentence)


def line_limit(options: JobOptions, backend: Backend) -> LineLimit:
    """The sentence limit as ``--overflow reject`` enforces it, named the way the user can change it."""
    tokens = sentence_limit(options, backend)
    if options.max_sentence_tokens is not None and options.max_sentence_tokens <= backend.max_tokens_per_sentence:
        return LineLimit(tokens, "--max-sentence-tokens")
    where = "the server's limit, its --max-sentence-tokens" if options.server else "the local runtime's limit"
    return LineLimit(tokens, f"{where}; --max-sentence-tokens can lower it, not raise it")


def _checked_records(plan: InputPlan, shard: ShardSpec, options: JobOptions, limit: LineLimit) -> list[Record]:
    """The shard's records, each within the sentence limit under the job's overflow policy: over it, ``reject``
    stops the job naming the line (the scan has refused such lines already; the input may have changed since),
    ``truncate`` keeps the first ``limit`` tokens, ``window`` keeps them all."""
    policy = Overflow.parse(options.overflow)
    keep = limit.tokens if policy is Overflow.TRUNCATE else None  # a huge line is tokenized only as far as kept
    records = read_shard(plan, shard, options.tokenized, keep)
    truncated = 0
    for record in records:
        if len(record.tokens) <= limit.tokens or policy is Overflow.WINDOW:
            continue
        if policy is Overflow.REJECT:
            raise limit.refusal(plan.path, record.index, f"{len(record.tokens):,}")
        record.tokens = record.tokens[: limit.tokens]
        truncated += 1
    if truncated:
        log.warning(
            "%s: %d lines of shard %d truncated to %d tokens (--overflow truncate)",
            plan.path,
            truncated,
            shard.number,
            limit.tokens,
        )
    return records


def embed_events(
    plan: InputPlan, shards: Sequence[ShardSpec], options: JobOptions, backend: Backend
) -> Iterator[ShardStart | CallGroup | ShardEnd]:
    """The embedding itself, the same for every engine: per shard its records (read and tokenized one shard
    ahead, in a thread of their own), then per call group its vectors. Groups are length-sorted; blank lines get no
    model call (the writer fills them in)."""
    limit = line_limit(options, backend)
    read_ahead = prefetched(((shard, _checked_records(plan, shard, options, limit)) for shard in shards), depth=1)
    for shard, records in read_ahead:
        yield ShardStart(shard, records)
        for positions in plan_call_groups([len(r.tokens) for r in records], backend.group_tokens):
            sentences = [records[p].tokens for p in positions]
            outputs = embed_windowed(backend.embed, sentences, limit.tokens, options.window_overlap)
            yield CallGroup(positions, outputs)
        yield ShardEnd(shard)


def prefetched(items: Iterator, depth: int = PREFETCH) -> Iterator:
    """``items`` produced by a background thread, up to ``depth`` ahead of the consumer. The runtime (and gRPC)
    release the GIL, so the next call group computes while this thread writes the last one to disk; on a GPU that
    keeps the device busy. An exception in the producer is raised here; leaving early stops the producer."""
    queue: Queue = Queue(maxsize=depth)
    stop = threading.Event()
    finished = object()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                queue.put(item, timeout=0.1)
                return True
            except Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(finished)
        except BaseException as exc:  # handed to the consumer, raised there
            put(_Failure(exc))

    thread = threading.Thread(target=produce, name="embed-file-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = queue.get()
            if item is finished:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue, then let it finish its group
            try:
                queue.get(timeout=0.1)
            except Empty:
                pass


@dataclass
class _Failure:
    error: BaseException


def write_shards(
    events: Iterator[ShardStart | CallGroup | ShardEnd],
    options: JobOptions,
    layout: Layout,
    directory: Path,
    with_ids: bool,
    on_batch: Callable[[int, int], None] | None = None,
) -> Iterator[dict]:
    """Consume embed_events: each shard goes to ``directory/part-NNNNNN.(h5|parquet)``, written under a unique
    temporary name, fsynced, renamed; then its manifest entry is yielded (committing it is the caller's job).
    ``on_batch(sentences, tokens)`` reports progress."""
    writer_class, suffix = WRITERS[options.output_format]
    dtype = DTYPES[layout.dtype]
    writer = temporary = records = None
    stats = ShardStats()
    try:
        for event in events:
            if isinstance(event, ShardStart):
                records = event.records
                temporary = directory / f".{event.shard.stem}.{uuid.uuid4().hex[:8]}{suffix}.tmp"
                writer = writer_class(temporary, layout, event.shard, with_ids)
                blank = [record for record in records if not record.tokens]
                writer.add(blank, [layout.empty()] * len(blank))
                stats = ShardStats(lines=len(records), blank=len(blank))
                if on_batch and blank:
                    on_batch(len(blank), 0)
            elif isinstance(event, CallGroup):
                group = [records[position] for position in event.positions]
                for record, vectors in zip(group, event.outputs):
                    if tuple(vectors.shape) != layout.shape(len(record.tokens)):
                        raise ElmoError(f"line {record.index + 1}: got vectors of shape {vectors.shape}")
                writer.add(group, [vectors.astype(dtype, copy=False) for vectors in event.outputs])
                tokens = sum(len(record.tokens) for record in group)
                stats.tokens += tokens
                if on_batch:
                    on_batch(len(event.positions), tokens)
            else:
                writer.close()
                writer = None
                final = directory / (event.shard.stem + suffix)
                fsync_file(temporary)
                os.replace(temporary, final)
                fsync_dir(directory)
                yield {
                    "shard": event.shard.number,
                    "file": final.name,
                    "first_line": event.shard.first_line,
                    "n_lines": event.shard.n_lines,
                    "blank": stats.blank,
                    "tokens": stats.tokens,
                    "bytes": final.stat().st_size,
                }
    finally:
        if writer is not None:
            writer.abort()
        if temporary is not None and temporary.exists():
            temporary.unlink()


def write_shard(
    plan: InputPlan,
    shard: ShardSpec,
    options: JobOptions,
    backend: Backend,
    layout: Layout,
    directory: Path,
    on_batch: Callable[[int, int], None] | None = None,
) -> dict:
    """Read, embed and write one shard (what a Ray actor does per row); returns its manifest entry."""
    events = prefetched(embed_events(plan, [shard], options, backend))
    (entry,) = write_shards(events, options, layout, directory, plan.input_format == JSONL, on_batch)
    return entry


# -- progress ------------------------------------------------------------------------------------------------------
class Progress:
    """tqdm bar over sentences (rate = sentences/s, ETA) with tokens/s as a postfix."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total, initial=done, unit="sent", desc="embed-file", disable=not enabled, dynamic_ncols=True
        )
        self.started = time.perf_counter()
        self.tokens = 0
        self.sentences = 0

    def __call__(self, sentences: int, tokens: int) -> None:
        self.sentences += sentences
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s", refresh=False)
        self.bar.update(sentences)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        self.bar.close()
