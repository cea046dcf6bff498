"""The input side of the job: scan and validate the input once, cut it into shards, read a shard's lines
back as records, and plan length-sorted call groups of them for the runtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elmo.errors import InputError
from elmo.text.tokenize import tokenize, whitespace_tokens

log = logging.getLogger("elmo.batch")


TEXT, JSONL = "text", "jsonl"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# One runtime call gets a length-sorted *call group* of a shard: as many tokens as make GROUP_BYTES of float32
# vectors (at least one batch). The runtime plans its batches over the whole group (the more it sees, the less
# padding), and memory holds at most PREFETCH + 2 groups, whatever the input's size. (Not the overflow policy's
# windows, elmo.text.overflow: those are pieces of one long sentence.)
GROUP_BYTES = 128 << 20
# A line over the sentence limit is counted whole up to this many characters (for the exact count in the refusal);
# beyond, only as far as it takes to know it is over the limit (an 18 MB line would take seconds to count).
EXACT_COUNT_CHARS = 1 << 20


# -- input ---------------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One input line. ``sentence`` is the ``sentence_to_index`` key (the stripped line, or the JSONL text)."""

    index: int  # 0-based line index in INPUT: the hdf5 key
    id: str  # JSONL id, or the line index as a string
    sentence: str
    tokens: list[str]


@dataclass(frozen=True)
class ShardSpec:
    """Lines ``[first_line, first_line + n_lines)`` of INPUT, bytes ``[byte_start, byte_end)``."""

    number: int
    first_line: int
    n_lines: int
    byte_start: int
    byte_end: int

    @property
    def stem(self) -> str:
        return f"part-{self.number:06d}"


@dataclass(frozen=True)
class InputPlan:
    path: Path
    input_format: str  # text | jsonl
    n_lines: int
    sha256: str
    shards: list[ShardSpec]


def detect_input_format(path: Path, requested: str) -> str:
    if requested in (TEXT, JSONL):
        return requested
    return JSONL if path.suffix.lower() in JSONL_SUFFIXES else TEXT


def _line_text(raw: bytes, line_index: int, path: Path) -> str:
    """Bytes of one line (terminator included) -> str without its terminator; bad UTF-8 names the line."""
    if line_index == 0 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark is not part of the first sentence
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # the same way out as elmo.text.files gives (which reads whole files: this scan streams, line by line)
        raise InputError(
            f"{path}: line {line_index + 1} is not valid UTF-8 (byte {exc.start + 1} of the line is "
            f"{raw[exc.start : exc.start + 1]!r}); convert it first, e.g. `iconv -f GB18030 -t UTF-8 {path} > "
            f"{path.stem}.utf8{path.suffix}` for Chinese text"
        ) from None
    if text.endswith("\n"):
        text = text[:-1]
    if text.endswith("\r"):
        text = text[:-1]
    return text


