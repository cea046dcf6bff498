"""``nlp.pipe`` with the ``elmo`` component against the in-process runtime on the same tokens, side by side.

    python -m bench.spacy.throughput --sentences 2000 --batch-size 128 --rounds 5 --out bench/results/spacy_pipe.json

The sentences are real English (Brown's held-out dev and test files, as ``elmo spacy data brown-pos`` has them,
when ``data/corpus`` holds the package; else bench.kit.texts' sentences). Each round times, in turn, (a)
``list(nlp.pipe(texts, batch_size=B))`` on ``spacy.blank("en")`` with the component (spaCy's tokenizer, the
component's batching, ``doc._.elmo_layers``, ``doc.tensor``) and (b) ``Embedder.embed_tokens`` on the same
tokens in batches of B, kept like the Docs are, on the very runtime the component opened (same threads; its
token-vector cache, filled by the warm-up pass, serves both alike). The ratio is (a)'s tokens/s over (b)'s, median
over rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.kit.results import bench_parser, result_path, write_json
from elmo.bench.figures import machine


def brown_sentences(n: int) -> tuple[list[str], str] | None:
    from elmo.mix.task_data import load_builtin

    try:
        data = load_builtin("brown-pos")
    except Exception:  # noqa: BLE001 (no corpus here: the fallback text)
        return None
    sentences = [" ".join(s) for split in ("dev", "test") for s in data.splits[split].sentences][:n]
    return sentences, f"Brown held-out dev + test files, first {len(sentences)} sentences"


def run(args) -> dict:
    import spacy

    from bench.kit.texts import sentences as kit_sentences

    texts, source = brown_sentences(args.sentences) or kit_sentences(args.sentences, min_words=5, max_words=40)
    nlp = spacy.blank("en")
    component = nlp.add_pipe("elmo", config={"model": str(args.model), "threads": args.threads})
    embedder = component.backend.embedder
    tokens = [[t.text for t in doc if not t.is_space] for doc in nlp.tokenizer.pipe(texts)]
    n_tokens = sum(len(t) for t in tokens)

    def piped() -> float:
        start = time.perf_counter()
        docs = list(nlp.pipe(texts, batch_size=args.batch_size))
        assert all(doc._.elmo_layers is not None for doc in docs)
        return time.perf_counter() - start

    def in_process() -> float:
        start = time.perf_counter()
        kept = []  # the layers stay, as the Docs' do: both sides pay for the memory they fill
        for i in range(0, len(tokens), args.batch_size):
            kept.extend(embedder.embed_tokens(tokens[i : i + args.batch_size]))
        return time.perf_counter() - start

    piped(), in_process()  # warm: allocations, kernel choice
    rounds = []
    for _ in range(args.rounds):
        rounds.append({"nlp_pipe_s": piped(), "in_process_s": in_process()})
        print(f"nlp.pipe {rounds[-1]['nlp_pipe_s']:.2f} s, in process {rounds[-1]['in_process_s']:.2f} s", flush=True)
    pipe_s = statistics.median(r["nlp_pipe_s"] for r in rounds)
    runtime_s = statistics.median(r["in_process_s"] for r in rounds)
    return {
        "sentences": len(texts),
        "tokens": n_tokens,
        "source": source,
        "batch_size": args.batch_size,
        "nlp_pipe_tokens_per_s": n_tokens / pipe_s,
        "in_process_tokens_per_s": n_tokens / runtime_s,
        "ratio": runtime_s / pipe_s,
        "rounds": rounds,
        "machine": machine(),
        "model": str(args.model),
    }


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("spacy.throughput", __doc__)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0: all cores)")
    parser.add_argument("--out", type=Path, default=result_path("spacy_pipe.json"))
    args = parser.parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    piped, in_process = result["nlp_pipe_tokens_per_s"], result["in_process_tokens_per_s"]
    print(f"nlp.pipe {piped:,.0f} tok/s vs in process {in_process:,.0f} tok/s: {result['ratio']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
