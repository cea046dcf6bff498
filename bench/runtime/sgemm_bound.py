"""This CPU's single-precision GEMM rate and the fraction of it a measured embedding rate reaches (issue 42).

    python -m bench.runtime.sgemm_bound --preset small --text brown.txt --lines 2000 \
        --throughput bench/results/batch_throughput_sgemm.json
    python -m bench.runtime.sgemm_bound --model models/default --tokens-per-s 9000

The rate: onnxruntime's own MatMul (MLAS, the library the runtime computes with; ``--threads`` intra-op threads)
on a constant weight matrix, at a large square shape and at the shapes ELMo runs: the LSTM's gates (batch x P ->
4C per step) and the highway (tokens x S -> 2S). Best of ``--repeat`` per shape; the bound is the best rate of
any shape (a shared host's neighbours only ever make a rate lower).

The work: the floating-point operations the model cannot avoid on the text, counted from its config (a
multiply-add is 2): per position (tokens + <S> and </S> per sentence), layer and direction the LSTM's recurrent
gates (P x 4C) and cell projection (C x P), and the input gates (P x 4C) of every layer but the first; per
*distinct* token once (the runtime caches token vectors, and the first layer's input gates depend on the token
alone) the first layer's input gates, the char-CNN over the token's own characters (+ BOW/EOW, no padding), the
highway layers and the projection. Padding, the trim window and repeated tokens are not counted: the bound is the
best any implementation of this model could do on this CPU.

Reported: GFLOP per 1,000 tokens, tokens/s at the bound, and with ``--throughput`` (bench.batch.throughput's JSON:
its best ``after`` ``embed_file_tokens_per_s``) or ``--tokens-per-s``, the fraction of the bound reached.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bench.kit.models import prepare_model
from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.texts import corpus_lines
from elmo.bench.figures import machine
from elmo.text.chars import BYTES, char_lengths, load_char_scheme

SQUARE = 2048


def matmul_rate(m: int, k: int, n: int, threads: int, repeat: int) -> float:
    """GFLOP/s of onnxruntime's MatMul, (m, k) x constant (k, n), best of ``repeat`` (each run long enough)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "sgemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((m, k)).astype(np.float32)
    flops = 2.0 * m * k * n
    calls = max(1, int(2e9 / flops))  # ~2 GFLOP a timing: long enough to read the clock well
    session.run(None, {"x": x})
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        for _ in range(calls):
            session.run(None, {"x": x})
        best = min(best, (time.perf_counter() - began) / calls)
    return flops / best / 1e9


def text_work(config: dict, lines: list[str], scheme=BYTES) -> dict:
    """The floating-point operations the model cannot avoid on ``lines`` (see the module docstring); a token's
    characters as ``scheme`` (the model's, elmo.text.chars) maps it, padding left out."""
    from elmo.text.tokenize import tokenize

    sentences = [tokenize(line).tokens for line in lines]
    sentences = [s for s in sentences if s]
    tokens = sum(len(s) for s in sentences)
    positions = tokens + 2 * len(sentences)
    p, c, layers = config["projection_dim"], config["cell_dim"], config["n_layers"]
    distinct = {t for sentence in sentences for t in sentence}
    gates, projection = 2 * 2 * p * 4 * c, 2 * 2 * c * p  # 2 directions, 2 FLOPs a multiply-add
    # every position: each layer's recurrent gates and cell projection, and the input gates of the layers above the
    # first; the first layer's input gates depend on the token alone: once per distinct token and <S>, </S>
    lstm = positions * (layers * (gates + projection) + (layers - 1) * gates) + (len(distinct) + 2) * gates
    width_of = {int(w): int(n) for w, n in config["filters"]}
    s = sum(width_of.values())
    char_dim = config["char_dim"]
    encoder = 0
    ids = [scheme.token_ids(token) for token in distinct]
    for length in map(int, char_lengths(np.stack(ids), scheme.pad_id) if ids else []):
        for width, channels in width_of.items():
            encoder += 2 * char_dim * width * channels * max(1, length - width + 1)
    encoder += len(distinct) * (config["n_highway"] * 2 * s * 2 * s + 2 * s * p)
    return {
        "sentences": len(sentences),
        "tokens": tokens,
        "distinct_tokens": len(distinct),
        "lstm_gflop": lstm / 1e9,
        "encoder_gflop": encoder / 1e9,
    }


def measured_rate(args) -> float | None:
    if args.tokens_per_s is not None:
        return args.tokens_per_s
    if args.throughput is not None:
        result = json.loads(args.throughput.read_text())
        return float(result["best"]["after"]["embed_file_tokens_per_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("runtime.sgemm_bound", __doc__, model=False)
    parser.add_argument("--model", help="model directory (default: --preset random weights)")
    parser.add_argument("--preset", default="small", help="random-weights shape when no --model (exported once)")
    parser.add_argument("--text", type=Path, default=None, help="text, one sentence a line (bench.kit.texts)")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--throughput", type=Path, default=None, help="bench.batch.throughput's JSON result")
    parser.add_argument("--tokens-per-s", type=float, default=None, help="a measured rate to compare instead")
    parser.add_argument("--out", type=Path, default=result_path("sgemm_bound.json"))
    args = parser.parse_args(argv)
    if args.throughput is not None and not args.throughput.is_file():
        parser.error(f"--throughput {args.throughput}: no such file (bench.batch.throughput --out writes it)")
    directory, named = prepare_model(args)
    config = json.loads((directory / "config.json").read_text())
    p, c, s = config["projection_dim"], config["cell_dim"], sum(int(n) for _, n in config["filters"])
    shapes = {
        "square": (SQUARE, SQUARE, SQUARE),
        "lstm gates, batch 64": (64, p, 4 * c),
        "lstm gates, batch 256": (256, p, 4 * c),
        "highway, 512 tokens": (512, s, 2 * s),
    }
    rates = {name: matmul_rate(*shape, args.threads, args.repeat) for name, shape in shapes.items()}
    for name, rate in rates.items():
        print(f"MatMul {name} {shapes[name]}: {rate:.1f} GFLOP/s ({args.threads} threads)", flush=True)
    lines, source = corpus_lines(args.lines, args.text)
    work = text_work(config, lines, load_char_scheme(directory))
    gflop = work["lstm_gflop"] + work["encoder_gflop"]
    bound = max(rates.values())
    result = {
        "model": named,
        "text": source,
        "threads": args.threads,
        "matmul_gflop_per_s": rates,
        "shapes": shapes,
        **work,
        "gflop_per_1000_tokens": 1000 * gflop / work["tokens"],
        "bound_gflop_per_s": bound,
        "tokens_per_s_at_bound": work["tokens"] * bound / gflop,
    }
    print(
        f"{source}: {work['tokens']} tokens ({work['distinct_tokens']} distinct), {gflop:.1f} GFLOP "
        f"(LSTM {work['lstm_gflop']:.1f}, char-CNN + highway + projection {work['encoder_gflop']:.1f}); "
        f"at {bound:.0f} GFLOP/s: {result['tokens_per_s_at_bound']:.0f} tokens/s"
    )
    rate = measured_rate(args)
    if rate is not None:
        result["measured_tokens_per_s"] = rate
        result["fraction_of_bound"] = rate / result["tokens_per_s_at_bound"]
        print(f"measured {rate:.0f} tokens/s: {100 * result['fraction_of_bound']:.0f} % of the bound")
    result["machine"] = machine()
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
