"""The biLSTM as a hand-built ONNX graph: one ``Scan`` per layer running both directions at once.

Why by hand: the tracer turns the scripted recurrence into a ``Loop`` that carries a tensor sequence; in
onnxruntime it runs ~5x slower than PyTorch eager (docs/runtime.md). A ``Scan`` over the hoisted input
projections with the state as loop-carried tensors runs at unrolled-graph speed, for any length, in one graph.

Graph (S = T + 2 positions, <S> and </S> included; L LSTM layers; P projection, C cell):
  inputs   tokens float32 (B, S, P) (row b: [<S>, n_b token vectors, </S>, anything]), lengths int64 (B,) = n_b
  outputs  layers float32 (B, L+1, T, 2P), zero past each sentence
The backward direction runs on ``ReverseSequence(x, n_b + 2)`` (only the valid part reversed: exact with padding)
and the forward and backward stacks are stacked on a leading axis of 2, so every MatMul and every elementwise
node serves both directions. Same maths as elmo.model (cell/proj clips, residual, masking); the export's
verification compares the two.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from elmo.config import ModelConfig

OPSET = 17
IR_VERSION = 8  # what torch's exporter writes; onnxruntime 1.31 reads up to 13


class _Builder:
    """Collects nodes and initializers with unique names (all under ``prefix``, so that model.onnx can join this
    graph to the traced char-CNN graph without a name clash)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def const(self, array: np.ndarray, hint: str) -> str:
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.array(array, order="C"), name))
        return name

    def i64(self, values) -> str:
        return self.const(np.array(values, np.int64), "i64")

    def unsqueeze(self, x: str, axis: int) -> str:
        return self.op("Unsqueeze", [x, self.i64([axis])])

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, outputs: int = 1, **attrs) -> str | list:
        names = [self.name(hint or op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=names[0], **attrs))
        return names[0] if outputs == 1 else names


def _layer_weights(state: dict[str, np.ndarray], layer: int, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Both directions' weights of one layer, stacked on a leading axis of 2 (forward, backward), x @ W layout."""

    def both(fmt: str, transform) -> np.ndarray:
        return np.stack([transform(state[fmt.format(d, layer)]) for d in ("forward_layers", "backward_layers")])

    weights = {
        "w_in": both("{}.{}.input_linearity.weight", lambda w: w.T),  # (2, in, 4C)
        "w_rec": both("{}.{}.state_linearity.weight", lambda w: w.T),  # (2, P, 4C)
        "b_rec": both("{}.{}.state_linearity.bias", lambda b: b[None, :]),  # (2, 1, 4C)
        "w_proj": both("{}.{}.state_projection.weight", lambda w: w.T),  # (2, C, P)
    }
    key = "{}.{}.initial_hidden"
    if key.format("forward_layers", layer) in state:  # the optional fixed warm state (elmo.weights)
        weights["h0"] = both(key, lambda h: h[None, :])  # (2, 1, P)
        weights["c0"] = both("{}.{}.initial_cell", lambda c: c[None, :])  # (2, 1, C)
    else:
        weights["h0"] = np.zeros((2, 1, cfg.projection_dim), np.float32)
        weights["c0"] = np.zeros((2, 1, cfg.cell_dim), np.float32)
    return {k: v.astype(np.float32) for k, v in weights.items()}


def _cell_body(weights: dict[str, np.ndarray], cfg: ModelConfig, scope: str) -> onnx.GraphProto:
    """Scan body: (h (D, B, P), c (D, B, C), gates_x_t (D, B, 4C)) -> (h', c', y_t = h'), D = 2 directions at
    once, or without the D axis for one direction (weights shaped accordingly)."""
    g = _Builder(f"context/{scope}/")
    h_in, c_in, gates_t = (f"context/{scope}/{name}" for name in ("h", "c", "gates_t"))
    h_next, c_next, y_t = (f"context/{scope}/{name}" for name in ("h_next", "c_next", "y_t"))
    p, c = cfg.projection_dim, cfg.cell_dim
    z = g.op("Add", [gates_t, g.op("MatMul", [h_in, g.const(weights["w_rec"], "w_rec")])])
    z = g.op("Add", [z, g.const(weights["b_rec"], "b_rec")])
    i, f, gg, o = g.op("Split", [z], "gate", outputs=4, axis=-1)
    cell = g.op(
        "Add", [g.op("Mul", [g.op("Sigmoid", [i]), g.op("Tanh", [gg])]), g.op("Mul", [g.op("Sigmoid", [f]), c_in])]
    )
    cell = _clip(g, cell, cfg.cell_clip)
    out = g.op(
        "MatMul", [g.op("Mul", [g.op("Sigmoid", [o]), g.op("Tanh", [cell])]), g.const(weights["w_proj"], "w_proj")]
    )
    hidden = _clip(g, out, cfg.proj_clip)
    g.nodes += [
        helper.make_node("Identity", [hidden], [h_next]),
        helper.make_node("Identity", [cell], [c_next]),
        helper.make_node("Identity", [hidden], [y_t]),
    ]

    lead = [2] if weights["w_rec"].ndim == 3 else []

    def value(name: str, width) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [*lead, "batch", width])

    return helper.make_graph(
        g.nodes,
        f"{scope}_cell",
        [value(h_in, p), value(c_in, c), value(gates_t, 4 * c)],
        [value(h_next, p), value(c_next, c), value(y_t, p)],
        initializer=g.initializers,
    )


