"""GPU check of the onnxruntime runtime (run by scripts/gpu-check.sh; imports no torch unless --torch is given).

    python scripts/gpu_check.py MODEL_DIR [--seconds 10] [--batch-sizes 1 64 512] [--clients 16] [--json OUT.json]
        [--torch] [--onnxruntime-from SITE]

1. onnxruntime is onnxruntime-gpu (``get_device() == 'GPU'``); with --onnxruntime-from, imported from that folder
   (a private site put first on PYTHONPATH, so that a CPU ``onnxruntime`` elsewhere cannot shadow it).
2. A plain start picks CUDA by itself: ``requested_providers(None)`` asks for it (GPU visible, CUDA libraries
   preloaded) and the default Embedder runs both graphs on CUDAExecutionProvider (session.get_providers()).
3. Parity: CUDA vs CPU on mixed-length batches, a 200-token sentence, a word over 50 bytes, CJK and emoji.
4. Throughput (tokens/s, latency p50) in process on CUDA at batch 1/64/512 sentences, IOBinding on and off, and on
   CPU at batch 64 for scale; with --torch also the PyTorch eager model on the GPU.
5. Served: ``elmo serve`` with default providers (bench.kit.serve starts it) reports CUDAExecutionProvider, and
   --clients gRPC clients (bench.kit.load.drive) give its tokens/s, latency and zero errors.
Exit status 1 with one line saying why when a step fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elmo.bench.run import synthetic_sentences  # noqa: E402
from elmo.errors import ElmoError  # noqa: E402
from elmo.runtime import CPU, CUDA, Embedder, requested_providers  # noqa: E402

PARITY_TOLERANCE = 2e-3  # cuBLAS/cuDNN sum in other orders (and may use TF32): far below a semantic error (~1)
SENTENCES_PER_REQUEST = 8  # bench.service.compiled_load's request size
SERVED_WARMUP_S = 3.0


class CheckFailed(Exception):
    """One step of the check failed; the message says which and why."""


def check_onnxruntime(site: Path | None) -> dict:
    """The imported onnxruntime is the GPU build, from ``site`` when given."""
    import onnxruntime as ort

    found = {
        "version": ort.__version__,
        "file": ort.__file__,
        "device": ort.get_device(),
        "available_providers": ort.get_available_providers(),
    }
    if site is not None and not Path(ort.__file__).resolve().is_relative_to(site.resolve()):
        raise CheckFailed(f"onnxruntime comes from {ort.__file__}, not {site}: put {site} first on PYTHONPATH")
    if found["device"] != "GPU":
        raise CheckFailed(f"onnxruntime {ort.__version__} at {ort.__file__} is a CPU build (get_device() != 'GPU')")
    return found


def default_cuda_embedder(model: Path) -> tuple[Embedder, dict]:
    """The Embedder a plain start gets; CUDA must be chosen without being named."""
    request = requested_providers(None)
    if CUDA not in request.providers:
        raise CheckFailed(f"a plain start does not request CUDA: {request.reason}")
    try:
        embedder = Embedder(model, cache_size=0)
    except ElmoError as exc:
        raise CheckFailed(f"the default Embedder did not start: {exc}") from None
    active = {"encoder": embedder.encoder.get_providers(), "context": embedder.context.get_providers()}
    if any(providers[0] != CUDA for providers in active.values()):
        raise CheckFailed(f"CUDAExecutionProvider is not active: sessions report {active}")
    return embedder, active


def parity_sentences() -> list[list[str]]:
    rng = np.random.default_rng(7)
    words = [f"w{int(i)}" for i in rng.integers(0, 500, size=200)]
    special = ["x" * 60, "naïve", "中文", "字", "😀", "👍🏽", "Ünïcödé" * 8, "."]
    return [words, special, ["a"], words[:7], ["中", "文", "字", "符", "。"], *synthetic_sentences(40, seed=3)]


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b) if x.size)


def parity(gpu: Embedder, cpu: Embedder) -> dict:
    """CUDA vs CPU, and CUDA with vs without IOBinding, on the same sentences."""
    sentences = parity_sentences()
    on_gpu, on_cpu = gpu.embed_tokens(sentences), cpu.embed_tokens(sentences)
    gpu.io_binding = False
    plain = gpu.embed_tokens(sentences)
    gpu.io_binding = True
    found = {
        "cuda_vs_cpu_max_abs": max_difference(on_gpu, on_cpu),
        "iobinding_vs_plain_max_abs": max_difference(on_gpu, plain),
    }
    if not found["cuda_vs_cpu_max_abs"] <= PARITY_TOLERANCE:
        raise CheckFailed(f"CUDA vs CPU differ by {found['cuda_vs_cpu_max_abs']:.2e} > {PARITY_TOLERANCE:.0e}")
    return found


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


def batches_of(text: list[list[str]], size: int) -> list[list[list[str]]]:
    return [text[i : i + size] for i in range(0, len(text) - size + 1, size)]


def torch_embedder(model_dir: Path):
    import torch

    from elmo.model.checkpoint import load_model
    from elmo.text.chars import batch_to_char_ids

    model = load_model(model_dir).float().eval().cuda()

    def embed(batch):
        with torch.inference_mode():
            layers, _ = model(torch.as_tensor(batch_to_char_ids(batch)).long().cuda())
            layers.cpu()

    return embed


def in_process_throughput(gpu: Embedder, cpu: Embedder, args: argparse.Namespace) -> dict:
    text = synthetic_sentences(max(4096, 3 * max(args.batch_sizes)), seed=0)
    throughput: dict = {}
    torch_embed = torch_embedder(args.model) if args.torch else None
    for size in args.batch_sizes:
        batches = batches_of(text, size)
        for binding in (True, False):
            gpu.io_binding = binding
            key = f"cuda batch {size}" + ("" if binding else " (no IOBinding)")
            throughput[key] = timed(gpu.embed_tokens, batches, args.seconds)
            print(f"{key}: {throughput[key]}", flush=True)
        if torch_embed is not None:
            key = f"torch eager cuda batch {size}"
            throughput[key] = timed(torch_embed, batches, args.seconds)
            print(f"{key}: {throughput[key]}", flush=True)
    gpu.io_binding = True
    throughput["cpu batch 64"] = timed(cpu.embed_tokens, batches_of(text, 64), args.seconds)
    print(f"cpu batch 64: {throughput['cpu batch 64']}", flush=True)
    return throughput


def served_throughput(model: Path, seconds: float, clients: int, expect: str) -> dict:
    """`elmo serve --model MODEL` with default providers, driven by ``clients`` gRPC clients for ``seconds``; the
    server must report ``expect`` as its execution provider and answer every request."""
    from bench.kit.load import MAX_REQUESTS, build_requests, drive
    from bench.kit.serve import start_server
    from bench.kit.texts import make_texts
    from elmo.client import EmbedderClient

    requests = build_requests(make_texts(1024), SENTENCES_PER_REQUEST, [], "float32")
    server = start_server(model, http=False)
    target, log_path = server.grpc_target, server.log_path
    try:
        with EmbedderClient(target) as client:
            provider = client.model_info().execution_provider
        if provider != expect:
            raise CheckFailed(f"`elmo serve` runs on {provider}, not {expect} (log: {log_path})")
        result = asyncio.run(drive(target, requests, clients, seconds, MAX_REQUESTS, None, server.pid, SERVED_WARMUP_S))
    finally:
        exit_code = server.stop()
    found = {"provider": provider, "server_exit_code": exit_code, **result.to_dict()}
    if result.errors or not result.requests or exit_code != 0:
        raise CheckFailed(f"served run: errors {result.errors}, {result.requests} requests, exit code {exit_code}")
    return found


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 512], help="sentences per call")
    parser.add_argument("--clients", type=int, default=16, help="concurrent gRPC clients of the served run")
    parser.add_argument("--threads", type=int, default=None, help="CPU provider threads (default: all)")
    parser.add_argument("--torch", action="store_true", help="also time the PyTorch eager model on the GPU")
    parser.add_argument("--onnxruntime-from", type=Path, default=None, help="the folder onnxruntime must come from")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def run_checks(args: argparse.Namespace, report: dict) -> None:
    report["onnxruntime"] = check_onnxruntime(args.onnxruntime_from)
    print(f"onnxruntime: {report['onnxruntime']}", flush=True)
    gpu, report["active_providers"] = default_cuda_embedder(args.model)
    print(f"a plain start runs both graphs on CUDA: {report['active_providers']}", flush=True)
    cpu = Embedder(args.model, providers=[CPU], intra_op_threads=args.threads, cache_size=0)
    report["parity"] = parity(gpu, cpu)
    print(f"parity: {report['parity']}", flush=True)
    report["model"] = {"path": str(args.model), "dim": gpu.info.dim, "n_layers": gpu.info.n_layers}
    report["throughput"] = in_process_throughput(gpu, cpu, args)
    del gpu, cpu  # the served run's process gets the GPU to itself
    report["served"] = served_throughput(args.model, args.seconds, args.clients, CUDA)
    print(f"served, {args.clients} clients: {report['served']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict = {}
    try:
        run_checks(args, report)
    except CheckFailed as exc:
        report["failed"] = str(exc)
        print(f"GPU CHECK FAILED: {exc}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if "failed" in report:
        return 1
    print("GPU CHECK PASSED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
