"""export/context_graph.py's separate (CPU) layout: the layers above 0 take their input product inside each step
([x_t, h] @ [W_in; W_rec] + b: ``inputs_in_step``), or hoisted out of the loop (what the export writes); both give
the same layers; per step, each gate is a product of its own, from weights stored once."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from elmo.export.context_graph import build_context_graph

from elmo.model.checkpoint import load_model
from elmo.model.config import ModelConfig


def scanned_widths(graph: onnx.ModelProto) -> list[int]:
    """The width of each Scan body's scanned input (its third input), in graph order: 0 for table rows (int64)."""
    widths = []
    for node in graph.graph.node:
        if node.op_type == "Scan":
            body = next(a.g for a in node.attribute if a.name == "body")
            scanned = body.input[2].type.tensor_type
            widths.append(scanned.shape.dim[-1].dim_value if scanned.elem_type == onnx.TensorProto.FLOAT else 0)
    return widths


def run(graph: onnx.ModelProto, feeds: dict) -> np.ndarray:
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["layers"], feeds)[0]


def both_layouts(model_dir) -> tuple[ModelConfig, onnx.ModelProto, onnx.ModelProto]:
    """The model's config, its context graph with the input product per step, and hoisted."""
    model = load_model(model_dir).float()
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    return model.cfg, build_context_graph(state, model.cfg, inputs_in_step=True), build_context_graph(state, model.cfg)


def scan_bodies(graph: onnx.ModelProto) -> list[onnx.GraphProto]:
    return [a.g for node in graph.graph.node if node.op_type == "Scan" for a in node.attribute if a.name == "body"]


def stored_weights(graph: onnx.ModelProto) -> set[bytes]:
    """The contents of the graph's weight tensors (those the export puts in its data file), its bodies' included."""
    tensors = [t for body in [graph.graph, *scan_bodies(graph)] for t in body.initializer]
    return {onnx.numpy_helper.to_array(t).tobytes() for t in tensors if np.prod(t.dims) >= 256}


def test_the_input_product_per_step_and_hoisted_give_the_same_layers(tiny_model_dir):
    cfg, per_step, hoisted = both_layouts(tiny_model_dir)
    # Layer 0 scans table rows in both; above it, per step scans the layer's input (P wide), hoisted its gates (4C).
    assert scanned_widths(per_step) == [0, 0] + [cfg.projection_dim] * 2 * (cfg.n_layers - 1)
    assert scanned_widths(hoisted) == [0, 0] + [4 * cfg.cell_dim] * 2 * (cfg.n_layers - 1)
    rng = np.random.default_rng(0)
    lengths = np.array([5, 2, 7], np.int64)
    feeds = {
        "table": rng.normal(size=(9, cfg.projection_dim)).astype(np.float32),
        "index": rng.integers(0, 9, size=(3, 9)).astype(np.int64),
        "lengths": lengths,
    }
    np.testing.assert_allclose(run(per_step, feeds), run(hoisted, feeds), rtol=1e-5, atol=1e-5)


def test_the_per_step_graph_computes_each_gate_by_a_product_of_its_own(tiny_model_dir, tmp_path):
    """No Split copies the gates inside a step; each gate's block of the weights is a Slice of the whole weight
    (and [W_in; W_rec] a Concat), which onnxruntime folds at load (none is left in the optimised bodies), so the
    weights stored are the hoisted graph's own (the export's data file holds each once)."""
    _, per_step, hoisted = both_layouts(tiny_model_dir)
    for body in scan_bodies(per_step):
        ops = [node.op_type for node in body.node]
        assert ops.count("Gemm") == 4 and "Split" not in ops and "MatMul" in ops  # the projection stays one product
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(per_step.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for body in scan_bodies(onnx.load(str(tmp_path / "optimised.onnx"))):
        ops = [node.op_type for node in body.node]
        assert "Slice" not in ops and ops.count("Concat") <= 1  # left per step: only [x_t, h] joined
    assert stored_weights(per_step) <= stored_weights(hoisted)
