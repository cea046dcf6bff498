"""Tokens/s of this project's runtime against AllenNLP 2.10.1's own ELMo, the same weights, the same sentences, the
same batches, taking turns in one run.

    scripts/allennlp-venv.sh                      # once: .venv-allennlp (AllenNLP, torch, h5py, numpy)
    .venv/bin/python -m bench.runtime.allennlp_side_by_side --models default small original

Both sides hold the same weights in AllenNLP's published format (options.json + weights.hdf5): ``default`` is
models/default written out in that format; ``small`` and ``original`` are random weights of the published ELMo-small
(1024/128) and ELMo-original (4096/512) shapes (elmo.bench.random_model), which ``elmo import-allennlp`` and ``elmo
export`` turn into this project's model directory. Those files are made once under ``--work``.

AllenNLP runs in its own venv (bench/runtime/allennlp_worker.py: ``batch_to_ids``, ``_ElmoBiLm`` under
``torch.no_grad``, the boundaries removed, numpy per sentence); this project's side is ``Embedder.embed_tokens``
with the token cache off (AllenNLP has none), so both compute every token. Each side times itself in its own
process: no pipe is inside the clock. Same thread count on both sides (``--threads``).

Before the clock, both embed the first ``--check-sentences`` sentences and every layer's vectors are compared
(max abs difference, lowest per-token cosine): a side that computes something else is refused (exit 2). Then
``--rounds`` rounds, each over ``--sentences-per-round`` new sentences in batches of each batch size, the two sides
alternating which goes first; tokens/s is reported per round (median and min-max, the spread of a shared machine).
Result: ``--out`` (default bench/results/allennlp_side_by_side.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.kit.results import bench_parser, result_path, write_json
from bench.kit.revision import REPO
from elmo.bench.figures import load_average
from elmo.bench.run import synthetic_sentences
from elmo.runtime.host import host_facts, host_summary

MODELS = ("default", "small", "original")
DEFAULT_MODEL = REPO / "models" / "default"
WORKER = Path(__file__).with_name("allennlp_worker.py")
AGREEMENT_BOUND = 1e-3  # max abs difference between the two sides' float32 vectors (both compute in float32)
OPTIONS, WEIGHTS = "options.json", "weights.hdf5"


# -- the same weights on both sides ------------------------------------------------------------------------------
def allennlp_datasets(state: dict[str, np.ndarray], n_filters: int, n_layers: int, cell: int) -> dict:
    """This project's BiLM state dict (numpy) -> bilm-tf's dump_weights layout, the inverse of
    elmo.importers.allennlp.convert_weights: x @ W kernels, TF gate order (i, j, f, o), TF's forget bias of +1
    taken back out of the bias, bilm-tf's carry gate = 1 - the highway's input gate."""
    ds = {"char_embed": state["encoder.char_embedding.weight"][1:]}
    for i in range(sum(1 for k in state if k.startswith("encoder.convs.") and k.endswith(".weight"))):
        ds[f"CNN/W_cnn_{i}"] = state[f"encoder.convs.{i}.weight"].transpose(2, 1, 0)[None]
        ds[f"CNN/b_cnn_{i}"] = state[f"encoder.convs.{i}.bias"]
    for k in range(sum(1 for key in state if key.startswith("encoder.highway.layers.") and key.endswith(".weight"))):
        weight, bias = state[f"encoder.highway.layers.{k}.weight"], state[f"encoder.highway.layers.{k}.bias"]
        ds[f"CNN_high_{k}/W_transform"], ds[f"CNN_high_{k}/b_transform"] = weight[:n_filters].T, bias[:n_filters]
        ds[f"CNN_high_{k}/W_carry"], ds[f"CNN_high_{k}/b_carry"] = -weight[n_filters:].T, -bias[n_filters:]
    ds["CNN_proj/W_proj"] = state["encoder.projection.weight"].T
    ds["CNN_proj/b_proj"] = state["encoder.projection.bias"]
    to_tf = [0, 2, 1, 3]  # torch blocks (i, f, g, o) -> TF (i, j, f, o)
    for direction, stack in ((0, "forward_layers"), (1, "backward_layers")):
        for layer in range(n_layers):
            name, group = f"{stack}.{layer}", f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            w_0 = np.concatenate([state[f"{name}.input_linearity.weight"].T, state[f"{name}.state_linearity.weight"].T])
            bias = state[f"{name}.state_linearity.bias"].copy()
            bias[cell : 2 * cell] -= 1.0
            ds[f"{group}/W_0"] = np.concatenate([w_0[:, b * cell : (b + 1) * cell] for b in to_tf], axis=1)
            ds[f"{group}/B"] = np.concatenate([bias[b * cell : (b + 1) * cell] for b in to_tf])
            ds[f"{group}/W_P_0"] = state[f"{name}.state_projection.weight"].T
    return {key: np.ascontiguousarray(value, dtype=np.float32) for key, value in ds.items()}


def write_hdf5(path: Path, datasets: dict[str, np.ndarray]) -> None:
    import h5py

    with h5py.File(path, "w") as handle:
        for name, array in datasets.items():
            handle.create_dataset(name, data=array)


def prepare(name: str, work: Path, elmo: Path) -> tuple[Path, Path]:
    """(AllenNLP's folder with options.json + weights.hdf5, this project's exported model directory) for ``name``,
    made once under ``work``."""
    files, model = work / name / "allennlp", work / name / "model"
    if name == "default":
        if not (files / WEIGHTS).is_file():
            from safetensors.numpy import load_file

            from elmo.bench.random_model import bilm_tf_options
            from elmo.model.config import ModelConfig

            cfg = ModelConfig.load(DEFAULT_MODEL)
            state = load_file(DEFAULT_MODEL / "model.safetensors")
            files.mkdir(parents=True, exist_ok=True)
            write_hdf5(files / WEIGHTS, allennlp_datasets(state, cfg.n_filters, cfg.n_layers, cfg.cell_dim))
            (files / OPTIONS).write_text(json.dumps(bilm_tf_options(cfg), indent=2) + "\n")
        return files, DEFAULT_MODEL
    if not (model / "onnx.json").is_file():
        from elmo.bench.random_model import write_bilm_tf_files

        print(f"writing random {name}-shape weights in AllenNLP's format, importing and exporting them", flush=True)
        write_bilm_tf_files(files, name, seed=0)
        run = [str(elmo), "import-allennlp", "--options", str(files / OPTIONS), "--weights", str(files / WEIGHTS)]
        subprocess.run([*run, "--out", str(model)], check=True)
        subprocess.run([str(elmo), "export", "--model", str(model)], check=True)
    return files, model


# -- the two sides ---------------------------------------------------------------------------------------------
class AllenNLP:
    """The worker process in the AllenNLP venv (bench/runtime/allennlp_worker.py)."""

    def __init__(self, python: Path, files: Path, threads: int, sentences: list[list[str]]) -> None:
        if not python.is_file():
            raise SystemExit(f"{python} not found: run scripts/allennlp-venv.sh first")
        self.process = subprocess.Popen(
            [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.versions = self.ask(op="load", options=str(files / OPTIONS), weights=str(files / WEIGHTS), threads=threads)
        self.ask(op="sentences", sentences=sentences)

    def ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        if "error" in answer:
            raise SystemExit(f"AllenNLP worker: {answer['error']}")
        return answer

    def seconds(self, batches: list[tuple[int, int]]) -> float:
        return self.ask(op="embed", batches=batches, out=None)["seconds"]

    def vectors(self, batches: list[tuple[int, int]]) -> list[np.ndarray]:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "vectors.npz"
            self.ask(op="embed", batches=batches, out=str(out))
            with np.load(out) as saved:
                return [saved[f"arr_{i}"] for i in range(len(saved.files))]

    def peak_rss_bytes(self) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) * 1024

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


class Ours:
    """``Embedder.embed_tokens``, token cache off."""

    def __init__(self, model: Path, threads: int, sentences: list[list[str]]) -> None:
        from elmo.runtime import Embedder

        self.embedder = Embedder(model, intra_op_threads=threads, cache_size=0)
        self.sentences = sentences

    def vectors(self, batches: list[tuple[int, int]]) -> list[np.ndarray]:
        embed = self.embedder.embed_tokens
        return [v for first, count in batches for v in embed(self.sentences[first : first + count])]

    def seconds(self, batches: list[tuple[int, int]]) -> float:
        seconds = 0.0
        for first, count in batches:
            begin = time.perf_counter()
            self.embedder.embed_tokens(self.sentences[first : first + count])
            seconds += time.perf_counter() - begin
        return seconds


def agreement(ours: list[np.ndarray], theirs: list[np.ndarray]) -> dict:
    """Max abs difference and the lowest per-token cosine over every layer of every sentence."""
    worst, lowest = 0.0, 1.0
    for a, b in zip(ours, theirs, strict=True):
        if a.shape != b.shape:
            raise SystemExit(f"shapes differ: this runtime {a.shape}, AllenNLP {b.shape}")
        worst = max(worst, float(np.abs(a - b).max()))
        dot = (a * b).sum(-1)
        norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
        lowest = min(lowest, float((dot / np.maximum(norms, 1e-12)).min()))
    scale = max(float(np.abs(b).max()) for b in theirs)
    return {"max_abs_difference": worst, "lowest_token_cosine": lowest, "largest_value": scale}


def batches_of(first: int, count: int, size: int) -> list[tuple[int, int]]:
    return [(start, min(size, first + count - start)) for start in range(first, first + count, size)]


def measure(sides: dict, sentences: list[list[str]], size: int, rounds: int, per_round: int, offset: int) -> dict:
    """``rounds`` rounds of ``per_round`` sentences each (from ``offset`` on), in batches of ``size``; the sides
    alternate which goes first."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        first = offset + r * per_round
        batches = batches_of(first, per_round, size)
        tokens = sum(len(s) for s in sentences[first : first + per_round])
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            rates[name].append(tokens / sides[name].seconds(batches))
    row: dict = {"batch_size": size, "rounds": rounds, "sentences_per_round": per_round}
    for name, values in rates.items():
        row[name] = {
            "tokens_per_s_median": round(float(np.median(values)), 1),
            "tokens_per_s_min": round(min(values), 1),
            "tokens_per_s_max": round(max(values), 1),
            "per_round": [round(v, 1) for v in values],
        }
    ours, theirs = row["this runtime"]["tokens_per_s_median"], row["AllenNLP"]["tokens_per_s_median"]
    row["ours_over_allennlp"] = round(ours / theirs, 2)
    row["ours_over_allennlp_per_round"] = per_round_ratios(row)
    return row


