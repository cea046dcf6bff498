"""spaCy's default tok2vec (HashEmbedCNN) against the ELMo listener, same data, epochs and seed, side by side.

    python -m bench.spacy.compare --set brown-pos --epochs 10 --out bench/results/spacy_brown_pos.json
    python -m bench.spacy.compare --set msra-ner --train 8000 --epochs 10 --out bench/results/spacy_msra_ner.json

For one built-in set (``elmo spacy data``: Brown POS on the held-out files, MSRA NER on its own test split), each
system is trained by ``python -m spacy train configs/spacy/{tagger,ner}_{tok2vec,elmo}.cfg`` for ``--epochs``
epochs with ``--seed`` (the same batches: same data, same batcher), in turn, each in a process of its own, and its
last model is scored on the test split with the gold tokens. The difference (ELMo − tok2vec) comes with a 95 %
interval from a paired bootstrap over test sentences (elmo.significance). Training time per epoch is the run's
wall time divided by the epochs (for ELMo, the first epoch also runs the biLM on every sentence; later ones read
its cache). Writes JSON and a Markdown table beside it. A benchmark: the figures depend on the machine.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.kit.results import bench_parser, result_path, write_json, write_text
from bench.kit.revision import REPO
from elmo.bench.figures import machine
from elmo.significance import paired_bootstrap, score_counts, verdict

# spaCy's default; the ELMo listener alone (mix + projection); the paper's recipe (the mix beside the default's
# embedding, into its encoder): configs/spacy/{tagger,ner}_{system}.cfg
SYSTEMS = ("tok2vec", "elmo", "elmo_tok2vec")
# set -> (config prefix, metric, the pipeline's component)
SETS = {"brown-pos": ("tagger", "accuracy", "tagger"), "msra-ner": ("ner", "entity_f1", "ner")}


def train(config: Path, data: Path, out: Path, epochs: int, seed: int) -> float:
    """``spacy train`` as a user runs it; returns its wall time in seconds."""
    command = [sys.executable, "-m", "spacy", "train", str(config), "--output", str(out)]
    command += ["--paths.train", str(data / "train.spacy"), "--paths.dev", str(data / "dev.spacy")]
    command += ["--training.max_epochs", str(epochs), "--system.seed", str(seed)]
    print("$", " ".join(command), flush=True)
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True)
    return time.perf_counter() - start


def sentence_counts(pipeline: Path, test: Path, metric: str) -> np.ndarray:
    """Per test sentence (correct, total, 0) for tags or (true positives, predicted, gold) for entities."""
    import spacy
    from spacy.tokens import Doc, DocBin

    nlp = spacy.load(pipeline)
    gold = list(DocBin().from_disk(test).get_docs(nlp.vocab))
    inputs = [Doc(nlp.vocab, words=[t.text for t in doc], spaces=[bool(t.whitespace_) for t in doc]) for doc in gold]
    counts = []
    for reference, predicted in zip(gold, nlp.pipe(inputs, batch_size=256)):
        if metric == "accuracy":
            correct = sum(a.tag_ == b.tag_ for a, b in zip(reference, predicted))
            counts.append((correct, len(reference), 0))
        else:
            want = {(e.start, e.end, e.label_) for e in reference.ents}
            got = {(e.start, e.end, e.label_) for e in predicted.ents}
            counts.append((len(want & got), len(got), len(want)))
    return np.array(counts, dtype=np.int64)


def compare(args) -> dict:
    from elmo.spacy.data import write_splits

    prefix, metric, _ = SETS[args.set]
    work = Path(args.work or tempfile.mkdtemp(prefix="spacy-compare-"))
    data = work / "data"
    described = write_splits(args.set, data, {"train": args.train, "dev": args.dev, "test": args.test})
    systems = {}
    for system in SYSTEMS:
        out = work / system
        seconds = train(REPO / "configs" / "spacy" / f"{prefix}_{system}.cfg", data, out, args.epochs, args.seed)
        counts = sentence_counts(out / "model-last", data / "test.spacy", metric)
        systems[system] = {
            "score": float(score_counts(metric, counts.sum(0))),
            "train_seconds": seconds,
            "seconds_per_epoch": seconds / args.epochs,
            "counts": counts,
        }
        print(f"{system}: {metric} {systems[system]['score']:.4f}, {seconds / args.epochs:.1f} s/epoch", flush=True)
    baseline = systems["tok2vec"]["counts"]
    for entry in systems.values():
        counts = entry.pop("counts")
        if counts is not baseline:
            entry["minus_tok2vec"] = paired_bootstrap(metric, counts, baseline, seed=args.seed)
            entry["minus_tok2vec"]["verdict"] = verdict(entry["minus_tok2vec"])
    return {
        "set": args.set,
        "metric": metric,
        "epochs": args.epochs,
        "seed": args.seed,
        "data": described,
        "systems": systems,
        "machine": machine(),
        "command": "python -m bench.spacy.compare " + " ".join(sys.argv[1:]),
    }


def table(result: dict) -> str:
    rows = [f"| system | {result['metric']} (test) | − tok2vec [95 % CI] | training s / epoch |", "|---|---:|---|---:|"]
    for name, entry in result["systems"].items():
        diff = entry.get("minus_tok2vec")
        versus = "—"
        if diff is not None:
            low, high = diff["ci95"]
            versus = f"{diff['difference']:+.4f} [{low:+.4f}, {high:+.4f}] ({diff['verdict']})"
        rows.append(f"| {name} | {entry['score']:.4f} | {versus} | {entry['seconds_per_epoch']:.1f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("spacy.compare", __doc__, model=False)
    parser.add_argument("--set", choices=tuple(SETS), required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    for split in ("train", "dev", "test"):
        parser.add_argument(f"--{split}", type=int, help=f"{split} sentences (a seeded subsample; default all)")
    parser.add_argument("--work", help="folder for the data and the trained pipelines (default: a new temp folder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = args.out or result_path(f"spacy_{args.set.replace('-', '_')}.json")
    result = compare(args)
    write_json(out, result)
    write_text(out.with_suffix(".md"), table(result))
    print(table(result))


if __name__ == "__main__":
    main()
