"""``elmo export``: a model directory (config.json + model.safetensors) -> ONNX graphs + onnx.json, verified.

Writes model.onnx (the whole model in one graph), encoder.onnx and context.onnx (the runtime's two halves, see
export/graphs.py and export/context_graph.py), their weights in model.onnx.data (each distinct tensor once), and
onnx.json (dims, layer count, char scheme, tokenizer settings, opset, checkpoint sha256, verification result).
Everything is written into a staging folder first, verified against PyTorch on inputs the tracer never saw, and
moved into place only when the verification passes; a failed verification raises ModelFileError.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import torch
from elmo.export.context_graph import build_context_graph
from elmo.export.graphs import EncoderGraph, PrefixGraph
from elmo.export.probe import at_export, write_probe
from elmo.export.quantize import (
    DEFAULT_SCHEME,
    SCHEMES,
    as_signed_weights,
    quantization_record,
    quantize_graph,
    verify_int8,
)
from elmo.export.verify import ErrorBound, verify_export
from onnx import numpy_helper

import elmo.model.bilm as elmo_model
from elmo.errors import ConfigError, InputError, ModelFileError
from elmo.model.checkpoint import load_model
from elmo.model.config import CONFIG_FILE, ModelConfig
from elmo.runtime.modeldir import (
    CONTEXT_FILE,
    CONTEXT_FUSED_FILE,
    CONTEXT_IN_STEP_FILE,
    CONTEXT_LAYOUTS,
    CONTEXT_S8_FILE,
    CONTEXT_S8_KEY,
    ENCODER_FILE,
    FORMAT_VERSION,
    ONNX_DATA_FILE,
    ONNX_FILE,
    ONNX_META_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
    sha256_of,
)
from elmo.runtime.probe import PROBE_FILE
from elmo.runtime.repository import readable_by_all
from elmo.runtime.tasks import TASKS_DIR
from elmo.text.chars import BYTES, ByteScheme, VocabScheme, load_char_scheme
from elmo.text.tokenize import TOKENIZER_SETTINGS

log = logging.getLogger("elmo.export")

OPSET = 17
# float32: a graph may be as far from float64 as float32 itself is on the same case (the worst of five roundings of
# the weights, export/verify.py), times a margin for another summation order and approximate tanh / sigmoid
# (onnxruntime measured 0.3-3.1x PyTorch's error on random published-size weights), or
# 1e-6 of the outputs' scale (float32 keeps ~7 digits; the recurrence loses about one). A dropped clip or two
# swapped gates miss by 1e-2 and more (tests/export/test_onnx_export.py), so the margin hides no real discrepancy.
FP32_BOUND = ErrorBound(floor=1e-5, float32_factor=10.0, relative=1e-6)
# fp16 keeps 11 significant bits: one rounding is off by at most 2^-11 (4.9e-4) of the value, and the error of a
# whole fp16 graph measured about one such unit of the outputs' scale (onnx.json, max abs error / max |output| per
# case: tiny test model 2.8-4.2e-4, the trained tiny test LM up to 5.1e-4, ELMo-small shape with PyTorch's
# initialisation 2.8-4.9e-4, the shipped default model 1.9-4.4e-4 with |output| up to 20 and errors up to 7.6e-3).
# The bound is 4 units (2^-9 = 1.95e-3) of the larger of 1 and max |output|: 1 because inside the recurrence the
# gates and tanh live on [-1, 1] whatever the outputs' scale. That is a 3.9x margin over the worst case measured,
# while clip limits 5 % too wide miss by 5e-3 x max |output| and more, dropped clips by 5e-2 x max |output|
# (tests/export/test_fp16.py); the flat 0.1 used before let the 5 % slip through. A model whose recurrence amplifies
# rounding (float32 itself 1e-5 or more from float64) is refused in fp16 past a few dozen tokens: correctly, its
# fp16 vectors drift (random ELMo-small weights at bilm-tf scales: 1.7e-2 at 50 tokens, 1.0 at 400).
FP16_RELATIVE = 2.0**-9
FP16_BOUND = ErrorBound(floor=FP16_RELATIVE, relative=FP16_RELATIVE)


def export_bound(fp16: bool, max_error: float | None = None) -> ErrorBound:
    """The verification bound of a float32 or fp16 graph, or the user's absolute ``max_error`` in its place."""
    return replace(FP16_BOUND if fp16 else FP32_BOUND, override=max_error)


