"""The model directory format: file names and the export metadata (onnx.json). Torch-free (serving path).

A model directory holds config.json (elmo.model.config), model.safetensors, vocab.txt, optionally a char vocabulary
(char_vocab.json, word_vocab.json: elmo.text.chars.VocabScheme, e.g. imported by elmo.importers.manylangs), and after
``elmo export`` model.onnx, encoder.onnx, context.onnx, context_fused.onnx, context_in_step.onnx (float exports;
older ones may lack it), context_s8.onnx (int8 exports), model.onnx.data (their shared weights) and onnx.json.
onnx.json describes the graphs (dims, layer count, char scheme, tokenizer, opset, the sha256 of the checkpoint it came
from, the verification result); :func:`read_onnx_metadata` checks it against config.json and the checkpoint so that
a stale or foreign export fails loudly, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elmo.errors import ConfigError, ModelFileError
from elmo.model.config import CONFIG_FILE, ModelConfig
from elmo.text.chars import MAX_CHARS, N_CHAR_IDS, ByteScheme, VocabScheme, load_char_scheme

WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.txt"
ONNX_FILE = "model.onnx"  # the whole model in one graph: char_ids (B, T, 50) -> layers (B, L+1, T, 2P), mask
ENCODER_FILE = "encoder.onnx"  # char-CNN: char_ids (N, 50) -> token vectors (N, P)
CONTEXT_FILE = "context.onnx"  # biLSTM: table (R, P), index (B, T+2), lengths (B,) -> layers (B, L+1, T, 2P)
CONTEXT_FUSED_FILE = "context_fused.onnx"  # the same, both directions per Scan step; for CUDA
CONTEXT_IN_STEP_FILE = "context_in_step.onnx"  # context.onnx with the upper layers' input product in each step
# An int8 export's context.onnx products as u8 x s8: the same integers (its uint8 weights and their zero points less
# 128), for CPUs whose u8 x s8 kernels accumulate in int32 (AVX-512 VNNI, AVX-VNNI, AMX-INT8), where onnxruntime's
# u8 x s8 kernels are faster than its u8 x u8 ones; elsewhere u8 x s8 saturates and context.onnx runs
# (docs/explanation/runtime.md).
CONTEXT_S8_FILE = "context_s8.onnx"
CONTEXT_S8_KEY = "context_s8"  # its key in onnx.json's "graphs"
# The context graph's layouts (export/context_graph.py): onnx.json's "graphs" key and the default file of each.
# "separate" is the CPU's, "fused" CUDA's; "in_step" is faster on CPU for wide batches (the batch job's: 1.1x at 64
# rows and more) but slower for a few rows, and float exports only have it.
CONTEXT_LAYOUTS = {
    "separate": ("context", CONTEXT_FILE),
    "fused": ("context_fused", CONTEXT_FUSED_FILE),
    "in_step": ("context_in_step", CONTEXT_IN_STEP_FILE),
}


def exported_layouts(directory: Path) -> list[str]:
    """The context layouts whose graph file ``directory`` holds (an export being verified: before onnx.json
    lists them)."""
    return [layout for layout, (_, file) in CONTEXT_LAYOUTS.items() if (directory / file).is_file()]


ONNX_DATA_FILE = "model.onnx.data"  # the graphs' weights, each tensor once
ONNX_META_FILE = "onnx.json"
FORMAT_VERSION = 2  # 2: context graphs take (table, index, lengths); 1 took (tokens, lengths)

MAX_META_BYTES = 16 << 20  # onnx.json: ~15 KB for a real export; a 200 MB one blocked the admin index for 2 s
_REQUIRED_META = ("format_version", "graph", "n_layers", "dim", "projection_dim", "cell_dim", "char_scheme", "dtype")


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def member_file(directory: Path, name: object, what: str, must_exist: bool = True) -> Path:
    """``directory / name`` for a file ``onnx.json`` names, checked: a plain name inside the folder (no path, no
    ``..``), not a symlink (it could point anywhere on the host), a regular file. ModelFileError names it."""
    where = directory / ONNX_META_FILE
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ModelFileError(f"{where}: {what} {name!r} must be a plain file name inside {directory}")
    path = directory / name
    if path.is_symlink():
        raise ModelFileError(f"{path}: {what} is a symlink: refused (a model's files must be its own, not links)")
    if path.exists() and not path.is_file():
        raise ModelFileError(f"{path}: {what} is not a regular file")
    if must_exist and not path.is_file():
        raise ModelFileError(f"{path}: {what} is missing (re-run `elmo export`)")
    return path


OUTSIDE_RULE = 'docs/how-to/models.md, "Paths that leave their folder"'
_log = logging.getLogger(__name__)
_said_outside: set[tuple[Path, Path]] = set()  # (path, where it leads): each said once per process
_said_lock = threading.Lock()


def outside_target(folder: Path, path: Path) -> Path | None:
    """Where ``path``, found in ``folder``, really is when that is outside ``folder`` (through a symlink, a ``..``
    or an absolute path); None when it stays inside, or does not exist."""
    try:
        real = Path(folder, path).resolve(strict=True)
        inside = real.is_relative_to(Path(folder).resolve())
    except (OSError, RuntimeError):  # missing, unreadable, a symlink loop: the caller's own check names it
        return None
    return None if inside else real


def note_if_outside(folder: Path, path: Path, what: str) -> Path | None:
    """The one rule for a model path found inside a folder (a repository's model and version folders, a model's
    task folders, a spaCy pipeline's model): a path that leads outside the folder is still used (a symlinked version
    published on purpose, a pipeline saved by reference), and one WARNING per process names it and where it leads.
    Returns that outside place, or None when the path stays inside."""
    real = outside_target(folder, path)
    if real is None:
        return None
    shown = Path(folder, path)
    with _said_lock:
        if (shown, real) in _said_outside:
            return real
        _said_outside.add((shown, real))
    _log.warning("%s %s leads outside %s, to %s: loaded from there (%s)", what, shown, folder, real, OUTSIDE_RULE)
    return real


def model_directory(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ModelFileError(f"{directory}: model directory not found")
    return directory


def read_onnx_metadata(model_dir: str | Path, check_checkpoint: bool = True) -> dict:
    """Read ``onnx.json`` and check it against ``config.json`` (and the checkpoint's sha256 when both exist).

    Raises ModelFileError naming the file for a missing, unreadable or inconsistent file.
    """
    directory = model_directory(model_dir)
    path = directory / ONNX_META_FILE
    if not path.is_file():
        raise ModelFileError(f"{path}: export metadata not found (run `elmo export --model {directory}`)")
    if path.stat().st_size > MAX_META_BYTES:
        raise ModelFileError(
            f"{path}: {path.stat().st_size:,} bytes, over the {MAX_META_BYTES:,} an export's "
            "metadata may have: refused unread"
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    missing = [key for key in _REQUIRED_META if key not in meta]
    if missing:
        raise ModelFileError(f"{path}: missing field(s) {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ModelFileError(
            f"{path}: format_version {meta['format_version']!r}, this runtime reads {FORMAT_VERSION}: export the "
            f"model again (elmo export --model {path.parent})"
        )
    scheme = meta["char_scheme"]
    if not isinstance(scheme, dict):
        raise ModelFileError(f"{path}: field char_scheme must be an object")
    if scheme.get("name", "elmo") == "elmo":
        if scheme.get("max_chars") != MAX_CHARS or scheme.get("n_chars") != N_CHAR_IDS:
            raise ModelFileError(f"{path}: char scheme {scheme} differs from this code's ({MAX_CHARS} x {N_CHAR_IDS})")
    elif scheme.get("name") != "vocab":
        raise ModelFileError(f"{path}: unknown char scheme {scheme.get('name')!r} (this runtime reads 'elmo', 'vocab')")
    # The checkpoint is hashed on a thread of its own while this one hashes the graphs' weight file: hashlib gives
    # up the GIL for each block, so a load reads the two (55 MB each for the ELMo-small shape) in the time of one.
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-sha256") as pool:
        wanted = check_checkpoint and meta.get("checkpoint_sha256")
        checkpoint = pool.submit(_checkpoint_sha256, directory) if wanted else None
        _check_against_config(directory, path, meta)
        _check_weights_data(directory, path, meta)
        if checkpoint is not None:
            _check_against_checkpoint(path, meta, checkpoint.result())
    return meta


def _check_against_config(directory: Path, meta_path: Path, meta: dict) -> None:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        return  # an export-only directory: onnx.json carries the dims itself
    try:
        cfg = ModelConfig.load(config_path)
    except ConfigError as exc:
        raise ModelFileError(str(exc)) from None
    expected = {
        "n_layers": cfg.n_output_layers,
        "dim": cfg.output_dim,
        "projection_dim": cfg.projection_dim,
        "cell_dim": cfg.cell_dim,
    }
    wrong = {key: (meta[key], value) for key, value in expected.items() if meta[key] != value}
    if wrong:
        details = ", ".join(f"{key}: {got} vs {want}" for key, (got, want) in wrong.items())
        raise ModelFileError(f"{meta_path}: does not match {config_path} ({details}); re-run `elmo export`")


def _check_weights_data(directory: Path, meta_path: Path, meta: dict) -> None:
    """The graphs' weight file must be the one exported with them (a truncated or swapped file would otherwise
    load and give wrong vectors, or fail with an onnxruntime message that does not name it)."""
    expected = meta.get("weights_data")
    if not expected:
        return
    if not isinstance(expected, dict) or not {"file", "bytes", "sha256"} <= set(expected):
        raise ModelFileError(f"{meta_path}: field weights_data must be {{file, bytes, sha256}} (re-run `elmo export`)")
    data = member_file(directory, expected["file"], "the graphs' weight file", must_exist=False)
    if not data.is_file():
        raise ModelFileError(f"{data}: the graphs' weight file is missing (re-run `elmo export`)")
    size = data.stat().st_size
    if size != expected["bytes"]:
        raise ModelFileError(f"{data}: {size} bytes, {meta_path.name} says {expected['bytes']} (truncated or replaced)")
    if sha256_of(data) != expected["sha256"]:
        raise ModelFileError(f"{data}: sha256 differs from {meta_path.name} (corrupted or replaced)")


def _checkpoint_sha256(directory: Path) -> str | None:
    weights = directory / WEIGHTS_FILE
    return sha256_of(weights) if weights.is_file() else None


def _check_against_checkpoint(meta_path: Path, meta: dict, checkpoint_sha256: str | None) -> None:
    expected = meta.get("checkpoint_sha256")
    if not expected or checkpoint_sha256 is None:
        return
    if checkpoint_sha256 != expected:
        raise ModelFileError(
            f"{meta_path}: exported from a different {WEIGHTS_FILE} (sha256 differs); re-run `elmo export`"
        )


def char_scheme_of(model_dir: str | Path, meta: dict) -> ByteScheme | VocabScheme:
    """The model directory's char scheme (elmo.text.chars.load_char_scheme), checked against onnx.json: the same
    scheme, row width and table sizes, and for a char vocabulary the very files the graphs were exported with."""
    directory = model_directory(model_dir)
    meta_path = directory / ONNX_META_FILE
    scheme = load_char_scheme(directory)
    declared = meta["char_scheme"]
    fields = {"name": scheme.name, "max_chars": scheme.max_chars, "n_chars": scheme.n_chars}
    if scheme.name == "vocab":
        fields |= {"width": scheme.width, "n_words": scheme.n_words}
    wrong = {key: (declared.get(key, "elmo" if key == "name" else None), want) for key, want in fields.items()}
    wrong = {key: pair for key, pair in wrong.items() if pair[0] != pair[1]}
    if wrong:
        details = ", ".join(
            f"{key}: {got!r} in onnx.json vs {want!r} in the folder" for key, (got, want) in wrong.items()
        )
        raise ModelFileError(f"{meta_path}: char scheme does not match the model directory's ({details})")
    for file, digest in (declared.get("sha256") or {}).items():
        if not (directory / file).is_file() or sha256_of(directory / file) != digest:
            raise ModelFileError(f"{directory / file}: missing or not the file the graphs were exported with")
    return scheme
