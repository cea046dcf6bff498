"""The load-time check: nothing is served that was not judged on the machine that serves it. Torch-free.

An export is verified once, on the exporting machine (export/verify.py, export/quantize.py). The graphs then travel:
a model repository is built on one host and served on others, whose CPU may choose other kernels (an int8 graph
judged on a VNNI CPU saturates on AVX2 without VNNI), whose onnxruntime build or provider may differ, whose copy of
a graph may have been edited or corrupted. So every export stores a probe (written by export/probe.py):

- in ``onnx.json`` -> ``probe``: the probe's sentences, the reference it was made against, the bar and the figures
  the export reached, and its file's size and sha256;
- in ``probe.bin``: the reference vectors, float32 little-endian, ``(n_layers, total tokens, dim)``, the sentences'
  tokens one after the other.

:func:`check_probe` runs those sentences through the runtime exactly as it serves (the same sessions, provider and
context layout) and judges the answers against the export's own bar: a float32 / fp16 export by the max abs error
to the float64 reference against the bound the export verification gave that case, an int8 export by its
per-token cosine to float32 (mean and min of every layer). One log line names the host's CPU features, the figures
and the bar; a miss raises ModelFileError and the model is not served.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from elmo.errors import ModelFileError
from elmo.runtime.host import host_summary
from elmo.runtime.modeldir import ONNX_META_FILE, member_file

log = logging.getLogger("elmo.runtime")

PROBE_FILE = "probe.bin"
MAX_ABS = "max_abs"  # float32, fp16: max |served - float64 reference| <= the export's bound for the probe
COSINE = "cosine"  # int8: per-token cosine to the float32 reference, mean and min of every layer over their bars
MAX_PROBE_BYTES = 64 << 20  # far above any real probe (ELMo-original shape: ~0.5 MB); checked before reading


@dataclass(frozen=True)
class Probe:
    """A model directory's stored probe (onnx.json -> probe, and probe.bin)."""

    sentences: list[list[str]]
    reference: np.ndarray  # (n_layers, total tokens, dim) float32
    kind: str  # MAX_ABS | COSINE
    bar: dict  # MAX_ABS: {"max_abs_error": b}; COSINE: {"mean": m, "min": n}
    describes: str  # what the reference is ("PyTorch float64", "float32 graphs")

    def split(self) -> list[np.ndarray]:
        """The reference per sentence, (n_layers, n_i, dim) each."""
        ends = np.cumsum([len(s) for s in self.sentences])[:-1]
        return np.split(self.reference, ends, axis=1)


@dataclass(frozen=True)
class ProbeResult:
    passed: bool
    figures: str
    bar: str

    def line(self, where: Path) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return f"load-time check of {where} on {host_summary()}: {verdict}: {self.figures}; bar: {self.bar}"