def _clip(g: _Builder, x: str, limit: float) -> str:
    if not limit:  # 0 = no clipping (elmo.config)
        return x
    return g.op("Clip", [x, g.const(np.array(-limit, np.float32), "lo"), g.const(np.array(limit, np.float32), "hi")])


def _positions_below(g: _Builder, count: str, limits: str) -> str:
    """(B, count) bool: position t < limits[b]."""
    positions = g.op("Range", [g.i64(0), count, g.i64(1)])
    return g.op("Less", [g.unsqueeze(positions, 0), g.unsqueeze(limits, 1)])


def _layers_value_info(cfg: ModelConfig) -> onnx.ValueInfoProto:
    shape = ["batch", cfg.n_output_layers, "tokens", cfg.output_dim]
    return helper.make_tensor_value_info("layers", TensorProto.FLOAT, shape)


def _fused_scan(g: _Builder, x: str, weights: dict, cfg: ModelConfig, layer: int, batch_and_steps: str, state) -> str:
    """Both directions in one Scan: x (2, B, S, in) -> h (2, B, S, P)."""
    # The input projection of every step, hoisted out of the recurrence: one (2, B*S, in) @ (2, in, 4C) MatMul.
    flat = g.op("Reshape", [x, g.i64([2, -1, weights["w_in"].shape[1]])])
    gates_shape = g.op("Concat", [g.i64([2]), batch_and_steps, g.i64([4 * cfg.cell_dim])], axis=0)
    gates = g.op("Reshape", [g.op("MatMul", [flat, g.const(weights["w_in"], "w_in")]), gates_shape])
    _, _, h = g.op(
        "Scan",
        [state(weights["h0"]), state(weights["c0"]), gates],
        f"scan{layer}",
        outputs=3,
        body=_cell_body(weights, cfg, f"l{layer}"),
        num_scan_inputs=1,
        scan_input_axes=[2],
        scan_output_axes=[2],
    )
    return h


def _separate_scans(g: _Builder, x: str, weights: dict, cfg: ModelConfig, layer: int, batch: str) -> str:
    """One Scan per direction (2-D weights): x (2, B, S, in) -> h (2, B, S, P). Measured against the fused form
    in bench/recurrence.py."""
    outputs = []
    for d, x_d in enumerate(g.op("Split", [x], outputs=2, axis=0)):
        one = {k: v[d] for k, v in weights.items()}
        gates = g.op("MatMul", [g.op("Squeeze", [x_d, g.i64([0])]), g.const(one["w_in"], "w_in")])  # (B, S, 4C)
        initial = [
            g.op(
                "Expand",
                [g.const(one[k], k), g.op("Concat", [g.unsqueeze(batch, 0), g.i64([one[k].shape[-1]])], axis=0)],
            )
            for k in ("h0", "c0")
        ]
        _, _, h = g.op(
            "Scan",
            [*initial, gates],
            f"scan{layer}_{d}",
            outputs=3,
            body=_cell_body(one, cfg, f"l{layer}d{d}"),
            num_scan_inputs=1,
            scan_input_axes=[1],
            scan_output_axes=[1],
        )
        outputs.append(g.unsqueeze(h, 0))
    return g.op("Concat", outputs, axis=0)


