"""Noisy neighbours (issue 28): do well-behaved clients and health probes keep their latency while two clients send
the worst requests the server's limits allow?

    python -m bench.service.noisy --model models/default --duration 20                  # alone, then with the abusers
    python -m bench.service.noisy --model models/default --duration 20 --before REV --rounds 2
    python -m bench.service.noisy --model models/default --single               # the worst single requests, one by one

Phases (one ``elmo serve --port 0 --http-port 0`` on 127.0.0.1 per run): a short warm-up, then ``--duration``
seconds of 8 well-behaved clients alone (4 gRPC through ``elmo.client.EmbedderClient``, 4 HTTP ``POST
/v1/embeddings`` on a kept-alive connection, each one 15-25-word sentence per request, back to back), then
``--duration`` seconds of the same with 2 abusers (``--abusers``), each rotating back to back through the largest
request of each kind that the server *accepts* (sized from the server's own limits, GetModelInfo, then shrunk
before the run while the server refuses it with 413: bench.service.noisy_load.fit_abuse_sizes):

  largest-pooled    POST /v1/embeddings, --max-pooled-inputs texts (2,048) of --max-pooled-tokens (300,000) in all
  most-tokens       POST /v1/embed, --max-inputs sentences totalling --max-request-tokens tokens, base64
  largest-window    POST /v1/embed, one text of --max-request-tokens tokens, "overflow": "window", base64
  largest-tokenize  POST /v1/tokenize, --max-request-tokens tokens of words long enough to fill the body limit
  largest-json      POST /v1/embed, float, every layer and a task mix (when the model has tasks), the most tokens
                    whose JSON answer fits --max-response-bytes

Each abuser's answers are counted by status (all 200 when the fit worked), read and thrown away. Throughout, a
prober calls HTTP ``GET /health`` and gRPC ``grpc.health.v1`` Check every 50 ms each and records every wait. The
well-behaved clients, the abusers and the prober are three processes of their own, so that one's work (reading a
100 MB answer) does not delay another's clock.

The issue's bar: well-behaved p99 with the abusers <= 2 x p99 alone + 50 ms; the worst health wait <= 250 ms.

``--single``: the four worst single requests of the issue (a 5.4 MB ``"apple " * 900000`` embeddings body;
``/v1/tokenize`` on ``"apple pie " * 700000``, or as much as the body limit allows; ``/v1/embed`` overflow window on
8,000 tokens, float; a 1 MB embeddings body), one at a time with the prober running: each one's status and time
and the prober's worst wait while it ran. ``--single --single-set abusers`` does the same with the abusers' five.

Results: a table on stdout, JSON (``--out``, default bench/results/noisy.json or noisy-single.json) and a timeline
plot beside it (.png). ``--before REV`` serves REV's code (a git worktree) and this checkout's in turn, ``--rounds``
times, the same model and limits for both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from bench.kit.load import Http
from bench.kit.results import RESULTS, bench_parser, fmt, pyplot, save_figure, save_result
from bench.kit.revision import code_trees, revision_info
from bench.kit.serve import start_server
from bench.kit.texts import sentences
from bench.service.noisy_load import (
    ABUSE_KINDS,
    HEALTH_BAR_MS,
    PROBE_INTERVAL_S,
    Workers,
    abuse_requests,
    abusers_process,
    clients_process,
    fit_abuse_sizes,
    prober_process,
    server_limits,
    single_requests,
)
from elmo.bench.figures import machine, percentiles_ms

MAX_PHASE_S = 600.0


# -- analysis ----------------------------------------------------------------------------------------------------


def _within(events: list[tuple], start: float, end: float) -> list[tuple]:
    return [e for e in events if start <= e[1] < end]


def _overlapping(probes: list[tuple], start: float, end: float) -> list[tuple]:
    """Probes (name, started, wait, status) whose wait overlaps [start, end]."""
    return [p for p in probes if p[1] <= end and p[1] + p[2] >= start]


def phase_report(events: dict[str, list], start: float, end: float) -> dict:
    clients = _within(events.get("clients", []), start, end)
    seconds = end - start
    report: dict = {"seconds": round(seconds, 2), "well_behaved": {}, "health": {}}
    for name, kinds in (("grpc", ("grpc",)), ("http", ("http",)), ("all", ("grpc", "http"))):
        mine = [e for e in clients if e[0] in kinds]
        ok = [e[2] - e[1] for e in mine if e[3] in ("OK", "200")]
        report["well_behaved"][name] = percentiles_ms(ok) | {
            "requests_per_s": round(len(ok) / seconds, 2) if seconds else 0.0,
            "errors": dict(Counter(e[3] for e in mine if e[3] not in ("OK", "200"))),
        }
    probes = _within(events.get("prober", []), start, end)
    for name in ("http", "grpc"):
        mine = [p for p in probes if p[0] == name]
        waits = [p[2] for p in mine]
        report["health"][name] = percentiles_ms(waits) | {
            "worst_at_s": round(max(mine, key=lambda p: p[2])[1] - start, 2) if mine else None,
            "not_serving": sum(p[3] not in ("200", "SERVING") for p in mine),
        }
    report["health_worst_ms"] = max((report["health"][n].get("max", 0.0) for n in ("http", "grpc")), default=0.0)
    abuse = _within(events.get("abusers", []), start, end)
    if abuse:
        report["abusers"] = {}
        for kind in ABUSE_KINDS:
            mine = [e for e in abuse if e[0] == kind]
            if not mine:
                continue
            worst_probe = max((p[2] for a in mine for p in _overlapping(probes, a[1], a[2])), default=0.0)
            report["abusers"][kind] = {
                "statuses": dict(Counter(e[3] for e in mine)),
                "seconds": percentiles_ms([e[2] - e[1] for e in mine], (50,)),
                "answer_mb": round(max(e[4] for e in mine) / 1e6, 2),
                "health_worst_ms_while_in_flight": round(1000 * worst_probe, 1),
                "refusals": {e[3]: e[5] for e in mine if e[5]},  # one server message per refusing status
            }
    return report


def verdict(alone: dict, abused: dict) -> dict:
    out = {}
    for name in ("grpc", "http", "all"):
        before, after = alone["well_behaved"][name].get("p99"), abused["well_behaved"][name].get("p99")
        bar = None if before is None else round(2 * before + 50, 2)
        out[f"p99_{name}"] = {
            "alone_ms": before,
            "abused_ms": after,
            "bar_ms": bar,
            "ok": None if bar is None or after is None else after <= bar,
        }
    worst = max(alone["health_worst_ms"], abused["health_worst_ms"])
    out["health"] = {"worst_ms": worst, "bar_ms": HEALTH_BAR_MS, "ok": worst <= HEALTH_BAR_MS}
    out["ok"] = bool(out["p99_all"]["ok"]) and out["health"]["ok"]
    return out


# -- one run -----------------------------------------------------------------------------------------------------
def start_prober(served) -> Workers:
    """The worker processes of one run, the health prober already started among them."""
    workers = Workers()
    workers.start(
        prober_process,
        served.grpc_target,
        served.http_url,
        PROBE_INTERVAL_S,
        workers.ready,
        workers.stop_event,
        workers.out,
    )
    return workers


def run_phases(args: argparse.Namespace, label: str, tree: Path | None, texts: list[str]) -> dict:
    served = start_server(args.model, threads=args.threads, serve_args=args.serve_arg, tree=tree, label=label)
    try:
        limits = server_limits(served.grpc_target)
        limits["fitted"], fitted = fit_abuse_sizes(served.http_url, limits)
        workers = start_prober(served)
        workers.start(
            clients_process,
            served.grpc_target,
            served.http_url,
            texts,
            args.grpc_clients,
            args.http_clients,
            workers.ready,
            workers.stop_event,
            workers.out,
        )
        workers.start(
            abusers_process,
            served.http_url,
            limits,
            args.abusers,
            workers.ready,
            workers.go,
            workers.stop_event,
            workers.out,
        )
        workers.wait_ready()
        t0 = time.monotonic() + args.warmup
        t1 = t0 + args.duration
        t2 = t1 + args.duration
        time.sleep(max(0.0, t1 - time.monotonic()))
        workers.go.set()
        time.sleep(max(0.0, t2 - time.monotonic()))
        events = workers.stop()
    finally:
        exit_code = served.stop()
    alone, abused = phase_report(events, t0, t1), phase_report(events, t1, t2)
    return {
        "tree": label,
        "limits": limits,
        "abuse_requests": {r["kind"]: r["what"] for r in abuse_requests(limits)},
        "fitted": fitted,  # {kind: [(tokens, status)]}: the sizes tried until the server took one
        "phases": {"alone": alone, "abused": abused},
        "verdict": verdict(alone, abused),
        "server_exit_code": exit_code,
        "timeline": _timeline(events, t0 - args.warmup, (t0, t1, t2)),
    }


def _timeline(events: dict[str, list], origin: float, marks: tuple[float, ...]) -> dict:
    """Every event relative to the run's start (s), for the plot and for anyone who wants to look closer."""

    def rel(t: float) -> float:
        return round(t - origin, 4)

    return {
        "marks_s": [rel(t) for t in marks],
        "clients": [(e[0], rel(e[1]), round(1000 * (e[2] - e[1]), 2), e[3]) for e in events.get("clients", [])],
        "prober": [(e[0], rel(e[1]), round(1000 * e[2], 2), e[3]) for e in events.get("prober", [])],
        "abusers": [(e[0], rel(e[1]), rel(e[2]), e[3], e[4]) for e in events.get("abusers", [])],
    }


