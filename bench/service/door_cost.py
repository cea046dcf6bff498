"""The front door's CPU cost per request and per token (issue 42), and how many tokens a second one server process can
feed a backend.

    python -m bench.service.door_cost --duration 10
    python -m bench.service.door_cost --sizes 1 8 32 --model tiny --out bench/results/door_cost.json
    python -m bench.service.door_cost --before 03f6808 --rounds 2      # REV's code and this checkout's in turn

One ``elmo serve`` of a model whose runtime costs little (``tiny``: random weights of the tiny shape) is loaded by the
compiled generators of bench.service.compiled_load (``h2load`` for gRPC ``Embed``, ``wrk`` for HTTP ``/v1/embed``
with base64), ``--connections`` at once, with requests of each of ``--sizes`` sentences in turn. Read from /proc
around each run: the CPU time of the server's event-loop thread (its main thread: accepting, decoding, checking,
tokenizing, queueing, building and sending answers; the runtime computes on other threads) and of the whole process.
Per run: the event loop's CPU microseconds per request; over the sizes, a least-squares line ``a + b * tokens``
gives the door's cost per request (``a``) and per token (``b``). The event loop is one thread, so one process
feeds at most ``tokens / (a + b * tokens)`` tokens a second at a request size, whatever the backend. Also per run,
from the server's own ``elmo_batch_sentences`` histogram: the runtime calls a request costs and the sentences a call
carries, the batches the door's arrivals let the batcher form (a call has a fixed cost, so small batches cost the
runtime's threads CPU that the same load in larger batches would not).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.kit.load import build_http_requests, build_requests
from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.revision import code_trees, revision_info
from bench.kit.sample import cpu_seconds
from bench.kit.serve import Server, start_server
from bench.kit.texts import sentences
from bench.service.compiled_load import ensure_generators, grpc_frame, model_directory, run_h2load, run_wrk
from elmo.bench.figures import machine

BATCH_SENTENCES = "elmo_batch_sentences"  # the server's histogram of sentences per runtime call


def measured(server: Server, run) -> dict:
    """``run()``'s result with the event loop's and the process's CPU seconds while it ran, and the runtime calls
    (batches) and their sentences the server counted meanwhile."""
    pid = server.pid
    sentences_before, batches_before = server.histogram(BATCH_SENTENCES)  # outside the CPU readings: the server
    loop_before, process_before = cpu_seconds(pid, pid), cpu_seconds(pid)  # answering /metrics is not the run's
    result = run()
    result["event_loop_cpu_s"] = cpu_seconds(pid, pid) - loop_before
    result["process_cpu_s"] = cpu_seconds(pid) - process_before
    sentences_after, batches_after = server.histogram(BATCH_SENTENCES)
    result["batches"] = int(batches_after - batches_before)
    result["batched_sentences"] = int(sentences_after - sentences_before)
    return result


def batch_shape(result: dict) -> dict:
    """Runtime calls per answered request and sentences per call, from a :func:`measured` run."""
    batches = max(1, result["batches"])
    return {
        "batches_per_request": result["batches"] / max(1, result["requests"]),
        "sentences_per_batch": result["batched_sentences"] / batches,
    }


def fit(points: list[tuple[int, float]]) -> dict:
    """Least squares ``us_per_request = a + b * tokens`` over (tokens per request, microseconds per request). With
    one request size there is no line: ``a`` is then the whole cost of a request of that size (the runs' mean) and
    ``b`` None (``--sizes 8`` compares trees at one size; a line through one point was numpy's rank warning and
    a slope that meant nothing)."""
    tokens, micros = np.array(points, dtype=float).T
    if len(set(tokens.tolist())) < 2:
        return {"us_per_request": float(micros.mean()), "us_per_token": None}
    b, a = np.polyfit(tokens, micros, 1)
    return {"us_per_request": float(a), "us_per_token": float(b)}


def cost_line(line: dict) -> str:
    """The event loop's cost as printed: per request and token, or per request alone at one size (:func:`fit`)."""
    if line["us_per_token"] is None:
        return f"{line['us_per_request']:.0f} us per request (one size)"
    return f"{line['us_per_request']:.0f} us per request + {line['us_per_token']:.2f} us per token"


def measure_server(args, texts: list[str], work: Path, tree: Path | None, label: str) -> dict:
    """One ``elmo serve`` (this checkout's code, or ``tree``'s) under each request size and protocol in turn: per
    protocol its runs and the least-squares line over them."""
    server = start_server(
        model_directory(args.model), threads=args.threads, tree=tree, label=label, serve_args=["--metrics-port", "0"]
    )
    runs = {"grpc": [], "http": []}
    try:
        for size in args.sizes:
            grpc_body, _, tokens = build_requests(texts[:size], size, [], "float32")[0]
            http_body = build_http_requests(texts[:size], size, [], "float32")[0][0]
            (work / "grpc.bin").write_bytes(grpc_frame(grpc_body))
            loads = {
                "grpc": lambda: run_h2load(server.grpc_target, work / "grpc.bin", args.connections, args.duration),
                "http": lambda b=http_body: run_wrk(server.http_address, b, args.connections, args.duration, work),
            }
            for protocol, load in loads.items():
                result = measured(server, load)
                result.update(sentences=size, tokens=tokens, requests_per_s=result["requests"] / result["seconds"])
                result.update(batch_shape(result))
                for key in ("event_loop", "process"):
                    result[f"{key}_us_per_request"] = 1e6 * result[f"{key}_cpu_s"] / max(1, result["requests"])
                runs[protocol].append(result)
                print(
                    f"{label} {protocol} {size} sentences ({tokens} tokens): {result['requests_per_s']:.0f} req/s, "
                    f"event loop {result['event_loop_us_per_request']:.0f} us/request, process "
                    f"{result['process_us_per_request']:.0f} us/request; {result['batches_per_request']:.2f} runtime "
                    f"calls a request, {result['sentences_per_batch']:.1f} sentences a call",
                    flush=True,
                )
    finally:
        server.stop()
    summary = {}
    for protocol, results in runs.items():
        line = fit([(r["tokens"], r["event_loop_us_per_request"]) for r in results])
        per_token = line["us_per_token"] or 0.0  # one size: us_per_request is the whole cost (fit)
        per_request = {r["tokens"]: line["us_per_request"] + per_token * r["tokens"] for r in results}
        line["feeds_tokens_per_s"] = {str(tokens): 1e6 * tokens / micros for tokens, micros in per_request.items()}
        summary[protocol] = line
    return {"runs": runs, "event_loop_cost": summary}


def measure(args, work: Path) -> dict:
    """``--rounds`` rounds, each code tree (this checkout; ``--before REV`` too) in turn within a round."""
    texts, source = sentences(max(args.sizes), min_words=15, max_words=25)
    rounds = []
    with code_trees(args.before) as trees:
        for _ in range(args.rounds):
            rounds.append({label: measure_server(args, texts, work, tree, label) for label, tree in trees})
    return {"model": args.model, "texts": source, "code": revision_info(args.before), "rounds": rounds}


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("service.door_cost", __doc__, model=False)
    parser.add_argument("--model", default="tiny", help="a random preset (default tiny: the runtime costs little)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32], help="sentences per request, in turn")
    parser.add_argument("--duration", type=int, default=10, help="seconds per run")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="the server's runtime threads")
    parser.add_argument("--before", help="also measure this git revision's code, in turn with this checkout's")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=result_path("door_cost.json"))
    args = parser.parse_args(argv)
    ensure_generators()
    work = Path(tempfile.mkdtemp(prefix="door-cost-"))
    try:
        result = {"machine": machine(), "connections": args.connections, **measure(args, work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.out, result)
    for index, entry in enumerate(result["rounds"], 1):
        for label, measured_tree in entry.items():
            for protocol, line in measured_tree["event_loop_cost"].items():
                feeds = ", ".join(f"{int(v):,} at {k}" for k, v in line["feeds_tokens_per_s"].items())
                print(
                    f"round {index} {label} {protocol}: {cost_line(line)} on the event loop; one process feeds "
                    f"at most {feeds} tokens/request tokens/s"
                )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