def build_context_graph(
    state: dict[str, np.ndarray], cfg: ModelConfig, fuse_directions: bool = True
) -> onnx.ModelProto:
    """``state``: the BiLM state dict as float32 numpy arrays. Returns the context.onnx model. ``fuse_directions``
    runs both directions in one Scan per layer (the default: fewer, larger ops); False gives one Scan each."""
    g = _Builder("context/")
    batch_and_steps = g.op("Slice", [g.op("Shape", ["tokens"]), g.i64([0]), g.i64([2])])  # [B, S]
    batch = g.op("Gather", [batch_and_steps, g.i64(0)], axis=0)
    steps = g.op("Gather", [batch_and_steps, g.i64(1)], axis=0)
    with_boundaries = g.op("Add", ["lengths", g.i64(2)])  # (B,) = n_b + 2
    mask = g.unsqueeze(g.op("Cast", [_positions_below(g, steps, with_boundaries)], to=TensorProto.FLOAT), 2)
    x0 = g.op("Mul", ["tokens", mask])  # (B, S, P); mask (B, S, 1)

    def reverse(x: str) -> str:  # reverse each row's first n_b + 2 positions, padding stays in place
        return g.op("ReverseSequence", [x, with_boundaries], batch_axis=0, time_axis=1)

    def direction_state(initial: np.ndarray) -> str:  # (2, 1, W) -> (2, B, W)
        width = g.i64([initial.shape[-1]])
        return g.op(
            "Expand", [g.const(initial, "initial"), g.op("Concat", [g.i64([2]), g.unsqueeze(batch, 0), width], axis=0)]
        )

    x = g.op("Concat", [g.unsqueeze(x0, 0), g.unsqueeze(reverse(x0), 0)], axis=0)  # (2, B, S, P): fwd, reversed
    layers = [g.op("Concat", [x0, x0], axis=-1)]
    for layer in range(cfg.n_layers):
        weights = _layer_weights(state, layer, cfg)
        if fuse_directions:
            h = _fused_scan(g, x, weights, cfg, layer, batch_and_steps, direction_state)  # (2, B, S, P)
        else:
            h = _separate_scans(g, x, weights, cfg, layer, batch)
        if layer > 0 and cfg.residual:
            h = g.op("Add", [h, x])
        x = g.op("Mul", [h, mask])
        forward, backward_reversed = (g.op("Squeeze", [t, g.i64([0])]) for t in g.op("Split", [x], outputs=2, axis=0))
        layers.append(g.op("Concat", [forward, reverse(backward_reversed)], axis=-1))
    stacked = g.op("Concat", [g.unsqueeze(t, 1) for t in layers], axis=1)  # (B, L+1, S, 2P)
    stacked = g.op("Slice", [stacked, g.i64([1]), g.i64([-1]), g.i64([2])])  # drop <S> and the last slot
    real = _positions_below(g, g.op("Sub", [steps, g.i64(2)]), "lengths")  # (B, T)
    real = g.unsqueeze(g.unsqueeze(g.op("Cast", [real], to=TensorProto.FLOAT), 1), 3)  # (B, 1, T, 1)
    g.nodes.append(helper.make_node("Mul", [stacked, real], ["layers"], name="context/layers"))
    graph = helper.make_graph(
        g.nodes,
        "elmo_context",
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["batch", "steps", cfg.projection_dim]),
            helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
        ],
        [_layers_value_info(cfg)],
        initializer=g.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="elmo-export")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model
