"""How should torch's OpenMP threads wait (elmo.train.threads)? Training tokens/s under each wait policy, on an idle
machine and on a busy one, the variants taking turns so that the machine's own load hits them alike.

    python -m bench.train.wait_policy --out wait.json                         # elmo train, configs/default.json
    python -m bench.train.wait_policy --corpus /data/corpus --steps 8 --repeats 3 --out wait.json
    python -m bench.train.wait_policy --workload adapt --text docs.txt --out wait-adapt.json   # elmo adapt's step
    python -m bench.train.wait_policy --variants default cli OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=10000 --out w.json

Each run is a fresh process (libgomp reads the variables once, when torch loads it) that takes ``--steps`` training
steps with the real loop (elmo.train.loop.train) and reports the tokens/s of the steps after the first ``--skip``
(allocation and first-touch costs). Variants: ``default`` (no variable: libgomp's own spinning, what every command
did before issue 30), ``cli`` (what ``elmo`` now sets before it imports a command, elmo.train.threads), or
``VAR=VALUE[,VAR=VALUE]`` set in the environment (``threads=N``: N torch threads). Busy: one CPU-bound hog
process per core (``python -c 'while True: pass'``), started here before the busy runs of a round and ended after
them, by their process ids.

Workloads: ``train`` runs ``--config``'s model and batch shape on ``--train-lines`` evenly spaced lines of its training
text (``--corpus`` replaces the config's data folder); ``adapt`` runs the training step of ``elmo adapt --model
MODEL --text TEXT`` (the split, the vocabulary and the "before" scores are made once, in ``--work``). Validation,
checkpoints and the time budget are off while timing. Results: a table (medians over ``--repeats``) on stdout, every
run and the medians in ``--out`` (JSON). A benchmark, not a test: its figures depend on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.kit.revision import REPO
from elmo.bench.figures import machine
from elmo.train.threads import SPIN_COUNT, WAIT_POLICY

DEFAULT_VARIANTS = ("default", "cli")
HOG = "while True: pass"
THREADS = "threads"  # in a variant: the torch thread count of the run (threads=1), beside any variable


# -- the variants ----------------------------------------------------------------------------------------------
def variant_settings(variant: str) -> dict[str, str]:
    """``VAR=VALUE[,VAR=VALUE]`` -> {VAR: VALUE}; ``default`` and ``cli`` set nothing themselves."""
    if variant in ("default", "cli"):
        return {}
    settings = {}
    for pair in variant.split(","):
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"wait_policy: variant {variant!r}: expected default, cli or VAR=VALUE[,VAR=VALUE]")
        settings[name] = value
    return settings


def variant_env(variant: str, base: dict[str, str]) -> dict[str, str]:
    """The environment of a run: ``base`` without any wait-policy variable, then the variant's own (``threads``, a
    torch thread count, is not an environment variable: the run sets it)."""
    env = {k: v for k, v in base.items() if k not in (WAIT_POLICY, SPIN_COUNT)}
    env.update({k: v for k, v in variant_settings(variant).items() if k != THREADS})
    return env


@contextlib.contextmanager
def hogs(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` busy-looping processes for the duration of the block, ended by their own ids afterwards."""
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- one run (in its own process) ------------------------------------------------------------------------------
def worker(spec: dict) -> dict:
    """Take the steps and measure them; runs in a fresh interpreter whose environment is the variant's."""
    if spec["variant"] == "cli":
        from elmo.train.threads import apply_wait_policy

        apply_wait_policy()  # exactly what elmo.cli.main does before it imports a command's module
    from elmo.train.threads import policy_in_force

    policy = policy_in_force()
    from elmo.train.loop import train  # torch (and libgomp) load here, after the policy is in the environment

    cfg = _worker_config(spec)
    cfg.data.sense_benchmark = False
    t = cfg.train
    t.log_every, t.valid_every, t.checkpoint_every = 1, 10**9, 10**9
    t.max_time_s, t.calibrate_bias_tokens = 0.0, 0
    if spec["threads"]:
        t.threads = spec["threads"]
    state = train(cfg, Path(spec["out"]), resume=False, stop_after=spec["steps"])
    return {"policy": policy, **step_rate(state["history"], spec["skip"])}


def _worker_config(spec: dict):
    if spec["workload"] == "adapt":
        from elmo.train.adapt import Adaptation, AdaptSettings

        job = Adaptation(
            Path(spec["model"]), Path(spec["text"]), Path(spec["adaptation"]), spec["tokenized"], AdaptSettings()
        )
        job.open(resume=True)
        return job.adapt_config()
    from elmo.train.config import load_train_config

    return load_train_config(spec["config"])


def step_rate(history: list[dict], skip: int) -> dict:
    """Tokens/s over the steps after the first ``skip``, from the loop's per-step log (tokens, tokens_per_s)."""
    steps = [h for h in history if "loss" in h]
    tokens = seconds = 0.0
    for before, entry in zip(steps, steps[1:]):
        if entry["step"] <= skip:
            continue
        n = entry["tokens"] - before["tokens"]
        tokens += n
        seconds += n / max(entry["tokens_per_s"], 1e-9)
    return {
        "steps": len(steps) - max(skip, 1),
        "tokens": int(tokens),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
    }


