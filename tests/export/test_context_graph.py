"""export/context_graph.py's separate (CPU) layout: the layers above 0 take their input product inside each step
([x_t, h] @ [W_in; W_rec] + b: ``inputs_in_step``), or hoisted out of the loop (what the export writes); both give
the same layers."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from elmo.export.context_graph import build_context_graph

from elmo.model.checkpoint import load_model


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


def test_the_input_product_per_step_and_hoisted_give_the_same_layers(tiny_model_dir):
    model = load_model(tiny_model_dir).float()
    cfg = model.cfg
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    per_step, hoisted = build_context_graph(state, cfg, inputs_in_step=True), build_context_graph(state, cfg)
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