def run_single(args: argparse.Namespace, label: str, tree: Path | None) -> dict:
    served = start_server(args.model, threads=args.threads, serve_args=args.serve_arg, tree=tree, label=label)
    rows = []
    try:
        limits = server_limits(served.grpc_target)
        if args.single_set == "abusers":  # the abusers' five, each alone
            limits["fitted"] = fit_abuse_sizes(served.http_url, limits)[0]
            requests = abuse_requests(limits)
        else:
            requests = single_requests(limits)
        workers = start_prober(served)
        workers.wait_ready()
        host, port = served.http_host_port
        idle_start = time.monotonic()
        time.sleep(args.idle)
        idle_end = time.monotonic()
        spans = []
        for _ in range(args.repeat):
            for item in requests:
                conn = Http(host, port, 600)
                started = time.monotonic()
                status, data = conn.call("POST", item["path"], item["body"])
                ended = time.monotonic()
                conn.close()
                message = data[:300].decode("utf-8", "replace") if not status.startswith("2") else ""
                spans.append((item, started, ended, status, len(data), message))
                time.sleep(args.pause)
        events = workers.stop()
    finally:
        exit_code = served.stop()
    probes = events.get("prober", [])
    idle = [p[2] for p in _within(probes, idle_start, idle_end)]
    for item, started, ended, status, size, message in spans:
        during = _overlapping(probes, started, ended)
        rows.append(
            {
                "kind": item["kind"],
                "what": item["what"],
                "status": status,
                "seconds": round(ended - started, 3),
                "answer_mb": round(size / 1e6, 2),
                "health_worst_ms": round(1000 * max((p[2] for p in during), default=0.0), 1),
                "health_worst_ms_http": round(1000 * max((p[2] for p in during if p[0] == "http"), default=0.0), 1),
                "health_worst_ms_grpc": round(1000 * max((p[2] for p in during if p[0] == "grpc"), default=0.0), 1),
                "probes": len(during),
                "message": message,
            }
        )
    return {
        "tree": label,
        "limits": limits,
        "idle_health": percentiles_ms(idle),
        "requests": rows,
        "health_bar_ms": HEALTH_BAR_MS,
        "ok": all(r["health_worst_ms"] <= HEALTH_BAR_MS for r in rows),
        "server_exit_code": exit_code,
        "timeline": {
            "prober": [(p[0], round(p[1] - idle_start, 4), round(1000 * p[2], 2), p[3]) for p in probes],
            "requests": [(s[0]["kind"], round(s[1] - idle_start, 4), round(s[2] - idle_start, 4), s[3]) for s in spans],
        },
    }


