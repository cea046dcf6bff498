"""Files that survive a crash: fsync of a file and of its folder, and a small file written whole or not at all
(under a temporary name, fsynced, renamed). The job directory, the shard writers and the finishing steps use them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fsync_file(path)
    except OSError:  # some filesystems refuse to fsync a directory; the rename is still atomic
        pass


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` in ``path``, whole: a crash leaves the old file or the new one, never half of it."""
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, value: dict) -> None:
    write_text_atomic(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
