"""The job's options (what ``elmo embed-file`` parsed) and its fingerprint: what decides the output's content, stored
with the unfinished job and the finished output, and described in the words of the command line when it differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elmo.batch.layout import LayerSpec, Layout
from elmo.batch.plan import InputPlan
from elmo.text.overflow import DEFAULT_WINDOW_OVERLAP

if TYPE_CHECKING:  # elmo.client (grpc) is imported only in remote mode
    from elmo.client import Connection


JOB_VERSION = 1
DEFAULT_SHARD_LINES = 1000


@dataclass
class JobOptions:
    """What `elmo embed-file` was asked, one field per flag (elmo.batch.cli.options_from_args fills it)."""

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
_OVERFLOW_FLAGS = ("--overflow", "--max-sentence-tokens", "--window-overlap-tokens")
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


def is_fingerprint(value: object) -> bool:
    """A job fingerprint as the job writes it (the mark of its _job.json and of its finished outputs)."""
    return isinstance(value, dict) and "version" in value