# -- reading ------------------------------------------------------------------------------------------------------
def read_probe(directory: Path, meta: dict) -> Probe:
    """The probe ``onnx.json`` declares, its file checked (name inside the folder, size, sha256) before use."""
    where = directory / ONNX_META_FILE
    spec = meta.get("probe")
    if not isinstance(spec, dict):
        raise ModelFileError(
            f"{where}: no load-time probe (exported before this runtime's check existed): re-run "
            f"`elmo export --model {directory}` so that it can be judged on the machine that serves it"
        )
    try:
        sentences = [[str(token) for token in sentence] for sentence in spec["sentences"]]
        shape = tuple(int(n) for n in spec["shape"])
        kind, bar, describes = str(spec["kind"]), dict(spec["bar"]), str(spec["reference"])
        name, size, digest = str(spec["file"]), int(spec["bytes"]), str(spec["sha256"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"{where}: field probe is malformed ({type(exc).__name__}: {exc})") from None
    if kind not in (MAX_ABS, COSINE) or len(shape) != 3 or shape[1] != sum(len(s) for s in sentences):
        raise ModelFileError(f"{where}: field probe: kind {kind!r} / shape {shape} do not match its sentences")
    keys = ("max_abs_error",) if kind == MAX_ABS else ("mean", "min")
    if not all(isinstance(bar.get(key), int | float) and np.isfinite(bar[key]) for key in keys):
        raise ModelFileError(f"{where}: field probe: a {kind} probe's bar needs finite {', '.join(keys)} (got {bar})")
    path = member_file(directory, name, "probe file", must_exist=False)
    expected = int(np.prod(shape)) * 4
    if size != expected or size > MAX_PROBE_BYTES:
        raise ModelFileError(f"{where}: probe of shape {shape} declares {size} bytes ({expected} expected)")
    if not path.is_file() or path.stat().st_size != size:
        raise ModelFileError(f"{path}: missing or not {size} bytes (re-run `elmo export`)")
    raw = path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != digest:
        raise ModelFileError(f"{path}: sha256 differs from {where.name} (corrupted or replaced)")
    reference = np.frombuffer(raw, dtype="<f4").reshape(shape).astype(np.float32)
    return Probe(sentences, reference, kind, bar, describes)


# -- judging ------------------------------------------------------------------------------------------------------
def token_cosines(got: Sequence[np.ndarray], expected: Sequence[np.ndarray]) -> np.ndarray:
    """Per-token cosine of each layer: sentences of (L+1, n, D) -> (L+1, total tokens). A zero vector against a
    zero vector counts as 1 (padding-free outputs have none; a zero against a non-zero vector counts as 0)."""
    parts = []
    for g, e in zip(got, expected):
        if not e.size:
            continue
        g, e = g.astype(np.float64), e.astype(np.float64)
        g_norm, e_norm = np.linalg.norm(g, axis=-1), np.linalg.norm(e, axis=-1)
        norms = g_norm * e_norm
        dots = np.sum(g * e, axis=-1)
        parts.append(np.where((g_norm == 0) & (e_norm == 0), 1.0, dots / np.where(norms > 0, norms, 1.0)))
    return np.concatenate(parts, axis=1)


def judge(probe: Probe, got: Sequence[np.ndarray]) -> ProbeResult:
    """The served vectors of the probe's sentences against its reference and bar."""
    expected = probe.split()
    shapes = [g.shape for g in got]
    if shapes != [e.shape for e in expected]:
        return ProbeResult(False, f"output shapes {shapes}, the probe has {[e.shape for e in expected]}", "shapes")
    finite = sum(int(np.count_nonzero(np.isfinite(g))) for g in got)
    total = sum(g.size for g in got)
    if finite != total:  # broken weights (NaN in a table) or a broken kernel: no distance means anything
        return ProbeResult(
            False,
            f"{total - finite} non-finite values (NaN or inf) of {total} in the probe's vectors",
            "finite vectors, then the export's",
        )
    if probe.kind == MAX_ABS:
        error = max(float(np.max(np.abs(g.astype(np.float64) - e))) for g, e in zip(got, expected) if e.size)
        bound = float(probe.bar["max_abs_error"])
        figures = f"max abs error {error:.2e} to {probe.describes} over {probe.reference.shape[1]} tokens"
        return ProbeResult(bool(error <= bound), figures, f"<= {bound:.2e} (the export's bound for the probe)")
    cosines = token_cosines(got, expected)
    means, minima = cosines.mean(axis=1), cosines.min(axis=1)
    mean_bar, min_bar = float(probe.bar["mean"]), float(probe.bar["min"])
    passed = bool(np.all(np.isfinite(cosines)) and means.min() >= mean_bar and minima.min() >= min_bar)
    figures = (
        f"per-token cosine to {probe.describes} over {cosines.shape[1]} tokens, layers mean "
        f"{' / '.join(f'{m:.5f}' for m in means)}, min {' / '.join(f'{m:.4f}' for m in minima)}"
    )
    return ProbeResult(passed, figures, f"mean >= {mean_bar}, min >= {min_bar} (the export's)")


def check_probe(directory: Path, probe: Probe, embed: Callable[[list[list[str]]], list[np.ndarray]]) -> ProbeResult:
    """Run the probe through ``embed`` (the runtime as it serves): one log line when it passes, ModelFileError
    carrying that line when it misses."""
    try:
        result = judge(probe, embed(probe.sentences))
    except Exception as exc:  # noqa: BLE001 - an onnxruntime failure on the probe is a failed check, said as such
        result = ProbeResult(False, f"the probe raised {type(exc).__name__}: {exc}", "answers at all")
    line = result.line(directory)
    if not result.passed:  # the one line is the error's: whoever refuses the model (the server, a repository) says it
        raise ModelFileError(f"{line}: this host's answers differ from those judged at export; not serving it")
    log.info("%s", line)
    return result
