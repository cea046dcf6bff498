"""The job directory (OUTPUT.partial/): the job's fingerprint, the committed-shards log and resume after a kill.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elmo.batch.layout import LayerSpec, Layout
from elmo.batch.plan import InputPlan
from elmo.errors import InputError
from elmo.text.overflow import DEFAULT_WINDOW_OVERLAP

if TYPE_CHECKING:  # elmo.client (grpc) is imported only in remote mode
    from elmo.client import Connection

log = logging.getLogger("elmo.batch")


JOB_VERSION = 1
DEFAULT_SHARD_LINES = 1000
PARTIAL_SUFFIX = ".partial"
JOB_FILE = "_job.json"
COMMIT_LOG = "_manifest.jsonl"  # committed shards, one JSON line each, appended and fsynced
MANIFEST_FILE = "_manifest.json"  # the finished Parquet output's manifest (complete: true)
def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse to fsync a directory; the rename is still atomic
        pass


# -- the job directory ---------------------------------------------------------------------------------------------
@dataclass
class JobOptions:
    input: Path
    output: Path
    model: Path | None
    server: str | None
    server_model: str
    spec: LayerSpec
    output_format: str
    dtype: str
    tokenized: bool
    input_format: str
    batch_tokens: int | None
    shard_lines: int
    engine: str = "local"
    workers: int | None = None
    threads: int | None = None
    overwrite: bool = False
    progress: bool = True
    ray_address: str | None = None
    server_wait: float = 30.0
    # lines over the sentence limit (elmo.text.overflow): reject the job, truncate them, or embed them in windows
    overflow: str = "reject"
    max_sentence_tokens: int | None = None  # None: the backend's own limit (the server's, or 100,000 locally)
    window_overlap: int = DEFAULT_WINDOW_OVERLAP
    # --server's TLS and token (elmo.client.Connection); None: plaintext, token from env ELMO_AUTH_TOKEN. Not part
    # of the fingerprint: it changes how vectors travel, not what they are (and the token must not be written).
    connection: Connection | None = None


def job_fingerprint(options: JobOptions, plan: InputPlan, backend_identity: dict, layout: Layout) -> dict:
    """Everything that decides the output's content. A partial job resumes only under the same fingerprint;
    batch size, engine, workers and threads only change the speed, so they are left out."""
    return {
        "version": JOB_VERSION,
        "input": str(plan.path.resolve()),
        "input_sha256": plan.sha256,
        "input_lines": plan.n_lines,
        "input_format": plan.input_format,
        "tokenized": options.tokenized,
        "layers": options.spec.text,
        "dtype": options.dtype,
        "format": options.output_format,
        "shard_lines": options.shard_lines,
        "n_layers": layout.n_layers,
        "dim": layout.dim,
        "overflow": [options.overflow, options.max_sentence_tokens, options.window_overlap],
        "source": backend_identity,
    }


# The words of the command line for what a fingerprint holds: a message names the flag a user typed, never a field.
_FLAG_OF_FIELD = {
    "input_format": "--input-format",
    "layers": "--layers",
    "dtype": "--dtype",
    "format": "--format",
    "shard_lines": "--shard-lines",
}
_OVERFLOW_FLAGS = ("--overflow", "--max-sentence-tokens", "--window-overlap")
_MODEL_FIELDS = ("source", "n_layers", "dim")
_INPUT_CONTENT_FIELDS = ("input_sha256", "input_lines")


def describe_differences(old: dict, new: dict) -> str:
    """What differs between two job fingerprints, in the words of the command line, the earlier value first:
    ``--overflow reject -> --overflow truncate``."""
    changed = {key for key in set(old) | set(new) if old.get(key) != new.get(key)}
    parts: list[str] = []
    if "version" in changed:
        parts.append("made by another version of embed-file")
    if "input" in changed:
        parts.append(f"INPUT {old.get('input')} -> INPUT {new.get('input')}")
    elif changed & set(_INPUT_CONTENT_FIELDS):
        parts.append(f"INPUT has changed ({old.get('input_lines')} lines -> {new.get('input_lines')} lines)")
    if "tokenized" in changed:
        parts.append(f"{_tokenized_words(old.get('tokenized'))} -> {_tokenized_words(new.get('tokenized'))}")
    for field, flag in _FLAG_OF_FIELD.items():
        if field in changed:
            parts.append(f"{flag} {old.get(field)} -> {flag} {new.get(field)}")
    if "overflow" in changed:
        parts.extend(_overflow_differences(old.get("overflow"), new.get("overflow")))
    if changed & set(_MODEL_FIELDS):
        parts.append(_model_difference(old.get("source"), new.get("source")))
    known = {"version", "input", "tokenized", "overflow", *_FLAG_OF_FIELD, *_MODEL_FIELDS, *_INPUT_CONTENT_FIELDS}
    parts.extend(f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted(changed - known))
    return ", ".join(parts)


def _tokenized_words(value: object) -> str:
    return "--tokenized" if value else "no --tokenized"


def _overflow_differences(old: object, new: object) -> list[str]:
    olds, news = _overflow_triple(old), _overflow_triple(new)
    return [
        f"{flag} {_flag_value(before)} -> {flag} {_flag_value(after)}"
        for flag, before, after in zip(_OVERFLOW_FLAGS, olds, news)
        if before != after
    ]


def _overflow_triple(value: object) -> tuple:
    """The fingerprint's ``overflow`` field: [policy, max sentence tokens, window overlap]."""
    if isinstance(value, list) and len(value) == len(_OVERFLOW_FLAGS):
        return tuple(value)
    return (None,) * len(_OVERFLOW_FLAGS)