def _json_fields(text: str, line_index: int, path: Path) -> tuple[str, str | None, list[str] | None]:
    """A JSONL line -> (id, text, tokens). ``id`` is optional (default: the line index); exactly one of a string
    ``text`` or a list of string ``tokens``. A blank line is an empty sentence."""
    where = f"{path}: line {line_index + 1}"
    if not text.strip():
        return str(line_index), "", None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object with 'id' and 'text', got {type(obj).__name__}")
    raw_id = obj.get("id", line_index)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise InputError(f"{where}: 'id' must be a string or an integer, got {raw_id!r}")
    has_text, has_tokens = "text" in obj, "tokens" in obj
    if has_text == has_tokens:
        raise InputError(f"{where}: expected exactly one of 'text' (a string) or 'tokens' (a list of strings)")
    if has_text:
        if not isinstance(obj["text"], str):
            raise InputError(f"{where}: 'text' must be a string, got {type(obj['text']).__name__}")
        return str(raw_id), obj["text"], None
    tokens = obj["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t and not t.isspace() for t in tokens):
        raise InputError(f"{where}: 'tokens' must be a list of non-empty strings")
    return str(raw_id), None, tokens


@dataclass(frozen=True)
class LineLimit:
    """The tokens a line may hold when ``--overflow reject`` (the default) refuses longer ones, and where that limit
    comes from, in the words of the command line."""

    tokens: int
    source: str = "--max-sentence-tokens"

    def refusal(self, path: Path, line_index: int, count: str) -> InputError:
        """The one refusal of a line over the limit (in the scan, and in the embedding loop's own check)."""
        return InputError(
            f"{path}: line {line_index + 1} has {count} tokens, over the limit of {self.tokens:,} tokens per line "
            f"({self.source}); use --overflow truncate (keep its first {self.tokens:,} tokens) or --overflow "
            "window (embed it all in overlapping windows), or split the line"
        )


def tokens_over_limit(
    sentence: str, limit: int, tokenized: bool, exact_count_chars: int = EXACT_COUNT_CHARS
) -> str | None:
    """None when ``sentence`` holds at most ``limit`` tokens; else its count for a message ("4,123,456", or "more
    than 100,000" when counting stopped early).

    Cheap on huge lines: a token is at least one character, so a sentence of at most ``limit`` characters is within
    the limit without tokenizing; one of up to ``exact_count_chars`` is counted whole (the exact count costs under a
    second); a longer one is tokenized a prefix at a time, the prefix doubling, and since a cut splits at most one
    token, a prefix with more than ``limit + 1`` tokens settles it."""
    if len(sentence) <= limit:
        return None
    if len(sentence) <= exact_count_chars:
        count, _ = _count_tokens(sentence, None, tokenized)
        return f"{count:,}" if count > limit else None
    size = 2 * (limit + 2)
    while size < len(sentence):
        count, _ = _count_tokens(sentence[:size], limit + 1, tokenized)
        if count > limit + 1:
            return f"more than {limit:,}"
        size *= 2
    count, complete = _count_tokens(sentence, limit + 1, tokenized)
    if count <= limit:
        return None
    return f"{count:,}" if complete else f"more than {limit:,}"


def _count_tokens(text: str, stop_after: int | None, tokenized: bool) -> tuple[int, bool]:
    """Tokens of ``text`` as the job will embed them, and whether that is all of them (tokenizing may stop once
    there are more than ``stop_after``)."""
    if tokenized:
        return len(whitespace_tokens(text)), True
    result = tokenize(text, stop_after=stop_after)
    return len(result.tokens), result.complete


def _check_line_length(
    text: str, fields: tuple | None, line_index: int, path: Path, tokenized: bool, limit: LineLimit
) -> None:
    """Refuse a line over the limit in the scan, before any embedding (``fields``: a JSONL line's, else None)."""
    if fields is not None:
        _, text, tokens = fields
        if tokens is not None:
            if len(tokens) > limit.tokens:
                raise limit.refusal(path, line_index, f"{len(tokens):,}")
            return
    count = tokens_over_limit(text.strip(), limit.tokens, tokenized)
    if count is not None:
        raise limit.refusal(path, line_index, count)


def make_record(
    raw: bytes, line_index: int, path: Path, input_format: str, tokenized: bool, keep: int | None = None
) -> Record:
    """One raw line -> Record. Raw text goes through elmo.text.tokenize.tokenize (the one tokenizer); with
    ``tokenized`` it is split on whitespace and embedded untouched. ``keep``: only the first ``keep`` tokens will be
    embedded (--overflow truncate), so tokenizing may stop once there are more."""
    text = _line_text(raw, line_index, path)
    tokens: list[str] | None = None
    if input_format == JSONL:
        record_id, text, tokens = _json_fields(text, line_index, path)
    else:
        record_id = str(line_index)
    if tokens is not None:
        return Record(line_index, record_id, " ".join(tokens), tokens)
    sentence = text.strip()
    words = whitespace_tokens(sentence) if tokenized else tokenize(sentence, stop_after=keep).tokens
    return Record(line_index, record_id, sentence, words)


def check_input_path(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path}: input file not found")
    if not path.is_file():
        raise InputError(f"{path}: input is not a regular file")


def scan_input(
    path: Path,
    input_format: str,
    shard_lines: int,
    progress: bool = False,
    limit: LineLimit | None = None,
    tokenized: bool = False,
) -> InputPlan:
    """Read INPUT once, validating every line (UTF-8; JSON for JSONL; with ``limit``, its length in tokens) so that
    a bad line fails the job before any work, and note where each shard starts. Memory: one entry per shard.
    ``progress``: a tqdm bar over the bytes on stderr (about 25 MB/s on one core: a 1 GB corpus is checked for 40 s
    before the first sentence is embedded)."""
    from tqdm import tqdm

    check_input_path(path)
    with tqdm(
        total=path.stat().st_size,
        unit="B",
        unit_scale=True,
        desc="checking input",
        disable=not progress,
        dynamic_ncols=True,
        leave=False,
    ) as bar:
        return _scan(path, input_format, shard_lines, bar, limit, tokenized)


def _scan(path: Path, input_format: str, shard_lines: int, bar, limit: LineLimit | None, tokenized: bool) -> InputPlan:
    digest = hashlib.sha256()
    shards: list[ShardSpec] = []
    line_index = 0
    offset = shard_start = 0
    try:
        with open(path, "rb") as handle:
            for raw in handle:
                digest.update(raw)
                text = _line_text(raw, line_index, path)
                fields = _json_fields(text, line_index, path) if input_format == JSONL else None
                # a line of at most N bytes holds at most N tokens (a token is at least one byte): only long ones
                # are counted
                if limit is not None and len(raw) > limit.tokens:
                    _check_line_length(text, fields, line_index, path, tokenized, limit)
                line_index += 1
                offset += len(raw)
                if line_index % shard_lines == 0:
                    shards.append(ShardSpec(len(shards), line_index - shard_lines, shard_lines, shard_start, offset))
                    shard_start = offset
                    bar.update(offset - bar.n)  # once a shard, not once a line (tqdm's call costs)
    except OSError as exc:
        raise InputError(f"{path}: cannot read input ({exc.strerror})") from None
    if line_index % shard_lines:
        first = len(shards) * shard_lines
        shards.append(ShardSpec(len(shards), first, line_index - first, shard_start, offset))
    return InputPlan(path, input_format, line_index, digest.hexdigest(), shards)


def read_shard(plan: InputPlan, shard: ShardSpec, tokenized: bool, keep: int | None = None) -> list[Record]:
    """The shard's lines as Records (seek to its byte range; no re-scan of what came before); ``keep`` as for
    make_record."""
    with open(plan.path, "rb") as handle:
        handle.seek(shard.byte_start)
        data = handle.read(shard.byte_end - shard.byte_start)
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    if len(lines) != shard.n_lines:
        raise InputError(f"{plan.path}: changed while the job was running (lines {shard.first_line}+)")
    return [
        make_record(raw, shard.first_line + i, plan.path, plan.input_format, tokenized, keep)
        for i, raw in enumerate(lines)
    ]


def plan_call_groups(lengths: Sequence[int], group_tokens: int) -> list[list[int]]:
    """Positions of the non-empty sentences sorted by length, cut into call groups of about ``group_tokens``
    real tokens (a group closes once it reaches the budget; a longer sentence is a group alone).

    A call group is what one runtime call gets: the runtime cuts it into batches under ``--runtime-batch-tokens`` by its
    own padding rule, and since the group is sorted those batches waste almost no padding."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for position in order:
        current.append(position)
        tokens += lengths[position]
        if tokens >= group_tokens:
            groups.append(current)
            current, tokens = [], 0
    if current:
        groups.append(current)
    return groups
