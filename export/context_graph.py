"""The biLSTM as a hand-built ONNX graph: ``Scan`` over the hoisted input projections, any sentence length.

Why by hand: the tracer turns the scripted recurrence into a ``Loop`` that carries a tensor sequence, which
onnxruntime runs 2-4x slower than PyTorch eager; a ``Scan`` with the state as loop-carried tensors runs at
unrolled-graph speed, for any length, in one graph (figures: docs/explanation/runtime.md, bench/recurrence.py).

Graph (S = T + 2 positions, <S> and </S> included; L LSTM layers; P projection, C cell; R table rows):
  inputs   table float32 (R, P): token vectors; index int64 (B, S): row b is [<S>, n_b tokens, </S>, anything]
           as rows of the table (the runtime's call table, or model.onnx's every position); lengths int64 (B,) = n_b
  outputs  layers float32 (B, L+1, T, 2P), zero past each sentence
The backward direction runs on the valid part of each row reversed (``ReverseSequence`` with n_b + 2: exact with
padding). Layouts of the same maths (the export writes each; the runtime picks per provider and caller):
  separate  one Scan per direction and layer, time-major, 2-D weights inside each Scan body: the faster one on
            CPU (MLAS pre-packs them once per session). Layer 0's input projection is computed once per table row,
            not per position (a token's projection does not depend on its context), and each step gathers its
            rows from it; being time-major, no Scan transposes its (S, B, 4C) input.
  in step   the same with the layers above 0 taking their input product inside each step, ``[x_t, h] [W_in; R]
            + b`` (``inputs_in_step``), and every gate its own product (no Split per step): faster on CPU for
            wide batches (the batch job), slower for a few rows
  fused     both directions in one Scan per layer (a leading axis of 2): half the Scan steps and kernel
            launches, for CUDA, where a step costs launches rather than arithmetic
Per step: ``z = (x_t W_in + b) + h R`` (the input projection and bias hoisted out of the loop), gates
reordered to (i, f, o, g) so one Sigmoid covers three of them; ``c = clip(i*g + f*c)``, ``h = clip((o*tanh c) W_P)``.
Same maths as elmo.model.bilm (clips, residual, masking); the export's verification compares the two.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from elmo.model.config import ModelConfig

OPSET = 17
IR_VERSION = 8  # what torch's exporter writes; onnxruntime 1.31 reads up to 13
DIRECTIONS = ("forward_layers", "backward_layers")


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


def _reorder_gates(w: np.ndarray, cell: int) -> np.ndarray:
    """Last axis (i, f, g, o) blocks -> (i, f, o, g)."""
    i, f, g, o = (w[..., k * cell : (k + 1) * cell] for k in range(4))
    return np.concatenate([i, f, o, g], axis=-1)


def direction_weights(state: dict[str, np.ndarray], direction: str, layer: int, cfg: ModelConfig) -> dict:
    """One direction's weights of one layer in x @ W layout, gates (i, f, o, g): w_in (in, 4C), b (4C,),
    w_rec (P, 4C), w_proj (C, P), h0 (1, P), c0 (1, C) (zero unless the model has a warm initial state)."""
    prefix, cell = f"{direction}.{layer}", cfg.cell_dim
    weights = {
        "w_in": _reorder_gates(state[f"{prefix}.input_linearity.weight"].T, cell),
        "b": _reorder_gates(state[f"{prefix}.state_linearity.bias"], cell),
        "w_rec": _reorder_gates(state[f"{prefix}.state_linearity.weight"].T, cell),
        "w_proj": state[f"{prefix}.state_projection.weight"].T,
        "h0": state.get(f"{prefix}.initial_hidden", np.zeros(cfg.projection_dim)).reshape(1, -1),
        "c0": state.get(f"{prefix}.initial_cell", np.zeros(cell)).reshape(1, -1),
    }
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}


def _clip(g: _Builder, x: str, limit: float) -> str:
    if not limit:  # 0 = no clipping (elmo.model.config)
        return x
    return g.op("Clip", [x, g.const(np.array(-limit, np.float32), "lo"), g.const(np.array(limit, np.float32), "hi")])


def _gate_block(body: _Builder, x: str, k: int, cell: int) -> str:
    """Gate k's block of a constant's last axis (C columns of 4C): folded by onnxruntime at load, so that the data
    file keeps each weight whole, as the other graphs store it."""
    return body.op("Slice", [x, body.i64([k * cell]), body.i64([(k + 1) * cell]), body.i64([-1])])


def _gate_products(
    body: _Builder,
    h_in: str,
    gates_t: str,
    w_rec: str,
    cell: int,
    gates_table: list[str] | None,
    step_input: tuple[np.ndarray, np.ndarray] | None,
) -> list[list[str]]:
    """The in-step layout's four Gemms' inputs (A, B, C), gates (i, f, o, g): with ``step_input``,
    [x_t, h] @ [W_in; W_rec]_k + b_k; else layer 0's h @ W_rec_k + the step's rows of gate k's table."""
    if step_input is not None:
        w_in, bias = step_input
        weights = body.op("Concat", [body.const(w_in, "w_in"), w_rec], axis=0)  # (in + P, 4C)
        joined = body.op("Concat", [gates_t, h_in], axis=-1)  # (B, in + P)
        b = body.const(bias, "b")
        return [[joined, _gate_block(body, weights, k, cell), _gate_block(body, b, k, cell)] for k in range(4)]
    rows = [body.op("Gather", [table, gates_t], axis=0) for table in gates_table]  # (B, C) each
    return [[h_in, _gate_block(body, w_rec, k, cell), rows[k]] for k in range(4)]


