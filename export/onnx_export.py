"""``elmo export``: a model directory (config.json + model.safetensors) -> model.onnx + onnx.json, verified.

The exported graph keeps ELMo's exact semantics for any batch size and sentence length: the projection-LSTM
recurrence is exported as an ONNX ``Loop`` (``torch.jit.script_if_tracing``), because ``nn.LSTM(proj_size)``
does not export, ONNX's LSTM op has no recurrent projection, and a traced Python loop would be unrolled to the
sample's length (see ../shared/reference/ENVIRONMENT.md). The command verifies the result against PyTorch on
lengths other than the tracing sample's before it reports success; a failed verification raises ModelFileError.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import elmo.model as elmo_model
from elmo.chars import MAX_CHARS, N_CHAR_IDS, batch_to_char_ids
from elmo.checkpoint import load_model
from elmo.config import CONFIG_FILE, ModelConfig
from elmo.errors import ModelFileError
from elmo.modeldir import (
    FORMAT_VERSION,
    ONNX_FILE,
    ONNX_META_FILE,
    WEIGHTS_FILE,
    sha256_of,
)
from elmo.tokenize import TOKENIZER_SETTINGS
from export.verify import VerificationReport, verify_onnx

log = logging.getLogger("elmo.export")

OPSET = 17
FP32_TOLERANCE = 1e-5
# fp16 rounds every intermediate to ~3 significant digits; the clipped LSTM states stay within ±3, so an
# absolute error of a few 1e-2 is what fp16 arithmetic gives. Beyond this bound the graph is broken, not imprecise.
FP16_TOLERANCE = 0.1


# -- loading -------------------------------------------------------------------------------------------------------
def load_bilm(model_dir: Path) -> elmo_model.BiLM:
    """A model directory -> BiLM in eval mode, float32 (fp16-stored weights are widened by load_model)."""
    return load_model(model_dir).float().eval()


# -- the exportable recurrence -------------------------------------------------------------------------------------
@torch.jit.script_if_tracing
def _loop_recurrence(
    gates_x: torch.Tensor,
    w_rec: torch.Tensor,
    b_rec: torch.Tensor,
    w_proj: torch.Tensor,
    cell_clip: float,
    proj_clip: float,
    initial_hidden: torch.Tensor,
    initial_cell: torch.Tensor,
) -> torch.Tensor:
    """Same maths as elmo.model.projection_lstm_recurrence; scripted so the tracer emits an ONNX Loop whose trip
    count is the runtime token axis. ``gates_x`` (B, T, 4C), initial state (P,) / (C,) -> (B, T, P)."""
    batch = gates_x.shape[0]
    steps = gates_x.shape[1]
    cell = torch.zeros([batch, initial_cell.shape[0]], dtype=gates_x.dtype, device=gates_x.device) + initial_cell
    hidden = torch.zeros([batch, initial_hidden.shape[0]], dtype=gates_x.dtype, device=gates_x.device)
    hidden = hidden + initial_hidden
    outputs: list[torch.Tensor] = []
    for t in range(steps):
        z = gates_x[:, t] + torch.matmul(hidden, w_rec.t()) + b_rec
        i, f, g, o = z.chunk(4, dim=-1)
        cell = torch.clamp(torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * cell, -cell_clip, cell_clip)
        hidden = torch.clamp(torch.matmul(torch.sigmoid(o) * torch.tanh(cell), w_proj.t()), -proj_clip, proj_clip)
        outputs.append(hidden)
    return torch.stack(outputs, dim=1)


def _exportable_recurrence(
    gates_x, w_rec, b_rec, w_proj, cell_clip: float, proj_clip: float, initial_hidden=None, initial_cell=None
):
    # A clip of 0 means "no clipping" in the config; an infinite bound is the same thing without an If node.
    inf = float("inf")
    if initial_hidden is None or initial_cell is None:
        initial_hidden = gates_x.new_zeros(w_proj.shape[0])
        initial_cell = gates_x.new_zeros(w_proj.shape[1])
    return _loop_recurrence(
        gates_x, w_rec, b_rec, w_proj, cell_clip or inf, proj_clip or inf, initial_hidden, initial_cell
    )


@contextlib.contextmanager
def exportable_recurrence() -> Iterator[None]:
    """Swap the eager recurrence for the scripted one while tracing, so the export reuses elmo.model's modules
    unchanged (ProjectionLSTM looks the function up in its module at call time)."""
    original = elmo_model.projection_lstm_recurrence
    elmo_model.projection_lstm_recurrence = _exportable_recurrence
    try:
        yield
    finally:
        elmo_model.projection_lstm_recurrence = original


class _GraphModule(torch.nn.Module):
    """char_ids int64 (B, T, 50) -> (layers float32 (B, L+1, T, 2P), mask bool (B, T))."""

    def __init__(self, model: elmo_model.BiLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, char_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layers, mask = self.model(char_ids)
        return layers.float(), mask


def export_graph(model: elmo_model.BiLM, path: Path, fp16: bool = False, opset: int = OPSET) -> None:
    """Trace ``model`` into ``path`` with dynamic batch and token axes. ``fp16`` converts the float32 graph's
    weights and arithmetic to float16 afterwards (inputs and outputs keep their types)."""
    sample = torch.as_tensor(batch_to_char_ids([["a", "bc", "def"], ["ghij", "k"]])).long()
    module = _GraphModule(model).eval()
    with exportable_recurrence(), torch.no_grad():
        torch.onnx.export(
            module,
            (sample,),
            str(path),
            dynamo=False,
            opset_version=opset,
            input_names=["char_ids"],
            output_names=["layers", "mask"],
            dynamic_axes={
                "char_ids": {0: "batch", 1: "tokens"},
                "layers": {0: "batch", 2: "tokens"},
                "mask": {0: "batch", 1: "tokens"},
            },
        )
    import onnx

    graph = onnx.load(str(path))
    _declare_output_dims(graph, model.cfg)
    if fp16:
        graph = convert_to_fp16(graph)
    onnx.save(graph, str(path))


def _declare_output_dims(graph, cfg: ModelConfig) -> None:
    """The tracer leaves the layer and feature axes symbolic; write the real sizes so that the runtime can check
    a graph against onnx.json before running it."""
    for output in graph.graph.output:
        if output.name == "layers":
            dims = output.type.tensor_type.shape.dim
            dims[1].dim_value = cfg.n_output_layers
            dims[3].dim_value = cfg.output_dim


def convert_to_fp16(graph):
    """A float32 ONNX model -> the same in float16 (onnxconverter-common handles the Loop body too); the graph's
    inputs and outputs keep their types."""
    import onnx
    from onnxconverter_common import float16

    model = float16.convert_float_to_float16(graph, keep_io_types=True)
    # The converter retypes tensors but leaves Cast(to=float) nodes (the model's mask casts) as they were, which
    # onnxruntime rejects; inside the graph every float is float16 now, only the graph outputs stay float32.
    outputs = {o.name for o in model.graph.output}

    def retype_casts(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:  # Loop / If bodies
                    retype_casts(attribute.g)
                elif (
                    (node.op_type, attribute.name) in (("Cast", "to"), ("SequenceEmpty", "dtype"))
                    and attribute.i == onnx.TensorProto.FLOAT
                    and node.output[0] not in outputs
                ):
                    attribute.i = onnx.TensorProto.FLOAT16

    def retype_sequences(graph: onnx.GraphProto) -> None:
        for value in [*graph.input, *graph.output, *graph.value_info]:
            element = value.type.sequence_type.elem_type if value.type.HasField("sequence_type") else None
            if element is not None and element.tensor_type.elem_type == onnx.TensorProto.FLOAT:
                element.tensor_type.elem_type = onnx.TensorProto.FLOAT16
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    retype_sequences(attribute.g)

    retype_casts(model.graph)
    retype_sequences(model.graph)
    return model


# -- metadata ------------------------------------------------------------------------------------------------------
def build_metadata(
    cfg: ModelConfig, name: str, checkpoint_sha256: str | None, fp16: bool, report: VerificationReport
) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "name": name,
        "graph": ONNX_FILE,
        "dtype": "float16" if fp16 else "float32",
        "opset": OPSET,
        "inputs": {"char_ids": ["batch", "tokens", MAX_CHARS]},
        "outputs": {"layers": ["batch", cfg.n_output_layers, "tokens", cfg.output_dim], "mask": ["batch", "tokens"]},
        "n_layers": cfg.n_output_layers,
        "dim": cfg.output_dim,
        "projection_dim": cfg.projection_dim,
        "cell_dim": cfg.cell_dim,
        "n_lstm_layers": cfg.n_layers,
        "char_scheme": {"name": "elmo", "max_chars": MAX_CHARS, "n_chars": N_CHAR_IDS, "shift": 1},
        "sentence_boundaries": "added inside the graph (<S>, </S>) and removed from the output",
        "tokenizer": TOKENIZER_SETTINGS,
        "recurrence": "onnx-loop",
        "checkpoint_sha256": checkpoint_sha256,
        "config": cfg.to_dict(),
        "exporter": {"torch": torch.__version__, "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "verification": report.to_dict(),
    }


# -- the command ---------------------------------------------------------------------------------------------------
def export_model(model_dir: str | Path, out_dir: str | Path | None = None, fp16: bool = False) -> Path:
    """Export ``model_dir`` to ``out_dir`` (default: the model directory itself) and verify it.

    Returns the path of the written model.onnx. Raises ModelFileError when verification fails (the bad graph
    is removed so that no runtime picks it up).
    """
    model_dir = Path(model_dir)
    out = Path(out_dir) if out_dir is not None else model_dir
    out.mkdir(parents=True, exist_ok=True)
    model = load_bilm(model_dir)
    cfg = model.cfg
    weights = model_dir / WEIGHTS_FILE
    checkpoint_sha = sha256_of(weights) if weights.is_file() else None

    onnx_path = out / ONNX_FILE
    # Written beside the target and moved into place only once verified: a failed export never replaces a good one.
    candidate = out / (ONNX_FILE + ".unverified")
    started = time.perf_counter()
    try:
        export_graph(model, candidate, fp16=fp16)
        log.info("exported %s in %.1f s; verifying against PyTorch", onnx_path, time.perf_counter() - started)
        report = verify_onnx(model, candidate, tolerance=FP16_TOLERANCE if fp16 else FP32_TOLERANCE, fp16=fp16)
    except BaseException:
        candidate.unlink(missing_ok=True)
        raise
    log.info("verification: %s", report.summary())
    if not report.passed:
        candidate.unlink(missing_ok=True)
        raise ModelFileError(f"{onnx_path}: verification against PyTorch failed: {report.summary()}")
    os.replace(candidate, onnx_path)

    meta = build_metadata(cfg, model_dir.resolve().name, checkpoint_sha, fp16, report)
    (out / ONNX_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if out.resolve() != model_dir.resolve():
        # The exported folder is a model directory of its own (the runtime checks onnx.json against config.json).
        for name in (CONFIG_FILE, "vocab.txt"):
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, out / name)
    return onnx_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="model directory (config.json + model.safetensors)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the model directory)")
    parser.add_argument("--fp16", action="store_true", help="export float16 weights and arithmetic (I/O stay fp32)")
    parser.add_argument("--threads", type=int, default=None, help="torch / onnxruntime threads for verification")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    path = export_model(args.model, args.out, fp16=args.fp16)
    meta = json.loads((path.parent / ONNX_META_FILE).read_text())
    print(f"wrote {path} and {path.parent / ONNX_META_FILE}; verification: {meta['verification']['summary']}")
    return 0
