"""Server memory under steady load (issue 28): does the RSS settle, or keep growing?

    python -m bench.service.memory --model models/default --window 60 --windows 10 # 16 gRPC clients, 10 windows of 60 s
    python -m bench.service.memory --model models/default --window 60 --before REV

``elmo serve`` (127.0.0.1, ``--port 0 --http-port 0``) is driven by bench.service.loadgen's client loop (``drive``: 16
gRPC clients, one channel each, requests of 8 sentences of 4-40 tokens, serialized once, back to back) for
``--windows`` consecutive windows of ``--window`` seconds (the clients reconnect between two windows, nothing
else pauses). The server's VmRSS is read from /proc/PID/status every second throughout. Per window: requests,
errors, latency, and the RSS at its end and its maximum. The verdict (issue 39): is every window from window 4 on
within 3 % of window 4 (RSS at the end, and the maximum)? A server grows while its caches and arenas fill (about
three minutes here) and must then stay level; one that still grows under the same load is leaking. A run of fewer
than 5 windows compares its last window with the one before.

Results: a table on stdout, JSON (``--out``, default bench/results/memory.json) and the RSS curve (.png beside it).
``--before REV`` runs REV's server (a git worktree) and this checkout's in turn, ``--rounds`` pairs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from bench.kit.load import build_requests, drive
from bench.kit.results import RESULTS, bench_parser, fmt, pyplot, save_figure, save_result
from bench.kit.revision import code_trees, revision_info
from bench.kit.sample import RssSampler, rss_mib
from bench.kit.serve import start_server
from bench.kit.texts import make_texts
from elmo.bench.figures import machine

TOLERANCE = 0.03  # every window from REFERENCE_WINDOW on within 3 % of it
REFERENCE_WINDOW = 4  # the RSS grows for about three windows of 60 s (arenas, caches), then must stay level


def measure(args: argparse.Namespace, label: str, tree: Path | None, requests: list) -> dict:
    served = start_server(args.model, threads=args.threads, serve_args=args.serve_arg, tree=tree, label=label)
    origin = time.monotonic()
    sampler = RssSampler(served.pid).start()
    windows = []
    try:
        for index in range(args.windows):
            began = time.monotonic()
            result = asyncio.run(
                drive(
                    served.grpc_target,
                    requests,
                    args.concurrency,
                    args.window,
                    1_000_000,
                    server_pid=served.pid,
                    warmup_s=args.warmup if index == 0 else 0.0,
                )
            )
            end_rss = rss_mib(served.pid)
            windows.append({"began": began, "ended": time.monotonic(), "end_rss": end_rss, "load": result.to_dict()})
            print(
                f"{label}: window {index + 1}: {result.requests} requests, {sum(result.errors.values())} errors, "
                f"RSS {fmt(end_rss)} MiB",
                file=sys.stderr,
                flush=True,
            )
    finally:
        samples = sampler.stop()
        exit_code = served.stop()
    out_windows = []
    for index, window in enumerate(windows):
        start = window["began"] + (args.warmup if index == 0 else 0.0)
        inside = [v for t, v in samples if start <= t <= window["ended"]] + (
            [window["end_rss"]] if window["end_rss"] else []
        )
        load = window["load"]
        out_windows.append(
            {
                "window": index + 1,
                "requests": load["requests"],
                "errors": load["errors"],
                "tokens_per_s": load["tokens_per_s"],
                "latency_ms": load["latency_ms"],
                "rss_end_mib": round(window["end_rss"], 1) if window["end_rss"] else None,
                "rss_max_mib": round(max(inside), 1) if inside else None,
                "rss_start_mib": round(inside[0], 1) if inside else None,
            }
        )
    return {
        "tree": label,
        "server_exit_code": exit_code,
        "windows": out_windows,
        "verdict": verdict(out_windows),
        "rss_series": [(round(t - origin, 2), round(v, 2)) for t, v in samples],
    }


def verdict(windows: list[dict]) -> dict:
    """Every window after the reference (window 4; in a run of fewer than 5, the one before the last) against it:
    the end RSS and the maximum, each within 3 %; ``change_percent`` is the largest change, by size."""
    if len(windows) < 2:
        return {"ok": None}
    reference = windows[min(REFERENCE_WINDOW, len(windows) - 1) - 1]
    later = windows[reference["window"] :]
    out: dict = {"reference_window": reference["window"]}
    for key in ("rss_end_mib", "rss_max_mib"):
        base = reference[key]
        changes = [(w[key] - base) / base for w in later if base and w[key] is not None]
        worst = max(changes, key=abs) if changes else None
        out[key] = {
            f"window_{reference['window']}": base,
            "later": [w[key] for w in later],
            "change_percent": None if worst is None else round(100 * worst, 2),
            "ok": None if worst is None else all(abs(c) <= TOLERANCE for c in changes),
        }
    out["errors"] = sum(sum(w["errors"].values()) for w in windows)
    out["ok"] = bool(out["rss_end_mib"]["ok"] and out["rss_max_mib"]["ok"]) and out["errors"] == 0
    return out


def print_run(run: dict, args: argparse.Namespace) -> None:
    print(f"\n## {run['tree']}: {args.concurrency} gRPC clients, {len(run['windows'])} windows of {args.window:.0f} s")
    print("| window | requests | errors | tokens/s | p50 / p99 ms | RSS start -> end (max), MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for w in run["windows"]:
        lat = w["latency_ms"]
        print(
            f"| {w['window']} | {w['requests']:,} | {sum(w['errors'].values())} | {w['tokens_per_s']:,.0f} | "
            f"{fmt(lat.get('p50'), 0)} / {fmt(lat.get('p99'), 0)} | {fmt(w['rss_start_mib'])} -> "
            f"{fmt(w['rss_end_mib'])} ({fmt(w['rss_max_mib'])}) |"
        )
    v = run["verdict"]
    if v.get("ok") is not None:
        end, peak = v["rss_end_mib"], v["rss_max_mib"]
        print(
            f"windows after window {v['reference_window']} against it, largest change: end RSS "
            f"{end['change_percent']:+.2f} %, max {peak['change_percent']:+.2f} % (limit ±{100 * TOLERANCE:.0f} %): "
            f"{'PASS' if v['ok'] else 'FAIL'}"
        )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(11, 4))
    for index, run in enumerate(result["runs"]):
        series = run["rss_series"]
        if series:
            ax.plot(*zip(*series), label=f"{run['tree']} (run {index + 1})")
    ax.set_xlabel("seconds since the server was SERVING")
    ax.set_ylabel("server VmRSS (MiB)")
    ax.set_title(f"server RSS under {result['config']['concurrency']} gRPC clients")
    ax.legend()
    save_figure(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("service.memory", __doc__)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per window")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before window 1")
    parser.add_argument("--concurrency", type=int, default=16, help="gRPC clients")
    parser.add_argument("--sentences-per-request", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="server onnxruntime intra-op threads")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
    parser.add_argument("--before", metavar="REV", help="also run git revision REV's server (a worktree), in turn")
    parser.add_argument("--rounds", type=int, default=1, help="with --before: before/after pairs, alternating")
    parser.add_argument("--label", default="after", help="without --before: the name of this checkout's runs")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json", help="JSON (a .png plot beside it)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.window <= 600 or not 2 <= args.windows <= 10 or not 0 < args.concurrency <= 256:
        parser.error("--window in (0, 600], --windows in 2..10, --concurrency in 1..256")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    requests = build_requests(make_texts(1024, 0), args.sentences_per_request, [], "float32")
    runs = []
    with code_trees(args.before, args.label) as trees:
        for _ in range(args.rounds if args.before else 1):
            for label, tree in trees:
                run = measure(args, label, tree, requests)
                print_run(run, args)
                runs.append(run)
    result = {
        "bench": "memory",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "revisions": revision_info(args.before, args.label),
        **machine(load_at_start),
        "runs": runs,
    }
    save_result(args.out, result, plot, args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