def _cell_body(
    g: _Builder,
    w_rec: str | np.ndarray,
    w_proj: str | np.ndarray,
    cfg: ModelConfig,
    scope: str,
    lead: list,
    gates_table: str | list[str] | None = None,
    step_input: tuple[np.ndarray, np.ndarray] | None = None,
) -> onnx.GraphProto:
    """Scan body: (h (*lead, B, P), c (*lead, B, C), gates_t (*lead, B, 4C)) -> (h', c', y_t = h'). The weights
    ``w_rec``, ``w_proj``: arrays, stored in the body (the separate layout), or names in the outer graph (the fused
    layout's stacks), read from the body. With ``gates_table`` (R, 4C) in the outer graph, the scanned input is
    the step's table rows (B,) int64 instead, and the body gathers its gates from the table. With ``step_input``
    (the layer's input weights W_in (in, 4C) and bias b (4C,)), the scanned input is the step's layer input x_t
    (B, in) and the gates are one product, [x_t, h] @ [W_in; W_rec] + b. The two weights are joined by a Concat in
    the body, which onnxruntime folds once at load: the data file keeps each as the other graphs store it.

    The in-step layout (``step_input``, or ``gates_table`` as four (R, C) tables, one per gate) computes each gate
    by a product of its own, whose (B, C) result the activations read in place (onnxruntime fuses a Gemm and its
    Sigmoid): no Split copies the (B, 4C) gates twice a step, 1.10-1.15x faster per run at 64-192 rows, but slower
    for a lone sentence on two threads (four smaller products to share out), hence only there
    (bench/notes/front-door.md)."""
    body = _Builder(f"{g.prefix}{scope}/")
    h_in, c_in, gates_t, h_next, c_next, y_t = (
        f"{body.prefix}{name}" for name in ("h", "c", "gates_t", "h_next", "c_next", "y_t")
    )
    cell = cfg.cell_dim
    if isinstance(w_rec, np.ndarray):
        w_rec, w_proj = body.const(w_rec, "w_rec"), body.const(w_proj, "w_proj")
    if step_input is not None or isinstance(gates_table, list):  # the in-step layout
        products = _gate_products(body, h_in, gates_t, w_rec, cell, gates_table, step_input)
        i, f, o, g_part = (body.op("Gemm", product) for product in products)
        i, f, o = (body.op("Sigmoid", [z]) for z in (i, f, o))
    else:
        step_gates = gates_t if gates_table is None else body.op("Gather", [gates_table, gates_t], axis=0)
        z = body.op("Add", [step_gates, body.op("MatMul", [h_in, w_rec])])
        sigmoid_part, g_part = body.op("Split", [z, body.i64([3 * cell, cell])], outputs=2, axis=-1)
        i, f, o = body.op("Split", [body.op("Sigmoid", [sigmoid_part])], outputs=3, axis=-1)
    new_cell = body.op("Add", [body.op("Mul", [i, body.op("Tanh", [g_part])]), body.op("Mul", [f, c_in])])
    new_cell = _clip(body, new_cell, cfg.cell_clip)
    projected = body.op("MatMul", [body.op("Mul", [o, body.op("Tanh", [new_cell])]), w_proj])
    hidden = _clip(body, projected, cfg.proj_clip)
    # The last nodes write h' and c' under the body's output names (no Identity copies per step); y_t is h' again.
    rename = {hidden: h_next, new_cell: c_next}
    for node in body.nodes:
        node.input[:] = [rename.get(name, name) for name in node.input]
        node.output[:] = [rename.get(name, name) for name in node.output]
    body.nodes.append(helper.make_node("Identity", [h_next], [y_t]))

    def value(name: str, width: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [*lead, "batch", width])

    p = cfg.projection_dim
    if gates_table is not None:
        scanned = helper.make_tensor_value_info(gates_t, TensorProto.INT64, [*lead, "batch"])
    else:
        scanned = value(gates_t, 4 * cell if step_input is None else step_input[0].shape[0])
    return helper.make_graph(
        body.nodes,
        f"{scope}_cell",
        [value(h_in, p), value(c_in, cell), scanned],
        [value(h_next, p), value(c_next, cell), value(y_t, p)],
        initializer=body.initializers,
    )


