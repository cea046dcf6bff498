"""Three `elmo serve` replicas behind HAProxy (deploy/haproxy.cfg) on loopback, under faults (issue 32).

    .venv/bin/python -m bench.service.replicas --model models/default --seconds 60            # both modes
    .venv/bin/python -m bench.service.replicas --model models/default --seconds 20 --mode no-balancer-retries

16 clients (by default 8 gRPC through elmo.client with its retry policy, 8 HTTP `POST /v1/embeddings` through
urllib3 with `Retry`, as docs/how-to/replicas.md says) send requests for --seconds. At one third of the run one replica
gets SIGTERM (it drains), at two thirds another gets SIGKILL. Reported per event window (the --window seconds after
each event, and the time before and after; a call counts where it started): requests, failed requests (after the
client's retries), client retries (HTTP: urllib3's retry history; gRPC: each call's attempts in HAProxy's log,
found by the x-request-id it sends, since gRPC retries inside its core, out of the application's sight), the
balancer's own retries, and p50/p99 latency.

The replicas run with `--shutdown-delay-s 5` (--shutdown-delay-s), as deploy/ runs them: a SIGTERMed replica says
NOT_SERVING at once but keeps answering for 5 s, while HAProxy's checks take it out. Modes: `balancer-retries`
runs deploy/haproxy.cfg as shipped (retries 3, redispatch, retry-on); `no-balancer-retries` sets
ELMO_LB_RETRIES=0, a balancer that never retries, as a Kubernetes Service does not.
JSON and Markdown go to --out (default bench/results/), replicas-<mode>.json / .md. Loopback only; needs
`haproxy` on PATH (`make haproxy`). The helpers (start_replicas from bench.kit.serve, Balancer) are what
tests/deploy/test_haproxy.py uses.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import grpc

from bench.kit.load import ClosedLoop, Record
from bench.kit.results import RESULTS
from bench.kit.revision import REPO
from bench.kit.serve import Server, free_port, start_replicas, wait_until
from elmo.bench.figures import machine, percentiles_ms
from elmo.client import RETRY_POLICY

HAPROXY_CFG = REPO / "deploy" / "haproxy.cfg"
REPLICAS = 3  # deploy/haproxy.cfg names elmo1..elmo3
MODES = ("balancer-retries", "no-balancer-retries")
HTTP_RETRY = {"total": 4, "backoff_factor": 0.1, "status_forcelist": (502, 503, 504), "allowed_methods": None}


# -- the balancer ----------------------------------------------------------------------------------------------------
class Balancer:
    """Debian's haproxy running deploy/haproxy.cfg as shipped, its addresses set through the environment."""

    def __init__(self, replicas: list[Server], workdir: Path, retries: bool = True, config: Path = HAPROXY_CFG):
        if shutil.which("haproxy") is None:
            raise FileNotFoundError("haproxy is not installed (make haproxy: Debian's package)")
        self.grpc_port, self.http_port, self.stats_port = free_port(), free_port(), free_port()
        env = dict(os.environ)
        for i, replica in enumerate(replicas, 1):
            env[f"ELMO{i}_HOST"] = "127.0.0.1"
            env[f"ELMO{i}_GRPC_PORT"], env[f"ELMO{i}_HTTP_PORT"] = str(replica.grpc_port), str(replica.http_port)
        env["ELMO_LB_GRPC"] = f"127.0.0.1:{self.grpc_port}"
        env["ELMO_LB_HTTP"] = f"127.0.0.1:{self.http_port}"
        env["ELMO_LB_STATS"] = f"127.0.0.1:{self.stats_port}"
        if not retries:
            env["ELMO_LB_RETRIES"] = "0"
        self.log_path = workdir / ("haproxy.log" if retries else "haproxy-no-retries.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=log, stderr=log, env=env)
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"

    def states(self) -> dict[tuple[str, str], str]:
        """(backend, server) -> UP / DOWN / ... from the stats page's CSV."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5) as reply:
            rows = csv.DictReader(io.StringIO(reply.read().decode().lstrip("# ")))
            return {(r["pxname"], r["svname"]): r["status"] for r in rows if r["pxname"].startswith("elmo_")}

    def wait_states(self, wanted: dict[str, str], timeout: float = 30) -> None:
        """Until every server named in ``wanted`` has that state in both backends."""

        def reached() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log_path.read_text()[-2000:]}")
            try:
                states = self.states()
            except OSError:
                return False
            return all(states.get((b, s)) == v for s, v in wanted.items() for b in ("elmo_grpc", "elmo_http"))

        wait_until(reached, timeout, f"haproxy servers {wanted}")

    def log_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text().splitlines() if " elmo_" in line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# HAProxy's httplog line: `IP:PORT [03/Dec/2026:06:50:11.297] grpc elmo_grpc/elmo1 0/0/0/2/2 200 ... 1/1/0/0/+1 ...`
LOG_LINE = re.compile(
    r"\[(?P<when>\d\d/\w{3}/\d{4}:\d\d:\d\d:\d\d\.\d{3})\] (?P<frontend>\S+) (?P<backend>[^/\s]+)/(?P<server>\S+) "
    r"\S+ (?P<status>-?\d+) .*? \d+/\d+/\d+/\d+/(?P<retries>\+?\d+) \d+/\d+ (?:\{(?P<request_id>[^}]*)\} )?"
)


def parse_log(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        match = LOG_LINE.search(line)
        if match:
            when = datetime.strptime(match["when"], "%d/%b/%Y:%H:%M:%S.%f").timestamp()
            out.append({**match.groupdict(), "when": when, "retries": int(match["retries"].lstrip("+"))})
    return out


# -- the load --------------------------------------------------------------------------------------------------------
@dataclass
class Call:
    protocol: str
    start: float  # wall clock (time.time), to line up with HAProxy's log
    seconds: float
    ok: bool
    retries: int = 0  # client retries seen by the client (HTTP only)
    error: str = ""
    request_id: str = ""  # sent as x-request-id, which HAProxy logs with every attempt
    retry_reasons: tuple[str, ...] = ()  # HTTP: why each retry happened (a status, or the connection error)


@dataclass
class Load:
    """The clients: gRPC through elmo.client (its retry policy), HTTP through urllib3 (``HTTP_RETRY``), each call
    run by bench.kit.load.ClosedLoop and counted as a :class:`Call`."""

    balancer: Balancer
    texts: list[str]
    grpc_clients: int
    http_clients: int
    closers: list = field(default_factory=list)  # each client's channel or pool, closed after the run

    def _grpc(self, seed: int):
        from elmo.client import EmbedderClient

        rng = random.Random(seed)
        client = EmbedderClient(self.balancer.grpc_target, timeout=30)
        self.closers.append(client.close)

        def step(n: int) -> dict:
            request = client.request(rng.sample(self.texts, 4), layers=[2], dtype="float16")
            rid = f"g{seed}-{n}"  # the channel's own retry policy applies; the id shows each attempt
            try:
                client.stub.Embed(request, timeout=30, metadata=(("x-request-id", rid),))
                return {"protocol": "grpc", "ok": True, "request_id": rid}
            except grpc.RpcError as error:  # a failed request is what is counted
                message = f"{error.code().name}: {error.details()}"[:200]
                return {"protocol": "grpc", "ok": False, "error": message, "request_id": rid}

        return step

    def _http(self, seed: int):
        import urllib3

        rng = random.Random(seed)
        pool = urllib3.PoolManager(retries=urllib3.Retry(**HTTP_RETRY, raise_on_status=False), timeout=30)
        self.closers.append(pool.clear)
        url = f"{self.balancer.http_url}/v1/embeddings"

        def step(n: int) -> dict:
            body = {"model": "", "input": rng.sample(self.texts, 4)}
            rid = f"h{seed}-{n}"
            try:
                reply = pool.request("POST", url, json=body, headers={"X-Request-Id": rid})
                history = reply.retries.history if reply.retries else ()
                ok = reply.status == 200 and len(json.loads(reply.data)["data"]) == 4
                reasons = tuple(f"HTTP {h.status}" if h.status else type(h.error).__name__ for h in history)
                error = "" if ok else f"HTTP {reply.status}"
                return {
                    "protocol": "http",
                    "ok": ok,
                    "retries": len(history),
                    "error": error,
                    "request_id": rid,
                    "retry_reasons": reasons,
                }
            except Exception as error:  # noqa: BLE001 - a failed request is what is counted
                return {"protocol": "http", "ok": False, "error": str(error)[:200], "request_id": rid}

        return step

    def start(self) -> ClosedLoop:
        steps = [self._grpc(i) for i in range(self.grpc_clients)]
        steps += [self._http(100 + i) for i in range(self.http_clients)]
        return ClosedLoop(steps).start()

    def calls(self, records: list[Record]) -> list[Call]:
        """Each record as a Call: started at its wall-clock time (HAProxy's log is in wall-clock time)."""
        calls = []
        for r in records:
            fields = r.value if r.error is None else {"protocol": "?", "ok": False, "error": str(r.error)[:200]}
            calls.append(Call(start=r.wall, seconds=r.seconds, **fields))
        return calls

    def close(self) -> None:
        for close in self.closers:
            close()


def attributed_time(call: Call, events: tuple[float, ...]) -> float:
    """When a call counts: the first event that hit it in flight (it started before, ended after), else its start;
    so a call cut off by a SIGKILL is that event's, not the window's before it."""
    return min((t for t in events if call.start <= t <= call.start + call.seconds), default=call.start)


def window_report(calls: list[Call], log: list[dict], start: float, end: float, events: tuple[float, ...] = ()) -> dict:
    """The calls that count in [start, end) (:func:`attributed_time`); each one's attempts are HAProxy's log lines
    with its request id."""
    inside = [c for c in calls if start <= attributed_time(c, events) < end]
    attempts: dict[str, list[dict]] = {}
    for entry in log:
        attempts.setdefault(entry.get("request_id") or "", []).append(entry)
    report = {"seconds": round(end - start, 1), "requests": len(inside), "failed": sum(not c.ok for c in inside)}
    report["client_retries"] = {
        "grpc": sum(max(0, len(attempts.get(c.request_id, [])) - 1) for c in inside if c.protocol == "grpc"),
        "http": sum(c.retries for c in inside if c.protocol == "http"),
    }
    report["balancer_retries"] = sum(e["retries"] for c in inside for e in attempts.get(c.request_id, []))
    for protocol in ("grpc", "http"):
        seconds = [c.seconds for c in inside if c.protocol == protocol and c.ok]
        if seconds:
            figures = percentiles_ms(seconds, (50, 99), digits=1)
            report[f"{protocol}_p50_ms"], report[f"{protocol}_p99_ms"] = figures["p50"], figures["p99"]
    report["errors"] = sorted({c.error for c in inside if not c.ok})[:5]
    report["http_retry_reasons"] = dict(Counter(reason for c in inside for reason in c.retry_reasons))
    return report


def run_mode(args: argparse.Namespace, mode: str, workdir: Path) -> dict:
    from bench.kit.texts import make_texts

    (workdir / mode).mkdir()
    extra = ["--shutdown-delay-s", str(args.shutdown_delay)]
    replicas = start_replicas(args.model, workdir / mode, threads=args.threads, extra=extra)
    balancer = Balancer(replicas, workdir / mode, retries=mode == "balancer-retries", config=args.config)
    try:
        balancer.wait_states({r.name: "UP" for r in replicas})
        load = Load(balancer, make_texts(400, seed=1, max_tokens=24), args.grpc_clients, args.http_clients)
        t_load = time.time()
        loop = load.start()
        t0 = time.time()  # once every client runs: the events' times count from here
        print(f"{mode}: {len(loop.steps)} clients started in {t0 - t_load:.1f} s", flush=True)
        events = [("sigterm", replicas[1], signal.SIGTERM), ("sigkill", replicas[2], signal.SIGKILL)]
        marks = [("start", t0)]
        for k, (name, replica, signum) in enumerate(events, 1):
            time.sleep(max(0.0, t0 + k * args.seconds / 3 - time.time()))
            marks.append((f"{name} {replica.name}", time.time()))
            replica.signal(signum)
        time.sleep(max(0.0, t0 + args.seconds - time.time()))
        records = loop.stop(60)
        load.close()
        t_end = time.time()
        time.sleep(1.5)  # HAProxy writes a request's line when it ends
        log = parse_log(balancer.log_lines())
        windows = {"before": (t0, marks[1][1])}
        for i, (name, t) in enumerate(marks[1:], 1):
            next_t = marks[i + 1][1] if i + 1 < len(marks) else t_end
            windows[name] = (t, min(t + args.window, next_t))
        if t_end - args.window > marks[-1][1] + args.window:
            windows[f"after (last {args.window:.0f} s)"] = (t_end - args.window, t_end)
        calls = load.calls(records)
        return {
            "mode": mode,
            "replicas": REPLICAS,
            "clients": {"grpc": args.grpc_clients, "http": args.http_clients},
            "seconds": round(t_end - t0, 1),
            "events": {name: round(t - t0, 1) for name, t in marks[1:]},
            # every call that failed or was retried by the client, by when it started: what each event cost
            "incidents": [
                {
                    "t": round(c.start - t0, 2),
                    "protocol": c.protocol,
                    "ok": c.ok,
                    "error": c.error,
                    "http_retry_reasons": list(c.retry_reasons),
                }
                for c in sorted(calls, key=lambda c: c.start)
                if not c.ok or c.retry_reasons
            ],
            "total": window_report(calls, log, t0, t_end),
            "windows": {
                name: window_report(calls, log, a, b, tuple(t for _, t in marks[1:]))
                for name, (a, b) in windows.items()
            },
            "exit_codes": {r.name: r.proc.poll() for r in replicas},
            "shutdown_delay_s": args.shutdown_delay,
            "grpc_retry_policy": RETRY_POLICY,
            "http_retry": dict(HTTP_RETRY),
            "command": " ".join(sys.argv),
        }
    finally:
        balancer.stop()
        for replica in replicas:
            replica.stop(cut_delay=True)


def markdown(result: dict) -> str:
    lines = [
        f"## {result['mode']}: {result['replicas']} replicas, {sum(result['clients'].values())} clients "
        f"({result['clients']['grpc']} gRPC, {result['clients']['http']} HTTP), {result['seconds']} s",
        "",
        "events at " + ", ".join(f"{name} +{t} s" for name, t in result["events"].items()),
        "",
        "| window | s | requests | failed | client retries gRPC / HTTP | balancer retries | p99 ms gRPC / HTTP |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, w in [*result["windows"].items(), ("whole run", result["total"])]:
        retries = f"{w['client_retries']['grpc']} / {w['client_retries']['http']}"
        lines.append(
            f"| {name} | {w['seconds']} | {w['requests']} | {w['failed']} | {retries} | {w['balancer_retries']} "
            f"| {w.get('grpc_p99_ms', '-')} / {w.get('http_p99_ms', '-')} |"
        )
    errors = sorted({e for w in result["windows"].values() for e in w["errors"]})
    if errors:
        lines += ["", "errors seen: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.service.replicas", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "default")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=5.0, help="seconds after each event reported on their own")
    parser.add_argument("--grpc-clients", type=int, default=8)
    parser.add_argument("--http-clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads per replica (default 1)")
    parser.add_argument(
        "--shutdown-delay-s",
        dest="shutdown_delay",
        type=float,
        default=5.0,
        help="the replicas' --shutdown-delay-s: seconds a SIGTERMed replica keeps answering while its health checks "
        "say NOT_SERVING (default 5, as deploy/ runs them; 0: refuse at once, the server's default)",
    )
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--config", type=Path, default=HAPROXY_CFG, help="HAProxy configuration (deploy/haproxy.cfg)")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"{args.config}: no such HAProxy configuration (run from a checkout, or pass --config)")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="replicas-"))
    for mode in MODES if args.mode == "both" else (args.mode,):
        result = run_mode(args, mode, workdir)
        result |= machine()  # the CPU, its kernel-relevant flags, cores, load (elmo.bench.figures)
        (args.out / f"replicas-{mode}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"replicas-{mode}.md").write_text(markdown(result))
        print(markdown(result))
    print(f"logs: {workdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
