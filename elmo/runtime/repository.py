"""A model repository: ``ROOT/NAME/VERSION/``, each version an exported model directory. Torch-free (serving path).

The layout follows Triton's model repository: one folder per model name, numbered version folders inside it. A
version counts only once it is complete: the folder has a whole numeric name, ``model.onnx`` and the other graphs
``onnx.json`` names, the weights file at the size ``onnx.json`` records, and an ``onnx.json`` whose verification
record passed (``elmo export`` writes it). Writers never build a version in place: :func:`publishing` hands out a
hidden temporary folder beside the versions (``ROOT/NAME/.incoming-PID-RANDOM``, so on the same filesystem) and
renames it to the next number when it is done, so a polling server sees either nothing or the whole version.

    ROOT/
      default/
        1/  model.onnx onnx.json model.onnx.data ... tasks/
        2/
        .incoming-4711-3f2a.../     (being written: ignored, like every hidden or non-numeric folder)
      zhs/
        1/

The rename is what makes it atomic: ``rename(2)`` of the finished folder onto ``ROOT/NAME/N`` either takes the
number or fails because the number exists (a non-empty folder is never replaced), so two publishers at once each get
their own number and neither ever writes into the other's. Copying a version in by hand (``cp -r``) is not atomic;
the size check on the weights file keeps a copy in progress from counting, but copy to a hidden name and rename.
Numbers are one more than the highest numbered entry present, as in Triton: a deleted highest version's number is
given again. A model or version folder may be a symlink to a folder elsewhere (published on purpose, e.g. ``ln -s
/data/exports/7 ROOT/default/7``): it counts like any other, and one WARNING names where it leads
(elmo.runtime.modeldir.note_if_outside; docs/how-to/models.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from elmo.errors import ConfigError, ModelFileError
from elmo.runtime.modeldir import MAX_META_BYTES, ONNX_FILE, ONNX_META_FILE, member_file, note_if_outside

VERSION_PATTERN = re.compile(r"[1-9][0-9]{0,8}")  # 1, 2, ... (no leading zeros: one folder per number)
MAX_VERSION = 999_999_999
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
INCOMING_PREFIX = ".incoming-"  # hidden, not a number: never taken for a version


@dataclass(frozen=True)
class ModelRef:
    """What a request or a command names: ``NAME`` (the latest version) or ``NAME@VERSION`` (pinned)."""

    name: str
    version: int | None = None

    @staticmethod
    def parse(text: str) -> ModelRef:
        name, sep, version = text.partition("@")
        if not name:
            raise ConfigError(f"model {text!r}: no model name (NAME or NAME@VERSION, like default@2)")
        if not sep:
            return ModelRef(name)
        if not VERSION_PATTERN.fullmatch(version):
            raise ConfigError(f"model {text!r}: the version after '@' must be a whole number from 1, like {name}@2")
        return ModelRef(name, int(version))

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def check_model_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(
            f"model name {name!r}: letters, digits, '.', '_' and '-' (up to 64, starting with a letter or digit)"
        )
    return name


def _read_meta(folder: Path) -> dict | None:
    """onnx.json as a dict; None when missing, unreadable, not an object, or larger than any export's (unread)."""
    try:
        if (folder / ONNX_META_FILE).stat().st_size > MAX_META_BYTES:
            return None
        meta = json.loads((folder / ONNX_META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def verification_passed(version_dir: Path) -> bool:
    """The export's verification record in ``onnx.json`` says it passed (False when missing or unreadable)."""
    meta = _read_meta(version_dir)
    verification = meta.get("verification") if meta else None
    return isinstance(verification, dict) and verification.get("passed") is True


def incomplete_reason(folder: Path) -> str | None:
    """Why ``folder``'s contents are not a complete, verified export (None when they are): the graphs onnx.json
    names, its weights file at the recorded size, a passed verification. Cheap (no hashing): a poller calls it.
    A version folder that leads outside its model's folder (a symlink) counts, said once (note_if_outside)."""
    note_if_outside(folder.parent, Path(folder.name), "version folder")
    meta = _read_meta(folder)
    if meta is None:
        where = folder / ONNX_META_FILE
        return f"{where}: missing or not a JSON object (or over {MAX_META_BYTES:,} bytes; run `elmo export`)"
    graphs = meta.get("graphs")
    names = {ONNX_FILE, *(graphs.values() if isinstance(graphs, dict) else ())}
    try:  # each a regular file inside the folder: a symlink or a path could make any host file "complete"
        for name in sorted(names, key=str):
            member_file(folder, name, "graph", must_exist=False)
    except ModelFileError as exc:
        return str(exc)
    missing = sorted(str(n) for n in names if not (folder / str(n)).is_file())
    if missing:
        return f"{folder}: missing {', '.join(missing)}"
    for field in ("weights_data", "probe"):  # the files whose sizes onnx.json records
        data = meta.get(field)
        if not (isinstance(data, dict) and "file" in data and "bytes" in data):
            continue
        try:
            size = member_file(folder, data["file"], field.replace("_", " "), must_exist=False).stat().st_size
        except ModelFileError as exc:
            return str(exc)
        except OSError:
            return f"{folder / str(data['file'])}: missing"
        if size != data["bytes"]:
            return f"{folder / str(data['file'])}: {size} bytes, onnx.json records {data['bytes']} (still copying?)"
    if not verification_passed(folder):
        return f"{folder / ONNX_META_FILE}: no passed verification record (export it with `elmo export`)"
    return None


def is_complete(version_dir: Path) -> bool:
    return VERSION_PATTERN.fullmatch(version_dir.name) is not None and incomplete_reason(version_dir) is None


def _numbered_entries(model_dir: Path, dirs_only: bool) -> list[int]:
    try:
        entries = list(model_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(p.name) for p in entries if VERSION_PATTERN.fullmatch(p.name) and (not dirs_only or p.is_dir()))


def numbered_folders(model_dir: Path) -> list[int]:
    """Every numbered folder under ``ROOT/NAME`` (complete or not), ascending."""
    return _numbered_entries(model_dir, dirs_only=True)


def complete_versions(model_dir: Path) -> list[int]:
    """The versions of one model that count (complete), ascending."""
    return [v for v in numbered_folders(model_dir) if is_complete(model_dir / str(v))]


def scan(root: Path) -> dict[str, list[int]]:
    """Model name -> its complete versions (possibly none), for every model folder under ``root`` (hidden and
    otherwise misnamed folders skipped; one that leads outside ``root``, a symlink, counts, said once)."""
    root = Path(root)
    if not root.is_dir():
        raise ModelFileError(f"{root}: model root not found (a folder of NAME/VERSION/ model directories)")
    found = {}
    for entry in sorted(root.iterdir()):
        if NAME_PATTERN.fullmatch(entry.name) and entry.is_dir():
            note_if_outside(root, Path(entry.name), "model folder")
            found[entry.name] = complete_versions(entry)
    return found


def version_dir(root: Path, name: str, version: int) -> Path:
    return Path(root) / name / str(version)


@dataclass
class Publication:
    """A version being written: ``folder`` is where to write it (a hidden folder inside ``ROOT/NAME``); once it is
    in place, ``version`` is its number and ``path`` its folder (``folder`` no longer exists then)."""

    folder: Path
    version: int | None = None
    path: Path | None = None


@contextlib.contextmanager
def publishing(root: Path, name: str) -> Iterator[Publication]:
    """Write a model directory into ``publication.folder``; on a clean exit it becomes ``ROOT/NAME/N``, N one more
    than the highest numbered entry there (renamed, so never seen half-written); on an error, or when the folder
    is not a complete verified export (ModelFileError), the folder is removed and nothing is published. Two
    publishers at once each get their own number. ``ROOT`` and ``ROOT/NAME`` are created when missing."""
    model_dir = Path(root) / check_model_name(name)
    try:
        model_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFileError(f"{model_dir}: cannot create the model's folder in the repository ({exc})") from None
    publication = Publication(_make_incoming(model_dir))
    try:
        yield publication
        reason = incomplete_reason(publication.folder)
        if reason is not None:
            raise ModelFileError(f"not a complete export, nothing was published to {model_dir}: {reason}")
        readable_by_all(publication.folder)
        _sync_tree(publication.folder)
        publication.version = _rename_to_next_version(publication.folder, model_dir)
        publication.path = model_dir / str(publication.version)
        _sync_dir(model_dir)
    finally:
        if publication.version is None:
            shutil.rmtree(publication.folder, ignore_errors=True)


def publish_copy(
    source: Path, root: Path, name: str, ignore: Callable[[str, list[str]], list[str]] | None = None
) -> Publication:
    """Copy the model directory ``source`` (``ignore`` as shutil.copytree's) in as the next version of ``name``."""
    with publishing(root, name) as publication:
        shutil.copytree(source, publication.folder, ignore=ignore, dirs_exist_ok=True, symlinks=False)
    return publication


def readable_by_all(folder: Path) -> None:
    """Folders 0755 and files 0644 below ``folder``, set explicitly: a model written by root (or under umask 077) is
    served by another user (the image's), who must read it; nothing in a model needs to be secret or executable."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        path.chmod(0o755 if path.is_dir() else 0o644)


def _make_incoming(model_dir: Path) -> Path:
    """A new hidden folder in ``model_dir``, with the permissions a plain mkdir gives (the umask's; mkdtemp's 0700
    would leave the published version unreadable to a server running as another user)."""
    for _ in range(100):
        folder = model_dir / f"{INCOMING_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        except OSError as exc:
            raise ModelFileError(f"{model_dir}: cannot write into the model's folder ({exc})") from None
        return folder
    raise ModelFileError(f"{model_dir}: could not create a temporary folder")


def _rename_to_next_version(folder: Path, model_dir: Path) -> int:
    """Rename ``folder`` to the next free number. rename(2) onto an existing non-empty folder (or a file) fails, so
    a number another publisher took first is skipped; an empty numbered folder (left by hand) is replaced."""
    for _ in range(1000):  # each failure means another publisher took the number: a new one is free now
        version = (_numbered_entries(model_dir, dirs_only=False) or [0])[-1] + 1
        if version > MAX_VERSION:
            raise ModelFileError(f"{model_dir}: no version number left after {MAX_VERSION}")
        try:
            os.rename(folder, model_dir / str(version))
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                continue
            raise ModelFileError(f"{folder}: could not rename it to {model_dir / str(version)} ({exc})") from None
        return version
    raise ModelFileError(f"{model_dir}: could not claim a version number (too many publishers at once?)")


def _sync_tree(folder: Path) -> None:
    """fsync every file and folder under ``folder``, so that after a crash the renamed version is whole too."""
    for directory, _, files in os.walk(folder):
        for file in files:
            path = os.path.join(directory, file)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(directory))


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem fsyncs a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = [
    "INCOMING_PREFIX",
    "ModelRef",
    "Publication",
    "check_model_name",
    "complete_versions",
    "incomplete_reason",
    "is_complete",
    "numbered_folders",
    "publish_copy",
    "publishing",
    "scan",
    "verification_passed",
    "version_dir",
]
