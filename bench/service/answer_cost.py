"""What building one answer costs the server (issue 42): the gRPC ``EmbedResponse`` bytes and the HTTP ``/v1/embed``
JSON (base64 and float numbers) of one request, from vectors shaped as the runtime hands them to the service.

    python -m bench.service.answer_cost                                   # models/default's shape: 3 x 1,024
    python -m bench.service.answer_cost --dim 16 --calls 1000             # the tiny model's answers (3 x 16)
    python -m bench.service.answer_cost --before 0a4a658 --rounds 3       # REV's code and this checkout's in turn
    python -m bench.service.answer_cost --dim 16 --cold 64                # each call after 64 MiB read: cold caches

One request of ``--sentences`` real English sentences of 15-25 words (tokenized as the service tokenizes them, with
their offsets) and ``--layers`` x ``--dim`` float32 vectors a token; each sentence's layers are a read-only view of
one padded batch output (batch, layers, longest + 2, dim), what ``elmo.runtime.Embedder.embed_tokens_with_stats
(views=True)`` gives the service. Timed on one thread, nothing else running: ``response_bytes`` (gRPC), and
``embed_answer`` + ``encode_json_parts`` with ``"encoding": "base64"`` and with JSON numbers (HTTP); and a client's
decoding of the base64 answer into float32 arrays, with the standard library's ``json`` and ``base64``
(``client_json_base64``) and with orjson and pybase64 (``client_orjson_pybase64``). The median of
``--repeat`` timings of ``--calls`` calls each, in microseconds a request. Each side runs in a child process of its
own code tree (``--before``: a git worktree of REV), the two taking turns round by round. Where these run in the
server (the event loop for small answers, a request worker for large ones) they hold the GIL throughout: every
microsecond here is one the event loop cannot serve another request in.

``--cold MIB``: before each call (outside its timing) the child reads an array of that many MiB, more than the
CPU's caches, as the runtime's threads do between two answers in a loaded server: the caches are cold for the
answer's code and data, as on the server's event loop (an 8-sentence tiny-model answer took 2.6-2.8x its hot time).
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.revision import REPO, code_trees, in_turn, revision_info, tree_env
from elmo.bench.figures import machine

PATHS = ("grpc", "http_base64", "http_float", "client_json_base64", "client_orjson_pybase64")


def request_result(n_sentences: int, n_layers: int, dim: int):
    """An ``EmbedResult`` of one request: real sentences, the service's tokens and offsets, vectors as batch views."""
    from types import SimpleNamespace

    import numpy as np
    from elmo.service.core.answers import EmbedResult, PreparedEmbed
    from elmo.service.models.batcher import BatchStats

    from bench.kit.texts import sentences
    from elmo.text.tokenize import tokenize
    from elmo.v1 import embedder_pb2 as pb

    texts, _ = sentences(n_sentences, min_words=15, max_words=25)
    tokenized = [tokenize(text) for text in texts]
    batch = np.random.default_rng(0).standard_normal(
        (n_sentences, n_layers, max(len(t.tokens) for t in tokenized) + 2, dim), dtype=np.float32
    )
    batch.flags.writeable = False
    version = SimpleNamespace(name="bench", number=1, n_layers=n_layers, dim=dim)  # what an answer names
    prepared = PreparedEmbed(version, [t.tokens for t in tokenized], [t.offsets for t in tokenized], None, None,
                             False, pb.FLOAT32, [0] * n_sentences, 1024, 0)  # fmt: skip
    vectors = [batch[i, :, : len(t.tokens)] for i, t in enumerate(tokenized)]
    return EmbedResult(prepared, vectors, [BatchStats(0.001, 0.01, n_sentences, prepared.n_tokens)], time.monotonic())


def time_paths(result, calls: int, repeat: int, cold_mib: int = 0) -> dict[str, float]:
    """Median microseconds a call of each path; ``cold_mib``: each call timed alone after reading that many MiB."""
    import numpy as np
    from elmo.service.core.answers import response_bytes
    from elmo.service.http.encode import encode_json_parts
    from elmo.service.http.schema import embed_answer

    body = b"".join(encode_json_parts(embed_answer(result, "base64", "bench")))
    builders = {
        "grpc": lambda: response_bytes(result, "bench"),
        "http_base64": lambda: encode_json_parts(embed_answer(result, "base64", "bench")),
        "http_float": lambda: encode_json_parts(embed_answer(result, "float", "bench")),
        "client_json_base64": lambda: decoded_layers(body, json.loads, base64.b64decode),
        "client_orjson_pybase64": lambda: decoded_layers(body, orjson.loads, fast_b64decode),
    }
    evict = np.ones(cold_mib << 18, np.float32) if cold_mib else None
    timings = {}
    for path, build in builders.items():
        build()  # warm: caches, first allocations
        runs = []
        for _ in range(repeat):
            runs.append(1e6 * (_time_calls(build, calls) if evict is None else _time_cold(build, calls, evict)))
        timings[path] = round(statistics.median(runs), 1)
    return timings


