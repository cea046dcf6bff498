"""GPU check of the onnxruntime runtime (run by scripts/gpu-check.sh; imports no torch unless --torch is given).

    python scripts/gpu_check.py MODEL_DIR [--seconds 10] [--json OUT.json] [--torch]

1. CUDAExecutionProvider must really be active (session.get_providers(), not the request) for both graphs.
2. Parity: CUDA vs CPU on mixed-length batches, a 200-token sentence, a word over 50 bytes, CJK and emoji.
3. Throughput (tokens/s, latency p50) on CUDA at several batch sizes, IOBinding on and off, and on CPU at
   batch 64 for scale; with --torch also the PyTorch eager model on the GPU.
Exit status 1 with one line saying why when CUDA is not active or parity fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.run import synthetic_sentences  # noqa: E402
from elmo.errors import ElmoError  # noqa: E402
from elmo.runtime import CPU, CUDA, Embedder  # noqa: E402

PARITY_TOLERANCE = 2e-3  # cuBLAS/cuDNN sum in other orders (and may use TF32): far below a semantic error (~1)


def parity_sentences() -> list[list[str]]:
    rng = np.random.default_rng(7)
    words = [f"w{int(i)}" for i in rng.integers(0, 500, size=200)]
    special = ["x" * 60, "naïve", "中文", "字", "😀", "👍🏽", "Ünïcödé" * 8, "."]
    return [words, special, ["a"], words[:7], ["中", "文", "字", "符", "。"], *synthetic_sentences(40, seed=3)]


def timed(embed, batches: list[list[list[str]]], seconds: float) -> dict:
    embed(batches[0])  # warm-up: kernels, allocations
    times, tokens, started = [], 0, time.perf_counter()
    for batch in batches:
        begin = time.perf_counter()
        embed(batch)
        times.append(time.perf_counter() - begin)
        tokens += sum(len(s) for s in batch)
        if time.perf_counter() - started > seconds and len(times) >= 3:
            break
    return {
        "tokens_per_s": round(tokens / sum(times)),
        "latency_ms_p50": round(1e3 * statistics.median(times), 2),
        "batches": len(times),
    }


def torch_embedder(model_dir: Path):
    import torch

    from elmo.chars import batch_to_char_ids
    from elmo.checkpoint import load_model

    model = load_model(model_dir).float().eval().cuda()

    def embed(batch):
        with torch.inference_mode():
            layers, _ = model(torch.as_tensor(batch_to_char_ids(batch)).long().cuda())
            layers.cpu()

    return embed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--threads", type=int, default=None, help="CPU provider threads (default: all)")
    parser.add_argument("--torch", action="store_true", help="also time the PyTorch eager model on the GPU")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import onnxruntime as ort

    report: dict = {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}
    print(f"onnxruntime {ort.__version__}; providers compiled in: {report['available_providers']}", flush=True)
    try:
        gpu = Embedder(args.model, providers=[CUDA], cache_size=0)
    except ElmoError as exc:
        print(f"GPU CHECK FAILED: CUDAExecutionProvider is not active: {exc}", flush=True)
        return 1
    active = {"encoder": gpu.encoder.get_providers(), "context": gpu.context.get_providers()}
    report["active_providers"] = active
    if any(providers[0] != CUDA for providers in active.values()):
        print(f"GPU CHECK FAILED: sessions report {active}", flush=True)
        return 1
    print(f"CUDA active for both graphs: {active}", flush=True)
    cpu = Embedder(args.model, providers=[CPU], intra_op_threads=args.threads, cache_size=0)

    sentences = parity_sentences()
    on_gpu, on_cpu = gpu.embed_tokens(sentences), cpu.embed_tokens(sentences)
    gpu.io_binding = False
    plain = gpu.embed_tokens(sentences)
    gpu.io_binding = True
    error = max(float(np.abs(a - b).max()) for a, b in zip(on_gpu, on_cpu) if a.size)
    binding_error = max(float(np.abs(a - b).max()) for a, b in zip(on_gpu, plain) if a.size)
    report["parity"] = {"cuda_vs_cpu_max_abs": error, "iobinding_vs_plain_max_abs": binding_error}
    print(f"parity: CUDA vs CPU max abs diff {error:.2e}; IOBinding vs plain run {binding_error:.2e}", flush=True)
    if not error <= PARITY_TOLERANCE:
        print(f"GPU CHECK FAILED: CUDA vs CPU differ by {error:.2e} > {PARITY_TOLERANCE:.0e}", flush=True)
        return 1

    text = synthetic_sentences(4096, seed=0)
    throughput: dict = {}
    torch_embed = torch_embedder(args.model) if args.torch else None
    for size in args.batch_sizes:
        batches = [text[i : i + size] for i in range(0, len(text) - size + 1, size)]
        for binding in (True, False):
            gpu.io_binding = binding
            key = f"cuda batch {size}" + ("" if binding else " (no IOBinding)")
            throughput[key] = timed(gpu.embed_tokens, batches, args.seconds)
            print(f"{key}: {throughput[key]}", flush=True)
        if torch_embed is not None:
            throughput[f"torch eager cuda batch {size}"] = timed(torch_embed, batches, args.seconds)
            print(f"torch eager cuda batch {size}: {throughput[f'torch eager cuda batch {size}']}", flush=True)
    batches = [text[i : i + 64] for i in range(0, len(text) - 63, 64)]
    throughput["cpu batch 64"] = timed(cpu.embed_tokens, batches, args.seconds)
    print(f"cpu batch 64: {throughput['cpu batch 64']}", flush=True)
    report["throughput"] = throughput
    report["model"] = {"path": str(args.model), "dim": gpu.info.dim, "n_layers": gpu.info.n_layers}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print("GPU CHECK PASSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