def per_round_ratios(row: dict) -> list[float]:
    """This runtime ÷ AllenNLP in each round (the two sides of a round ran back to back on the same sentences)."""
    pairs = zip(row["this runtime"]["per_round"], row["AllenNLP"]["per_round"], strict=True)
    return [round(ours / theirs, 2) for ours, theirs in pairs]


def run_model(name: str, args, sentences: list[list[str]]) -> dict:
    files, model = prepare(name, args.work, args.elmo)
    theirs = AllenNLP(args.allennlp_python, files, args.threads, sentences)
    ours = Ours(model, args.threads, sentences)
    sides = {"this runtime": ours, "AllenNLP": theirs}
    check = batches_of(0, args.check_sentences, 8)
    for side in sides.values():  # warm-up: allocations, kernel choice
        side.seconds(check[:1])
    agreed = agreement(ours.vectors(check), theirs.vectors(check))
    print(f"{name}: {agreed}", flush=True)
    if agreed["max_abs_difference"] > AGREEMENT_BOUND:
        raise SystemExit(2)
    entry = {"model": name, "agreement": agreed | {"bound": AGREEMENT_BOUND}, "rows": [], "allennlp": theirs.versions}
    offset = args.check_sentences
    for size in args.batch_sizes:
        row = measure(sides, sentences, size, args.rounds, args.sentences_per_round, offset)
        offset += args.rounds * args.sentences_per_round
        entry["rows"].append(row)
        print(
            f"{name:8s} batch {size:3d}: this runtime {row['this runtime']['tokens_per_s_median']:,.0f} tokens/s, "
            f"AllenNLP {row['AllenNLP']['tokens_per_s_median']:,.0f} ({row['ours_over_allennlp']}x)",
            flush=True,
        )
    entry["allennlp_peak_rss_bytes"] = theirs.peak_rss_bytes()
    theirs.close()
    ours.embedder.close()
    return entry