# -- output ------------------------------------------------------------------------------------------------------
def print_phases(run: dict) -> None:
    print(f"\n## {run['tree']}: well-behaved clients (ms; requests/s), health probes (ms)")
    print("| phase | gRPC p50 / p99 | HTTP p50 / p99 | all p50 / p99 | req/s | errors | health worst HTTP / gRPC |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, phase in run["phases"].items():
        wb = phase["well_behaved"]
        errors = sum(sum(wb[k]["errors"].values()) for k in ("grpc", "http"))
        cells = [f"{fmt(wb[k].get('p50'))} / {fmt(wb[k].get('p99'))}" for k in ("grpc", "http", "all")]
        health = f"{fmt(phase['health']['http'].get('max'))} / {fmt(phase['health']['grpc'].get('max'))}"
        print(f"| {name} | {' | '.join(cells)} | {wb['all']['requests_per_s']:.1f} | {errors} | {health} |")
    abusers = run["phases"]["abused"].get("abusers", {})
    if abusers:
        print("\n| abuser request | what | statuses | time p50 / max (ms) | answer MB | health worst while in flight |")
        print("|---|---|---|---:|---:|---:|")
        for kind, row in abusers.items():
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["statuses"].items()))
            times = f"{fmt(row['seconds'].get('p50'), 0)} / {fmt(row['seconds'].get('max'), 0)}"
            what = run["abuse_requests"].get(kind, "")
            print(
                f"| {kind} | {what} | {statuses} | {times} | {row['answer_mb']} | "
                f"{row['health_worst_ms_while_in_flight']} |"
            )
    v = run["verdict"]
    p99 = v["p99_all"]
    print(
        f"\nbar: p99 with abusers {fmt(p99['abused_ms'])} ms <= 2 x {fmt(p99['alone_ms'])} + 50 = {fmt(p99['bar_ms'])}"
        f" ms: {'PASS' if p99['ok'] else 'FAIL'}; health worst {fmt(v['health']['worst_ms'])} ms <= "
        f"{HEALTH_BAR_MS:.0f} ms: {'PASS' if v['health']['ok'] else 'FAIL'}"
    )


