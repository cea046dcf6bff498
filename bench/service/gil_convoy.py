"""A runtime call beside a busy Python thread (issue 42): why the served runtime's calls take several times as long
as the same calls alone.

    python -m bench.service.gil_convoy --model runs/bench-models/elmo-tiny --calls 100

The service's runtime calls run on worker threads while the event loop's thread runs Python (decoding, checks,
answers). onnxruntime gives the GIL away for each run and the worker takes it back after; CPython lets a thread that
waits for the GIL wait up to its switch interval (``sys.setswitchinterval``, 5 ms by default) before it makes the
holder hand it over. A call that takes the GIL back several times waits that long each time. Here one
``Embedder.embed_tokens_with_stats`` of ``--sentences`` real sentences is timed (median of ``--calls``) alone and
beside a thread that spins in Python (a loop that is never idle: the event loop under load), for each
``--intervals`` switch interval, each sentence's layers copied out of its batch (the default) and as views
(``views=True``, what the service asks for: a copy of more than a few hundred floats gives the GIL away).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable

from bench.kit.results import bench_parser
from bench.kit.texts import sentences
from elmo.bench.figures import machine


def median_ms(call: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def beside_busy_thread(call: Callable[[], object], calls: int) -> float:
    """``call``'s median time while another thread spins in Python."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(100))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        return median_ms(call, calls)
    finally:
        stop.set()
        spinner.join()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("service.gil_convoy", __doc__)
    parser.add_argument("--sentences", type=int, default=32, help="sentences per call (default 32)")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    parser.add_argument("--intervals", type=float, nargs="+", default=[0.005, 0.0005], help="switch intervals (s)")
    args = parser.parse_args(argv)
    from elmo.runtime import Embedder
    from elmo.text.tokenize import tokenize

    texts, source = sentences(args.sentences, min_words=15, max_words=25)
    tokens = [tokenize(text).tokens for text in texts[: args.sentences]]
    embedder = Embedder(args.model, intra_op_threads=args.threads)
    embedder.warmup()
    median_ms(lambda: embedder.embed_tokens(tokens), 5)
    before = sys.getswitchinterval()
    rows = []
    try:
        for interval in args.intervals:
            sys.setswitchinterval(interval)
            for views in (False, True):
                call = functools.partial(embedder.embed_tokens_with_stats, tokens, views=views)
                rows.append({"switch_interval_ms": 1000 * interval, "views": views,
                             "alone_ms": round(median_ms(call, args.calls), 3),
                             "beside_busy_thread_ms": round(beside_busy_thread(call, args.calls), 3)})  # fmt: skip
    finally:
        sys.setswitchinterval(before)
        embedder.close()
    print(json.dumps({"machine": machine(), "model": str(args.model), "texts": source, "sentences": len(tokens),
                      "calls": args.calls, "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