class _Graph:
    """The parts of the context graph shared by both layouts. ``time_major``: the recurrent tensors are
    (S, B, ...) (the separate layout), else (B, S, ...)."""

    def __init__(self, cfg: ModelConfig, time_major: bool) -> None:
        self.cfg, self.time_major = cfg, time_major
        g = self.g = _Builder("context/")
        self.batch_and_steps = g.op("Shape", ["index"])  # [B, S]
        self.batch = g.op("Gather", [self.batch_and_steps, g.i64(0)], axis=0)
        self.steps = g.op("Gather", [self.batch_and_steps, g.i64(1)], axis=0)
        self.with_boundaries = g.op("Add", ["lengths", g.i64(2)])  # (B,) = n_b + 2
        inside = g.op("Cast", [self.positions_below(self.steps, self.with_boundaries)], to=TensorProto.FLOAT)
        self.batch_mask = g.unsqueeze(inside, 2)  # (B, S, 1)
        self.mask = g.unsqueeze(g.op("Transpose", [inside], perm=[1, 0]), 2) if time_major else self.batch_mask
        self.scan_axis = 0 if time_major else 1

    def positions_below(self, count: str, limits: str) -> str:
        """(B, count) bool: position t < limits[b]."""
        positions = self.g.op("Range", [self.g.i64(0), count, self.g.i64(1)])
        return self.g.op("Less", [self.g.unsqueeze(positions, 0), self.g.unsqueeze(limits, 1)])

    def reverse(self, x: str) -> str:
        """Reverse each row's first n_b + 2 positions (along the step axis); padding stays in place."""
        batch_axis, time_axis = (1, 0) if self.time_major else (0, 1)
        return self.g.op("ReverseSequence", [x, self.with_boundaries], batch_axis=batch_axis, time_axis=time_axis)

    def steps_shape(self, width: int) -> str:
        """The shape (S, B, width) or (B, S, width) of the recurrent tensors."""
        g = self.g
        leading = [self.steps, self.batch] if self.time_major else [self.batch, self.steps]
        return g.op("Concat", [*(g.unsqueeze(d, 0) for d in leading), g.i64([width])], axis=0)

    def initial_state(self, initial: str, width: int, lead: list) -> str:
        """(*lead, 1, W) -> (*lead, B, W)."""
        shape = self.g.op("Concat", [self.g.i64(lead), self.g.unsqueeze(self.batch, 0), self.g.i64([width])], axis=0)
        return self.g.op("Expand", [initial, shape])

    def scan(
        self,
        gates: str,
        w: dict,
        layer: str,
        lead: list,
        gates_table: str | list[str] | None = None,
        step_input: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> str:
        """Run the recurrence over ``gates`` (*lead, steps and batch axes, 4C) -> h (*lead, same axes, P); with
        ``gates_table`` (R, 4C), ``gates`` holds table rows (steps and batch axes) int64; with ``step_input``, the
        layer's input (steps and batch axes, in) (see _cell_body)."""
        cfg, axis = self.cfg, self.scan_axis + len(lead)
        _, _, h = self.g.op(
            "Scan",
            [
                self.initial_state(w["h0"], cfg.projection_dim, lead),
                self.initial_state(w["c0"], cfg.cell_dim, lead),
                gates,
            ],
            f"scan_{layer}",
            outputs=3,
            body=_cell_body(self.g, w["w_rec"], w["w_proj"], cfg, layer, lead, gates_table, step_input),
            num_scan_inputs=1,
            scan_input_axes=[axis],
            scan_output_axes=[axis],
        )
        return h


def _separate_layer(
    graph: _Graph, xs: list[str], weights: list[dict], layer: int, inputs_in_step: bool = False
) -> list[str]:
    """One Scan per direction, time-major: xs[d] (S, B, in) -> h[d] (S, B, P). Layer 0's xs[d] are the table
    rows (S, B) int64: its input projection is computed once per table row and gathered per step. A layer above
    it projects its input for all steps at once, outside the loop; with ``inputs_in_step`` inside each step,
    with the recurrent product ([x_t, h] @ [W_in; W_rec]): no (S·B, 4C) gates through memory, 1.11-1.15× faster
    per run at 64 rows, but 1.3-1.55× slower at 1 row and slower at 8, where each step reads twice the weights
    (bench/notes/front-door.md). The export writes it as context_in_step.onnx, which the batch job runs; the
    service keeps the hoisted graph, as a lone sentence's latency comes first."""
    g, outputs = graph.g, []
    for d, (x, w) in enumerate(zip(xs, weights)):
        scope = f"l{layer}d{d}"
        # The step's weights live in the Scan body, where MLAS pre-packs them once (read from the outer scope, they
        # are not: 3-12 % slower per step); a hoisted projection is one 2-D Gemm with the bias folded in.
        if layer > 0 and inputs_in_step:
            names = {k: g.const(w[k], f"{k}_l{layer}d{d}") for k in ("h0", "c0")}
            names |= {"w_rec": w["w_rec"], "w_proj": w["w_proj"]}
            outputs.append(graph.scan(x, names, scope, [], step_input=(w["w_in"], w["b"])))
            continue
        names = {k: g.const(v, f"{k}_l{layer}d{d}") for k, v in w.items() if k not in ("w_rec", "w_proj")}
        names |= {"w_rec": w["w_rec"], "w_proj": w["w_proj"]}
        if layer == 0:
            if inputs_in_step:  # one (R, C) table per gate (_cell_body), each from its block of the weights
                cell = graph.cfg.cell_dim
                blocks = [[_gate_block(g, names[k], gate, cell) for k in ("w_in", "b")] for gate in range(4)]
                table = [g.op("Gemm", ["table", *block]) for block in blocks]
            else:
                table = g.op("Gemm", ["table", names["w_in"], names["b"]])  # (R, 4C)
            outputs.append(graph.scan(x, names, scope, [], gates_table=table))
            continue
        flat = g.op("Reshape", [x, g.i64([-1, w["w_in"].shape[0]])])  # (S*B, in)
        gates = g.op("Gemm", [flat, names["w_in"], names["b"]])  # (S*B, 4C): hoisted
        gates = g.op("Reshape", [gates, graph.steps_shape(4 * graph.cfg.cell_dim)])  # (S, B, 4C)
        outputs.append(graph.scan(gates, names, scope, []))
    return outputs


def _fused_layer(graph: _Graph, xs: list[str], weights: list[dict], layer: int) -> list[str]:
    """Both directions in one Scan: xs[d] (B, S, in) -> h[d] (B, S, P). The (2, ...) weight stacks are built in
    the graph from the same 2-D initializers the separate layout uses (onnxruntime folds them at load), so the
    weights are stored once."""
    g = graph.g
    stacked = {}
    for key in weights[0]:
        parts = [g.unsqueeze(g.const(w[key], f"{key}_l{layer}d{d}"), 0) for d, w in enumerate(weights)]
        stacked[key] = g.op("Concat", parts, axis=0)
    b = g.unsqueeze(stacked["b"], 1)  # (2, 1, 4C)
    x = g.op("Concat", [g.unsqueeze(t, 0) for t in xs], axis=0)  # (2, B, S, in)
    flat = g.op("Reshape", [x, g.i64([2, -1, weights[0]["w_in"].shape[0]])])  # one (2, B*S, in) @ (2, in, 4C)
    gates = g.op("Add", [g.op("MatMul", [flat, stacked["w_in"]]), b])
    shape = g.op("Concat", [g.i64([2]), graph.steps_shape(4 * graph.cfg.cell_dim)], axis=0)
    h = graph.scan(g.op("Reshape", [gates, shape]), stacked, f"l{layer}", [2])  # (2, B, S, P)
    return [g.op("Squeeze", [part, g.i64([0])]) for part in g.op("Split", [h], outputs=2, axis=0)]


def _first_inputs(graph: _Graph, tokens: str) -> list[str]:
    """Layer 0's forward and backward inputs: the table rows (S, B) int64 in the separate layout (its projection
    is gathered per step), the masked token vectors ``tokens`` (B, S, P) in the fused one."""
    x0 = graph.g.op("Transpose", ["index"], perm=[1, 0]) if graph.time_major else tokens
    return [x0, graph.reverse(x0)]


def _batch_major(graph: _Graph, x: str) -> str:
    return graph.g.op("Transpose", [x], perm=[1, 0, 2]) if graph.time_major else x


def build_context_graph(
    state: dict[str, np.ndarray], cfg: ModelConfig, fuse_directions: bool = False, inputs_in_step: bool = False
) -> onnx.ModelProto:
    """``state``: the BiLM state dict as float32 numpy arrays -> the context graph (see the module docstring).
    ``inputs_in_step``: the separate layout's layers above 0 take their input product inside each step (see
    _separate_layer; context_in_step.onnx; measured in bench/notes/runtime-studies.md)."""
    graph = _Graph(cfg, time_major=not fuse_directions)
    g = graph.g
    tokens = g.op("Mul", [g.op("Gather", ["table", "index"], axis=0), graph.batch_mask])  # (B, S, P)
    layers = [g.op("Concat", [tokens, tokens], axis=-1)]
    xs = _first_inputs(graph, tokens)  # forward input, backward input (reversed order; stays reversed up the stack)
    for layer in range(cfg.n_layers):
        weights = [direction_weights(state, direction, layer, cfg) for direction in DIRECTIONS]
        if fuse_directions:
            hs = _fused_layer(graph, xs, weights, layer)
        else:
            hs = _separate_layer(graph, xs, weights, layer, inputs_in_step)
        if layer > 0 and cfg.residual:
            hs = [g.op("Add", [h, x]) for h, x in zip(hs, xs)]
        xs = [g.op("Mul", [h, graph.mask]) for h in hs]
        layers.append(_batch_major(graph, g.op("Concat", [xs[0], graph.reverse(xs[1])], axis=-1)))
    stacked = g.op("Concat", [g.unsqueeze(t, 1) for t in layers], axis=1)  # (B, L+1, S, 2P)
    stacked = g.op("Slice", [stacked, g.i64([1]), g.i64([-1]), g.i64([2])])  # drop <S> and the last slot
    real = graph.positions_below(g.op("Sub", [graph.steps, g.i64(2)]), "lengths")  # (B, T)
    real = g.unsqueeze(g.unsqueeze(g.op("Cast", [real], to=TensorProto.FLOAT), 1), 3)  # (B, 1, T, 1)
    g.nodes.append(helper.make_node("Mul", [stacked, real], ["layers"], name="context/layers"))
    inputs = [
        helper.make_tensor_value_info("table", TensorProto.FLOAT, ["rows", cfg.projection_dim]),
        helper.make_tensor_value_info("index", TensorProto.INT64, ["batch", "steps"]),
        helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch"]),
    ]
    output = helper.make_tensor_value_info(
        "layers", TensorProto.FLOAT, ["batch", cfg.n_output_layers, "tokens", cfg.output_dim]
    )
    model = helper.make_model(
        helper.make_graph(g.nodes, "elmo_context", inputs, [output], initializer=g.initializers),
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="elmo-export",
    )
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model