def decoded_layers(body: bytes, loads, b64decode) -> list:
    """What a client does with a base64 ``/v1/embed`` answer: its JSON parsed, each sentence's layers a float32 array
    of their shape."""
    import numpy as np

    layers = [embedding["layers"] for embedding in loads(body)["embeddings"]]
    return [np.frombuffer(b64decode(tensor["data"]), "<f4").reshape(tensor["shape"]) for tensor in layers]


def fast_b64decode(text: str) -> bytes:
    """pybase64's SIMD decoding, the input checked as it goes (``validate=True`` is its fast path)."""
    import pybase64

    return pybase64.b64decode(text, validate=True)


def _time_calls(build, calls: int) -> float:
    """Seconds a call, ``calls`` calls back to back."""
    started = time.perf_counter()
    for _ in range(calls):
        build()
    return (time.perf_counter() - started) / calls


def _time_cold(build, calls: int, evict) -> float:
    """Seconds a call, each call timed alone after ``evict`` is read through (its sum: every cache line)."""
    total = 0.0
    for _ in range(calls):
        evict.sum()
        started = time.perf_counter()
        build()
        total += time.perf_counter() - started
    return total / calls


def child(args: argparse.Namespace) -> None:
    result = request_result(args.sentences, args.layers, args.dim)
    timings = time_paths(result, args.calls, args.repeat, args.cold)
    print(json.dumps({"tokens": result.prepared.n_tokens, "us_per_request": timings}))


def measure_tree(args: argparse.Namespace, tree: Path | None) -> dict:
    """This file run as a script on ``tree``'s code (None: this checkout): an older tree need not have it."""
    command = [sys.executable, __file__, "--child", "--sentences", str(args.sentences), "--layers", str(args.layers),
               "--dim", str(args.dim), "--calls", str(args.calls), "--repeat", str(args.repeat),
               "--cold", str(args.cold)]  # fmt: skip
    root = tree or REPO
    output = subprocess.run(command, capture_output=True, text=True, check=True, cwd=root, env=tree_env(root)).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("service.answer_cost", __doc__, model=False)
    parser.add_argument("--sentences", type=int, default=8, help="sentences in the request")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dim", type=int, default=1024, help="floats a layer a token (models/default: 1,024)")
    parser.add_argument("--calls", type=int, default=200, help="calls a timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings a path (their median is reported)")
    parser.add_argument("--cold", type=int, default=0, metavar="MIB",
                        help="read this many MiB before each call (untimed): the caches cold, as on a loaded "
                             "server's event loop (0: calls back to back, the caches warm)")  # fmt: skip
    parser.add_argument("--before", help="also time this git revision's code, in turn with this checkout's")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=result_path("answer_cost.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    rounds = []
    with code_trees(args.before) as trees:
        for index in range(args.rounds):
            entry = {}
            for label, tree in in_turn(trees, index):
                entry[label] = measure_tree(args, tree)
                print(f"round {index + 1} {label}: {entry[label]['us_per_request']} us a request "
                      f"({entry[label]['tokens']} tokens)", flush=True)  # fmt: skip
            rounds.append(entry)
    labels = list(rounds[0])
    medians = {label: {path: statistics.median(r[label]["us_per_request"][path] for r in rounds) for path in PATHS}
               for label in labels}  # fmt: skip
    result = {"machine": machine(), "code": revision_info(args.before), "sentences": args.sentences,
              "layers": args.layers, "dim": args.dim, "calls": args.calls, "repeat": args.repeat, "cold_mib": args.cold,
              "rounds": rounds, "median_us_per_request": medians}  # fmt: skip
    write_json(args.out, result)
    print(f"medians (us a request): {medians}\nwrote {args.out}")


if __name__ == "__main__":
    main()
