"""The exact biLSTM recurrence, measured in the forms we considered (docs/explanation/runtime.md, "alternatives").

    python -m bench.runtime.recurrence --model runs/bench-models/elmo-small --batch-sizes 1 8 64 --steps 27 --threads 1

Every variant computes the same thing from the same token vectors (B, S, P) and lengths: both directions, all
layers, clips, residual, padding-exact reversal, output (B, L+1, S-2, 2P). Variants:
  torch eager      elmo.model.bilm's ProjectionLSTM stacks (the training code), Python loop over steps
  ort loop         the same traced with the loop in torch.jit.script_if_tracing -> ONNX Loop (any length)
  ort unrolled     the eager loop traced at exactly S steps (one graph per length bucket; best case: no bucket
                   padding; the graph only works for that S)
  ort scan separate  export/context_graph.py, one Scan per direction and layer (any length): the runtime's
                   CPU graph (context.onnx)
  ort scan separate inputs in step  the same with the layers above 0 taking their input product inside each
                   step, with the recurrent one (build_context_graph's ``inputs_in_step``: context_in_step.onnx, the
                   batch job's CPU graph)
  ort scan fused   the same with both directions in one Scan per layer: the runtime's CUDA graph
                   (context_fused.onnx)
Each variant's max abs difference from torch eager is printed next to its time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from elmo.export.context_graph import build_context_graph

import elmo.model.bilm as elmo_model
from elmo.bench.figures import machine
from elmo.model.checkpoint import load_model


class TorchContext(torch.nn.Module):
    """tokens (B, S, P) with boundaries, lengths (B,) real tokens -> layers (B, L+1, S-2, 2P), via the model's
    own stacks (same maths as context.onnx)."""

    def __init__(self, model: elmo_model.BiLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        model, full = self.model, lengths + 2
        steps = torch.arange(tokens.shape[1]).view(1, -1)
        mask = (steps < full.view(-1, 1)).unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * mask
        forward = model.run_stack(model.forward_layers, tokens, mask)
        backward = model.run_stack(model.backward_layers, elmo_model.reverse_padded(tokens, full), mask)
        layers = [torch.cat([tokens, tokens], -1)]
        layers += [torch.cat([f, elmo_model.reverse_padded(b, full)], -1) for f, b in zip(forward, backward)]
        valid = (steps[:, 2:] - 2 < lengths.view(-1, 1)).to(tokens.dtype).view(tokens.shape[0], 1, -1, 1)
        return torch.stack(layers, 1)[:, :, 1:-1] * valid


@torch.jit.script_if_tracing
def _loop_recurrence(
    gates_x: torch.Tensor,
    w_rec: torch.Tensor,
    b_rec: torch.Tensor,
    w_proj: torch.Tensor,
    cell_clip: float,
    proj_clip: float,
) -> torch.Tensor:
    cell = torch.zeros([gates_x.shape[0], w_proj.shape[1]], dtype=gates_x.dtype)
    hidden = torch.zeros([gates_x.shape[0], w_proj.shape[0]], dtype=gates_x.dtype)
    outputs: list[torch.Tensor] = []
    for t in range(gates_x.shape[1]):
        z = gates_x[:, t] + torch.matmul(hidden, w_rec.t()) + b_rec
        i, f, g, o = z.chunk(4, dim=-1)
        cell = torch.clamp(torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * cell, -cell_clip, cell_clip)
        hidden = torch.clamp(torch.matmul(torch.sigmoid(o) * torch.tanh(cell), w_proj.t()), -proj_clip, proj_clip)
        outputs.append(hidden)
    return torch.stack(outputs, dim=1)


@contextlib.contextmanager
def loop_recurrence():
    original = elmo_model.projection_lstm_recurrence
    elmo_model.projection_lstm_recurrence = lambda gx, wr, br, wp, cc, pc, **_: _loop_recurrence(gx, wr, br, wp, cc, pc)
    try:
        yield
    finally:
        elmo_model.projection_lstm_recurrence = original


def export(module: torch.nn.Module, args: tuple, path: Path, dynamic_steps: bool) -> None:
    axes = {"tokens": {0: "batch", 1: "steps"} if dynamic_steps else {0: "batch"}, "lengths": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["tokens", "lengths"],
            output_names=["layers"],
            dynamic_axes=axes,
        )


VARIANTS = ("loop", "unrolled", "scan separate", "scan separate inputs in step", "scan fused")
SCAN_LAYOUTS = {  # variant -> build_context_graph's layout arguments
    "scan fused": {"fuse_directions": True},
    "scan separate": {},
    "scan separate inputs in step": {"inputs_in_step": True},
}


def measure_batch(context: TorchContext, sessions: dict, batch: int, args: argparse.Namespace) -> dict:
    """All variants on the same input, taking turns run by run (the machine's load hits them alike); medians."""
    tokens = torch.randn(batch, args.steps, context.model.cfg.projection_dim)
    lengths = torch.full((batch,), args.steps - 2)
    traced = {"tokens": tokens.numpy(), "lengths": lengths.numpy()}
    # The Scan graphs read a token table and an index into it: here every position is its own row.
    scan = {
        "table": tokens.reshape(-1, tokens.shape[-1]).numpy(),
        "index": np.arange(batch * args.steps).reshape(batch, args.steps),
        "lengths": lengths.numpy(),
    }
    with torch.inference_mode():
        reference = context(tokens, lengths).numpy()
    row = {"batch": batch, "steps": args.steps}
    runs = {"torch eager": lambda: context(tokens, lengths)}
    for name, session in sessions.items():
        feeds = scan if name.startswith("scan") else traced
        row[f"ort {name} max abs diff"] = float(np.abs(session.run(None, feeds)[0] - reference).max())
        runs[f"ort {name}"] = lambda s=session, f=feeds: s.run(None, f)
    times: dict[str, list[float]] = {name: [] for name in runs}
    clock = time.thread_time if args.cpu_time else time.perf_counter
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, fn in runs.items():
                start = clock()
                fn()
                times[name].append(clock() - start)
    per_run = batch * (args.steps - 2)
    for name, values in times.items():
        row[name] = statistics.median(values)
    print(
        f"B={batch:3d} S={args.steps}: "
        + " · ".join(f"{k} {1e3 * row[k]:.1f} ms ({per_run / row[k]:,.0f} tok/s)" for k in runs),
        "· max abs diff " + "/".join(f"{row[f'ort {n} max abs diff']:.1e}" for n in sessions),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=27, help="S = tokens + 2 (all rows full length)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with this thread's CPU time (with --threads 1 all work runs on the calling thread): steadier "
        "than wall time on a shared, loaded machine",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model).eval()
    context = TorchContext(model).eval()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        sample = (torch.randn(2, args.steps, model.cfg.projection_dim), torch.tensor([args.steps - 2, 3]))
        with loop_recurrence():
            export(context, sample, Path(scratch) / "loop.onnx", dynamic_steps=True)
        export(context, sample, Path(scratch) / "unrolled.onnx", dynamic_steps=False)
        state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        for name, layout in SCAN_LAYOUTS.items():
            graph = build_context_graph(state, model.cfg, **layout)
            (Path(scratch) / f"{name}.onnx").write_bytes(graph.SerializeToString())
        sessions = {
            name: ort.InferenceSession(str(Path(scratch) / f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
            for name in VARIANTS
        }
        for batch in args.batch_sizes:
            rows.append(measure_batch(context, sessions, batch, args))
    if args.json:
        clock = "thread CPU time" if args.cpu_time else "wall time"
        summary = {"threads": args.threads, "clock": clock, "model": str(args.model), "rows": rows}
        summary |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