def _flag_value(value: object) -> str:
    return "(not given)" if value is None else str(value)


def _model_difference(old: object, new: object) -> str:
    old, new = old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}
    if "server_model" in old and "server_model" in new:
        return (
            f"--server model {old.get('server_model')} version {old.get('server_model_version')} -> "
            f"{new.get('server_model')} version {new.get('server_model_version')}"
        )
    if old.get("model_sha256") and old.get("model_sha256") == new.get("model_sha256"):
        return "the task of --layers mix:TASK has changed (its task.json)"
    return "another model (--model DIR or --server: its files or its version differ)"


def is_job_entry(name: str) -> bool:
    """A name the job writes in OUTPUT.partial/ (its shards, their temporaries, its log, its fingerprint)."""
    return bool(_JOB_ENTRY.fullmatch(name))


# what the job writes in OUTPUT.partial/: _job.json, _manifest.jsonl, _manifest.json, _assembled.h5.tmp, shard files
# part-NNNNNN.(h5|parquet), their temporaries .part-NNNNNN.<hex>.(h5|parquet).tmp, and ._<name>.<hex>.tmp ones
_JOB_ENTRY = re.compile(
    r"_job\.json|_manifest\.jsonl?|_assembled\.h5\.tmp|part-\d{6,}\.(h5|parquet)"
    r"|\.part-\d{6,}\.[0-9a-f]{8}\.(h5|parquet)\.tmp|\._(job\.json|manifest\.jsonl?)\.[0-9a-f]{8}\.tmp"
)


def is_fingerprint(value: object) -> bool:
    """A job fingerprint as the job writes it (the mark of its _job.json and of its finished outputs)."""
    return isinstance(value, dict) and "version" in value