def run_worker(spec: dict, env: dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "bench.train.wait_policy", "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"wait_policy: run {spec['variant']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the workloads ---------------------------------------------------------------------------------------------
def prepare_train(args: argparse.Namespace, work: Path) -> dict:
    """A copy of ``--config`` whose training text is ``--train-lines`` evenly spaced lines of its own (reading and
    counting a whole corpus in every run would take longer than the steps)."""
    cfg = json.loads(Path(args.config).read_text())
    data = cfg.setdefault("data", {})
    if args.corpus:
        for key in ("train", "valid", "vocab"):
            data[key] = str(Path(args.corpus) / f"{key}.txt")
    first = data.get("train", "data/corpus/train.txt")
    first = first[0] if isinstance(first, list) else first
    lines = Path(first).read_text(encoding="utf-8").splitlines(keepends=True)
    lines = lines[:: max(1, len(lines) // args.train_lines)][: args.train_lines]
    (work / "train.txt").write_text("".join(lines), encoding="utf-8")
    data.update(train=str(work / "train.txt"), train_sentences=0, valid_tokens=2000)
    (work / "config.json").write_text(json.dumps(cfg, indent=1))
    return {"workload": "train", "config": str(work / "config.json")}


def prepare_adapt(args: argparse.Namespace, work: Path) -> dict:
    """`elmo adapt --stop-after 0`: the split, the vocabulary and the "before" scores, once for every run."""
    adaptation = work / "adaptation"
    cmd = [
        sys.executable,
        "-m",
        "elmo.cli",
        "adapt",
        "--model",
        str(args.model),
        "--text",
        str(args.text),
        "--out",
        str(adaptation),
        "--stop-after",
        "0",
        "--no-export",
    ]
    cmd += ["--tokenized"] if args.tokenized else []
    print(f"preparing the adaptation in {adaptation} (split, vocabulary, the 'before' scores)", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"wait_policy: elmo adapt --stop-after 0 failed:\n{proc.stderr[-3000:]}")
    return {
        "workload": "adapt",
        "model": str(args.model),
        "text": str(args.text),
        "tokenized": args.tokenized,
        "adaptation": str(adaptation),
    }


# -- the benchmark ---------------------------------------------------------------------------------------------
def bench(args: argparse.Namespace, work: Path) -> dict:
    base = prepare_adapt(args, work) if args.workload == "adapt" else prepare_train(args, work)
    base.update(steps=args.skip + args.steps, skip=args.skip, threads=args.threads)
    cores = os.cpu_count() or 1
    runs = []
    for repeat in range(args.repeats):
        for busy in (condition == "busy" for condition in args.conditions):
            order = args.variants[repeat % len(args.variants) :] + args.variants[: repeat % len(args.variants)]
            with hogs(cores if busy else 0):
                for variant in order:  # the variants take turns, their order rotating from round to round
                    spec = {**base, "variant": variant, "out": str(work / f"run-{len(runs)}")}
                    spec["threads"] = int(variant_settings(variant).get(THREADS, spec["threads"]))
                    result = run_worker(spec, variant_env(variant, dict(os.environ)))
                    runs.append({"variant": variant, "busy": busy, "repeat": repeat, **result})
                    print(
                        f"  round {repeat + 1} {'busy' if busy else 'idle'} {variant:<28} "
                        f"{result['tokens_per_s']:>9.1f} tokens/s  ({result['policy']})",
                        flush=True,
                    )
    return {
        "workload": args.workload,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpus": cores, **machine()},
        "runs": runs,
        "medians": medians(runs, args.variants),
    }


def medians(runs: list[dict], variants: list[str]) -> dict:
    out: dict = {variant: {} for variant in variants}
    for run in runs:
        out[run["variant"]].setdefault("busy" if run["busy"] else "idle", []).append(run["tokens_per_s"])
    return {v: {c: round(statistics.median(values), 1) for c, values in m.items()} for v, m in out.items()}


def table(result: dict) -> str:
    conditions = [c for c in ("idle", "busy") if any(c in m for m in result["medians"].values())]
    rows = [f"{'variant':<30}" + "".join(f"{c + ' tokens/s':>15}" for c in conditions)]
    for variant, m in result["medians"].items():
        rows.append(f"{variant:<30}" + "".join(f"{m[c]:>15.1f}" for c in conditions))
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.train.wait_policy", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="JSON results file (required)")
    p.add_argument("--workload", choices=["train", "adapt"], default="train")
    p.add_argument("--config", default=str(REPO / "configs" / "default.json"), help="train: the training config")
    p.add_argument("--corpus", default=None, help="train: folder with train.txt, valid.txt, vocab.txt")
    p.add_argument("--train-lines", type=int, default=20000, help="train: lines of training text read")
    p.add_argument("--model", type=Path, default=REPO / "models" / "default", help="adapt: the model to adapt")
    p.add_argument("--text", type=Path, default=None, help="adapt: the domain text")
    p.add_argument("--tokenized", action="store_true", help="adapt: --text is already tokenized")
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--skip", type=int, default=2, help="untimed first steps per run")
    p.add_argument("--repeats", type=int, default=3, help="rounds (idle then busy, every variant in each)")
    p.add_argument("--conditions", nargs="+", choices=["idle", "busy"], default=["idle", "busy"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the config's / torch's default)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and args.out is None:
        p.error("--out is required")
    if args.workload == "adapt" and args.worker is None and args.text is None:
        p.error("--workload adapt needs --text")
    if args.steps < 1 or args.skip < 0 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1, --skip >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="wait-policy-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        result = bench(args, work)
    result["wall_s"] = round(time.time() - started, 1)
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
