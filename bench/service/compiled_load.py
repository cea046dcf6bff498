"""Served ÷ in-process with compiled load generators: nghttp2's ``h2load`` for gRPC ``Embed``, ``wrk`` for HTTP
``POST /v1/embed`` (base64), so that the client costs the server's cores little.

    python -m bench.service.compiled_load --rounds 3 --duration 15 --out bench/results/compiled_load.json
    python -m bench.service.compiled_load --before a11166d --rounds 3    # this checkout and REV alternating
    python -m bench.service.compiled_load --processes 1 2 --rounds 3     # this checkout as 1 and as 2 processes
    python -m bench.service.compiled_load --before 15a6c25 --processes 2 --before-processes 2    # both as 2
    python -m bench.service.compiled_load --serve-args='--max-delay-ms 10'    # more flags for this checkout's servers
    python -m bench.service.compiled_load --variants nice=bench/notes/tricks/nice.patch --one-sentence-s 2    # tricks

For each model (``--models``: ``default`` = models/default, ``tiny`` = random weights of the tiny shape, where the
runtime costs little and the door's own cost shows), each round measures in turn, per code tree (this checkout, and
``--before REV`` when given) ``elmo serve --threads N`` under ``h2load -c C`` (gRPC, one request of ``--per-request``
sentences sent again and again, framed as gRPC) and under ``wrk -c C`` (HTTP/1.1 keep-alive, the same sentences as a
``/v1/embed`` JSON body with ``"encoding": "base64"``, all layers). Each generator runs on one thread. Every load run
is set against the in-process runtime (``Embedder.embed`` on the same texts, ``--batch`` texts per call, back to back
for half ``--duration``) measured just before and just after it, so that the host's drift within a round moves both
sides of a ratio alike. Before the runs, one request of each kind is sent by this checkout's client and its answer
checked (h2load cannot read gRPC's status, which travels in trailers). Reported: requests/s and tokens/s of each, and
served ÷ in-process, per round and as medians; the latency each generator reports (``latency_ms``: wrk's p50 and p99,
h2load's mean and max, which is all it gives). Every load run records the machine's busy cores. The generators come
from Debian (``nghttp2-client``, ``wrk``) and are installed by this command when missing. A benchmark: the figures
depend on the machine, which the JSON names."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bench.kit.load import build_http_requests, build_requests, load_embedder, measure_in_process
from bench.kit.models import DEFAULT_MODEL, MODELS_CACHE
from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.revision import REPO, code_trees, in_turn, revision_info
from bench.kit.serve import start_server
from bench.kit.texts import sentences
from bench.service.tricks import TODAY, one_sentence, variant_info, variant_trees
from elmo.bench.figures import machine

GENERATORS = {"h2load": "nghttp2-client", "wrk": "wrk"}
T = TypeVar("T")


def ensure_generators() -> None:
    """h2load and wrk on PATH, from Debian's packages when missing (with sudo when not root)."""
    missing = [package for tool, package in GENERATORS.items() if shutil.which(tool) is None]
    if not missing:
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    print(f"installing {' '.join(missing)} (Debian) for the compiled load generators", flush=True)
    subprocess.run([*sudo, "apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def model_directory(name: str) -> Path:
    """``default``: models/default; an exported model directory: itself; else random weights of that preset."""
    if name == "default":
        return DEFAULT_MODEL
    if (Path(name) / "onnx.json").is_file():
        return Path(name)
    from elmo.bench.random_model import cached_random_model

    return cached_random_model(MODELS_CACHE / f"elmo-{name}", name)


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message: no compression, 4-byte big-endian length."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def h2load(target: str, body: Path, options: list[str]) -> str:
    """h2load's output for gRPC ``Embed`` calls to ``target`` carrying ``body`` (a framed request), one call in
    flight a connection, with ``options`` (connections, and a duration or a count)."""
    command = [
        "h2load",
        *options,
        "-m",
        "1",
        "-d",
        str(body),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        f"http://{target}/elmo.v1.Embedder/Embed",
    ]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def run_h2load(target: str, body: Path, connections: int, duration: int, more: tuple | list = ()) -> dict:
    output = h2load(target, body, ["-t", "1", "-c", str(connections), "-D", str(duration), *more])
    done = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", output
    )
    seconds = float(re.search(r"finished in ([\d.]+)s", output).group(1))
    result = {"requests": int(done.group(2)), "failed": int(done.group(3)) + int(done.group(4)), "seconds": seconds}
    times = re.search(r"time for request:\s+([\d.]+\w+)\s+([\d.]+\w+)\s+([\d.]+\w+)", output)  # min max mean
    if times:  # h2load reports no percentiles
        result["latency_ms"] = {"mean": milliseconds(times.group(3)), "max": milliseconds(times.group(2))}
    return all_answered(result, "h2load", output)


def milliseconds(duration: str) -> float:
    """A load generator's duration (``850.12us``, ``41.63ms``, ``1.20s``) in milliseconds."""
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", duration).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk_script(body: bytes, work: Path) -> Path:
    """wrk's Lua script for ``POST body``: the body is read from a file beside it, byte for byte (a body spelled in
    the script would need Lua's escapes, which are not JSON's: a ``\\u2192`` stops the script from loading, and
    wrk then sends bodiless GETs)."""
    body_file = work / "body.json"
    body_file.write_bytes(body)
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"local file = assert(io.open([==[{body_file}]==], 'rb'))\n"
        "wrk.body = file:read('*a')\nfile:close()\n"
    )
    return script


