"""``elmo bench``: tokens/s and latency of the project's PyTorch eager BiLM vs the onnxruntime runtime.

    elmo bench                                   # models/default (if present) + ELMo-small + ELMo-original shapes
                                                 # -> ./bench-results/cpu.json and cpu.md (--out, --name, --force)
    elmo bench --model DIR --shapes small --batch-sizes 1 8 64 --threads 2 --seconds 20

For every model and batch size the same sentences (batches of B, in order) go through: ``torch eager``
(``BiLM(char_ids)`` on the padded batch, the way the training code runs it), ``torch sorted`` (the same model
on the batch sorted by length and cut by the runtime's own batch planner: PyTorch without the padding waste),
``ort`` (``Embedder.embed_tokens`` with the token cache off: the distinct-token char-CNN + Scan biLSTM path)
and ``ort+cache`` (the same with a warm LRU cache of token vectors, as a long-running server has it). The
engines take turns batch by batch, so the machine's load hits them alike. Random-weight models of the
published shapes are written and exported once under ``--models-cache`` (default OUT/models/). Results:
OUT/<name>.json and .md (a Markdown table), OUT being ``--out`` (default ./bench-results/, in the current
directory: never inside the installed package); an existing result is kept unless ``--force``. Benchmarks, not
tests.

Before anything is timed, every engine embeds the first ``--check-sentences`` sentences (in batches of the size
being measured, after the token cache's warm-up) and each is compared with the same model in PyTorch float64 under
the export's own bound for the graph's dtype (export/onnx_export.py FP32_BOUND / FP16_BOUND; FP16_BOUND on a GPU
provider, whose TF32 arithmetic keeps fp16's precision; or ``--max-error``):
an engine that computes something else is refused (``EnginesDisagree``, exit 2), since its speed would mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from elmo.bench.figures import load_average, percentiles_ms
from elmo.errors import ElmoError, InputError
from elmo.flags import add_alias
from elmo.runtime.host import host_facts, host_summary
from elmo.text.chars import batch_to_char_ids

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = Path("bench-results")  # relative: under the directory the user runs `elmo bench` in
DEFAULT_MODEL = REPO / "models" / "default"
ENGINES = ("torch eager", "torch sorted", "ort", "ort+cache")

_CJK = (  # 300 frequent Chinese characters, most frequent first
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
    "小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长"
    "知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最"
    "间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市"
    "眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计"
    "或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让"
)


def synthetic_sentences(n: int, seed: int = 0) -> list[list[str]]:
    """Deterministic text-like sentences: Zipf-distributed words (a 20k vocabulary of letter strings, some
    capitalised, punctuation), 1 in 5 sentences Chinese characters, lengths log-normal around 20 (3-80)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1.0 / np.arange(1, 27) ** 0.9
    vocab = [
        "".join(rng.choice(letters, size=int(rng.integers(1, 12)), p=weights / weights.sum())) for _ in range(20000)
    ]
    vocab[:8] = [".", ",", "the", "of", "and", "to", "a", "in"]
    zipf = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    cjk = np.array(list(_CJK))
    cjk_p = 1.0 / np.arange(1, len(cjk) + 1) ** 0.8
    sentences = []
    for length in np.clip(rng.lognormal(2.9, 0.55, size=n), 3, 80).astype(int):
        if rng.random() < 0.2:
            sentences.append(list(rng.choice(cjk, size=length, p=cjk_p / cjk_p.sum())) + ["。"])
        else:
            words = [str(w) for w in rng.choice(vocab, size=length, p=zipf / zipf.sum())]
            words[0] = words[0].capitalize()
            sentences.append(words)
    return sentences


def text_sentences(path: Path, n: int) -> list[list[str]]:
    from elmo.text.tokenize import tokenize

    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [tokenize(line).tokens for line in lines[:n] if tokenize(line).tokens]


def random_shape_model(shape: str, cache: Path) -> Path:
    """``cache``/<shape>: random weights of a published shape, exported by this exporter (once)."""
    from elmo.bench.random_model import cached_random_model

    return cached_random_model(cache / shape, shape)


# -- measurement ---------------------------------------------------------------------------------------------------
class EnginesDisagree(ElmoError):
    """An engine's vectors are not the model's (beyond the export bound): the benchmark refuses to time it."""


