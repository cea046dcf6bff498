"""The job directory (OUTPUT.partial/): the job's fingerprint, the committed-shards log and resume after a kill;
and which files in it are the job's own (the only ones it ever removes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from elmo.batch.atomic import read_json, write_json_atomic, write_text_atomic
from elmo.batch.options import describe_differences, is_fingerprint
from elmo.errors import InputError

log = logging.getLogger("elmo.batch")


PARTIAL_SUFFIX = ".partial"
JOB_FILE = "_job.json"
COMMIT_LOG = "_manifest.jsonl"  # committed shards, one JSON line each, appended and fsynced
MANIFEST_FILE = "_manifest.json"  # the finished Parquet output's manifest (complete: true)


def is_job_entry(name: str) -> bool:
    """A name the job writes in OUTPUT.partial/ (its shards, their temporaries, its log, its fingerprint)."""
    return bool(_JOB_ENTRY.fullmatch(name))


# what the job writes in OUTPUT.partial/: _job.json, _manifest.jsonl, _manifest.json, _assembled.h5.tmp, shard files
# part-NNNNNN.(h5|parquet), their temporaries .part-NNNNNN.<hex>.(h5|parquet).tmp, and ._<name>.<hex>.tmp ones
_JOB_ENTRY = re.compile(
    r"_job\.json|_manifest\.jsonl?|_assembled\.h5\.tmp|part-\d{6,}\.(h5|parquet)"
    r"|\.part-\d{6,}\.[0-9a-f]{8}\.(h5|parquet)\.tmp|\._(job\.json|manifest\.jsonl?)\.[0-9a-f]{8}\.tmp"
)
_JOB_FILE_TEMPORARY = re.compile(r"\._job\.json\.[0-9a-f]{8}\.tmp")


class JobDirectory:
    """``OUTPUT.partial/``: the job's fingerprint, the committed-shards log and the shard files.

    The log is the only truth: a shard file not listed there (killed before its commit) or a listed one that is
    missing or has another size is redone. A torn last line of the log (killed mid-append) is dropped.

    Only a folder that is the job's own is ever emptied or removed: one holding the job's ``_job.json`` and nothing
    but the job's files (or, killed before that file was written, nothing or that file's temporary; or, killed while
    a Parquet output was being finished, the finished manifest instead).
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
        job_file, manifest = self.path / JOB_FILE, self.path / MANIFEST_FILE
        if job_file.exists():
            if not is_fingerprint(read_json(job_file)):
                self._refuse(f"its {JOB_FILE} is not an embed-file job's")
        elif manifest.exists():  # killed while finishing a Parquet output: its manifest carries the job's mark
            if not is_fingerprint(read_json(manifest).get("job")):
                self._refuse(f"its {MANIFEST_FILE} is not an embed-file job's")
        elif any(not _JOB_FILE_TEMPORARY.fullmatch(child.name) for child in self.path.iterdir()):
            # the job writes its _job.json right after making the folder: without one, the folder can only be
            # empty or hold that file's temporary (killed in between)
            self._refuse(f"it has no {JOB_FILE}")

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
            old = read_json(self.path / JOB_FILE)
            if overwrite or not old:  # not old: killed before the fingerprint was written, nothing worth keeping
                self.remove()
            elif old != fingerprint:
                self._restart_or_refuse(old, fingerprint)
            else:
                self._load_log()
        if not self.path.is_dir():
            self.path.mkdir(parents=True)
            write_json_atomic(self.path / JOB_FILE, fingerprint)
        self._remove_uncommitted()

    def _restart_or_refuse(self, old: dict, fingerprint: dict) -> None:
        committed = self._read_log()
        differences = describe_differences(old, fingerprint)
        if not committed:
            log.info(
                "%s: an unfinished job with other options (%s) committed nothing; starting again",
                self.path,
                differences,
            )
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
        write_text_atomic(log_path, "".join(json.dumps(e) + "\n" for e in self.committed.values()))

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