FP16_MAX = float(np.finfo(np.float16).max)
# Tensors at least this big go to the shared data file; small ones stay inline.
EXTERNAL_THRESHOLD = 1024
STAGING = ".export-staging"
# all it may write
GRAPH_FILES = (ONNX_FILE, ENCODER_FILE, CONTEXT_FILE, CONTEXT_FUSED_FILE, CONTEXT_IN_STEP_FILE, CONTEXT_S8_FILE)


def load_bilm(model_dir: Path) -> elmo_model.BiLM:
    """A model directory -> BiLM in eval mode, float32 (fp16-stored weights are widened by load_model)."""
    return load_model(model_dir).float().eval()


# -- building the graphs ------------------------------------------------------------------------------------------
def _trace(module: torch.nn.Module, args: tuple, path: Path, inputs: dict, outputs: dict) -> onnx.ModelProto:
    """Trace ``module`` to ONNX (legacy exporter: the dynamo exporter fixes the token axis silently) and load it.
    ``inputs`` / ``outputs``: name -> {axis: symbolic name} for the dynamic axes."""
    # The tracer warns that torch.as_tensor(BOS_IDS / EOS_IDS) becomes a constant of the trace "which might cause the
    # trace to be incorrect": they are constants (the byte scheme's boundary ids), and every export is verified
    # numerically against PyTorch float64 on inputs the tracer never saw before it is moved into place, so a wrong
    # trace cannot pass unnoticed. Only that category, only around this call; every other warning still shows.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=list(inputs),
            output_names=list(outputs),
            dynamic_axes={**inputs, **outputs},
        )
    graph = onnx.load(str(path))
    path.unlink()
    return graph


def model_char_scheme(model_dir: Path, model: elmo_model.BiLM) -> ByteScheme | VocabScheme:
    """The model directory's char scheme (elmo.text.chars.load_char_scheme), checked against the model: the same
    scheme and row width, ids inside the embedding tables, the same sentence-boundary rows."""
    scheme = load_char_scheme(model_dir)
    cfg = model.cfg
    where = f"{model_dir / CONFIG_FILE}"
    if scheme.name != cfg.char_scheme or scheme.width != cfg.token_width:
        raise ModelFileError(
            f"{where}: char_scheme '{cfg.char_scheme}' (rows of {cfg.token_width} ids) does not match the model "
            f"directory's char scheme '{scheme.name}' (rows of {scheme.width}; files {list(scheme.files)})"
        )
    if scheme.n_chars > cfg.n_chars or scheme.n_words > cfg.n_words:
        raise ModelFileError(f"{where}: the char/word vocabulary has ids past the model's tables (n_chars, n_words)")
    if isinstance(scheme, VocabScheme):
        rows = np.stack([scheme.bos_ids, scheme.eos_ids]).astype(np.int64)
        if not np.array_equal(model.encoder.boundary_ids.numpy(), rows):
            raise ModelFileError(f"{model_dir / WEIGHTS_FILE}: encoder.boundary_ids differ from the char vocabulary's")
    return scheme