class TorchEngine:
    """The project's PyTorch BiLM on a padded batch. ``sort``: the batch is first sorted by length and cut with
    the runtime's own planner (elmo.runtime.plan_batches), so that padding is not what the comparison measures.
    A call returns the vectors per sentence, float32 (L+1, n, 2P), in the batch's order (as ``embed_tokens``)."""

    def __init__(self, model_dir: Path, sort: bool = False) -> None:
        import torch

        from elmo.model.checkpoint import load_model

        self.torch = torch
        self.model = load_model(model_dir).float().eval()
        self.sort = sort

    def __call__(self, batch: list[list[str]]) -> list[np.ndarray]:
        from elmo.runtime import CPU_STEP_COST, DEFAULT_MAX_BATCH_TOKENS, plan_batches

        parts = [list(range(len(batch)))]
        if self.sort:
            order = sorted((i for i, s in enumerate(batch) if s), key=lambda i: len(batch[i]))
            sizes = plan_batches([len(batch[i]) + 2 for i in order], DEFAULT_MAX_BATCH_TOKENS, CPU_STEP_COST)
            starts = np.cumsum([0, *sizes])
            parts = [order[a:b] for a, b in zip(starts[:-1], starts[1:])]
        cfg = self.model.cfg
        out = [np.zeros((cfg.n_output_layers, 0, cfg.output_dim), np.float32) for _ in batch]  # empty sentences
        with self.torch.inference_mode():
            for part in parts:
                layers, _ = self.model(self.torch.as_tensor(batch_to_char_ids([batch[i] for i in part])).long())
                layers = layers.numpy()
                for row, index in enumerate(part):
                    out[index] = layers[row, :, : len(batch[index])]
        return out


def engine_bound(meta: dict, max_error: float | None = None, provider: str = "CPUExecutionProvider"):
    """The bound ``elmo export`` derives for a graph of this dtype (an export-time ``--max-error`` is not taken
    over: the benchmark holds every engine to what the runtime promises), or the absolute ``max_error``.

    The export verifies on the CPU provider. On another (CUDA), cuBLAS/cuDNN may multiply float32 in TF32, which
    keeps fp16's 11 significant bits, so a float32 graph is held to the fp16 rule there (reasoned, not measured)."""
    from elmo.export.onnx_export import export_bound
    from elmo.runtime import CPU

    return export_bound(meta.get("dtype") == "float16" or provider != CPU, max_error)


# model directory -> its float64 reference on the check sentences: computed once, not once per batch size (a
# float64 pass of the ELMo-original shape takes a while on a small machine).
_REFERENCES: dict[tuple, object] = {}


def float64_reference(model_dir: Path, model, sentences: list[list[str]]):
    """export.verify.Reference of ``sentences`` (``model`` in float64, and float32's error on them), cached by
    the checkpoint (path and modification time) and the sentences."""
    from elmo.export.verify import references
    from elmo.runtime.modeldir import WEIGHTS_FILE

    weights = Path(model_dir).resolve() / WEIGHTS_FILE
    key = (str(weights), weights.stat().st_mtime_ns, tuple(map(tuple, sentences)))
    if key not in _REFERENCES:
        (_REFERENCES[key],) = references(model, [(f"first {len(sentences)} sentences", sentences)])
    return _REFERENCES[key]


def check_agreement(engines: dict, reference, batch_size: int, bound, dtype: str, label: str) -> dict:
    """Every engine's vectors for the ``reference``'s sentences (fed in batches of ``batch_size``) against the
    model in PyTorch float64, each judged by ``bound`` as the export's verification judges a case. Returns the
    figures per engine; raises EnginesDisagree naming ``label`` (model, batch size) and the engines off it."""
    from elmo.export.verify import compare

    figures, failed = {}, []
    for name, engine in engines.items():

        def embed(batch: list[list[str]], engine=engine) -> list[np.ndarray]:
            return [v for i in range(0, len(batch), batch_size) for v in engine(batch[i : i + batch_size])]

        report = compare([reference], embed, bound, dtype, f"{name} in batches of {batch_size}")
        figures[name] = report.max_abs_error
        if not report.passed:
            failed.append(report.summary())
    if failed:
        raise EnginesDisagree(
            f"{label}: engines disagree with the model (PyTorch float64) beyond the export bound; not timing them: "
            + " | ".join(failed)
        )
    return {
        "reference": "PyTorch float64",
        "sentences": len(reference.sentences),
        "bound": bound.describe(),
        "case_bound": bound.for_case(reference.float32_error, reference.output_scale),
        "max_abs_error": figures,
    }