def run_wrk(address: str, body: bytes, connections: int, duration: int, work: Path) -> dict:
    # wrk counts a request as failed after its default timeout of seconds: a loaded machine or a large model is slower
    command = [
        "wrk",
        "-t",
        "1",
        "-c",
        str(connections),
        "-d",
        f"{duration}s",
        "--latency",
        "--timeout",
        "120s",
        "-s",
        str(wrk_script(body, work)),
        f"http://{address}/v1/embed",
    ]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    output = run.stdout + run.stderr
    total = re.search(r"(\d+) requests in ([\d.]+)(m?s)", output)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    seconds = float(total.group(2)) / (1000 if total.group(3) == "ms" else 1)
    failed = int(bad.group(1)) if bad else 0
    failed += sum(int(v) for v in errors.groups()) if errors else 0
    result = {"requests": int(total.group(1)) - failed, "failed": failed, "seconds": seconds}
    percentiles = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)$", output, re.MULTILINE))
    if percentiles:
        result["latency_ms"] = {f"p{k}": milliseconds(v) for k, v in percentiles.items()}
    return all_answered(result, "wrk", output)


def all_answered(result: dict, generator: str, output: str) -> dict:
    """``result`` when every request was answered; else SystemExit with the generator's own report: a rate of
    failures is not a rate of answers (a load run whose requests fail measures nothing)."""
    if result["failed"] or not result["requests"]:
        raise SystemExit(
            f"{generator}: {result['failed']} requests failed, {result['requests']} answered; its "
            f"report:\n{output.strip()}"
        )
    return result