def print_single(run: dict) -> None:
    idle = run["idle_health"]
    print(
        f"\n## {run['tree']}: worst single requests (prober idle: p50 {fmt(idle.get('p50'))}, "
        f"max {fmt(idle.get('max'))} ms)"
    )
    print("| request | what | status | seconds | answer MB | health worst (ms) HTTP / gRPC |")
    print("|---|---|---|---:|---:|---:|")
    for row in run["requests"]:
        print(
            f"| {row['kind']} | {row['what']} | {row['status']} | {row['seconds']:.2f} | {row['answer_mb']} | "
            f"{row['health_worst_ms_http']:.0f} / {row['health_worst_ms_grpc']:.0f} |"
        )


def summarize(runs: list[dict]) -> dict:
    """Per code tree: the median over rounds of the headline figures."""
    out = {}
    for label in dict.fromkeys(r["tree"] for r in runs):
        mine = [r for r in runs if r["tree"] == label]
        row = {}
        for phase in ("alone", "abused"):
            for proto in ("grpc", "http", "all"):
                for q in ("p50", "p99"):
                    values = [r["phases"][phase]["well_behaved"][proto].get(q) for r in mine]
                    values = [v for v in values if v is not None]
                    row[f"{phase}_{proto}_{q}_ms"] = round(statistics.median(values), 2) if values else None
            row[f"{phase}_requests_per_s"] = round(
                statistics.median(r["phases"][phase]["well_behaved"]["all"]["requests_per_s"] for r in mine), 2
            )
            row[f"{phase}_health_worst_ms"] = max(r["phases"][phase]["health_worst_ms"] for r in mine)
        row["passes"] = [r["verdict"]["ok"] for r in mine]
        out[label] = row
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.6 * len(runs)), squeeze=False)
    colors = dict(zip(ABUSE_KINDS, ("tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan")))
    for ax, run in zip(axes[:, 0], runs):
        timeline = run["timeline"]
        for proto, color in (("grpc", "tab:blue"), ("http", "tab:orange")):
            points = [(e[1], e[2]) for e in timeline["clients"] if e[0] == proto]
            if points:
                ax.scatter(*zip(*points), s=3, color=color, label=f"well-behaved {proto}", alpha=0.6)
        for probe, color in (("http", "black"), ("grpc", "tab:green")):
            points = [(e[1], e[2]) for e in timeline["prober"] if e[0] == probe]
            if points:
                ax.scatter(*zip(*points), s=2, marker="s", color=color, label=f"health {probe}")
        seen, lanes = set(), []  # lanes: the end of the last request drawn in each (one per abuser, in effect)
        for kind, start, end, _status, _size in sorted(timeline["abusers"], key=lambda e: e[1]):
            lane = next((i for i, last in enumerate(lanes) if last <= start), len(lanes))
            if lane == len(lanes):
                lanes.append(end)
            lanes[lane] = end
            y = 0.4 * 1.4**lane
            label = f"abuser {kind}" if kind not in seen else None
            seen.add(kind)
            ax.plot([start, end], [y, y], lw=5, color=colors.get(kind, "grey"), label=label, solid_capstyle="butt")
        for mark in timeline["marks_s"]:
            ax.axvline(mark, color="grey", ls=":", lw=1)
        ax.axhline(HEALTH_BAR_MS, color="red", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(0.3, None)
        ax.set_xlabel("seconds since start (dotted: alone | with abusers | end)")
        ax.set_ylabel("latency / wait (ms)")
        v = run["verdict"]
        ax.set_title(
            f"{run['tree']}: p99 all {fmt(v['p99_all']['alone_ms'])} -> {fmt(v['p99_all']['abused_ms'])} ms; "
            f"health worst {fmt(v['health']['worst_ms'])} ms"
        )
        ax.legend(fontsize=7, loc="upper left", ncol=3, markerscale=3)
    save_figure(fig, path)


def plot_single(result: dict, path: Path) -> None:
    plt = pyplot()

    runs = result["runs"]
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.4 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        for probe, color in (("http", "black"), ("grpc", "tab:green")):
            points = [(e[1], e[2]) for e in run["timeline"]["prober"] if e[0] == probe]
            if points:
                ax.plot(*zip(*points), lw=0.8, color=color, label=f"health {probe}")
        for kind, start, end, status in run["timeline"]["requests"]:
            ax.axvspan(start, end, alpha=0.15, color="tab:red")
            ax.text(start, 0.5, f"{kind} ({status})", fontsize=7, rotation=90, va="bottom")
        ax.axhline(HEALTH_BAR_MS, color="red", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylim(0.3, None)
        ax.set_xlabel("seconds (shaded: a worst single request in flight)")
        ax.set_ylabel("health wait (ms)")
        ax.set_title(f"{run['tree']}: health probe waits during the worst single requests")
        ax.legend(fontsize=7, loc="upper right")
    save_figure(fig, path)


# -- command line ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("service.noisy", __doc__)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase (alone, with abusers)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured well-behaved load first")
    parser.add_argument("--grpc-clients", type=int, default=4)
    parser.add_argument("--http-clients", type=int, default=4)
    parser.add_argument(
        "--abusers", type=int, default=2, help="abusers, each rotating through the kinds from its own first one"
    )
    parser.add_argument("--threads", type=int, default=2, help="server onnxruntime intra-op threads")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
    parser.add_argument("--single", action="store_true", help="the worst single requests one at a time instead")
    parser.add_argument(
        "--single-set",
        choices=["issue", "abusers"],
        default="issue",
        help="--single: the issue's four requests, or the abusers' five (each alone)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="--single: times each request is sent")
    parser.add_argument("--idle", type=float, default=2.0, help="--single: seconds of probes with nothing else first")
    parser.add_argument("--pause", type=float, default=1.0, help="--single: seconds between two requests")
    parser.add_argument("--before", metavar="REV", help="also serve git revision REV's code (a worktree), in turn")
    parser.add_argument("--rounds", type=int, default=1, help="with --before: before/after pairs, alternating")
    parser.add_argument("--label", default="after", help="without --before: the name of this checkout's runs")
    parser.add_argument("--texts", type=int, default=400, help="well-behaved sentence pool")
    parser.add_argument("--text", type=Path, default=None, help="text to take the sentences from (see bench.kit.texts)")
    parser.add_argument("--out", type=Path, default=None, help="JSON (a .png plot beside it)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= MAX_PHASE_S:
        parser.error(f"--duration must be in (0, {MAX_PHASE_S:.0f}]")
    if not 0 < args.rounds <= 10:
        parser.error("--rounds must be in 1..10")
    if args.out is None:
        args.out = RESULTS / ("noisy-single.json" if args.single else "noisy.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()
    texts, source = sentences(args.texts, text=args.text)
    runs = []
    with code_trees(args.before, args.label) as trees:
        for _ in range(args.rounds if args.before else 1):
            for label, tree in trees:
                if args.single:
                    run = run_single(args, label, tree)
                    print_single(run)
                else:
                    run = run_phases(args, label, tree, texts)
                    print_phases(run)
                sys.stdout.flush()
                runs.append(run)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {
        "bench": "noisy-single" if args.single else "noisy",
        "config": config,
        "revisions": revision_info(args.before, args.label),
        "sentences": source,
        **machine(load_at_start),
        "runs": runs,
    }
    if not args.single:
        result["summary"] = summarize(runs)
    save_result(args.out, result, (plot_single if args.single else plot), args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