def measure(model_dir: Path, sentences: list[list[str]], batch_size: int, args: argparse.Namespace) -> dict:
    """Interleaved timing of the engines on consecutive batches of ``sentences``."""
    import torch

    from elmo.runtime import CPU, Embedder

    torch.set_num_threads(args.threads)
    providers = None if args.provider == "auto" else [args.provider]
    engines = {
        "torch eager": TorchEngine(model_dir),
        "torch sorted": TorchEngine(model_dir, sort=True),
        "ort": Embedder(model_dir, providers=providers, intra_op_threads=args.threads, cache_size=0).embed_tokens,
        "ort+cache": Embedder(model_dir, providers=providers, intra_op_threads=args.threads).embed_tokens,
    }
    embedder = engines["ort"].__self__
    provider = embedder.info.provider if providers != [CPU] else CPU
    batches = [sentences[i : i + batch_size] for i in range(0, len(sentences) - batch_size + 1, batch_size)]
    for engine in engines.values():  # warm-up: allocations, kernel choice, a first cache fill
        engine(batches[0][:2])
    for batch in batches[: max(1, args.cache_warm_batches)]:
        engines["ort+cache"](batch)
    # Same vectors first (the cache engine answering from its warm cache), then the clock.
    bound = engine_bound(embedder.meta, args.max_error, provider)
    reference = float64_reference(model_dir, engines["torch eager"].model, sentences[: max(1, args.check_sentences)])
    dtype = str(embedder.meta.get("dtype", "float32"))
    agreement = check_agreement(engines, reference, batch_size, bound, dtype, f"{model_dir}, batch {batch_size}")
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: list[int] = []
    started = time.perf_counter()
    for batch in batches[1:] + batches[:1]:
        for name, engine in engines.items():
            begin = time.perf_counter()
            engine(batch)
            times[name].append(time.perf_counter() - begin)
        tokens.append(sum(len(s) for s in batch))
        if time.perf_counter() - started > args.seconds and len(tokens) >= args.min_batches:
            break
    row = {"batch_size": batch_size, "batches": len(tokens), "tokens": int(sum(tokens)), "provider": provider}
    row["agreement"] = agreement
    for name, values in times.items():
        latency = percentiles_ms(values, (50,), digits=3)
        row[name] = {
            "tokens_per_s": sum(tokens) / sum(values),
            "latency_ms_p50": latency["p50"],
            "latency_ms_max": latency["max"],
        }
    row["speedup_ort"] = row["ort"]["tokens_per_s"] / row["torch eager"]["tokens_per_s"]
    row["speedup_ort_cache"] = row["ort+cache"]["tokens_per_s"] / row["torch eager"]["tokens_per_s"]
    return row