def build_graphs(
    model: elmo_model.BiLM,
    scratch: Path,
    scheme: ByteScheme | VocabScheme | None = None,
    int8: bool = False,
    quantization: str = DEFAULT_SCHEME,
) -> dict[str, onnx.ModelProto]:
    """The graphs (file name -> ModelProto, weights inline). The char-CNN parts are traced (sample of several
    lengths; verification uses others), the biLSTM is built by hand (export/context_graph.py); ``int8``: the
    biLSTM's weights quantized (export/quantize.py, ``quantization``: one of its SCHEMES), in model.onnx too."""
    scheme = scheme or BYTES
    char_ids = torch.as_tensor(scheme.batch([["a", "bc", "def"], ["ghij", "k"]])).long()
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    context = build_context_graph(state, model.cfg)
    context_fused = build_context_graph(state, model.cfg, fuse_directions=True)
    if int8:
        context, context_fused = (quantize_graph(graph, quantization) for graph in (context, context_fused))
    contexts = {CONTEXT_FILE: context, CONTEXT_FUSED_FILE: context_fused}
    if int8 and SCHEMES[quantization]["weight_type"] == "QUInt8":  # the same products for VNNI / AMX CPUs
        contexts[CONTEXT_S8_FILE] = as_signed_weights(context)
    if not int8:  # the batch job's CPU graph; its step weights are joined at load, where quantization cannot see
        contexts[CONTEXT_IN_STEP_FILE] = build_context_graph(state, model.cfg, inputs_in_step=True)
    # A trimmable scheme's rows may arrive cut short (the runtime's char trim): the id axis is symbolic then.
    char_axes = {0: "n_tokens", 1: "n_chars"} if scheme.trimmable else {0: "n_tokens"}
    encoder = _trace(
        EncoderGraph(model),
        (char_ids[0],),
        scratch / ENCODER_FILE,
        {"char_ids": char_axes},
        {"token_vectors": {0: "n_tokens"}},
    )
    prefix = _trace(
        PrefixGraph(model),
        (char_ids,),
        scratch / "prefix.onnx",
        {"char_ids": {0: "batch", 1: "tokens"}},
        {
            "table": {0: "rows"},
            "index": {0: "batch", 1: "steps"},
            "lengths": {0: "batch"},
            "mask": {0: "batch", 1: "tokens"},
        },
    )
    for graph in contexts.values():
        graph.ir_version = prefix.ir_version
    # Names cannot collide: every name in the hand-built graph starts with "context/".
    full = onnx.compose.merge_models(
        prefix,
        context,
        io_map=[("table", "table"), ("index", "index"), ("lengths", "lengths")],
        outputs=["layers", "mask"],
    )
    graphs = {ONNX_FILE: full, ENCODER_FILE: encoder, **contexts}
    for graph in graphs.values():
        _declare_output_dims(graph, model.cfg)
        onnx.checker.check_model(graph)
    return graphs


def _declare_output_dims(graph: onnx.ModelProto, cfg: ModelConfig) -> None:
    """The tracer leaves the layer and feature axes symbolic; write the real sizes so that the runtime can check
    a graph against onnx.json before running it."""
    for output in graph.graph.output:
        dims = output.type.tensor_type.shape.dim
        if output.name == "layers":
            dims[1].dim_value = cfg.n_output_layers
            dims[3].dim_value = cfg.output_dim
        elif output.name == "token_vectors":
            dims[1].dim_value = cfg.projection_dim


# -- float16 -------------------------------------------------------------------------------------------------------
def convert_to_fp16(graph: onnx.ModelProto) -> onnx.ModelProto:
    """A float32 ONNX model -> the same in float16 (onnxconverter-common handles the Loop body too); the graph's
    inputs and outputs keep their types."""
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(graph, keep_io_types=True)
    outputs = {o.name for o in model.graph.output}

    # The converter retypes tensors but leaves Cast(to=float) and SequenceEmpty(dtype=float) attributes as they
    # were, which onnxruntime rejects; inside the graph every float is float16 now, only the outputs stay float32.
    def retype(graph: onnx.GraphProto) -> None:
        for value in [*graph.input, *graph.output, *graph.value_info]:
            if value.type.HasField("sequence_type"):
                element = value.type.sequence_type.elem_type.tensor_type
                if element.elem_type == onnx.TensorProto.FLOAT:
                    element.elem_type = onnx.TensorProto.FLOAT16
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:  # Loop bodies
                    retype(attribute.g)
                elif (
                    (node.op_type, attribute.name) in (("Cast", "to"), ("SequenceEmpty", "dtype"))
                    and attribute.i == onnx.TensorProto.FLOAT
                    and node.output[0] not in outputs
                ):
                    attribute.i = onnx.TensorProto.FLOAT16

    retype(model.graph)
    return model


