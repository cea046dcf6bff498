r"""A small load generator for the service, gRPC or HTTP/JSON: loopback only, bounded in count and time.

    python -m bench.service.loadgen --model models/default --concurrency 16 --duration 30 --baseline
    python -m bench.service.loadgen --server 127.0.0.1:50051 --concurrency 16 --duration 60 --server-pid PID
    python -m bench.service.loadgen --model models/default --protocol http --duration 30 --baseline

Issue 28's check (served throughput and p50 at 16 clients not worse than before the change, gRPC and HTTP, served ÷
in-process at least 0.9 in every round), before and after alternating in one run:

    python -m bench.service.loadgen --model models/default --concurrency 16 --duration 20 --rounds 3 --baseline \
        --threads 2 --protocol both --before 71af429 --json bench/results/loadgen-issue28.json

With ``--model`` it starts ``elmo serve`` itself on a free loopback port (same ``--threads``; ``--http-port 0`` too
when HTTP is driven), drives it, and stops it with SIGTERM; ``--baseline`` also measures the in-process runtime
(this checkout's ``Embedder.embed_texts``) on the same texts once per round, before the round's served runs, so that
both figures come from the same machine state. Reports requests/s, tokens/s, latency p50/p99, errors by status code,
and the server's RSS (start of measurement, end, max) and CPU, as one JSON object on stdout (and ``--json``).

Protocols (``--protocol``): ``grpc`` (default) sends ``Embed`` calls, one channel per client, serialized once up
front and not decoded. ``http`` sends the same requests (same texts, sentences per request, layers and dtype) as
``POST /v1/embed`` JSON bodies with ``"encoding": "base64"`` (the closest to the gRPC wire bytes), one kept-alive
HTTP/1.1 connection per client (``http.client``, a thread each), bodies encoded once up front and answers read but
not decoded. Either way a request counts when it answers (gRPC OK / HTTP 200, a non-empty body) inside the
measured window, with the tokens this checkout's tokenizer finds in its texts; before the runs one answer per server
and protocol is decoded and its token count checked against that (``answer_check``). Errors (gRPC status codes,
HTTP statuses, ``conn:<exception>``) are counted, never raised. ``both``: gRPC and HTTP phases in each round.

``--before REV`` (with ``--model``): also serve git revision REV's code from a worktree (bench.kit.revision), with the
same model directory, the same serve arguments and the same client code (this checkout's); both servers are up for
the whole run and take turns, each round: in-process, before-grpc, after-grpc, before-http, after-http. Reported
per round and as medians over rounds: tokens/s, p50/p99 and served ÷ in-process for each tree and protocol, and the
after ÷ before ratios of throughput and p50 (``summary.after_over_before``, ``summary.issue_check``); a table on
stderr. Without ``--before`` and with one protocol the JSON keeps its old shape (``rounds[i].served``). The exit
status is 1 when any request failed or an answer check did not match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.kit.load import (
    MAX_REQUESTS,
    LoadResult,
    build_http_requests,
    build_requests,
    check_answers,
    drive,
    drive_http,
    load_embedder,
    measure_in_process,
)
from bench.kit.revision import code_trees, revision_info
from bench.kit.serve import Server, check_loopback, start_server
from bench.kit.texts import make_texts
from elmo.bench.figures import machine

MAX_DURATION_S = 600.0
MAX_CONCURRENCY = 256
PROTOCOLS = ("grpc", "http")


@dataclass
class Endpoint:
    """One server to drive: its gRPC target, its HTTP HOST:PORT (when driven), its PID, and, when this run started
    it, the server (bench.kit.serve.Server) to stop."""

    label: str
    grpc_target: str
    http_address: str | None
    pid: int | None
    server: Server | None = None


def start_endpoint(args: argparse.Namespace, label: str, tree: Path | None, with_http: bool) -> Endpoint:
    """``elmo serve`` of ``tree``'s code (this checkout's when None) with this checkout's model directory, with
    ``--http-port 0`` when HTTP is driven."""
    server = start_server(
        args.model,
        threads=args.threads,
        serve_args=args.serve_arg,
        http=with_http,
        tree=tree,
        own_session=args.server_session == "own",
        label=label,
    )
    http = server.http_address or "-"
    print(f"{label}: elmo serve pid {server.pid}, gRPC {server.grpc_target}, HTTP {http}", file=sys.stderr)
    return Endpoint(label, server.grpc_target, server.http_address if with_http else None, server.pid, server)


# -- command line ----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.service.loadgen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="start `elmo serve --model DIR` on a free loopback port and drive it")
    where.add_argument("--server", help="HOST:PORT of a running server's gRPC (loopback only)")
    parser.add_argument("--http-server", help="with --server and --protocol http|both: its HTTP HOST:PORT (loopback)")
    parser.add_argument("--server-pid", type=int, default=None, help="with --server: PID whose RSS and CPU to sample")
    parser.add_argument(
        "--protocol",
        choices=["grpc", "http", "both"],
        default="grpc",
        help="gRPC Embed calls, HTTP POST /v1/embed (base64, one kept-alive connection per client), or both in "
        "each round (default grpc)",
    )
    parser.add_argument(
        "--before",
        metavar="REV",
        help="with --model: also serve git revision REV's code (a worktree; same model, serve arguments and clients), "
        "before and after taking turns in every round; reports the after / before ratios",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument(
        "--duration", type=float, default=30.0, help=f"seconds of measured load per phase (max {MAX_DURATION_S:.0f})"
    )
    parser.add_argument("--requests", type=int, default=MAX_REQUESTS, help="stop a phase after this many requests")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of unmeasured load before each phase")
    parser.add_argument("--sentences-per-request", type=int, default=8)
    parser.add_argument("--texts", type=int, default=1024, help="size of the deterministic text pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", default="", help="comma-separated layers to request (default all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (server and baseline)")
    parser.add_argument(
        "--baseline", action="store_true", help="with --model: also measure the in-process runtime, once per round"
    )
    parser.add_argument("--baseline-batch", type=int, default=64, help="texts per in-process embed_texts call")
    parser.add_argument("--baseline-duration", type=float, default=None, help="seconds per in-process phase")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of (in-process, then each served phase: before and after per protocol); medians over rounds",
    )
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
    parser.add_argument(
        "--server-session",
        choices=("shared", "own"),
        default="shared",
        help="with --model: the server in this run's session, or in its own (as under systemd)",
    )
    parser.add_argument("--auth-token", default=os.environ.get("ELMO_AUTH_TOKEN"))
    parser.add_argument("--json", type=Path, default=None, help="also write the result JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.duration <= MAX_DURATION_S:
        parser.error(f"--duration must be in (0, {MAX_DURATION_S:.0f}]")
    if not 0 < args.requests <= MAX_REQUESTS:
        parser.error(f"--requests must be in (0, {MAX_REQUESTS}]")
    if not 0 < args.concurrency <= MAX_CONCURRENCY:
        parser.error(f"--concurrency must be in (0, {MAX_CONCURRENCY}]")
    if not 0 < args.rounds <= 20 or args.duration * args.rounds > MAX_DURATION_S:
        parser.error(f"--rounds must be in (0, 20] and rounds x duration <= {MAX_DURATION_S:.0f} s")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.baseline and args.model is None:
        parser.error("--baseline needs --model")
    if args.before and args.model is None:
        parser.error("--before needs --model (it starts both servers)")
    if args.server and args.protocol != "grpc" and not args.http_server:
        parser.error("--protocol http|both with --server needs --http-server HOST:PORT")
    if args.http_server and not args.server:
        parser.error("--http-server goes with --server (with --model the HTTP port is the server's own)")
    return args


def run_phase(
    args: argparse.Namespace, endpoint: Endpoint, protocol: str, grpc_requests: list, http_requests: list
) -> LoadResult:
    """One served phase: warm-up, then ``--duration`` seconds measured, on one server over one protocol."""
    if protocol == "grpc":
        return asyncio.run(
            drive(
                endpoint.grpc_target,
                grpc_requests,
                args.concurrency,
                args.duration,
                args.requests,
                args.auth_token,
                endpoint.pid,
                args.warmup,
            )
        )
    assert endpoint.http_address is not None
    return drive_http(
        endpoint.http_address,
        http_requests,
        args.concurrency,
        args.duration,
        args.requests,
        args.auth_token,
        endpoint.pid,
        args.warmup,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()

    protocols = list(PROTOCOLS) if args.protocol == "both" else [args.protocol]
    with_http = "http" in protocols
    texts = make_texts(args.texts, args.seed)
    layers = [int(v) for v in args.layers.split(",") if v.strip()]
    grpc_requests = build_requests(texts, args.sentences_per_request, layers, args.dtype)
    http_requests = build_http_requests(texts, args.sentences_per_request, layers, args.dtype) if with_http else []
    report: dict = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "auth_token"}
    }
    if args.model is not None:
        report["revisions"] = revision_info(args.before)
    baseline_s = args.baseline_duration or args.duration
    embedder = load_embedder(args.model, args.threads, texts, args.baseline_batch) if args.baseline else None
    label = "after" if args.model is not None else "server"
    rounds: list[dict] = []
    endpoints: dict[str, Endpoint] = {}
    with code_trees(args.before if args.model is not None else None, label) as trees:
        labels = [tree_label for tree_label, _ in trees]
        try:
            if args.model is not None:
                for tree_label, tree in trees:
                    endpoints[tree_label] = start_endpoint(args, tree_label, tree, with_http)
            else:
                check_loopback(args.server)
                if args.http_server:
                    check_loopback(args.http_server)
                endpoints[label] = Endpoint(label, args.server, args.http_server, args.server_pid)
            report["answer_check"] = {}
            for tree_label, endpoint in endpoints.items():
                check = check_answers(
                    endpoint.grpc_target if "grpc" in protocols else None,
                    endpoint.http_address if with_http else None,
                    grpc_requests[0],
                    http_requests[0] if with_http else grpc_requests[0],
                    args.auth_token,
                )
                report["answer_check"][tree_label] = check
                for protocol, row in check.items():
                    if not row["ok"]:
                        print(f"WARNING: {tree_label} {protocol}: answer check failed: {row}", file=sys.stderr)
            checks_ok = all(row["ok"] for check in report["answer_check"].values() for row in check.values())
            for index in range(args.rounds):  # in-process first, then before/after per protocol, in turn
                one: dict = {"round": index + 1}
                if embedder is not None:
                    one["in_process"] = measure_in_process(embedder, texts, baseline_s, args.baseline_batch).to_dict()
                    print(
                        f"round {index + 1} in-process: {one['in_process']['tokens_per_s']:,.0f} tokens/s",
                        file=sys.stderr,
                    )
                phases: dict = {}
                for protocol in protocols:
                    for tree_label in labels:
                        result = run_phase(args, endpoints[tree_label], protocol, grpc_requests, http_requests)
                        phases.setdefault(tree_label, {})[protocol] = result.to_dict()
                        print(f"round {index + 1} {_phase_line(tree_label, protocol, result, one)}", file=sys.stderr)
                one["phases"] = phases
                rounds.append(one)
        finally:
            exit_codes = {name: e.server.stop() for name, e in endpoints.items() if e.server is not None}
    if exit_codes:
        report["server_exit_code"] = exit_codes[label] if len(exit_codes) == 1 else exit_codes
    report |= machine(load_at_start)
    if len(labels) == 1 and len(protocols) == 1:  # the old shape: rounds[i] = {in_process, served}
        (only,) = protocols
        flat = [
            {k: v for k, v in r.items() if k == "in_process"} | {"served": r["phases"][label][only]} for r in rounds
        ]
        report["rounds"] = flat
        report["summary"] = summarize(flat)
    else:
        report["rounds"] = rounds
        report["summary"] = summarize_phases(rounds, labels, protocols)
    text = json.dumps(report, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print_table(rounds, labels, protocols, report["summary"], file=sys.stderr)
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if report["summary"]["errors"] == 0 and checks_ok else 1


def _phase_line(tree_label: str, protocol: str, result: LoadResult, one: dict) -> str:
    ratio = ""
    if "in_process" in one and one["in_process"]["tokens_per_s"]:
        ratio = f", served / in-process {result.tokens_per_s / one['in_process']['tokens_per_s']:.3f}"
    lat = result.latency_ms
    return (
        f"{tree_label} {protocol}: {result.tokens_per_s:,.0f} tokens/s, {result.requests} requests, "
        f"p50 {lat.get('p50', float('nan')):.1f} ms, p99 {lat.get('p99', float('nan')):.1f} ms{ratio}, "
        f"errors {sum(result.errors.values())}"
    )


# -- what the rounds add up to ---------------------------------------------------------------------------------
def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of one served series (``rounds[i]["served"]``), and its ratio to the in-process runtime
    when every round has one."""
    served = [r["served"] for r in rounds]
    out = {
        "served_tokens_per_s": _median(s["tokens_per_s"] for s in served),
        "served_requests_per_s": _median(s["requests_per_s"] for s in served),
        "served_latency_ms_p50": _median(s["latency_ms"].get("p50", 0) for s in served),
        "served_latency_ms_p99": _median(s["latency_ms"].get("p99", 0) for s in served),
        "served_tokens_per_server_cpu_s": _median(s["tokens_per_cpu_s"] or 0 for s in served),
        "errors": sum(sum(s["errors"].values()) for s in served),
        "server_rss_mib_first_start": served[0]["rss_mib"].get("start"),
        "server_rss_mib_last_end": served[-1]["rss_mib"].get("end"),
    }
    if all("in_process" in r for r in rounds):
        base = [r["in_process"] for r in rounds]
        out["in_process_tokens_per_s"] = _median(b["tokens_per_s"] for b in base)
        out["in_process_tokens_per_cpu_s"] = _median(b["tokens_per_cpu_s"] or 0 for b in base)
        out["served_over_in_process"] = _ratio(out["served_tokens_per_s"], out["in_process_tokens_per_s"])
        out["served_over_in_process_per_round"] = [
            _ratio(r["served"]["tokens_per_s"], r["in_process"]["tokens_per_s"]) for r in rounds
        ]
        out["served_over_in_process_min"] = min(out["served_over_in_process_per_round"], default=None)
        out["served_over_in_process_per_cpu_s"] = _ratio(
            out["served_tokens_per_server_cpu_s"], out["in_process_tokens_per_cpu_s"]
        )
    return out


