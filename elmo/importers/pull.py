"""``elmo pull NAME``: a published ELMo model by name, from its publisher's address to a servable model directory.

1. Download the files the catalogue (elmo.importers.catalogue) lists for NAME into the download cache: resumable, a
   progress bar, the size checked, the SHA-256 checked against the one the catalogue pins where a publisher's (or
   a mirror's LFS pointer) was found, else pinned on first download and verified on every later one
   (elmo.importers.download). Nothing else in this project downloads at run time; this command does only when asked.
2. Import them through the existing importers: AllenNLP's ``options.json`` + ``weights.hdf5``
   (elmo.importers.allennlp, read with h5py) or ELMoForManyLangs' zip (extracted, checked for unsafe paths, then
   elmo.importers.manylangs, whose ``.pkl`` state dicts are read without unpickling); both importers check every
   declared shape and dtype, and the byte budget, before they read a weight.
3. Export and verify (elmo.export.onnx_export) into ``--out DIR`` (built beside it under a hidden name and renamed
   when verified), or, with ``--model-root ROOT``, publish it as the next version of NAME (elmo.runtime.repository:
   atomic, so a server polling ROOT sees the whole version or nothing).

``--base-url URL`` (or ``ELMO_PULL_BASE_URL``) fetches the same paths from a mirror (tests use a local server).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import sys
import zipfile
from pathlib import Path

import torch

from elmo.errors import ConfigError, DataError, ElmoError, ModelFileError
from elmo.export.onnx_export import export_model
from elmo.importers.allennlp import import_allennlp
from elmo.importers.budget import DEFAULT_MAX_WEIGHT_BYTES, add_budget_argument, checked_budget
from elmo.importers.catalogue import ALLENNLP, CATALOGUE, Entry, markdown_table, resolve_url
from elmo.importers.download import DEFAULT_MAX_DOWNLOAD_BYTES, Fetched, Pins, fetch
from elmo.importers.manylangs import import_manylangs
from elmo.runtime.repository import check_model_name, publishing

log = logging.getLogger(__name__)
BASE_URL_ENV = "ELMO_PULL_BASE_URL"
CACHE_ENV = "ELMO_PULL_CACHE"
PINS_FILE = "pins.json"
PULL_RECORD = "pull.json"  # in the model directory: where its files came from, their sha256, the licence


def default_cache() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elmo" / "pull"


def lookup(name: str, catalogue: dict[str, Entry] | None = None) -> Entry:
    catalogue = CATALOGUE if catalogue is None else catalogue
    if name in catalogue:
        return catalogue[name]
    folded = {key.lower(): entry for key, entry in catalogue.items()}
    if name.lower() in folded:
        return folded[name.lower()]
    raise ConfigError(f"unknown model {name!r}: one of {', '.join(catalogue)} (`elmo pull --list` shows the table)")


def download(
    entry: Entry,
    cache: Path,
    pins: Pins,
    base_url: str | None = None,
    retries: int = 3,
    progress: bool = True,
    max_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
) -> list[Fetched]:
    """Every file of ``entry`` in ``cache/NAME/``, checked against its size and its published SHA-256, else its pin
    (recorded on first download), none longer than its known size or ``max_bytes``."""
    return [
        fetch(
            resolve_url(source.url, base_url),
            cache / entry.name / source.file,
            f"{entry.name}/{source.file}",
            pins,
            source.size,
            retries=retries,
            progress=progress,
            max_bytes=max_bytes,
            sha256=source.sha256,
        )
        for source in entry.files
    ]


# Python's zipfile guidance on decompression bombs: check what the archive declares before extracting anything.
# zipfile then stops each member at its declared size. ELMoForManyLangs' zips hold ~ 0.3-1 GB of float weights,
# which deflate barely compresses (ratio ~1.1; the .dic text files ~4).
MAX_EXTRACT_BYTES = 8 << 30  # all members together
MAX_MEMBER_BYTES = 4 << 30
MAX_RATIO = 100  # uncompressed / compressed, for members over RATIO_FROM bytes
RATIO_FROM = 1 << 20


def extract_zip(archive: Path, into: Path) -> Path:
    """Extract an ELMoForManyLangs zip into ``into`` (refusing absolute paths, ``..``, links and declared sizes
    past MAX_EXTRACT_BYTES / MAX_MEMBER_BYTES / MAX_RATIO) and return the model folder in it: the one folder that
    holds ``char.dic`` (the zip's top level, or one folder down)."""
    into.mkdir(parents=True, exist_ok=True)
    root = into.resolve()
    try:
        with zipfile.ZipFile(archive) as handle:
            for info in handle.infolist():
                target = (root / info.filename).resolve()
                if not target.is_relative_to(root) or (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise DataError(f"{archive}: unsafe entry {info.filename!r} (outside the folder, or a link)")
                _check_member_size(archive, info)
            total = sum(info.file_size for info in handle.infolist())
            if total > MAX_EXTRACT_BYTES:
                raise DataError(
                    f"{archive}: its members expand to {total:,} bytes, over the {MAX_EXTRACT_BYTES:,} "
                    "a model archive may: refused, nothing extracted"
                )
            handle.extractall(root)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError) as exc:
        raise DataError(f"{archive}: not a readable zip ({exc}); remove it to download it again") from None
    folders = sorted({p.parent for p in root.rglob("char.dic")}, key=lambda p: len(p.parts))
    if not folders:
        raise DataError(f"{archive}: no ELMoForManyLangs model folder inside (no char.dic)")
    return folders[0]


def _check_member_size(archive: Path, info: zipfile.ZipInfo) -> None:
    if info.file_size > MAX_MEMBER_BYTES:
        raise DataError(
            f"{archive}: member {info.filename!r} expands to {info.file_size:,} bytes, over the "
            f"{MAX_MEMBER_BYTES:,} one member may: refused, nothing extracted"
        )
    if info.file_size > RATIO_FROM and info.file_size > MAX_RATIO * max(info.compress_size, 1):
        ratio = info.file_size / max(info.compress_size, 1)
        raise DataError(
            f"{archive}: member {info.filename!r} expands {ratio:,.0f}-fold ({info.compress_size:,} -> "
            f"{info.file_size:,} bytes), over {MAX_RATIO}x: a decompression bomb, refused, nothing "
            "extracted"
        )


def build(
    entry: Entry,
    files: list[Fetched],
    pins: Pins,
    folder: Path,
    work: Path,
    threads: int | None,
    max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES,
) -> None:
    """Import ``files`` into the model directory ``folder``, export and verify it, and record the provenance."""
    try:
        with torch.no_grad():
            if entry.kind == ALLENNLP:
                options, weights = (f.path for f in files)
                import_allennlp(options, weights, folder, max_weight_bytes=max_weight_bytes)
            else:
                try:
                    import_manylangs(extract_zip(files[0].path, work), folder, max_weight_bytes)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    except ElmoError as exc:
        # Files first downloaded by this run that do not import are not what the publisher meant to serve: their
        # pins and the files go, so that a rerun does not verify against a bad pin forever.
        fresh = [f for f in files if f.pinned == "recorded"]
        for f in fresh:
            pins.forget(f.key)
            f.path.unlink(missing_ok=True)
        if not fresh:
            raise
        names = ", ".join(f.path.name for f in fresh)
        why = f"removed what this run downloaded first, {names}, and its new pins: a rerun downloads afresh"
        raise type(exc)(f"{exc} ({why})") from None
    card = folder / "README.md"
    if card.is_file():  # the importer titles the card with the folder's (temporary) name
        lines = card.read_text().splitlines()
        card.write_text("\n".join([f"# {entry.name}: {entry.title}", *lines[1:]]) + "\n")
    record = {
        "name": entry.name,
        "title": entry.title,
        "licence": entry.licence,
        "files": [{"file": f.path.name, "url": f.url, "sha256": f.sha256, "bytes": f.size} for f in files],
    }
    (folder / PULL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    log.info("%s imported; exporting and verifying", entry.name)
    export_model(folder, threads=threads)


def pull(
    name: str,
    out: Path | None = None,
    model_root: Path | None = None,
    repo_name: str | None = None,
    cache: Path | None = None,
    pins_path: Path | None = None,
    base_url: str | None = None,
    retries: int = 3,
    progress: bool = True,
    threads: int | None = None,
    catalogue: dict[str, Entry] | None = None,
    max_download_bytes: int = DEFAULT_MAX_DOWNLOAD_BYTES,
    max_weight_bytes: int = DEFAULT_MAX_WEIGHT_BYTES,
) -> dict:
    """Download, check, import, export and verify the model ``name`` into ``out`` or as the next version in the
    model repository ``model_root`` (under ``repo_name``, default ``name``). Returns the summary printed."""
    entry = lookup(name, catalogue)
    if (out is None) == (model_root is None):
        raise ConfigError("give exactly one of --out DIR (a model directory) and --model-root ROOT (a repository)")
    if model_root is not None:
        repo_name = check_model_name(repo_name or entry.name)
    else:
        out = Path(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {out}: already exists and is not empty; choose a new folder or remove it")
    cache = Path(cache) if cache is not None else default_cache()
    pins = Pins(Path(pins_path) if pins_path is not None else cache / PINS_FILE)
    files = download(entry, cache, pins, base_url, retries, progress, max_download_bytes)
    for f in files:
        how = "downloaded" if f.downloaded else "in the cache"
        log.info("%s: %s, %s bytes, sha256 %s (pin %s)", f.key, how, f"{f.size:,}", f.sha256, f.pinned)
    work = cache / entry.name / f".extract-{os.getpid()}-{secrets.token_hex(4)}"
    summary = {
        "name": entry.name,
        "licence": entry.licence,
        "files": {f.path.name: {"sha256": f.sha256, "bytes": f.size, "pin": f.pinned} for f in files},
    }
    if model_root is not None:
        with publishing(Path(model_root), repo_name) as publication:
            build(entry, files, pins, publication.folder, work, threads, max_weight_bytes)
        return {**summary, "out": str(publication.path), "model": repo_name, "version": publication.version}
    staging = out.parent / f".{out.name}.pulling-{os.getpid()}-{secrets.token_hex(4)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        build(entry, files, pins, staging, work, threads, max_weight_bytes)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**summary, "out": str(out)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "name",
        nargs="?",
        help="a published model: small, medium, original, 5.5B (AllenNLP, English) or an ELMoForManyLangs language "
        "code (zh, de, ...); --list shows them all",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="print the catalogue (names, files, sizes, which files are pinned by a published SHA-256, licences)",
    )
    parser.add_argument("--out", type=Path, default=None, help="the model directory to write (new or empty)")
    parser.add_argument(
        "--model-root",
        type=Path,
        default=None,
        metavar="ROOT",
        help="publish as the next version of NAME in this model repository instead (atomic)",
    )
    parser.add_argument(
        "--as",
        dest="repo_name",
        default=None,
        metavar="MODEL",
        help="with --model-root: the model's name in the repository (default: NAME)",
    )
    parser.add_argument(
        "--cache", type=Path, default=None, help=f"download cache (default ${CACHE_ENV}, else ~/.cache/elmo/pull)"
    )
    parser.add_argument(
        "--pins",
        type=Path,
        default=None,
        help=f"the pins file: sha256 + size per file, recorded on first download (default CACHE/{PINS_FILE})",
    )
    parser.add_argument(
        "--base-url",
        default=None,
        help=f"a mirror with the publishers' paths (default ${BASE_URL_ENV}, else the publishers' addresses)",
    )
    parser.add_argument("--retries", type=int, default=3, help="resume a broken transfer this many times in one run")
    parser.add_argument(
        "--max-download-bytes",
        type=int,
        default=DEFAULT_MAX_DOWNLOAD_BYTES,
        metavar="N",
        help="a file whose size neither the catalogue nor a pin gives is cut off and refused past N bytes "
        f"(default {DEFAULT_MAX_DOWNLOAD_BYTES:,}); a file of known size never past that size",
    )
    add_budget_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, default=None, help="torch / onnxruntime threads for the verification")


def run(args: argparse.Namespace) -> int:
    if args.list:
        sys.stdout.write(markdown_table())
        return 0
    if not args.name:
        raise ConfigError("name a model (`elmo pull --list` shows the catalogue), e.g. elmo pull small --out DIR")
    if args.retries < 0:
        raise ConfigError(f"--retries must be 0 or more (got {args.retries})")
    if args.max_download_bytes < 1:
        raise ConfigError(f"--max-download-bytes must be at least 1 (got {args.max_download_bytes})")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        summary = pull(
            args.name,
            out=args.out,
            model_root=args.model_root,
            repo_name=args.repo_name,
            cache=args.cache,
            pins_path=args.pins,
            base_url=args.base_url or os.environ.get(BASE_URL_ENV) or None,
            retries=args.retries,
            progress=not args.no_progress,
            threads=args.threads,
            max_download_bytes=args.max_download_bytes,
            max_weight_bytes=checked_budget(args),
        )
    except ModelFileError as exc:  # an import or export refusal: name the model it was pulling
        raise ModelFileError(f"{args.name}: {exc}") from None
    print(json.dumps(summary, ensure_ascii=False))
    return 0
