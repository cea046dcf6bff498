"""The job directory (OUTPUT.partial/): the job's fingerprint, the committed-shards log and resume after a kill.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
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


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3])


class JobDirectory:
    """``OUTPUT.partial/``: the job's fingerprint, the committed-shards log and the shard files.

    The log is the only truth: a shard file not listed there (killed before its commit) or a listed one that is
    missing or has another size is redone. A torn last line of the log (killed mid-append) is dropped.
    """

    def __init__(self, output: Path) -> None:
        self.output = output
        self.path = output.with_name(output.name + PARTIAL_SUFFIX)
        self.committed: dict[int, dict] = {}
        self.on_commit: Callable[[dict], None] | None = None  # e.g. the hdf5 assembly copying the shard in
        self.timeline: list[tuple[float, int]] = []  # (time, tokens) of this run's commits

    def open(self, fingerprint: dict, overwrite: bool) -> None:
        job_file = self.path / JOB_FILE
        if self.path.exists() and overwrite:
            shutil.rmtree(self.path)
        if self.path.exists() and job_file.is_file():
            old = _read_json(job_file)
            if old != fingerprint:
                raise InputError(
                    f"{self.path} holds an unfinished job with other arguments or input "
                    f"({_differences(old, fingerprint)}); rerun with the same arguments to resume it, "
                    "or pass --overwrite to start over"
                )
            self._load_log()
        else:
            if self.path.exists():  # killed before the fingerprint was written: nothing worth keeping
                shutil.rmtree(self.path)
            self.path.mkdir(parents=True)
            _write_json_atomic(job_file, fingerprint)
        self._remove_uncommitted()

    def _load_log(self) -> None:
        log_path = self.path / COMMIT_LOG
        if not log_path.is_file():
            return
        entries = []
        for line in log_path.read_bytes().split(b"\n"):
            try:
                entry = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # the torn tail of an append cut short
            shard_file = self.path / str(entry.get("file", ""))
            if shard_file.is_file() and shard_file.stat().st_size == entry.get("bytes"):
                entries.append(entry)
        self.committed = {entry["shard"]: entry for entry in entries}
        # rewrite the log without the torn line so that later appends start on a fresh line
        _write_text_atomic(log_path, "".join(json.dumps(e) + "\n" for e in self.committed.values()))

    def _remove_uncommitted(self) -> None:
        keep = {JOB_FILE, COMMIT_LOG} | {entry["file"] for entry in self.committed.values()}
        for child in self.path.iterdir():
            if child.name not in keep:
                shutil.rmtree(child) if child.is_dir() else child.unlink()

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


