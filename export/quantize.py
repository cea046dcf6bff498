"""``elmo export --int8``: the biLSTM's weights in 8 bits, judged by how close its vectors stay to float32.

What is quantized: every MatMul / Gemm of the context graphs whose weight is a constant (onnxruntime's dynamic
quantization, ``onnxruntime.quantization.quantize_dynamic``): the hoisted input projections and, inside each Scan
body, the recurrent and projection matrices, each weight column with its own scale (per channel; uint8 weights by
default, see SCHEMES for why); activations are quantized per call (per step inside the recurrence) to uint8. The
char-CNN (encoder.onnx) stays float32, so layer 0 is unchanged; so do the gates' non-linearities, the cell state and
the clips. The fused layout (for CUDA) keeps float32 where its weights are stacked inside the graph: int8 is a CPU
option.

How it is judged (before the export is kept): per-token cosine similarity of each biLSTM layer to the float32
graphs of the same weights, on the verification sentences and on held-out text when given (``--heldout FILE``).
The bar: mean >= INT8_MEAN_COSINE for every layer and no token below INT8_MIN_COSINE. The export stores a probe
(export/probe.py) judged by the same bar on every host that loads it (elmo.runtime.probe). Measured figures per
scheme and CPU: docs/explanation/runtime.md, ``python -m bench.export.int8 --schemes ...``.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from elmo.runtime.probe import token_cosines

INT8_MEAN_COSINE = 0.999  # a mean this close keeps task scores (bench/export/int8.py)
INT8_MIN_COSINE = 0.99  # and no single token far off (measured worst: 0.997 on real text)
QUANTIZED_OPS = ("MatMul", "Gemm")
QUANTIZATION = {  # what onnx.json records of every int8 export; quantization_record adds the weights' scheme
    "method": "onnxruntime dynamic quantization (quantize_dynamic, EnableSubgraph)",
    "ops": list(QUANTIZED_OPS),
    "activations": "uint8, scale and zero point per call (per step inside the recurrence)",
    "float32": "encoder.onnx (char-CNN, layer 0), gate non-linearities, cell state, clips",
}

Sentences = list[list[str]]


# onnxruntime's dynamic quantization takes activations as uint8; the weights' type picks the CPU kernel (MLAS).
# u8 x s8 on AVX2 without VNNI multiplies with VPMADDUBSW, which adds two u8 x s8 products into a *saturating* int16:
# large activations against large weights clip, and the biLSTM's recurrence carries the error along (measured on an
# AMD EPYC with AVX2, no VNNI: layer cosine to float32 mean 0.995 / 0.993, min 0.91 on the shipped model). VNNI and
# AMX accumulate into int32 and do not saturate, so the same file is right on one CPU and wrong on another. Either
# of onnxruntime's documented remedies keeps every kernel exact: 7-bit weights (reduce_range: two products stay
# under 2^15) or u8 weights (u8 x u8 kernels widen to int16 before multiplying: no saturating step on any ISA).
# The integer results are then the same on every x86-64 CPU; bench/export/int8.py --schemes measures all three.
SCHEMES: dict[str, dict] = {
    "u8u8": {"weight_type": "QUInt8", "reduce_range": False},
    "u8s8": {"weight_type": "QInt8", "reduce_range": False},
    "u8s8-reduce-range": {"weight_type": "QInt8", "reduce_range": True},
}
DEFAULT_SCHEME = "u8u8"


def quantization_record(scheme: str = DEFAULT_SCHEME) -> dict:
    """What onnx.json records of an int8 export (``quantization``)."""
    options = SCHEMES[scheme]
    weights = "uint8, asymmetric" if options["weight_type"] == "QUInt8" else "int8, symmetric"
    bits = ", 7 bits (reduce_range)" if options["reduce_range"] else ""
    return {**QUANTIZATION, "scheme": scheme, "weights": f"{weights}{bits}, one scale per output column"}


@contextlib.contextmanager
def _without_preprocessing_advice():
    """quantize_dynamic logs "Please consider to run pre-processing before quantization" on the root logger for
    every graph: its pre-processing (shape inference, graph optimisation) is for traced graphs; the context graphs are
    built by hand with their shapes declared, so the advice is nothing a user can act on. Only that record, only
    around the call."""

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider to run pre-processing")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def quantize_graph(graph: onnx.ModelProto, scheme: str = DEFAULT_SCHEME) -> onnx.ModelProto:
    """``graph`` with its constant-weight MatMuls / Gemms in 8 bits (Scan bodies included); see the module doc and
    SCHEMES."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    options = SCHEMES[scheme]
    with tempfile.TemporaryDirectory(prefix="elmo-int8-") as scratch, _without_preprocessing_advice():
        source, target = Path(scratch) / "float32.onnx", Path(scratch) / "int8.onnx"
        onnx.save(graph, str(source))
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=list(QUANTIZED_OPS),
            per_channel=True,
            reduce_range=options["reduce_range"],
            weight_type=getattr(QuantType, options["weight_type"]),
            extra_options={"EnableSubgraph": True},
        )
        quantized = onnx.load(str(target))
    quantized.ir_version = graph.ir_version
    return quantized