# -- shared weights ------------------------------------------------------------------------------------------------
def initializers(graph: onnx.GraphProto):
    """Every initializer of ``graph`` and of the graphs its nodes hold (Scan bodies)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from initializers(attribute.g)


def store_exact_fp16(graph: onnx.ModelProto | onnx.GraphProto) -> int:
    """Store each large float32 weight whose values are all exact float16 numbers (a checkpoint saved with fp16
    storage) as float16 plus a Cast back to float32 in the graph that holds it (a Scan body too), which
    onnxruntime folds when it loads the graph: half the bytes on disk, the same float32 arithmetic, bit-identical
    weights. Returns how many tensors were narrowed."""
    graph = graph.graph if isinstance(graph, onnx.ModelProto) else graph
    narrowed = sum(
        store_exact_fp16(attribute.g)
        for node in graph.node
        for attribute in node.attribute
        if attribute.type == onnx.AttributeProto.GRAPH
    )
    casts = []
    for tensor in graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT:
            continue
        array = numpy_helper.to_array(tensor)
        if array.nbytes < EXTERNAL_THRESHOLD or not np.all(np.abs(array) <= FP16_MAX):  # beyond: not fp16 numbers
            continue
        half = array.astype(np.float16)
        if not np.array_equal(half.astype(np.float32), array):
            continue
        name = tensor.name
        tensor.CopyFrom(numpy_helper.from_array(half, f"{name}::fp16"))
        casts.append(onnx.helper.make_node("Cast", [f"{name}::fp16"], [name], name=f"{name}::widen", to=1))
        narrowed += 1
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return narrowed


def save_with_shared_weights(graphs: dict[str, onnx.ModelProto], directory: Path) -> int:
    """Save every graph into ``directory`` with its large tensors in one data file, each distinct tensor once
    (the three graphs hold the same weights). Returns the data file's size in bytes."""
    stored: dict[bytes, tuple[int, int]] = {}
    with open(directory / ONNX_DATA_FILE, "wb") as data:
        for name, graph in graphs.items():
            store_exact_fp16(graph)
            for tensor in initializers(graph.graph):
                array = numpy_helper.to_array(tensor)
                if array.nbytes < EXTERNAL_THRESHOLD:
                    continue
                raw = array.tobytes()
                key = hashlib.sha256(raw + str((array.dtype, array.shape)).encode()).digest()
                if key not in stored:
                    data.write(b"\0" * (-data.tell() % 64))  # aligned, as onnxruntime prefers for mapping
                    stored[key] = (data.tell(), len(raw))
                    data.write(raw)
                offset, length = stored[key]
                tensor.ClearField("raw_data")
                tensor.ClearField("float_data")
                tensor.ClearField("int32_data")
                tensor.ClearField("int64_data")
                tensor.data_location = onnx.TensorProto.EXTERNAL
                del tensor.external_data[:]
                for field, value in (("location", ONNX_DATA_FILE), ("offset", offset), ("length", length)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = field, str(value)
            onnx.save(graph, str(directory / name))
        return data.tell()


# -- metadata ------------------------------------------------------------------------------------------------------
def encoder_trim_window(cfg: ModelConfig, scheme: ByteScheme | VocabScheme) -> int | None:
    """How many padding ids a cut token row must keep after its longest token: the widest filter. Then every
    filter still sees an all-padding window, the value every cut-off window had, so the max over positions is
    unchanged (bit for bit: each window is the same dot product). None: rows must keep their full width."""
    return max(width for width, _ in cfg.filters) if scheme.trimmable else None


def build_metadata(
    cfg: ModelConfig,
    name: str,
    checkpoint_sha256: str | None,
    dtype: str,
    data: Path,
    scheme: ByteScheme | VocabScheme | None = None,
) -> dict:
    scheme = scheme or BYTES
    char_scheme = scheme.metadata()
    if scheme.files:  # the vocabulary files the graphs were exported with (modeldir checks them)
        char_scheme["sha256"] = {file: sha256_of(data.parent / file) for file in scheme.files}
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "graph": ONNX_FILE,
        "graphs": {
            "model": ONNX_FILE,
            "encoder": ENCODER_FILE,
            **{key: file for key, file in CONTEXT_LAYOUTS.values() if (data.parent / file).is_file()},
            **({CONTEXT_S8_KEY: CONTEXT_S8_FILE} if (data.parent / CONTEXT_S8_FILE).is_file() else {}),
        },
        "weights_data": {"file": ONNX_DATA_FILE, "bytes": data.stat().st_size, "sha256": sha256_of(data)},
        "dtype": dtype,
        "opset": OPSET,
        "inputs": {"char_ids": ["batch", "tokens", scheme.width]},
        "outputs": {"layers": ["batch", cfg.n_output_layers, "tokens", cfg.output_dim], "mask": ["batch", "tokens"]},
        "n_layers": cfg.n_output_layers,
        "dim": cfg.output_dim,
        "projection_dim": cfg.projection_dim,
        "cell_dim": cfg.cell_dim,
        "n_lstm_layers": cfg.n_layers,
        "char_scheme": char_scheme,
        "encoder_trim_window": encoder_trim_window(cfg, scheme),
        "sentence_boundaries": "added inside the graphs (<S>, </S>) and removed from the output",
        "tokenizer": TOKENIZER_SETTINGS,
        "recurrence": "ONNX Scan, input projection hoisted; context.onnx one Scan per direction (CPU), "
        "context_fused.onnx both directions per Scan (CUDA), context_in_step.onnx the upper layers' input product "
        "inside each step (CPU, wide batches: the batch job; float exports)",
        "checkpoint_sha256": checkpoint_sha256,
        "config": cfg.to_dict(),
        "exporter": {"torch": torch.__version__, "onnx": onnx.__version__},
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# -- the command ---------------------------------------------------------------------------------------------------
def export_model(
    model_dir: str | Path,
    out_dir: str | Path | None = None,
    fp16: bool = False,
    threads: int | None = None,
    max_error: float | None = None,
    int8: bool = False,
    heldout: list[list[str]] | None = None,
    quantization: str = DEFAULT_SCHEME,
) -> Path:
    """Export ``model_dir`` into ``out_dir`` (default: the model directory itself) and verify it.

    ``int8``: the biLSTM's weights in int8 (export/quantize.py), judged by per-token cosine to float32 on the
    verification sentences and ``heldout`` (tokenized sentences) instead of the max-abs bound; ``quantization``:
    the weights' scheme (export/quantize.py SCHEMES; the default holds on every x86-64 CPU).

    Every export stores a probe (export/probe.py) that the runtime runs on each host that loads the model; the
    export itself runs it last, on the staged folder, as any host would.

    ``max_error``: an absolute bound on every verification case in place of the derived one (FP32_BOUND /
    FP16_BOUND), for a user who has judged the figures in onnx.json himself.

    Returns the path of the written model.onnx. Raises ModelFileError when verification fails; nothing in
    ``out_dir`` is replaced then.
    """
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else model_dir
    if int8 and (fp16 or max_error is not None):
        raise ConfigError("--int8 goes with neither --fp16 nor --max-error (int8 is judged by cosine to float32)")
    model = load_bilm(model_dir)
    cfg = model.cfg
    weights = model_dir / WEIGHTS_FILE
    checkpoint_sha = sha256_of(weights) if weights.is_file() else None

    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        scheme = model_char_scheme(model_dir, model)
        for file in scheme.files:  # the runtime in the verification reads the scheme from the folder
            shutil.copyfile(model_dir / file, staging / file)
        started = time.perf_counter()
        graphs = build_graphs(model, staging, scheme, int8=int8, quantization=quantization)
        if fp16:
            graphs = {name: convert_to_fp16(graph) for name, graph in graphs.items()}
        data_bytes = save_with_shared_weights(graphs, staging)
        del graphs
        dtype = "float16" if fp16 else "int8" if int8 else "float32"
        meta = build_metadata(cfg, model_dir.resolve().name, checkpoint_sha, dtype, staging / ONNX_DATA_FILE, scheme)
        if int8:
            meta["quantization"] = quantization_record(quantization)
        bound = None if int8 else export_bound(fp16, max_error)
        meta["probe"] = write_probe(staging, model, scheme, bound)
        (staging / ONNX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.copyfile(model_dir / CONFIG_FILE, staging / CONFIG_FILE)
        log.info(
            "exported %d graphs (%.1f MB of weights) in %.1f s; verifying against PyTorch",
            len(meta["graphs"]),
            data_bytes / 1e6,
            time.perf_counter() - started,
        )
        threads = threads or max(1, torch.get_num_threads())
        if int8:
            report = verify_int8(model, staging, threads, heldout or [])
        else:
            report = verify_export(model, staging, bound=bound, dtype=dtype, threads=threads)
        log.info("verification: %s", report.summary())
        if not report.passed:
            against = "float32" if int8 else "PyTorch"
            raise ModelFileError(f"{out / ONNX_FILE}: verification against {against} failed: {report.summary()}")
        meta["verification"] = report.to_dict()
        meta["probe"]["at_export"] = at_export(check_staged(staging, threads))
        (staging / ONNX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _move_into_place(staging, out, model_dir, scheme.files)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out / ONNX_FILE


def exported_graphs(directory: Path) -> tuple[str, ...]:
    """The graph files an export wrote into ``directory``, in GRAPH_FILES' order."""
    return tuple(name for name in GRAPH_FILES if (directory / name).is_file())


def check_staged(staging: Path, threads: int):
    """The load-time check (elmo.runtime.probe) on the staged folder, as a serving host runs it (CPU)."""
    from elmo.runtime import CPU, Embedder

    runtime = Embedder(staging, providers=[CPU], intra_op_threads=threads, cache_size=0, check_on_load=False)
    try:
        return runtime.check()
    finally:
        runtime.close()


def _move_into_place(staging: Path, out: Path, model_dir: Path, scheme_files: tuple[str, ...] = ()) -> None:
    # The metadata last: a reader never sees new metadata beside old graphs. A graph this export does not write
    # (an int8 export has no in_step graph) is removed: left behind, it would point into a weight file it predates.
    graphs = exported_graphs(staging)
    names = (*scheme_files, ONNX_DATA_FILE, *graphs, PROBE_FILE, ONNX_META_FILE)
    for name in names:
        (staging / name).chmod(0o644)  # readable by the serving user whatever the umask
        os.replace(staging / name, out / name)
    for name in set(GRAPH_FILES) - set(graphs):
        (out / name).unlink(missing_ok=True)
    if out.resolve() != model_dir.resolve():  # the exported folder is a model directory of its own
        for name in (CONFIG_FILE, VOCAB_FILE):
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, out / name)
        if (model_dir / TASKS_DIR).is_dir():  # the same weights: the task mixes stay current (served with --int8 too)
            shutil.copytree(model_dir / TASKS_DIR, out / TASKS_DIR, dirs_exist_ok=True)
    readable_by_all(out)  # the copies and the model's own files too: a server running as another user reads them


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="model directory (config.json + model.safetensors)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the model directory)")
    parser.add_argument("--fp16", action="store_true", help="float16 weights and arithmetic (inputs/outputs stay)")
    parser.add_argument(
        "--int8",
        action="store_true",
        help="int8 biLSTM weights (onnxruntime dynamic quantization, CPU), kept only when every biLSTM layer's "
        "per-token cosine to float32 has mean >= 0.999 and min >= 0.99",
    )
    parser.add_argument(
        "--heldout",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --int8: also judge on this text (UTF-8, one sentence per line; the first 300 non-blank lines)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch / onnxruntime threads for verification")
    parser.add_argument(
        "--max-error",
        type=float,
        default=None,
        metavar="ABS",
        help="accept the export when every verification case is within ABS (max abs error vs PyTorch float64), in "
        "place of the derived per-case bound; the figures per case are in onnx.json -> verification",
    )


HELDOUT_LINES = 300


def heldout_sentences(path: Path, lines: int = HELDOUT_LINES) -> list[list[str]]:
    """The first ``lines`` non-blank lines of ``path`` through the one tokenizer, each cut to 400 tokens."""
    from elmo.text.tokenize import tokenize

    try:
        with open(path, encoding="utf-8") as handle:
            texts = [line.strip() for line in handle if line.strip()][:lines]
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read held-out text: {exc}") from exc
    if not texts:
        raise InputError(f"{path}: no text in the held-out file")
    return [tokenize(text).tokens[:400] for text in texts]


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.max_error is not None and not (args.max_error > 0 and np.isfinite(args.max_error)):
        raise ConfigError(f"--max-error must be a positive number (got {args.max_error})")
    if args.heldout is not None and not args.int8:
        raise ConfigError("--heldout goes with --int8")
    heldout = heldout_sentences(args.heldout) if args.heldout is not None else None
    path = export_model(
        args.model,
        args.out,
        fp16=args.fp16,
        threads=args.threads,
        max_error=args.max_error,
        int8=args.int8,
        heldout=heldout,
    )
    meta = json.loads((path.parent / ONNX_META_FILE).read_text())
    files = (*exported_graphs(path.parent), ONNX_DATA_FILE, PROBE_FILE, ONNX_META_FILE)
    names = ",".join(files)
    print(f"wrote {path.parent}/{{{names}}}")
    print(f"verification: {meta['verification']['summary']}")
    return 0