def main() -> None:
    parser = bench_parser("runtime.allennlp_side_by_side", __doc__, model=False)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="default: all three")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads, both sides")
    parser.add_argument("--rounds", type=int, default=5, help="turns each side takes per batch size")
    parser.add_argument("--sentences-per-round", type=int, default=32)
    parser.add_argument("--check-sentences", type=int, default=16, help="compared on both sides before the clock")
    parser.add_argument("--allennlp-python", type=Path, default=REPO / ".venv-allennlp" / "bin" / "python")
    parser.add_argument("--elmo", type=Path, default=Path(sys.executable).with_name("elmo"), help="the elmo command")
    parser.add_argument("--work", type=Path, default=REPO / "bench-results" / "allennlp", help="weights made here")
    parser.add_argument("--out", type=Path, default=result_path("allennlp_side_by_side.json"))
    args = parser.parse_args()
    needed = args.check_sentences + len(args.batch_sizes) * args.rounds * args.sentences_per_round
    sentences = synthetic_sentences(needed)
    result = {
        "workload": f"synthetic Zipf text (elmo.bench.run.synthetic_sentences), seed 0, {needed} sentences, "
        f"mean {np.mean([len(s) for s in sentences]):.1f} tokens",
        "threads": args.threads,
        "environment": host_facts() | {"cpu_count": os.cpu_count(), "load_before": load_average()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m bench.runtime.allennlp_side_by_side " + " ".join(sys.argv[1:]),
        "models": [run_model(name, args, sentences) for name in args.models],
    }
    result["environment"]["load_after"] = load_average()
    write_json(args.out, result)
    print(f"{host_summary()}\nwrote {args.out}")


if __name__ == "__main__":
    main()