# -- reporting -----------------------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        f"CPU: {host_summary()} · "
        f"Threads: {env['threads']} (torch and onnxruntime alike) · CPU cores: {env['cpu_count']} · load average "
        f"before/after: {env['load_before']} / {env['load_after']} · workload: {results['workload']}",
        "",
        "| model | batch | engine | tokens/s | latency p50 (ms) | vs torch eager |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for model in results["models"]:
        for row in model["rows"]:
            base = row["torch eager"]["tokens_per_s"]
            for engine in ENGINES:
                figures = row[engine]
                lines.append(
                    f"| {model['name']} | {row['batch_size']} | {engine} | {figures['tokens_per_s']:,.0f} | "
                    f"{figures['latency_ms_p50']:,.1f} | {figures['tokens_per_s'] / base:.2f}x |"
                )
    lines += ["", "Before timing, every engine's vectors matched PyTorch float64 within the export bound:"]
    for model in results["models"]:
        checks = [row["agreement"] for row in model["rows"]]
        worst = max(max(check["max_abs_error"].values()) for check in checks)
        lines.append(
            f"- {model['name']}: first {checks[0]['sentences']} sentences, worst max abs error {worst:.1e} "
            f"(bound {checks[0]['bound']})"
        )
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, action="append", default=None, help="model directory (repeatable)")
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=["small", "original"],
        help="random-weight published shapes: small medium original",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="sentences per batch, one measurement each (default 1 8 64)",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch and onnxruntime intra-op threads")
    parser.add_argument("--provider", default="CPUExecutionProvider", help="onnxruntime provider, or 'auto'")
    budget = parser.add_argument(
        "--time-budget-s",
        dest="seconds",
        type=float,
        default=15.0,
        help="time budget per model and batch size (default 15)",
    )
    add_alias(parser, "--seconds", budget)
    parser.add_argument("--min-batches", type=int, default=2, help="batches timed at least, whatever the budget")
    parser.add_argument("--cache-warm-batches", type=int, default=4, help="batches that fill the cache first")
    parser.add_argument("--sentences", type=int, default=2000, help="synthetic sentences to draw batches from")
    parser.add_argument(
        "--check-sentences",
        type=int,
        default=16,
        help="sentences every engine must embed like PyTorch float64 (export bound) before it is timed",
    )
    parser.add_argument(
        "--max-error",
        type=float,
        default=None,
        metavar="ABS",
        help="absolute bound for that check in place of the export's rule for the graph's dtype",
    )
    parser.add_argument("--text", type=Path, default=None, help="one sentence per line instead of synthetic text")
    parser.add_argument("--name", default="cpu", help="results file name: OUT/NAME.json and OUT/NAME.md")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"results folder (default ./{DEFAULT_OUT}/ in this directory)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT/NAME.json and .md if they exist")
    parser.add_argument(
        "--models-cache", type=Path, default=None, help="random-weight shapes exported here (default OUT/models)"
    )


def result_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """OUT/NAME.json and OUT/NAME.md, refused before anything is measured (a run can take an hour) when NAME is not
    a plain file name or a result is already there and --force was not given."""
    if not args.name or Path(args.name).name != args.name or args.name in (".", ".."):
        raise InputError(f"--name {args.name!r}: a file name, without folders (the folder is --out)")
    paths = (args.out / f"{args.name}.json", args.out / f"{args.name}.md")
    existing = [path for path in paths if path.exists()]
    if existing and not args.force:
        raise InputError(f"{existing[0]} already exists; pass --force to overwrite it, or choose another --name")
    return paths


def run(args: argparse.Namespace) -> int:
    json_path, md_path = result_paths(args)
    models = list(args.model or ([DEFAULT_MODEL] if (DEFAULT_MODEL / "onnx.json").is_file() else []))
    models += [random_shape_model(shape, args.models_cache or args.out / "models") for shape in args.shapes]
    if args.text:
        sentences, workload = text_sentences(args.text, args.sentences), f"{args.text.name} (first lines)"
    else:
        sentences, workload = synthetic_sentences(args.sentences), "synthetic Zipf text (elmo/bench/run.py), seed 0"
    mean_length = float(np.mean([len(s) for s in sentences]))
    results = {
        "workload": f"{workload}, {len(sentences)} sentences, mean {mean_length:.1f} tokens",
        "environment": {
            **host_facts(),  # the CPU, its kernel-relevant flags, cores and library versions (elmo.runtime.host)
            "threads": args.threads,
            "cpu_count": os.cpu_count(),
            "load_before": load_average(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "models": [],
    }
    for model_dir in models:
        meta = json.loads((model_dir / "onnx.json").read_text())
        name = "default" if model_dir.resolve() == DEFAULT_MODEL.resolve() else model_dir.name
        entry = {"name": name, "path": str(model_dir), "dim": meta["dim"], "cell_dim": meta["cell_dim"], "rows": []}
        for batch_size in args.batch_sizes:
            row = measure(model_dir, sentences, batch_size, args)
            entry["rows"].append(row)
            print(
                f"{name:10s} batch {batch_size:3d}: "
                + " · ".join(f"{e} {row[e]['tokens_per_s']:,.0f} tok/s" for e in ENGINES)
                + f" ({row['batches']} batches)",
                flush=True,
            )
        results["models"].append(entry)
    results["environment"]["load_after"] = load_average()
    args.out.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    md_path.write_text(table)
    print(table)
    print(f"wrote {json_path.resolve()} and {md_path.resolve()}")
    return 0