def summarize_phases(rounds: list[dict], labels: list[str], protocols: list[str]) -> dict:
    """Per tree and protocol, :func:`summarize`'s medians; with a before tree, after / before per protocol (ratio of
    the medians, and per round), and the issue's check."""
    out: dict = {}
    for tree_label in labels:
        for protocol in protocols:
            series = [
                {k: v for k, v in r.items() if k == "in_process"} | {"served": r["phases"][tree_label][protocol]}
                for r in rounds
            ]
            out.setdefault(tree_label, {})[protocol] = summarize(series)
    out["errors"] = sum(out[t][p]["errors"] for t in labels for p in protocols)
    if rounds and all("in_process" in r for r in rounds):
        out["in_process_tokens_per_s"] = _median(r["in_process"]["tokens_per_s"] for r in rounds)
    if "before" in labels:
        out["after_over_before"] = {}
        out["issue_check"] = {}
        for protocol in protocols:
            before, after = out["before"][protocol], out["after"][protocol]
            per_round = [(r["phases"]["before"][protocol], r["phases"]["after"][protocol]) for r in rounds]
            ratios = {
                "tokens_per_s": _ratio(after["served_tokens_per_s"], before["served_tokens_per_s"]),
                "tokens_per_s_per_round": [_ratio(a["tokens_per_s"], b["tokens_per_s"]) for b, a in per_round],
                "latency_p50": _ratio(after["served_latency_ms_p50"], before["served_latency_ms_p50"]),
                "latency_p50_per_round": [
                    _ratio(a["latency_ms"].get("p50"), b["latency_ms"].get("p50")) for b, a in per_round
                ],
                "latency_p99": _ratio(after["served_latency_ms_p99"], before["served_latency_ms_p99"]),
            }
            out["after_over_before"][protocol] = ratios
            check = {
                "throughput_not_worse": ratios["tokens_per_s"] is not None and ratios["tokens_per_s"] >= 1.0,
                "p50_not_worse": ratios["latency_p50"] is not None and ratios["latency_p50"] <= 1.0,
            }
            if "served_over_in_process_min" in after:
                check["served_over_in_process_min"] = {
                    "before": before["served_over_in_process_min"],
                    "after": after["served_over_in_process_min"],
                }
                check["after_served_over_in_process_at_least_0.9_every_round"] = (
                    after["served_over_in_process_min"] is not None and after["served_over_in_process_min"] >= 0.9
                )
            out["issue_check"][protocol] = check
    return out


