"""What the load-time check (elmo.runtime.probe) costs when a model loads, beside the load itself.

    python -m bench.runtime.load_check --model models/default
    python -m bench.runtime.load_check --preset original            # ELMo-original shape, random weights

Each round opens an Embedder without the check (sessions, graphs, the probe file read and its sha256 checked), then
runs the check once: the probe's sentences through the cold runtime, as a server's warm-up does. Medians over
``--repeat`` rounds; JSON to ``--out`` with the machine's CPU and flags (``host``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.kit.models import prepare_model
from bench.kit.results import result_path
from elmo.bench.figures import machine
from elmo.runtime import CPU, Embedder
from elmo.runtime.host import host_summary


def one_round(model: Path, threads: int) -> dict[str, float]:
    started = time.perf_counter()
    runtime = Embedder(model, providers=[CPU], intra_op_threads=threads, check_on_load=False)
    loaded = time.perf_counter()
    result = runtime.check()
    checked = time.perf_counter()
    runtime.close()
    if not result.passed:
        raise SystemExit(f"the check failed: {result.figures}")
    return {"load_ms": 1000 * (loaded - started), "check_ms": 1000 * (checked - loaded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: --preset random weights)")
    parser.add_argument("--preset", default="small", help="random-weights shape when no --model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=result_path("load_check.json"))
    args = parser.parse_args()
    model, label = prepare_model(args)
    rounds = [one_round(model, args.threads) for _ in range(args.repeat)]
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    tokens = len(json.loads((model / "onnx.json").read_text())["probe"]["sentences"])
    result = {"model": label, "threads": args.threads, **machine(), "rounds": rounds, "median": medians}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{label}; {args.threads} threads; {host_summary()}; probe of {tokens} sentences")
    print(f"load {medians['load_ms']:.0f} ms, load-time check {medians['check_ms']:.0f} ms (medians of {args.repeat})")


if __name__ == "__main__":
    main()
