"""``elmo export --int8``: the biLSTM's weights in int8, judged by how close its vectors stay to float32.

What is quantized: every MatMul / Gemm of the context graphs whose weight is a constant (onnxruntime's dynamic
quantization, ``onnxruntime.quantization.quantize_dynamic``): the hoisted input projections and, inside each Scan
body, the recurrent and projection matrices, each weight column with its own scale (per channel, signed int8);
activations are quantized per call (per step inside the recurrence) to uint8. The char-CNN (encoder.onnx) stays
float32, so layer 0 is unchanged; so do the gates' non-linearities, the cell state and the clips. The fused layout
(for CUDA) keeps float32 where its weights are stacked inside the graph: int8 is a CPU option.

How it is judged (before the export is kept): per-token cosine similarity of each biLSTM layer to the float32
graphs of the same weights, on the verification sentences and on held-out text when given (``--heldout FILE``).
The bar: mean >= INT8_MEAN_COSINE for every layer and no token below INT8_MIN_COSINE. Measured on the shipped
default model (handbook text, held out of training): mean 0.99974 / 0.99962, min 0.9984 / 0.9971 for layers 1 / 2;
per-tensor scales 0.99955 / 0.99937, min 0.9958 (bench/int8.py has the figures with task scores and speed).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

INT8_MEAN_COSINE = 0.999  # the bar: a mean this close keeps task scores (bench/int8.py)
INT8_MIN_COSINE = 0.99  # and no single token far off (measured worst: 0.997 on real text)
QUANTIZED_OPS = ("MatMul", "Gemm")
QUANTIZATION = {  # what onnx.json records of an int8 export
    "method": "onnxruntime dynamic quantization (quantize_dynamic, EnableSubgraph)",
    "ops": list(QUANTIZED_OPS),
    "weights": "int8, symmetric, one scale per output column",
    "activations": "uint8, scale and zero point per call (per step inside the recurrence)",
    "float32": "encoder.onnx (char-CNN, layer 0), gate non-linearities, cell state, clips",
}

Sentences = list[list[str]]


def quantize_graph(graph: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` with its constant-weight MatMuls / Gemms in int8 (Scan bodies included); see the module doc."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="elmo-int8-") as scratch:
        source, target = Path(scratch) / "float32.onnx", Path(scratch) / "int8.onnx"
        onnx.save(graph, str(source))
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=list(QUANTIZED_OPS),
            per_channel=True,
            weight_type=QuantType.QInt8,
            extra_options={"EnableSubgraph": True},
        )
        quantized = onnx.load(str(target))
    quantized.ir_version = graph.ir_version
    return quantized


def count_ops(graph: onnx.GraphProto, counts: dict[str, int] | None = None) -> dict[str, int]:
    """Node count per op type, Scan bodies included."""
    counts = {} if counts is None else counts
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                count_ops(attribute.g, counts)
    return counts


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


@dataclass
class CosineReport:
    """How close the int8 vectors stay to float32, per layer (layer 0, the char-CNN, is float32 in both)."""

    mean: list[float]
    minimum: list[float]
    tokens: int
    sentences: int
    mean_bar: float = INT8_MEAN_COSINE
    min_bar: float = INT8_MIN_COSINE
    failures: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        finite = all(np.isfinite(self.mean)) and all(np.isfinite(self.minimum))
        return (
            finite
            and not self.failures
            and self.tokens > 0
            and min(self.mean) >= self.mean_bar
            and min(self.minimum) >= self.min_bar
        )

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        means = " / ".join(f"{m:.5f}" for m in self.mean[1:])
        minima = " / ".join(f"{m:.4f}" for m in self.minimum[1:])
        text = (
            f"{verdict}: int8 vs float32 per-token cosine over {self.tokens} tokens ({self.sentences} sentences), "
            f"biLSTM layers mean {means}, min {minima}; bar: mean >= {self.mean_bar}, min >= {self.min_bar}"
        )
        return text + "".join(f"; {failure}" for failure in self.failures)

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed, "summary": self.summary(), "reference": "float32 graphs"}


def compare_cosine(
    sentences: Sentences,
    int8: Callable[[Sentences], list[np.ndarray]],
    float32: Callable[[Sentences], list[np.ndarray]],
) -> CosineReport:
    """Both embedders on ``sentences``; the per-layer cosine figures."""
    failures: list[str] = []
    try:
        got, expected = int8(sentences), float32(sentences)
        cosines = token_cosines(got, expected)
    except Exception as exc:  # an onnxruntime failure is a verification failure, reported as such
        failures.append(f"raised {type(exc).__name__}: {exc}")
        cosines = np.zeros((1, 0))
    n = cosines.shape[1]
    return CosineReport(
        mean=[float(c.mean()) if n else float("nan") for c in cosines],
        minimum=[float(c.min()) if n else float("nan") for c in cosines],
        tokens=int(n),
        sentences=len(sentences),
        failures=tuple(failures),
    )


def verify_int8(model, directory: Path, threads: int = 1, heldout: Sentences = ()) -> CosineReport:
    """The int8 graphs written in ``directory`` (model.onnx alone, and the runtime with each context layout)
    against the PyTorch model in float32, on the verification sentences plus ``heldout``: one report, the worst
    figures of the three paths."""
    import onnxruntime as ort
    from elmo.export.verify import full_graph_embedder, torch_layers, verification_cases

    from elmo.runtime import CPU, Embedder
    from elmo.runtime.modeldir import ONNX_FILE
    from elmo.text.chars import load_char_scheme

    scheme = load_char_scheme(directory)
    sentences = [s for _, case in verification_cases() for s in case if s] + [s for s in heldout if s]
    single = model.float()

    def reference(batch: Sentences, chunk: int = 32) -> list[np.ndarray]:
        return [v for i in range(0, len(batch), chunk) for v in torch_layers(single, batch[i : i + chunk], scheme)]

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    whole = full_graph_embedder(ort.InferenceSession(str(directory / ONNX_FILE), options, providers=[CPU]), scheme)
    expected = reference(sentences)
    reports = [compare_cosine(sentences, lambda batch: [v for s in batch for v in whole([s])], lambda _: expected)]
    for layout in ("separate", "fused"):
        runtime = Embedder(directory, providers=[CPU], intra_op_threads=threads, cache_size=0, context_layout=layout)
        reports.append(compare_cosine(sentences, runtime.embed_tokens, lambda _: expected))
    labels = (ONNX_FILE, "runtime (separate)", "runtime (fused)")
    return CosineReport(
        mean=[min(values) for values in zip(*(r.mean for r in reports))],
        minimum=[min(values) for values in zip(*(r.minimum for r in reports))],
        tokens=reports[0].tokens,
        sentences=len(sentences),
        failures=tuple(f"{label}: {failure}" for label, r in zip(labels, reports) for failure in r.failures),
    )