class JobDirectory:
    """``OUTPUT.partial/``: the job's fingerprint, the committed-shards log and the shard files.

    The log is the only truth: a shard file not listed there (killed before its commit) or a listed one that is
    missing or has another size is redone. A torn last line of the log (killed mid-append) is dropped.

    Only a folder that is the job's own is ever emptied or removed: one holding the job's ``_job.json`` and nothing
    but the job's files (or, killed before the fingerprint was written, nothing but them).
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.with_name(output.name + PARTIAL_SUFFIX)
        self.committed: dict[int, dict] = {}
        self.on_commit: Callable[[dict], None] | None = None  # e.g. the hdf5 assembly copying the shard in
        self.timeline: list[tuple[float, int]] = []  # (time, tokens) of this run's commits

    def check_ours(self) -> None:
        """Refuse (InputError) an OUTPUT.partial that is not the job's own: the job would resume, empty or remove
        it. Nothing there is fine."""
        if not (self.path.exists() or self.path.is_symlink()):
            return
        if self.path.is_symlink() or not self.path.is_dir():
            self._refuse("it is not a folder")
        foreign = sorted(child.name for child in self.path.iterdir() if child.is_dir() or not is_job_entry(child.name))
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            self._refuse(f"it holds {shown}, which embed-file did not write")
        job_file = self.path / JOB_FILE
        if job_file.exists() and not is_fingerprint(_read_json(job_file)):
            self._refuse(f"its {JOB_FILE} is not an embed-file job's")

    def _refuse(self, why: str) -> None:
        raise InputError(
            f"{self.path} already exists and is not an unfinished embed-file job ({why}); embed-file keeps its "
            f"unfinished work in OUTPUT.partial and touches no folder it did not make: choose another OUTPUT path"
        )

    def open(self, fingerprint: dict, overwrite: bool) -> None:
        """Resume the unfinished job under ``fingerprint``, or start one. A job with other options starts again
        when it committed nothing; one with committed shards is refused, naming what differs (``overwrite``
        discards it)."""
        self.check_ours()
        if self.path.is_dir():
            old = _read_json(self.path / JOB_FILE)
            if overwrite or not old:  # not old: killed before the fingerprint was written, nothing worth keeping
                self.remove()
            elif old != fingerprint:
                self._restart_or_refuse(old, fingerprint)
            else:
                self._load_log()
        if not self.path.is_dir():
            self.path.mkdir(parents=True)
            _write_json_atomic(self.path / JOB_FILE, fingerprint)
        self._remove_uncommitted()

    def _restart_or_refuse(self, old: dict, fingerprint: dict) -> None:
        committed = self._read_log()
        differences = describe_differences(old, fingerprint)
        if not committed:
            log.info("%s: an unfinished job with other options (%s) committed nothing; starting again", self.path,
                     differences)  # fmt: skip
            self.remove()
            return
        raise InputError(
            f"{self.path} holds an unfinished job with {len(committed)} shards committed, run with other options or "
            f"input: {differences}; to resume it, rerun with the earlier values (left of each ->), or add "
            "--overwrite to discard its shards and start again"
        )

    def remove(self) -> None:
        """Remove the job's folder: only the job's own files are in it (check_ours)."""
        if not self.path.is_dir():
            return
        self.check_ours()
        for child in self.path.iterdir():
            child.unlink()
        self.path.rmdir()

    def discard_if_nothing_committed(self) -> None:
        """After a failure: a job that committed nothing leaves nothing behind (the failure itself is what the
        user needs to hear of, so a folder that cannot be removed is only logged)."""
        try:
            if not self.committed and not self._read_log():
                self.remove()
        except (OSError, InputError) as exc:
            log.warning("%s: left in place (%s)", self.path, exc)

    def _read_log(self) -> dict[int, dict]:
        """The committed shards the log lists whose files are there, whole."""
        log_path = self.path / COMMIT_LOG
        if not log_path.is_file():
            return {}
        entries = []
        for line in log_path.read_bytes().split(b"\n"):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # the torn tail of an append cut short
            if not isinstance(entry, dict) or "shard" not in entry:
                continue
            shard_file = self.path / str(entry.get("file", ""))
            if shard_file.is_file() and shard_file.stat().st_size == entry.get("bytes"):
                entries.append(entry)
        return {entry["shard"]: entry for entry in entries}

    def _load_log(self) -> None:
        log_path = self.path / COMMIT_LOG
        if not log_path.is_file():
            return
        self.committed = self._read_log()
        # rewrite the log without the torn line so that later appends start on a fresh line
        _write_text_atomic(log_path, "".join(json.dumps(e) + "\n" for e in self.committed.values()))

    def _remove_uncommitted(self) -> None:
        keep = {JOB_FILE, COMMIT_LOG} | {entry["file"] for entry in self.committed.values()}
        for child in self.path.iterdir():
            if child.name not in keep:  # a job's own file (check_ours): a temporary or an uncommitted shard
                child.unlink()

    def commit(self, entry: dict) -> None:
        """Append one shard's entry to the log and fsync: from here on the shard survives any crash."""
        with open(self.path / COMMIT_LOG, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.committed[entry["shard"]] = entry
        self.timeline.append((time.perf_counter(), entry["tokens"]))
        if self.on_commit:
            self.on_commit(entry)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


def _write_json_atomic(path: Path, value: dict) -> None:
    _write_text_atomic(path, json.dumps(value, indent=1, sort_keys=True) + "\n")


