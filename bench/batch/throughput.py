"""Throughput of ``elmo embed-file`` against the in-process runtime on the same model, sentences and threads.

    python -m bench.batch.throughput --model models/default [--lines 9000] [--threads 2] [--repeat 3]
    python -m bench.batch.throughput --preset small          # ELMo-small shape, random weights (exported once)

*runtime*: ``Embedder.embed_tokens`` on the sentences tokenized beforehand, ``--shard-lines`` sentences per call
(the runtime sorts and batches them), outputs discarded: the ceiling. Also ``Embedder.embed_texts`` on the raw
lines: the runtime's own answer to the job's input, tokenizer included. Each on an Embedder of its own, built by
the job's backend (the same context graph) and starting with a cold token cache, as the job does.

*embed-file*: the whole job in-process on the raw text (scan + UTF-8 check + tokenizer + windows + runtime + shard
files + commit log + hdf5 assembly or Parquet manifest), end to end; and its rate while shards stream, from its
first to its last commit: what a long input runs at, once start-up and the final flush are amortised.

The paths alternate ``--repeat`` times and the best of each is kept (the machine is shared); CPU seconds (process
time, all threads) are reported too, and the job's by thread (bench.kit.sample.ThreadCpuSampler: the runtime's
runs, its reading thread, the writer, onnxruntime's own threads). ``--memory`` also runs the job as a subprocess on
1x and 4x the lines and reports each one's peak RSS: bounded memory means the two are close once the pipeline is
full (several shards).

Writes JSON to ``--out`` (default bench/results/batch_throughput.json) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.kit.models import prepare_model
from bench.kit.results import result_path
from bench.kit.revision import REPO
from bench.kit.sample import ThreadCpuSampler, run_measured
from bench.kit.texts import corpus_lines
from elmo.bench.figures import machine

if TYPE_CHECKING:
    from elmo.runtime import Embedder


def job_embedder(model: Path, args: argparse.Namespace) -> Embedder:
    """A warmed-up Embedder built by the batch job's own backend (elmo.batch.engines.local_backend: on CPU the
    in_step context graph, which the service's default Embedder does not run), with no token vectors cached yet."""
    from elmo.batch.engines import local_backend

    embedder = local_backend(model, args.batch_tokens, args.threads).embedder
    embedder.warmup()
    return embedder


def time_runtime(model: Path, lines: list[str], args: argparse.Namespace) -> dict:
    """The in-process runtime on the same sentences, ``--shard-lines`` per call: ``embed_tokens`` on sentences
    tokenized beforehand (the strict ceiling) and ``embed_texts`` on the raw lines (the same input as the job).
    Each path runs on an Embedder of its own, built as the job builds its own (:func:`job_embedder`), so that
    each starts with a cold token cache, as the job does: a second path on the first one's Embedder found every
    token's char-CNN vector cached and ran faster than the ceiling. Returns {path: (wall seconds, CPU seconds)},
    each path's token-cache misses while it ran, the context layout and the token count."""
    from elmo.text.tokenize import tokenize

    texts = [line.strip() for line in lines]
    sentences = [tokenize(text).tokens for text in texts]
    timings, misses, layout = {}, {}, None
    for name, items in (("tokens", sentences), ("texts", texts)):
        embedder = job_embedder(model, args)
        call, layout = getattr(embedder, f"embed_{name}"), embedder.context_layout
        missed_before = embedder.cache.misses  # the warm-up's own
        began, cpu = time.perf_counter(), time.process_time()
        for start in range(0, len(items), args.shard_lines):
            call(items[start : start + args.shard_lines])
        timings[name] = (time.perf_counter() - began, time.process_time() - cpu)
        misses[name] = embedder.cache.misses - missed_before
        embedder.close()
    tokens = sum(len(s) for s in sentences)
    return {"timings": timings, "cache_misses": misses, "context_layout": layout, "tokens": tokens}