def as_signed_weights(graph: onnx.ModelProto) -> onnx.ModelProto:
    """A u8-weight graph (scheme u8u8) as u8 x s8: every uint8 weight of a MatMulInteger and its zero point less 128
    (Scan bodies included), a copy. (a - a0)(w - w0) = (a - a0)((w - 128) - (w0 - 128)): the same integer products,
    so the same vectors where onnxruntime's u8 x s8 kernels accumulate in int32 (VNNI, AMX), which are faster than
    its u8 x u8 ones; on AVX2 without VNNI they saturate (the reason for u8 weights), so the runtime picks this form
    only where the CPU accumulates in int32 (elmo.runtime.host.int8_accumulates_in_int32)."""
    signed = onnx.ModelProto()
    signed.CopyFrom(graph)
    for tensor in integer_weights(signed.graph):
        if tensor.data_type == onnx.TensorProto.UINT8:
            shifted = numpy_helper.to_array(tensor).astype(np.int16) - 128
            tensor.CopyFrom(numpy_helper.from_array(shifted.astype(np.int8), tensor.name))
    return signed


def integer_weights(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """The constant operands a MatMulInteger multiplies by, Scan bodies included: its weight B and B's zero point
    (inputs 1 and 3; A and its zero point are the activations, quantized per call)."""
    constants = {tensor.name: tensor for tensor in graph.initializer}
    for node in graph.node:
        if node.op_type == "MatMulInteger":
            yield from (constants[name] for name in node.input[1:2] + node.input[3:4] if name in constants)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from integer_weights(attribute.g)


def count_ops(graph: onnx.GraphProto, counts: dict[str, int] | None = None) -> dict[str, int]:
    """Node count per op type, Scan bodies included."""
    counts = {} if counts is None else counts
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                count_ops(attribute.g, counts)
    return counts


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
    """The int8 graphs written in ``directory`` (model.onnx alone, and the runtime with each context layout, and
    with context_s8.onnx where this CPU's int8 kernels accumulate in int32: elsewhere the load-time probe judges it
    on the hosts that pick it) against the PyTorch model in float32, on the verification sentences plus
    ``heldout``: one report, the worst figures of the paths."""
    import onnxruntime as ort
    from elmo.export.verify import full_graph_embedder, torch_layers, verification_cases

    from elmo.runtime import CPU, Embedder
    from elmo.runtime.host import int8_accumulates_in_int32
    from elmo.runtime.modeldir import CONTEXT_S8_FILE, ONNX_FILE
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
    runs = {"runtime (separate)": ("separate", False), "runtime (fused)": ("fused", None)}
    if (directory / CONTEXT_S8_FILE).is_file() and int8_accumulates_in_int32():  # else it would saturate here
        runs["runtime (separate, u8 x s8)"] = ("separate", True)
    for layout, signed in runs.values():
        runtime = Embedder(
            directory,
            providers=[CPU],
            intra_op_threads=threads,
            cache_size=0,
            context_layout=layout,
            signed_int8=signed,
            check_on_load=False,  # judged here on all the sentences; the probe runs once the export has passed
        )
        reports.append(compare_cosine(sentences, runtime.embed_tokens, lambda _: expected))
    labels = (ONNX_FILE, *runs)
    return CosineReport(
        mean=[min(values) for values in zip(*(r.mean for r in reports))],
        minimum=[min(values) for values in zip(*(r.minimum for r in reports))],
        tokens=reports[0].tokens,
        sentences=len(sentences),
        failures=tuple(f"{label}: {failure}" for label, r in zip(labels, reports) for failure in r.failures),
    )