def check_answers(grpc_target: str, http_address: str, texts: list[str], tokens: int) -> None:
    """One answer of each protocol, decoded by this checkout's client, holds the tokens the load counts."""
    import urllib.request

    from elmo.client import EmbedderClient

    with EmbedderClient(grpc_target) as client:
        answered = sum(len(e.tokens) for e in client.embed(texts))
    request = urllib.request.Request(
        f"http://{http_address}/v1/embed",
        method="POST",
        data=json.dumps({"inputs": texts, "encoding": "base64"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        http_tokens = sum(len(r["tokens"]) for r in json.loads(reply.read())["embeddings"])
    if answered != tokens or http_tokens != tokens:
        raise SystemExit(f"answers hold {answered} (gRPC) / {http_tokens} (HTTP) tokens, the load counts {tokens}")


def against(result: dict, in_process_requests_per_s: float) -> dict:
    """A load run's result with its requests/s and their ratio to the in-process rate of the same round."""
    result["requests_per_s"] = result["requests"] / result["seconds"]
    result["served_over_in_process"] = result["requests_per_s"] / in_process_requests_per_s
    return result


def busy_cores(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and the machine's busy cores meanwhile (every CPU's non-idle time over the wall time)."""

    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
        return sum(fields[:8]) - fields[3] - fields[4], sum(fields[:8])  # busy (less idle, iowait), all

    busy0, all0 = ticks()
    result = run()
    busy1, all1 = ticks()
    cpus = sum(line.startswith("cpu") and line[3].isdigit() for line in open("/proc/stat"))
    return result, cpus * (busy1 - busy0) / max(1, all1 - all0)


def loaded(run) -> dict:
    """A load run's result, with the machine's busy cores while it ran."""
    result, cores = busy_cores(run)
    return {**result, "machine_busy_cores": round(cores, 2)}


def served_runs(entry: dict) -> dict:
    return {key: value for key, value in entry.items() if isinstance(value, dict) and "served_over_in_process" in value}


def start_servers(args, model: Path, trees: list) -> dict:
    """One server per code tree and process count (``--processes`` for this checkout, ``--before-processes`` for REV;
    labelled "after", "after_2p", "before_2p", ...:
    ``elmo serve --processes N``, the ``--threads`` split among its processes, so that every server has as many
    runtime threads in all) and with ``--serve-args``."""
    servers = {}
    for label, tree in trees:
        extra = shlex.split(args.serve_args) if tree is None else []
        for count in args.processes if tree is None else args.before_processes:
            name = label if count == 1 else f"{label}_{count}p"
            serve_args = (["--processes", str(count)] if count > 1 else []) + extra
            threads = max(1, args.threads // count)
            servers[name] = start_server(model, threads=threads, tree=tree, label=name, serve_args=serve_args)
    return servers


def measure_model(args, name: str, trees: list, work: Path) -> dict:
    model = model_directory(name)
    texts, source = sentences(max(args.batch, args.per_request), min_words=15, max_words=25)
    grpc_body, _, tokens = build_requests(texts[: args.per_request], args.per_request, [], "float32")[0]
    http_body = build_http_requests(texts[: args.per_request], args.per_request, [], "float32")[0][0]
    (work / "grpc.bin").write_bytes(grpc_frame(grpc_body))
    one_body, _, one_tokens = build_requests(texts[:1], 1, [], "float32")[0]  # --one-sentence-s
    (work / "one.bin").write_bytes(grpc_frame(one_body))
    embedder = load_embedder(model, args.threads, texts, args.batch)
    servers = start_servers(args, model, trees)
    loads = Loads(args, work, http_body, build_http_requests(texts[:1], 1, [], "float32")[0][0])
    rounds = []
    try:
        for server in servers.values():
            check_answers(server.grpc_target, server.http_address, texts[: args.per_request], tokens)
            if args.one_sentence_s:
                check_answers(server.grpc_target, server.http_address, texts[:1], one_tokens)
        for index in range(args.rounds):
            rounds.append(measure_round(loads, embedder, texts, tokens, servers, index))
            print(f"{name} round {index + 1}: {round_line(rounds[-1])}", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        embedder.close()
    medians = {
        key: statistics.median(r[key]["served_over_in_process"] for r in rounds) for key in served_runs(rounds[0])
    }
    shown = model.relative_to(REPO) if model.is_absolute() and REPO in model.parents else model  # no machine paths
    return {
        "model": str(shown),
        "texts": source,
        "sentences_per_request": args.per_request,
        "tokens_per_request": tokens,
        "rounds": rounds,
        "median_served_over_in_process": medians,
    }


class Loads:
    """The two generators' runs against an address, with the machine's busy cores while each ran."""

    def __init__(self, args, work: Path, http_body: bytes, one_http: bytes = b""):
        self.args, self.work, self.http_body, self.one_http = args, work, http_body, one_http

    def grpc(self, target: str) -> dict:
        args = self.args
        return loaded(lambda: run_h2load(target, self.work / "grpc.bin", args.connections, args.duration))

    def http(self, address: str) -> dict:
        args = self.args
        return loaded(lambda: run_wrk(address, self.http_body, args.connections, args.duration, self.work))


class InProcess:
    """The in-process runtime's rate, measured again after every load run: each run is set against the mean of the
    in-process runs just before and just after it, so that a host whose speed drifts during a round (these shared
    machines swing by a fifth within minutes) moves both sides of a ratio alike."""

    def __init__(self, embedder, texts: list[str], tokens: int, duration: float, batch: int):
        self.embedder, self.texts, self.tokens, self.duration, self.batch = embedder, texts, tokens, duration, batch
        self.runs: list[dict] = []
        self.measure()

    def measure(self) -> dict:
        local = measure_in_process(self.embedder, self.texts, self.duration, self.batch)
        run = {
            "requests_per_s": local.tokens / local.seconds / self.tokens,
            "cpu_us_per_request": 1e6 * local.cpu_s * self.tokens / local.tokens,
        }
        self.runs.append(run)
        return run

    def judge(self, result: dict) -> dict:
        """``result`` (a load run just ended) against the in-process runs either side of it."""
        before, after = self.runs[-1], self.measure()
        rps = (before["requests_per_s"] + after["requests_per_s"]) / 2
        return {**against(result, rps), "in_process_requests_per_s": rps}

    def summary(self) -> dict:
        """The round's in-process figures: the mean of its runs, and each run's rate in order."""
        rates = [run["requests_per_s"] for run in self.runs]
        mean = statistics.fmean(rates)
        return {
            "in_process_requests_per_s": mean,
            "in_process_tokens_per_s": mean * self.tokens,
            "in_process_cpu_us_per_request": statistics.fmean(run["cpu_us_per_request"] for run in self.runs),
            "in_process_runs_requests_per_s": rates,
        }


def measure_round(loads: Loads, embedder, texts: list[str], tokens: int, servers: dict, index: int = 0) -> dict:
    """Each server under each generator, with an in-process run of half the
    load runs' duration before the first and after every one (:class:`InProcess`). The servers take turns in the
    opposite order every other round (``index``), so that neither is always measured first."""
    args = loads.args
    local = InProcess(embedder, texts, tokens, args.duration / 2, args.batch)
    order = in_turn(list(servers), index)
    entry: dict = {"order": order}
    for label in order:
        server = servers[label]
        if "grpc" in args.protocols:
            entry[f"{label}_grpc"] = local.judge(loads.grpc(server.grpc_target))
        if "http" in args.protocols:
            entry[f"{label}_http"] = local.judge(loads.http(server.http_address))
        if args.one_sentence_s:
            entry[f"{label}_one"] = one_sentence(loads, server, run_h2load, run_wrk)
    return {**local.summary(), **entry}


def round_line(entry: dict) -> str:
    served = [
        f"{k} {v['requests_per_s']:.1f} req/s ({v['served_over_in_process']:.2f}){latency_note(v)}"
        for k, v in served_runs(entry).items()
    ]
    return ", ".join(served)


def latency_note(run: dict) -> str:
    """`` p99 41.6 ms`` (wrk) or `` mean 29.5 ms`` (h2load), where the generator reported it."""
    latency = run.get("latency_ms", {})
    key = "p99" if "p99" in latency else "mean" if "mean" in latency else None
    return f" {key} {latency[key]:.1f} ms" if key else ""


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser("service.compiled_load", __doc__, model=False)
    parser.add_argument(
        "--models", nargs="+", default=["tiny", "default"], help="default, a random preset, or a model directory"
    )
    parser.add_argument("--before", help="also serve this git revision's code, alternating with this checkout")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        metavar="NAME=REV",
        help="also serve each revision REV (a trick taken out: bench.service.tricks), in turn with this checkout",
    )
    parser.add_argument(
        "--one-sentence-s",
        type=int,
        default=0,
        help="seconds of one-sentence calls on one connection per server and round (gRPC, HTTP, HTTP beside a "
        "gRPC load): their p50 (default 0: none)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=15, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--per-request", type=int, default=8, help="sentences per request")
    parser.add_argument("--batch", type=int, default=128, help="texts per in-process call")
    parser.add_argument("--threads", type=int, default=2, help="the server's and the runtime's threads")
    parser.add_argument(
        "--protocols",
        nargs="+",
        choices=["grpc", "http"],
        default=["grpc", "http"],
        help="the service's protocols to load (default both)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        nargs="+",
        default=[1],
        help="serve this checkout with each of these process counts in turn (elmo serve --processes N, "
        "--threads split among them; default 1)",
    )
    parser.add_argument(
        "--before-processes",
        type=int,
        nargs="+",
        default=[1],
        help="the same for --before REV (a revision with elmo serve --processes)",
    )
    parser.add_argument(
        "--serve-args",
        default="",
        help="more `elmo serve` flags for this checkout's servers, one string (--serve-args='--max-delay-ms 10')",
    )
    parser.add_argument("--out", type=Path, default=result_path("compiled_load.json"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ensure_generators()
    load_at_start = os.getloadavg()
    result = {
        "machine": None,  # at the end: the load average then too
        "connections": args.connections,
        "duration_s": args.duration,
        "code": revision_info(args.before, TODAY if args.variants else "after"),
        "variants": variant_info(args.variants),
        "one_sentence_s": args.one_sentence_s,
        "models": {},
    }
    with variant_trees(args.variants) if args.variants else code_trees(args.before) as trees:
        work = Path(tempfile.mkdtemp(prefix="compiled-load-"))
        try:
            for name in args.models:
                result["models"][name] = measure_model(args, name, trees, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"] = machine(load_at_start)
    write_json(args.out, result)
    for name, entry in result["models"].items():
        print(name, {k: round(v, 3) for k, v in entry["median_served_over_in_process"].items()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