def time_embed_file(
    model: Path, source: Path, output: Path, args: argparse.Namespace, cpu_interval: float = 0.1
) -> tuple[float, float, float | None, dict[str, float]]:
    """The job's wall and CPU seconds, its steady rate, and its CPU seconds by thread (the runtime's runs, its
    reading thread, its writer: the main thread, onnxruntime's own threads: ``native``), read every
    ``cpu_interval`` seconds: a thread that ends between two readings (the model's loading threads, the runtime's
    pools at the end) loses up to that much of its time."""
    from elmo.batch.job import run_job
    from elmo.batch.layout import parse_layers
    from elmo.batch.options import JobOptions

    options = JobOptions(
        input=source,
        output=output,
        model=model,
        server=None,
        server_model="",
        spec=parse_layers(args.layers),
        output_format=args.format,
        dtype=args.dtype,
        tokenized=False,
        input_format="text",
        batch_tokens=args.batch_tokens,
        shard_lines=args.shard_lines,
        threads=args.threads,
        overwrite=True,
        progress=False,
    )
    threads = ThreadCpuSampler(cpu_interval).start()
    began, cpu = time.perf_counter(), time.process_time()
    result = run_job(options)
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    return seconds, cpu, result.steady_tokens_per_s, threads.stop()


def peak_rss_mb(model: Path, source: Path, output: Path, args: argparse.Namespace) -> float:
    """Peak resident memory of one `elmo embed-file` process (MiB), from its own rusage (bench.kit.sample), so that
    earlier children do not count."""
    command = [sys.executable, "-m", "elmo.cli", "embed-file", str(source), str(output), "--model", str(model)]
    command += ["--layers", args.layers, "--format", args.format, "--dtype", args.dtype, "--no-progress", "--overwrite"]
    command += ["--shard-lines", str(args.shard_lines)]
    if args.batch_tokens:
        command += ["--runtime-batch-tokens", str(args.batch_tokens)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    log = output.with_suffix(".log")
    with open(log, "w") as handle:
        done = run_measured(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"embed-file failed with exit code {done.returncode}; log: {log}")
    return done.peak_rss_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: --preset random weights)")
    parser.add_argument("--preset", default="small", help="random-weights shape when no --model")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-tokens", type=int, default=None, help="default: the runtime's")
    parser.add_argument("--shard-lines", type=int, default=1000)
    parser.add_argument("--layers", default="all")
    parser.add_argument("--format", default="hdf5", choices=["hdf5", "parquet"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="also peak RSS at 1x and 4x --lines (subprocesses)")
    parser.add_argument("--out", type=Path, default=result_path("batch_throughput.json"))
    parser.add_argument("--text", type=Path, help="input text (default: data/corpus/test.txt, else synthetic)")
    args = parser.parse_args()

    model, model_name = prepare_model(args)
    lines, corpus_name = corpus_lines(args.lines, args.text)
    work = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    try:
        source = work / "in.txt"
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
        runtime_s, embed_file_s, runtime_cpu, embed_file_cpu, texts_s, steady_rates = [], [], [], [], [], []
        thread_cpu: list[dict[str, float]] = []
        tokens, runtime_layout = 0, None
        for _ in range(args.repeat):
            measured = time_runtime(model, lines, args)
            tokens = measured["tokens"]
            runtime_layout = measured["context_layout"]
            runtime_s.append(measured["timings"]["tokens"][0])
            runtime_cpu.append(measured["timings"]["tokens"][1])
            texts_s.append(measured["timings"]["texts"][0])
            seconds, cpu, steady, threads = time_embed_file(model, source, work / f"out.{args.format}", args)
            thread_cpu.append(threads)
            embed_file_s.append(seconds)
            embed_file_cpu.append(cpu)
            steady_rates.append(steady or 0.0)
        output_bytes = sum(p.stat().st_size for p in work.glob("out*") if p.is_file()) or sum(
            p.stat().st_size for p in (work / f"out.{args.format}").rglob("*") if p.is_file()
        )
        result = {
            "model": model_name,
            "corpus": corpus_name,
            "lines": len(lines),
            "tokens": tokens,
            "layers": args.layers,
            "format": args.format,
            "dtype": args.dtype,
            "threads": args.threads,
            "batch_tokens": args.batch_tokens,
            "shard_lines": args.shard_lines,
            "runtime_context_layout": runtime_layout,
            "runtime_tokens_per_s": tokens / min(runtime_s),
            "runtime_texts_tokens_per_s": tokens / min(texts_s),
            "runtime_texts_seconds": texts_s,
            "embed_file_tokens_per_s": tokens / min(embed_file_s),
            "embed_file_steady_tokens_per_s": max(steady_rates),
            "embed_file_steady_rates": steady_rates,
            "runtime_seconds": runtime_s,
            "embed_file_seconds": embed_file_s,
            "runtime_cpu_seconds": runtime_cpu,
            "embed_file_cpu_seconds": embed_file_cpu,
            # the fastest run's CPU seconds by thread: where the job's CPU goes
            "embed_file_thread_cpu_seconds": thread_cpu[embed_file_s.index(min(embed_file_s))],
            "output_bytes": output_bytes,
            **machine(),  # CPU model, kernel-relevant flags, cores, library versions, load
        }
        result["ratio"] = result["embed_file_tokens_per_s"] / result["runtime_tokens_per_s"]
        result["ratio_vs_texts"] = result["embed_file_tokens_per_s"] / result["runtime_texts_tokens_per_s"]
        result["ratio_of_medians"] = statistics.median(runtime_s) / statistics.median(embed_file_s)
        # CPU seconds per token do not depend on what else the (shared) machine runs
        result["cpu_ratio"] = min(runtime_cpu) / min(embed_file_cpu)
        if args.memory:
            big = work / "in4.txt"
            big.write_text("\n".join(lines * 4) + "\n", encoding="utf-8")
            result["peak_rss_mb"] = {
                f"{len(lines)} lines": peak_rss_mb(model, source, work / f"m1.{args.format}", args),
                f"{4 * len(lines)} lines": peak_rss_mb(model, big, work / f"m4.{args.format}", args),
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"model: {result['model']}; corpus: {result['corpus']}; {tokens} tokens; "
        f"layers {args.layers}, {args.dtype}, {args.format}"
    )
    print("| path | tokens/s | relative |\n|---|---:|---:|")
    ceiling = result["runtime_tokens_per_s"]
    print(f"| in-process runtime, pre-tokenized (`Embedder.embed_tokens`) | {ceiling:,.0f} | 100 % |")
    print(
        f"| in-process runtime, raw text (`Embedder.embed_texts`) | {result['runtime_texts_tokens_per_s']:,.0f} | "
        f"{100 * result['runtime_texts_tokens_per_s'] / result['runtime_tokens_per_s']:.1f} % |"
    )
    print(
        f"| `elmo embed-file` end to end | {result['embed_file_tokens_per_s']:,.0f} | {100 * result['ratio']:.1f} % |"
    )
    steady = result["embed_file_steady_tokens_per_s"]
    if steady:
        print(
            f"| `elmo embed-file` while shards stream (first to last commit) | {steady:,.0f} | "
            f"{100 * steady / ceiling:.1f} % |"
        )
    print(
        f"(best of {args.repeat} each; ratio of the medians: {100 * result['ratio_of_medians']:.1f} %; "
        f"tokens per CPU-second: {100 * result['cpu_ratio']:.1f} % of the runtime's)"
    )
    by_thread = result["embed_file_thread_cpu_seconds"]
    print("embed-file CPU by thread (fastest run): " + ", ".join(f"{k} {v:.2f} s" for k, v in by_thread.items()))
    if "peak_rss_mb" in result:
        print("peak RSS:", ", ".join(f"{k}: {v:.0f} MB" for k, v in result["peak_rss_mb"].items()))


if __name__ == "__main__":
    main()
