"""What each layer of the service's gRPC plumbing costs (issue 42), from a bare grpc.aio server up to the service.

    python -m bench.service.door_plumbing --rounds 2 --duration 6 --calls 3000
    python -m bench.service.door_plumbing --model default --out bench/results/door_plumbing_default.json

The rungs answer the same ``Embed`` request (``--per-request`` real English sentences): five of them with the
service's own answer bytes to it, prebuilt (bench.service.door_ceiling's echo server), with more of the service's
plumbing in front each time, and the last one is the service itself (``elmo serve`` of ``--model``):

  bare      grpc.aio alone
  settings  + the service's server settings (message and stream bounds, grpc.aio's own count of calls)
  observer  + its observer interceptor (every call timed, counted, its status code worked out)
  gate      + its call gate (per-peer shares, the request message read against a clock)
  plumbing  all three, as the service stacks them
  service   the service: plumbing, checks, tokenizing, batching, the runtime, the answer

Per rung and round: requests/s under h2load (``--connections`` connections, ``--duration`` seconds) with the
machine's CPU per answered request (every core's busy time from /proc/stat: server, generator and kernel), and the
mean latency of one connection's ``--calls`` calls one after another (h2load ``-c 1``). The rungs take turns, the
order reversed every other round. A rung's cost is its difference from the rung below it, in the same round.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from bench.kit.load import build_requests
from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.revision import in_turn
from bench.kit.serve import start_server
from bench.kit.texts import sentences
from bench.service.compiled_load import ensure_generators, grpc_frame, h2load, loaded, model_directory, run_h2load
from bench.service.door_ceiling import PLUMBING, grpc_answer, start_echo
from elmo.bench.figures import machine

RUNGS: dict[str, tuple[str, ...] | None] = {
    "bare": (),
    "settings": ("settings",),
    "observer": ("observer",),
    "gate": ("gate",),
    "plumbing": PLUMBING,
    "service": None,  # elmo serve itself
}
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def latency_seconds(h2load_output: str) -> float:
    """The mean of h2load's "time for request" line (min, max, mean, sd), in seconds."""
    found = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)\b", h2load_output)
    if found is None:
        raise RuntimeError(f"no request times in h2load's output:\n{h2load_output}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def run_latency(target: str, body: Path, calls: int) -> float:
    """Mean seconds per call of ``calls`` calls on one connection, one at a time."""
    return latency_seconds(h2load(target, body, ["-n", str(calls), "-c", "1"]))


def measure_rung(target: str, body: Path, args) -> dict:
    """One rung's load run (requests/s, machine CPU per request) and latency run."""
    result = loaded(lambda: run_h2load(target, body, args.connections, args.duration))
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} of the calls to {target} failed")
    rate, cores = result["requests"] / result["seconds"], result["machine_busy_cores"]
    return {
        "requests_per_s": round(rate, 1),
        "machine_busy_cores": cores,
        "machine_cpu_us_per_request": round(1e6 * cores / rate, 1),
        "latency_mean_us": round(1e6 * run_latency(target, body, args.calls), 1),
    }


def measure_rounds(targets: dict[str, str], body: Path, args, measure=measure_rung) -> list[dict]:
    """Every rung in every round, in turn (the order reversed every other round)."""
    rounds = []
    for index in range(args.rounds):
        order = in_turn(list(targets), index)
        entry = {"order": order} | {rung: measure(targets[rung], body, args) for rung in order}
        rounds.append(entry)
        print(f"round {index + 1}: " + ", ".join(f"{rung} {entry[rung]['requests_per_s']:.0f} req/s "
                                                 f"{entry[rung]['latency_mean_us']:.0f} us" for rung in targets),
              flush=True)  # fmt: skip
    return rounds


def medians(rounds: list[dict]) -> dict:
    rungs = [rung for rung in rounds[0] if rung != "order"]
    keys = ("requests_per_s", "machine_cpu_us_per_request", "latency_mean_us")
    return {rung: {key: round(statistics.median(r[rung][key] for r in rounds), 1) for key in keys} for rung in rungs}


def table(result: dict) -> str:
    lines = ["| rung | requests/s | machine CPU per request (us) | latency, one connection (us) |",
             "|---|---:|---:|---:|"]  # fmt: skip
    for rung, m in result["medians"].items():
        lines.append(f"| {rung} | {m['requests_per_s']:,.0f} | {m['machine_cpu_us_per_request']:,.0f} | "
                     f"{m['latency_mean_us']:,.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("service.door_plumbing", __doc__, model=False)
    parser.add_argument("--model", default="tiny",
                        help="tiny or small (random weights of that shape), or default (models/default); default tiny")
    parser.add_argument("--threads", type=int, default=2, help="the service's runtime threads")
    parser.add_argument("--per-request", type=int, default=8, help="sentences in the request")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--duration", type=int, default=6, help="seconds of each load run")
    parser.add_argument("--calls", type=int, default=3000, help="calls of each latency run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=result_path("door_plumbing.json"))
    args = parser.parse_args(argv)
    ensure_generators()
    texts, source = sentences(args.per_request, min_words=15, max_words=25)
    request, _, tokens = build_requests(texts, args.per_request, [], "float32")[0]
    work = Path(tempfile.mkdtemp(prefix="door-plumbing-"))
    body = work / "grpc.bin"
    body.write_bytes(grpc_frame(request))
    service = start_server(model_directory(args.model), threads=args.threads, http=False)
    echoes: list[subprocess.Popen] = []
    try:
        answer = grpc_answer(service.grpc_target, request)
        targets = {}
        for rung, plumbing in RUNGS.items():
            if plumbing is None:
                targets[rung] = service.grpc_target
                continue
            process, port = start_echo("grpc", answer, work, plumbing)
            echoes.append(process)
            targets[rung] = f"127.0.0.1:{port}"
        rounds = measure_rounds(targets, body, args)
    finally:
        service.stop()
        for process in echoes:
            process.terminate()
            process.wait(10)
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "texts": source, "tokens_per_request": tokens, "answer_bytes": len(answer), "rounds": rounds,
              "medians": medians(rounds)} | machine()  # fmt: skip
    write_json(args.out, result)
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