def print_table(rounds: list[dict], labels: list[str], protocols: list[str], summary: dict, file=None) -> None:
    """Per round and phase, and the medians, as a markdown table; then after / before per protocol."""
    print(
        "\n| round | tree | protocol | tokens/s | requests/s | p50 ms | p99 ms | served / in-process | errors |",
        file=file,
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|", file=file)
    for r in rounds:
        base = r.get("in_process")
        if base:
            print(f"| {r['round']} | | in-process | {base['tokens_per_s']:,.0f} | | | | | |", file=file)
        for protocol in protocols:
            for tree_label in labels:
                s = r["phases"][tree_label][protocol]
                ratio = _ratio(s["tokens_per_s"], base["tokens_per_s"]) if base else None
                print(
                    f"| {r['round']} | {tree_label} | {protocol} | {s['tokens_per_s']:,.0f} | "
                    f"{s['requests_per_s']:.1f} | "
                    f"{_fmt(s['latency_ms'].get('p50'))} | {_fmt(s['latency_ms'].get('p99'))} | {_fmt(ratio, 3)} | "
                    f"{sum(s['errors'].values())} |",
                    file=file,
                )
    for protocol in protocols:
        for tree_label in labels:
            m = summary[tree_label][protocol] if tree_label in summary else summary
            ratio = _fmt(m.get("served_over_in_process"), 3)
            if m.get("served_over_in_process_min") is not None:
                ratio += f" (min {_fmt(m['served_over_in_process_min'], 3)})"
            print(
                f"| median | {tree_label} | {protocol} | {m['served_tokens_per_s']:,.0f} | "
                f"{m['served_requests_per_s']:.1f} | {_fmt(m['served_latency_ms_p50'])} | "
                f"{_fmt(m['served_latency_ms_p99'])} | {ratio} | {m['errors']} |",
                file=file,
            )
    for protocol, ratios in summary.get("after_over_before", {}).items():
        print(
            f"{protocol}: after / before: tokens/s {_fmt(ratios['tokens_per_s'], 3)} (rounds "
            f"{', '.join(_fmt(v, 3) for v in ratios['tokens_per_s_per_round'])}), p50 {_fmt(ratios['latency_p50'], 3)} "
            f"(rounds {', '.join(_fmt(v, 3) for v in ratios['latency_p50_per_round'])}), "
            f"p99 {_fmt(ratios['latency_p99'], 3)}",
            file=file,
        )
    for protocol, check in summary.get("issue_check", {}).items():
        line = f"{protocol}: throughput not worse: {_yes(check['throughput_not_worse'])}; "
        line += f"p50 not worse: {_yes(check['p50_not_worse'])}"
        if "served_over_in_process_min" in check:
            key = "after_served_over_in_process_at_least_0.9_every_round"
            line += f"; after served / in-process >= 0.9 in every round: {_yes(check[key])} "
            line += f"(lowest {_fmt(check['served_over_in_process_min']['after'], 3)})"
        print(line, file=file)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _median(values) -> float:
    return round(float(np.median(list(values))), 2)


if __name__ == "__main__":
    sys.exit(main())
