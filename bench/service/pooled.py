"""OpenAI-sized requests on /v1/embeddings (issue 29): 2,048 inputs in one call, and the server's peak memory.

    python -m bench.service.pooled --model models/default
    python -m bench.service.pooled --model models/default --inputs 2048 --words 30 60 110

One ``elmo serve`` (127.0.0.1, ``--port 0 --http-port 0``, default limits) gets, one after another, a request of
``--inputs`` paragraph-length inputs for each ``--words`` size (real English sentences joined until the paragraph
has that many words: bench.kit.sentences), each as one ``POST /v1/embeddings``; the first on the fresh server,
the others on the server as the requests before left it. Throughout, ``GET /health`` is probed every 50 ms on a
connection of its own: its worst wait during each request. For each: the status, the
wall time, the tokens (``usage``), the answer's size, and the server's memory: its VmRSS before, and the peak
(VmHWM, reset through /proc/PID/clear_refs just before the request, so the peak is this request's), sampled every
20 ms too for the plot. Beside it, what the request's per-token vectors would take if they were all held at once
(tokens x layers x dim x 4 bytes): the server embeds a pooled request in chunks of the per-token limits and keeps
one vector per input, so its peak should follow the answer, not that figure.

Results: a table on stdout, JSON (``--out``, default bench/results/pooled.json) and the RSS curves (.png beside it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from bench.kit.load import Http
from bench.kit.results import RESULTS, bench_parser, fmt, pyplot, save_figure, save_result
from bench.kit.sample import RssSampler, peak_rss_mib, reset_peak, rss_mib
from bench.kit.serve import start_server
from bench.kit.texts import sentences
from elmo.bench.figures import machine

SAMPLE_S = 0.02
PROBE_S = 0.05


def paragraphs(n: int, words: int, seed: int) -> list[str]:
    """``n`` paragraphs of about ``words`` words: real sentences joined (cycled when there are fewer)."""
    pool, _ = sentences(4 * n, seed=seed, min_words=10, max_words=30)
    out, i = [], 0
    for _ in range(n):
        text: list[str] = []
        while len(text) < words:
            text += pool[i % len(pool)].split()
            i += 1
        out.append(" ".join(text[:words]))
    return out


class HealthProber:
    """``GET /health`` every PROBE_S on its own connection, in a thread: the worst wait while it runs."""

    def __init__(self, host: str, port: int):
        self.http, self.waits, self._stop = Http(host, port, 60), [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            self.http.call("GET", "/health")
            self.waits.append(time.perf_counter() - began)
            self._stop.wait(PROBE_S)

    def start(self) -> HealthProber:
        self._thread.start()
        return self

    def stop(self) -> float:
        """The worst wait, in ms."""
        self._stop.set()
        self._thread.join(10)
        self.http.close()
        return round(1000 * max(self.waits, default=0.0), 1)


def one_request(served, http: Http, documents: list[str], n_layers: int, dim: int) -> dict:
    body = json.dumps({"model": "", "input": documents}).encode()
    before = rss_mib(served.pid)
    exact_peak = reset_peak(served.pid)
    sampler = RssSampler(served.pid, SAMPLE_S).start()
    prober = HealthProber(*served.http_host_port).start()
    began, t0 = time.perf_counter(), time.monotonic()
    status, data = http.call("POST", "/v1/embeddings", body)
    seconds = time.perf_counter() - began
    health_worst_ms = prober.stop()
    samples = [(round(t - t0, 3), round(v, 1)) for t, v in sampler.stop()]
    peak = peak_rss_mib(served.pid) if exact_peak else max(v for _, v in samples)
    answer = json.loads(data) if status == "200" else {"error": data[:300].decode(errors="replace")}
    tokens = answer.get("usage", {}).get("prompt_tokens", 0)
    return {
        "inputs": len(documents),
        "words_per_input": len(documents[0].split()),
        "request_mib": round(len(body) / 2**20, 2),
        "status": status,
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds) if tokens else None,
        "answer_mib": round(len(data) / 2**20, 2),
        "vectors": len(answer.get("data", [])),
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(peak, 1),
        "peak_growth_mib": round(peak - before, 1),
        "peak_is_exact": exact_peak,  # VmHWM, else the 20 ms samples' maximum
        "all_per_token_vectors_mib": round(tokens * n_layers * dim * 4 / 2**20, 1),
        "health_worst_ms": health_worst_ms,
        "error": answer.get("error"),
        "rss_samples": samples,
    }


def print_table(result: dict) -> None:
    print(f"\n## /v1/embeddings, {result['config']['inputs']} inputs per request, default limits (MiB, s)")
    print(
        "| server | words per input | tokens | status | time | tokens/s | answer | RSS before | peak | peak growth | "
        "all per-token vectors | health worst (ms) |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for i, run in enumerate(result["runs"]):
        print(
            f"| {'fresh' if i == 0 else 'warm'} | {run['words_per_input']} | {run['tokens']:,} | {run['status']} | "
            f"{fmt(run['seconds'])} | "
            f"{run['tokens_per_s'] or 0:,} | {fmt(run['answer_mib'])} | {fmt(run['rss_before_mib'])} | "
            f"{fmt(run['rss_peak_mib'])} | {fmt(run['peak_growth_mib'])} | {fmt(run['all_per_token_vectors_mib'])} | "
            f"{fmt(run['health_worst_ms'])} |"
        )


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in result["runs"]:
        t, rss = zip(*run["rss_samples"]) if run["rss_samples"] else ((), ())
        ax.plot(t, rss, label=f"{run['inputs']} x {run['words_per_input']} words ({run['tokens']:,} tokens)")
    ax.set_xlabel("seconds into the request")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("one POST /v1/embeddings at OpenAI's request size")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("service.pooled", __doc__)
    parser.add_argument("--inputs", type=int, default=2048, help="inputs per request (default 2048, OpenAI's)")
    parser.add_argument(
        "--words", type=int, nargs="+", default=[110, 30, 60, 110], help="words per input, one request each, in turn"
    )
    parser.add_argument("--threads", type=int, default=2, help="the server's onnxruntime threads")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `elmo serve` argument (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pooled.json", help="JSON (a .png plot beside it)")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    load_at_start = os.getloadavg()
    from elmo.client import EmbedderClient

    served = start_server(args.model, threads=args.threads, serve_args=args.serve_arg)
    try:
        with EmbedderClient(served.grpc_target) as client:
            info = client.model_info()
        http = Http(*served.http_host_port, timeout=900)
        runs = [
            one_request(served, http, paragraphs(args.inputs, words, seed), info.n_layers, info.dim)
            for seed, words in enumerate(args.words)
        ]
        http.close()
    finally:
        exit_code = served.stop()
    result = {
        "bench": "pooled",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        **machine(load_at_start),
        "server_exit_code": exit_code,
        "runs": runs,
    }
    print_table(result)
    save_result(args.out, result, plot, args.no_plot)
    return 0 if all(run["status"] == "200" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
