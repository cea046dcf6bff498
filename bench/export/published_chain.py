"""A user's published-size weights through the whole CPU chain, each step timed and its peak memory taken:

    python -m bench.export.published_chain --preset original [--work runs/bench/original] [--lines 200] [--threads 2]

1. ``elmo import-allennlp`` on random bilm-tf files of the preset's shape (export/random_model.py writes them);
2. ``elmo export`` (graphs + verification against PyTorch float64);
3. ``elmo serve`` until grpc.health says SERVING (model load + warm-up forward), then serving the next step;
4. ``elmo embed-file --server`` through that server, and ``elmo embed-file`` in process, hdf5 ``--layers all``.

Each step is its own process; peak RSS is the kernel's maximum resident set of that process (wait4's ru_maxrss,
for the server VmHWM read before SIGTERM). Prints a Markdown table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.kit.revision import REPO
from bench.kit.sample import peak_rss_mib, run_measured
from bench.kit.serve import start_server
from bench.kit.texts import make_texts
from elmo.bench.figures import machine


def run_step(name: str, argv: list[str], log: Path) -> dict:
    """One ``elmo`` command as a child process -> wall seconds and its peak RSS (MiB)."""
    with open(log, "a") as handle:
        handle.write(f"\n$ elmo {' '.join(argv)}\n")
        handle.flush()
        done = run_measured([sys.executable, "-m", "elmo.cli", *argv], stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"step {name!r} failed with exit code {done.returncode}; log: {log}")
    return {"step": name, "seconds": round(done.seconds, 1), "peak_rss_mib": int(done.peak_rss_mib)}


def run_chain(preset: str, work: Path, lines: int, threads: int) -> list[dict]:
    from elmo.export.random_model import write_bilm_tf_files

    work.mkdir(parents=True, exist_ok=True)
    log = work / "chain.log"
    log.write_text("")
    options, weights = write_bilm_tf_files(work / "src", preset, seed=0)
    model = work / "model"
    text = work / "corpus.txt"
    text.write_text("\n".join(make_texts(lines, seed=1)) + "\n")
    steps = [
        run_step(
            "import-allennlp",
            ["import-allennlp", "--options", str(options), "--weights", str(weights), "--out", str(model)],
            log,
        ),
        run_step("export", ["export", "--model", str(model), "--threads", str(threads)], log),
    ]
    started = time.perf_counter()
    server = start_server(model, threads=threads, http=False, timeout=900)
    target = server.grpc_target
    serve = {"step": "serve (start to SERVING)", "seconds": round(time.perf_counter() - started, 1)}
    try:
        layers = ["--layers", "all"]
        steps.append(
            run_step(
                "embed-file --server",
                ["embed-file", str(text), str(work / "remote.hdf5"), "--server", target, *layers],
                log,
            )
        )
        serve["peak_rss_mib"] = round(peak_rss_mib(server.pid))
    finally:
        server.stop()
    steps.insert(2, serve)
    steps.append(
        run_step(
            "embed-file (in process)",
            [
                "embed-file",
                str(text),
                str(work / "local.hdf5"),
                "--model",
                str(model),
                "--threads",
                str(threads),
                *layers,
            ],
            log,
        )
    )
    print(f"logs: {log}, {server.log_path}")
    return steps


def markdown(preset: str, steps: list[dict], lines: int) -> str:
    rows = [f"| {s['step']} | {s['seconds']:.1f} | {s['peak_rss_mib']:,} |" for s in steps]
    head = [
        f"ELMo-{preset} shape, random bilm-tf weights, {lines} lines",
        "",
        "| step | seconds | peak RSS (MiB) |",
        "|---|---:|---:|",
    ]
    return "\n".join(head + rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export.published_chain", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="original", choices=["small", "medium", "original", "tiny"])
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default runs/bench/chain-PRESET)")
    parser.add_argument("--lines", type=int, default=200, help="lines embedded by each embed-file step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="JSON (default WORK/chain.json)")
    args = parser.parse_args(argv)
    work = args.work or REPO / "runs" / "bench" / f"chain-{args.preset}"
    steps = run_chain(args.preset, work, args.lines, args.threads)
    result = {"preset": args.preset, "lines": args.lines, "threads": args.threads, "steps": steps}
    result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
    (args.out or work / "chain.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(args.preset, steps, args.lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
