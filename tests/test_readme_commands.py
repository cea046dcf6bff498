"""Every command in the fenced bash blocks of README.md and of the docs pages that took the README's blocks when it
became a front page (DOCUMENTS: docs/how-to/clients.md, docs/how-to/pipeline.md, ...) runs as written here (in CI: a
fresh clone on a fresh machine), or as the substitution listed next to it in README_COMMANDS, the one table of how
each command is covered. A command of any of those pages that is neither run nor listed fails
test_every_readme_command_is_run_or_listed, so the README and those pages cannot drift from what is tested. Their
Python blocks run against the served default model.

- `make test` is what CI runs (.ci/run), so this suite running at all proves it.
- `make serve` is taken from the README's set-up block (not hard-coded), started in the background exactly as
  written (the `served` fixture), and must reach grpc.health SERVING; while it is up the tour's commands (client
  CLI, health probe, curl of /metrics) and the Python snippet run against it; the last test stops it with SIGTERM,
  which must drain and exit 0.
- Those commands name `make serve`'s own ports, 50051/8080/9090, so they cannot move to free ones. When something
  already holds one (most likely the user's own `make serve`), every test that needs them skips with the one reason
  readme_ports_decision gives, and the rest of the file runs; in CI (a fresh machine) that is a failure instead, so
  the README's serving commands are never silently dropped there. Every other server in the suite picks a free port.
- The tour's batch-job and mix lines run in a scratch folder holding the files a user would have (a corpus, a
  CoNLL file) and a copy of models/default, so the new task is not written into the shipped model.
- The pipeline block (fetch, train, the whole recipe, eval, baseline, export, serve; docs/how-to/pipeline.md) runs in
  tests/test_readme_pipeline.py, in a scratch folder, on a tiny config.

The first run creates .venv-serve (about a minute); later runs reuse it. The shipped default model is part of the
product: if models/default/model.onnx is missing these tests fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elmo.v1 import embedder_pb2 as pb
from elmo.v1 import embedder_pb2_grpc as pb_grpc
from elmo.wire import from_tensor
from tests.conftest import in_ci
from tests.lm_fixtures import write_domain_text

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# The README and the pages its blocks moved to: every ```bash command of each is run or listed in README_COMMANDS,
# every ```python block of each runs against `make serve`. A page that takes a README block joins this list.
DOCUMENTS = (
    README,
    DOCS / "how-to" / "clients.md",
    DOCS / "how-to" / "pipeline.md",
    DOCS / "explanation" / "quality.md",
    DOCS / "speed.md",
    DOCS / "how-to" / "spacy.md",
)
DEFAULT_MODEL = REPO / "models" / "default"
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8080, 9090
pytestmark = pytest.mark.usefixtures("make_serve_ports")  # its ports and .venv-serve: one module at a time
SERVING_DEADLINE_S = 480  # first run builds .venv-serve: pip install of the serve extra on 2 busy cores
EXIT_DEADLINE_S = 60
SENTENCE = "The cat sat on the mat ."


# -- the table: how each README bash command is covered --------------------------------------------------------------
FIXTURE, CI, SERVED, USER_FILES, PIPELINE, NOT_RUN = "fixture", "ci", "served", "user files", "pipeline", "not run"
SPACY = "spacy"  # docs/how-to/spacy.md's commands, in a scratch folder (test_docs_spacy_commands_run_in_order)
REPO_ROOT = "repo root"  # as written, in the checkout


@dataclass(frozen=True)
class Coverage:
    """How one README command is checked. ``run_as``: the command line actually run, when it is not the README's
    own (every such substitution is here, in this one table, with its reason in ``why``); ``expect``: a string
    the command's output must contain."""

    how: str  # FIXTURE | CI | SERVED (repo root, `make serve` up) | REPO_ROOT | USER_FILES | PIPELINE | NOT_RUN
    run_as: str | None = None
    why: str = ""
    expect: str = ""


README_COMMANDS: dict[str, Coverage] = {
    # set-up block
    "make serve": Coverage(FIXTURE, why="the `served` fixture runs it in the background until SERVING"),
    "make test": Coverage(CI, why=".ci/run runs exactly this (test_ci_runs_the_readme_test_command)"),
    # tour: against the running server, from the repo root
    "make serve &": Coverage(FIXTURE, why="the `served` fixture: `make serve` in the background, as here"),
    '.venv-serve/bin/elmo embed --server 127.0.0.1:50051 "我买了一台苹果电脑。" "The apple fell."': Coverage(
        SERVED, expect="'The apple fell.': 4 tokens"
    ),
    ".venv-serve/bin/python scripts/healthcheck.py 127.0.0.1:50051": Coverage(SERVED, expect="SERVING"),
    "curl -s localhost:9090/metrics | grep elmo_": Coverage(SERVED, expect="elmo_requests_total{"),
    'curl -s localhost:8080/v1/embeddings -H \'Content-Type: application/json\' -d \'{"model": "default", '
    '"input": ["我买了一台苹果电脑。", "The apple fell."]}\'': Coverage(
        SERVED, expect='"usage":{"prompt_tokens":14,"total_tokens":14}'
    ),
    'curl -s localhost:8080/v1/embed -H \'Content-Type: application/json\' -d \'{"input": ["苹果很好吃"], '
    '"task": "pos_brown", "omit_layers": true}\'': Coverage(SERVED, expect='"tokens":["苹","果","很","好","吃"]'),
    # tour: batch job and a new task mix, in a scratch folder with the user's files and a copy of models/default
    ".venv-serve/bin/elmo embed-file corpus.txt out.hdf5 --model models/default --layers all": Coverage(USER_FILES),
    ".venv-serve/bin/elmo embed-file corpus.jsonl out/ --model models/default --layers mix:pos_brown "
    "--dtype float16": Coverage(USER_FILES),
    "make dev": Coverage(REPO_ROOT, expect=".venv"),
    ".venv/bin/elmo mix train --model models/default --task my_task --kind tagging --data train.conll": Coverage(
        USER_FILES
    ),
    # tour: bring your own quality, in the same scratch folder (the user's text: this repository's docs)
    ".venv/bin/elmo adapt --model models/default --text my_domain.txt --out models/my-domain": Coverage(
        USER_FILES,
        run_as=".venv/bin/elmo adapt --model models/default --text my_domain.txt --out models/my-domain "
        "--time-budget-s 180 --epochs 0.25 --calibrate-tokens 0",
        why="the default budget is 30 minutes; a quarter epoch (two steps) takes the same path: split, before, "
        "training, after, stale tasks, export (tests/train/test_adapt.py checks that perplexity falls)",
    ),
    ".venv/bin/elmo import-manylangs --model zhs.model --out models/zhs": Coverage(USER_FILES),
    # pipeline block (docs/how-to/pipeline.md): tests/test_readme_pipeline.py, in a scratch folder, in this order
    ".venv/bin/elmo data fetch": Coverage(PIPELINE),
    ".venv/bin/elmo train --config configs/default.json --out runs/default": Coverage(
        PIPELINE,
        run_as=".venv/bin/elmo train --config configs/tiny.json --out runs/default",
        why="configs/default.json trains for 80 minutes; configs/tiny.json is the same pipeline with a tiny model",
    ),
    "scripts/build-default-model.sh": Coverage(
        PIPELINE,
        run_as="ELMO_BUILD_TINY=1 scripts/build-default-model.sh",
        why="the real recipe takes 9 h; ELMO_BUILD_TINY=1 runs all of it (six stages, export, report, three "
        "tasks, mix report) with tiny budgets, into runs/tiny-build",
    ),
    ".venv/bin/elmo eval-lm --model runs/default --text data/corpus/test.en.txt --tokenized": Coverage(
        PIPELINE,
        run_as=".venv/bin/elmo eval-lm --model runs/default --text runs/tiny-build/corpus/test.en.txt --tokenized",
        why="scoring all 129 K test tokens takes minutes on 2 cores even with a tiny model; the tiny build's slice "
        "of the same file (every 50th line) is scored instead",
    ),
    ".venv/bin/elmo baseline --corpus data/corpus": Coverage(PIPELINE),
    ".venv/bin/elmo export --model runs/default": Coverage(PIPELINE),
    ".venv/bin/elmo serve --model runs/default --port 50052 --http-port 8082": Coverage(
        PIPELINE,
        run_as=".venv/bin/elmo serve --model runs/default --port 0 --http-port 0 --port-file serve.port",
        why="50052 and 8082 may be taken on a test machine (the page picks them to sit beside `make serve`'s 50051 "
        "and 8080); any free ports instead, the gRPC one read back from --port-file",
    ),
    # docs/how-to/spacy.md: tests/test_readme_commands.py::test_docs_spacy_commands_run_in_order, in a scratch folder
    ".venv/bin/elmo spacy data brown-pos --out corpus/brown": Coverage(
        SPACY,
        run_as=".venv/bin/elmo spacy data brown-pos --out corpus/brown --train 300 --dev 60 --test 60",
        why="the whole set trains for minutes an epoch; the same command on a seeded subsample",
    ),
    ".venv/bin/python -m spacy train configs/spacy/tagger_elmo_tok2vec.cfg --output training/brown --paths.train "
    "corpus/brown/train.spacy --paths.dev corpus/brown/dev.spacy": Coverage(
        SPACY,
        run_as=".venv/bin/python -m spacy train configs/spacy/tagger_elmo_tok2vec.cfg --output training/brown "
        "--paths.train corpus/brown/train.spacy --paths.dev corpus/brown/dev.spacy --training.max_epochs 1",
        why="the config trains 8 epochs; one takes the same path (tests/spacy train the configs to a better score)",
    ),
    ".venv/bin/elmo spacy export-task training/brown/model-last --component tagger --model models/default --task "
    "spacy_pos": Coverage(SPACY),
    (
        ".venv/bin/python -m bench.spacy.compare --set brown-pos --epochs 8 --out bench/results/spacy_brown_pos.json"
    ): Coverage(NOT_RUN, why="trains three systems for 8 epochs (about 10 minutes); tests/spacy train its configs"),
    ".venv/bin/python -m bench.spacy.compare --set msra-ner --train 6000 --epochs 8 --out "
    "bench/results/spacy_msra_ner.json": Coverage(
        NOT_RUN, why="trains three NER systems for 8 epochs (about 40 minutes); tests/spacy train its configs"
    ),
}


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment: a ``#`` at the start or after a blank, outside quotes."""
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index].rstrip()
    return line.rstrip()


def fenced_blocks(readme: str, language: str) -> list[str]:
    """The bodies of the README's fenced blocks opened with ```language."""
    blocks = re.findall(r"^```([\w+-]*)[ \t]*\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE)
    return [body for lang, body in blocks if lang == language]


def bash_commands(readme: str) -> list[str]:
    """Every command line of every ```bash block, in README order: comments stripped, continuation lines joined."""
    commands = []
    for block in fenced_blocks(readme, "bash"):
        for line in re.sub(r"[ \t]*\\\n[ \t]*", " ", block).splitlines():
            command = strip_comment(line).strip()
            if command:
                commands.append(command)
    return commands


def page_name(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def documents_text() -> dict[str, str]:
    """DOCUMENTS' text, by page name ('README.md', 'docs/how-to/clients.md', ...), in DOCUMENTS order."""
    return {page_name(path): path.read_text(encoding="utf-8") for path in DOCUMENTS}


def page_commands(pages: dict[str, str]) -> list[tuple[str, str]]:
    """(page, command) for every ```bash command of every page, in page order and in order within each page."""
    return [(page, command) for page, text in pages.items() for command in bash_commands(text)]


def coverage_gaps(pages: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    """((page, command) missing from README_COMMANDS, README_COMMANDS entries in none of the pages)."""
    found = page_commands(pages)
    commands = {command for _, command in found}
    return [(p, c) for p, c in found if c not in README_COMMANDS], [c for c in README_COMMANDS if c not in commands]


def commands_covered_by(how: str, pages: dict[str, str] | None = None) -> list[str]:
    """The commands of ``pages`` (default: DOCUMENTS; in page order) that README_COMMANDS says are covered by
    ``how``."""
    found = page_commands(pages if pages is not None else documents_text())
    return [c for _, c in found if c in README_COMMANDS and README_COMMANDS[c].how == how]


def test_readme_parsing_finds_commands_and_python_blocks() -> None:
    text = (
        "# T\n\n```bash\nmake serve &   # wait\n\n.venv/bin/elmo embed 'a # b' \\\n    --x 1   # tail\n```\n\n"
        "```\nnot -> a command\n```\n\n```python\nprint(1)  # ok\n```\n"
    )
    assert bash_commands(text) == ["make serve &", ".venv/bin/elmo embed 'a # b' --x 1"]
    assert fenced_blocks(text, "python") == ["print(1)  # ok\n"]
    assert strip_comment('curl -s x | grep "#" # why') == 'curl -s x | grep "#"'


def test_every_readme_command_is_run_or_listed() -> None:
    """The README and the pages that took its blocks cannot drift: each bash command of each is in README_COMMANDS,
    and each entry is still in one of them."""
    pages = documents_text()
    assert list(pages)[0] == "README.md" and all(path.is_file() for path in DOCUMENTS), list(pages)
    unlisted, stale = coverage_gaps(pages)
    assert not unlisted, (
        f"(page, command)s that no test runs: {unlisted}. Add each to README_COMMANDS in {Path(__file__).name} "
        "with how it is run (as written, or the substitution and why), or as NOT_RUN with the reason"
    )
    assert not stale, f"README_COMMANDS lists commands that are in none of {list(pages)}: {stale}"
    commands = [command for _, command in page_commands(pages)]
    assert len(commands) == len(set(commands)), "a command written on two pages: keep one, link to it from the other"
    for command, coverage in README_COMMANDS.items():
        assert coverage.how in (FIXTURE, CI, SERVED, REPO_ROOT, USER_FILES, PIPELINE, SPACY, NOT_RUN), command
        if coverage.run_as is not None or coverage.how in (FIXTURE, CI, NOT_RUN):
            assert coverage.why, f"{command!r}: a substituted, fixture-run or unrun command needs its reason"


def test_a_new_unlisted_readme_command_is_caught() -> None:
    """On every page of DOCUMENTS: a new command is caught, and so is a listed one that is gone from its page or
    whose page leaves DOCUMENTS."""
    pages = documents_text()
    assert coverage_gaps(pages) == ([], [])
    for page in pages:
        added = pages | {page: pages[page] + "\n```bash\n.venv/bin/elmo something-new --flag   # new\n```\n"}
        unlisted, stale = coverage_gaps(added)
        assert unlisted == [(page, ".venv/bin/elmo something-new --flag")] and stale == [], page
    for page, command in page_commands(pages):
        joined = re.sub(r"[ \t]*\\\n[ \t]*", " ", pages[page])  # continuation lines joined, as bash_commands does
        assert command in joined, (page, command)
        _, stale = coverage_gaps(pages | {page: joined.replace(command, "make something-else")})
        assert command in stale, (page, command)
        _, stale = coverage_gaps({name: text for name, text in pages.items() if name != page})
        assert command in stale, (page, command)
    # the pipeline block moved to docs/how-to/pipeline.md: its commands are counted there, not only in the README
    assert {page for page, command in page_commands(pages) if README_COMMANDS[command].how == PIPELINE} == {
        "docs/how-to/pipeline.md"
    }


def test_readme_is_a_front_page_that_maps_every_docs_page() -> None:
    """The README names every page of docs/ (its map: one line per page), and each page of DOCUMENTS exists."""
    readme = README.read_text(encoding="utf-8")
    unmapped = [page_name(path) for path in sorted(DOCS.glob("*.md")) if f"]({page_name(path)})" not in readme]
    assert not unmapped, f"docs pages the README's map does not link: {unmapped}"
    assert all(path.is_file() for path in DOCUMENTS), DOCUMENTS


def setup_block(readme: str) -> str:
    """The first fenced code block after the README's 'Set-up' heading."""
    heading = re.search(r"^#+ .*set-?up.*$", readme, flags=re.IGNORECASE | re.MULTILINE)
    assert heading, "README.md has no set-up section"
    block = re.search(r"^```[a-z]*\n(.*?)^```", readme[heading.end() :], flags=re.DOTALL | re.MULTILINE)
    assert block, "README.md's set-up section has no code block"
    return block[1]


def readme_command(readme: str, program: str) -> str:
    """The set-up block's line that starts with ``program`` (e.g. 'make serve'), without its trailing comment."""
    lines = [line for line in setup_block(readme).splitlines() if line.strip().startswith(program)]
    assert len(lines) == 1, f"expected one line starting with {program!r} in the set-up block, found {lines}"
    return " ".join(shlex.split(lines[0], comments=True))


def test_setup_block_parsing_finds_the_commands() -> None:
    text = "# T\n\n## Set-up: the two commands\n\n```bash\nmake serve   # serve it\nmake test    # test it\n```\n"
    assert readme_command(text, "make serve") == "make serve"
    assert readme_command(text, "make test") == "make test"
    with pytest.raises(AssertionError):
        readme_command("# T\n\nno set-up here\n", "make serve")


def test_ci_runs_the_readme_test_command() -> None:
    """The second command: CI's entry point runs exactly the README's test command."""
    command = readme_command(README.read_text(), "make test")
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert command in ci_lines, f".ci/run does not run the README's {command!r}"


# The files a user brings to the tour's batch-job and mix lines: a few lines of text (both languages), the same as
# JSONL, and a tagged CoNLL file ("token TAG" lines, a blank line between sentences; elmo/tasks_data.read_conll).
USER_TEXT = ["The apple fell .", "我买了一台苹果电脑。", "The cat sat on the mat ."]
USER_TAGGED = [
    ("The cat sat on the mat .", "DET NOUN VERB ADP DET NOUN ."),
    ("A dog ran to the park .", "DET NOUN VERB ADP DET NOUN ."),
    ("She reads a book .", "PRON VERB DET NOUN ."),
    ("We like green apples .", "PRON VERB ADJ NOUN ."),
] * 5  # 20 sentences: the mix trainer holds out every 10th for dev


# The README's `elmo adapt` line needs a user's text, not a large one: it checks that the command runs, reports
# before/after perplexity and leaves a verified model (tests/train/test_adapt.py measures the adaptation itself).
USER_DOMAIN_CHARS = 100_000


def write_user_files(folder: Path) -> None:
    (folder / "corpus.txt").write_text("".join(f"{line}\n" for line in USER_TEXT), encoding="utf-8")
    records = [json.dumps({"id": f"s{i}", "text": line}, ensure_ascii=False) for i, line in enumerate(USER_TEXT)]
    (folder / "corpus.jsonl").write_text("".join(f"{r}\n" for r in records), encoding="utf-8")
    conll = ["\n".join(f"{w} {t}" for w, t in zip(words.split(), tags.split())) for words, tags in USER_TAGGED]
    (folder / "train.conll").write_text("\n\n".join(conll) + "\n", encoding="utf-8")
    write_domain_text(folder / "my_domain.txt", max_chars=USER_DOMAIN_CHARS)
    from tests.importers.test_manylangs import write_synthetic_folder  # a tiny model in ELMoForManyLangs' format

    write_synthetic_folder(folder / "zhs.model")


def serving_venv() -> Path:
    """The checkout's .venv-serve, built as `make serve` builds it (the CPU flavour) when no test has yet."""
    venv = REPO / ".venv-serve"
    if not (venv / "bin" / "elmo").exists():
        run_command("make --no-print-directory .venv-serve/.installed-cpu", REPO, timeout=SERVING_DEADLINE_S)
    return venv


def test_readme_repo_root_commands_run_as_written() -> None:
    """`make dev`: in a checkout where `make test` (CI) or `make check` built .venv, it finds it up to date."""
    commands = commands_covered_by(REPO_ROOT)
    assert commands == ["make dev"], commands
    for command in commands:
        output = run_command(command, REPO, timeout=900)
        assert README_COMMANDS[command].expect in output, output


def test_readme_batch_and_mix_commands_run_on_a_users_files(tmp_path) -> None:
    """The tour's embed-file and mix lines, as written, in a folder with the user's files and models/default.

    models/default is a copy: `mix train` stores the new task inside the model directory, and the shipped model
    must not gain a test task. .venv and .venv-serve are the checkout's (symlinks), as in a user's clone."""
    import h5py
    import pyarrow.parquet as pq

    assert (DEFAULT_MODEL / "model.onnx").is_file(), f"{DEFAULT_MODEL}/model.onnx is missing"
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    (tmp_path / ".venv-serve").symlink_to(serving_venv())
    shutil.copytree(DEFAULT_MODEL, tmp_path / "models" / "default")
    write_user_files(tmp_path)
    commands = commands_covered_by(USER_FILES)
    assert len(commands) == 5, commands
    outputs = {
        command: run_command(README_COMMANDS[command].run_as or command, tmp_path, timeout=600) for command in commands
    }

    with h5py.File(tmp_path / "out.hdf5", "r") as hdf5:  # AllenNLP's layout: one [3, n_tokens, dim] per line
        index = json.loads(hdf5["sentence_to_index"][0])
        assert sorted(index) == sorted(USER_TEXT)
        assert hdf5[index["The apple fell ."]].shape[:2] == (3, 4)
    table = pq.read_table(sorted((tmp_path / "out").glob("*.parquet")))
    assert sorted(table.column("id").to_pylist()) == [f"s{i}" for i in range(len(USER_TEXT))]
    task = json.loads((tmp_path / "models" / "default" / "tasks" / "my_task" / "task.json").read_text())
    assert task["kind"] == "tagging"
    assert sorted(task["labels"]) == sorted({tag for _, tags in USER_TAGGED for tag in tags.split()})
    assert not (DEFAULT_MODEL / "tasks" / "my_task").exists()

    adapted = tmp_path / "models" / "my-domain"
    result = json.loads(outputs[commands[3]].strip().splitlines()[-1])
    assert {"before_ppl", "after_ppl", "tokens"} <= set(result) and result["tokens"] > 0
    assert {"my_task", "pos_brown"} <= set(result["stale_tasks"])  # carried over, marked stale
    assert json.loads((adapted / "onnx.json").read_text())["verification"]["passed"] is True
    assert json.loads((tmp_path / "models" / "zhs" / "config.json").read_text())["char_scheme"] == "vocab"


def port_is_free(port: int) -> bool:
    """Nothing listens on ``port``: it binds on IPv4's and (where the host has IPv6) IPv6's any-address, as a server
    would. SO_REUSEADDR: a connection of an earlier run left in TIME_WAIT does not count as taken."""
    families = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for family, host in families:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # IPv6 compiled in but switched off on this host
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


README_PORTS = (GRPC_PORT, HTTP_PORT, METRICS_PORT)  # `make serve`'s, as the README's commands name them


def readme_ports_decision(ports: tuple[int, ...] = README_PORTS, ci: bool | None = None) -> tuple[str, str] | None:
    """Whether the README's port-bound commands (`make serve` and what talks to it on ``ports``) can run here: None
    when every port is free; else ("skip", why) on a developer's machine, where the taken port is most likely their
    own `make serve`, and ("fail", why) in CI (``ci``: None reads the environment), where a fresh machine has
    nothing there and a skip would silently drop the README's serving commands."""
    taken = [port for port in ports if not port_is_free(port)]
    if not taken:
        return None
    held, listed = "/".join(map(str, taken)), "/".join(map(str, ports))
    plural = len(taken) > 1
    subject = f"port{'s' if plural else ''} {held}" + (f" of {listed}" if len(taken) < len(ports) else "")
    subject += " are" if plural else " is"
    if in_ci() if ci is None else ci:
        return "fail", f"{subject} in use: CI is set, so the README's port-bound commands must run, not skip"
    return "skip", f"{subject} in use (your own `make serve`?): the README's port-bound commands are skipped"


def fresh_shell_environment() -> dict[str, str]:
    """The environment of a person's shell: none of the make/pytest/venv context this test runs in."""
    drop = {"MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "VIRTUAL_ENV", "PYTHONPATH", "PYTEST_CURRENT_TEST"}
    # the Makefile's `?=` variables
    drop |= {"MODEL", "PORT", "HTTP_PORT", "METRICS_PORT", "SERVE_VENV", "VENV", "SERVE_FLAVOUR"}
    env = {key: value for key, value in os.environ.items() if key not in drop}
    # no activated venv either: a README command must name its venv (.venv/bin/elmo), a bare `elmo` must fail here
    venvs = [str(REPO / name) for name in (".venv", ".venv-serve")]
    path = [entry for entry in env.get("PATH", "").split(os.pathsep) if not entry.startswith(tuple(venvs))]
    env["PATH"] = os.pathsep.join(path)
    return env


def run_command(command: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None) -> str:
    """``command`` as typed into a shell in ``cwd``; its output (stdout + stderr). The test fails unless it exits 0."""
    proc = subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env=env or fresh_shell_environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )
    tail_text = "\n".join(proc.stdout.splitlines()[-40:])
    assert proc.returncode == 0, f"`{command}` (in {cwd}) exited with {proc.returncode}:\n{tail_text}"
    return proc.stdout


def embed_count(metrics_text: str) -> float:
    """elmo_requests_total for successful Embed calls (0 before the first)."""
    for line in metrics_text.splitlines():
        if line.startswith("elmo_requests_total{") and 'method="Embed"' in line and 'code="OK"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def scrape_metrics() -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def serve_process(make_pid: int) -> int | None:
    """The `elmo serve` process that `make serve` started (what an orchestrator would send SIGTERM to)."""
    for pid in descendants(make_pid):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/elmo") for a in argv) and b"serve" in argv:
            return pid
    return None


def health_status(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status
    except grpc.RpcError:
        return None


def listening_socket(family: socket.AddressFamily = socket.AF_INET, host: str = "127.0.0.1") -> socket.socket:
    """A socket listening on a port the system picks, as another server on this machine would hold it."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


def released_port() -> int:
    """A port that was free a moment ago: bound, then let go (nothing listens there now)."""
    with listening_socket() as sock:
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "family, host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1")]
)
def test_a_port_held_by_another_server_is_not_free(family, host) -> None:
    try:
        held = listening_socket(family, host)
    except OSError as error:  # a host without IPv6
        pytest.skip(f"cannot listen on {host}: {error}")
    with held:
        port = held.getsockname()[1]
        assert not port_is_free(port)
    assert port_is_free(port)  # let go: free again


def test_readme_ports_held_elsewhere_skip_with_one_message_and_fail_in_ci() -> None:
    free = released_port()
    with listening_socket() as first, listening_socket() as second:
        a, b = first.getsockname()[1], second.getsockname()[1]
        skipped = "(your own `make serve`?): the README's port-bound commands are skipped"
        assert readme_ports_decision((a, b), ci=False) == ("skip", f"ports {a}/{b} are in use {skipped}")
        assert readme_ports_decision((free, a), ci=False) == ("skip", f"port {a} of {free}/{a} is in use {skipped}")
        verdict, why = readme_ports_decision((free, a, b), ci=True)
        assert verdict == "fail" and why.startswith(f"ports {a}/{b} of {free}/{a}/{b} are in use: CI is set"), why
    assert readme_ports_decision((free, a, b), ci=False) is None  # all let go: the port-bound tests run
    assert readme_ports_decision((free, a, b), ci=True) is None


HELD_PORTS_PLUGIN = """\
def pytest_collection_modifyitems(items):
    import tests.test_readme_commands as readme

    readme.README_PORTS = {ports!r}  # stand-ins for 50051/8080/9090, held by the test that runs this
"""


@pytest.mark.parametrize("ci", [None, "1"])
def test_taken_readme_ports_skip_only_the_served_tests(tmp_path, ci) -> None:
    """End to end, in a pytest of its own: with the ports held, the `served` fixture's test skips with the one
    message (an error in CI) and a test of the same file that needs no server still passes."""
    with listening_socket() as grpc_, listening_socket() as http, listening_socket() as metrics:
        ports = tuple(sock.getsockname()[1] for sock in (grpc_, http, metrics))
        (tmp_path / "held_ports.py").write_text(HELD_PORTS_PLUGIN.format(ports=ports))
        env = {key: value for key, value in os.environ.items() if key not in ("CI", "PYTEST_ADDOPTS")}
        env["CI"] = ci or ""
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO)])
        tests = ("test_readme_serve_command_serves_embeds_and_stops_cleanly", "test_ci_runs_the_readme_test_command")
        nodes = [f"{Path(__file__).relative_to(REPO)}::{name}" for name in tests]
        command = [sys.executable, "-m", "pytest", "-p", "held_ports", "-p", "no:cacheprovider", "-rsE", *nodes]
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    listed = "/".join(map(str, ports))
    if ci:
        assert done.returncode == 1 and "1 passed, 1 error" in out, out
        assert f"ports {listed} are in use: CI is set" in out, out
    else:
        assert done.returncode == 0 and "1 passed, 1 skipped" in out, out
        skipped = "(your own `make serve`?): the README's port-bound commands are skipped"
        assert f"ports {listed} are in use {skipped}" in out, out


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """The README's serve command running in the background until SERVING; stopped (hard) at the end if still up."""
    assert (DEFAULT_MODEL / "model.onnx").is_file(), (
        f"{DEFAULT_MODEL}/model.onnx is missing: `make serve` serves the shipped default model"
    )
    decision = readme_ports_decision(README_PORTS)  # taken (the user's own `make serve`?): one skip, all its tests
    if decision is not None:
        verdict, why = decision
        if verdict == "fail":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    command = readme_command(README.read_text(), "make serve")
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            ["bash", "-c", command],  # as typed into a shell, in the repo root
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=fresh_shell_environment(),
            start_new_session=True,  # its own process group: cleanup can reach make, pip and elmo alike
        )
    try:
        deadline = time.monotonic() + SERVING_DEADLINE_S
        while health_status(f"127.0.0.1:{GRPC_PORT}") != health_pb2.HealthCheckResponse.SERVING:
            if process.poll() is not None:
                pytest.fail(f"`{command}` exited with {process.returncode} before SERVING:\n{tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"`{command}` not SERVING after {SERVING_DEADLINE_S} s:\n{tail(log_path)}")
            time.sleep(1)
        yield process, log_path
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # only the group this fixture started
            process.wait(timeout=30)


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def test_readme_tour_commands_run_against_the_served_model(served) -> None:
    """The tour's client commands, as written, from the repo root, while `make serve` is up."""
    _, log_path = served
    commands = commands_covered_by(SERVED)
    assert commands, "README_COMMANDS lists no tour command run against the server"
    for command in commands:
        output = run_command(command, REPO, timeout=120)
        assert README_COMMANDS[command].expect in output, f"`{command}` printed:\n{output}"
    # the tour's first line says to wait for "SERVING" in the log
    assert "SERVING" in log_path.read_text(errors="replace")


def python_block_runner(block: str, page: str = "README.md") -> str:
    """A script that runs a Python block of ``page``, then prints what it left behind (arrays' shapes, results'
    tokens)."""
    return (
        "import json\n"
        f"namespace = {{}}\nexec(compile({block!r}, {page!r}, 'exec'), namespace)\n"
        "found = {}\n"
        "for name, value in namespace.items():\n"
        "    if hasattr(value, 'shape') and hasattr(value, 'dtype'):\n"
        "        found[name] = {'shape': list(value.shape), 'dtype': str(value.dtype)}\n"
        "    elif hasattr(value, 'tokens') and hasattr(value, 'mix'):\n"
        "        found[name] = {'tokens': list(value.tokens), 'mix': list(value.mix.shape)}\n"
        "    elif hasattr(value, 'usage') and hasattr(value, 'data'):\n"  # an OpenAI embeddings reply
        "        found[name] = {'vectors': len(value.data), 'dim': len(value.data[0].embedding),\n"
        "                       'prompt_tokens': value.usage.prompt_tokens}\n"
        "print(json.dumps(found))\n"
    )


def test_readme_python_blocks_run_against_the_served_model(served) -> None:
    """Each ```python block of DOCUMENTS (the README's tour blocks live in docs/how-to/clients.md), as written, from the
    repo root, against `make serve`: in the torch-free serve venv, or, for the OpenAI client's block, in .venv (the
    `openai` package is the user's, not the service's: the dev extra)."""
    clients = set(documented_snippets().values()) | set(spacy_blocks())  # run in .venv-clients / .venv, below
    blocks = [
        (page, block)
        for page, text in documents_text().items()
        for block in fenced_blocks(text, "python")
        if block not in clients
    ]
    assert blocks, f"{[page_name(path) for path in DOCUMENTS]} have no Python block"
    found: dict = {}
    for page, block in blocks:
        venv = ".venv" if "from openai import" in block else ".venv-serve"
        python = REPO / venv / "bin" / "python"
        output = run_command(f"{shlex.quote(str(python))} -c {shlex.quote(python_block_runner(block, page))}", REPO)
        names = json.loads(output.strip().splitlines()[-1])
        assert not set(names) & set(found), f"{page}: a block leaves {sorted(set(names) & set(found))} again"
        found.update(names)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        dim = pb_grpc.EmbedderStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30).dim
    # what the snippet promises: a task mix per token; the in-process Embedder's (tokens, layers) per text
    assert found["result"] == {"tokens": ["The", "cat", "sat", "."], "mix": [4, dim]}, found
    assert found["layers"] == {"shape": [3, 4, dim], "dtype": "float32"}, found
    # the OpenAI block: 苹 果 很 好 吃 and Apple shares rose . are 9 tokens
    assert found["reply"] == {"vectors": 2, "dim": dim, "prompt_tokens": 9}, found
    # and the first comment's "float32 (3 layers, 8 tokens, dim)" for 我吃了一个苹果。
    from elmo.client import EmbedderClient

    with EmbedderClient(f"127.0.0.1:{GRPC_PORT}") as client:
        layers = client.embed_texts(["我吃了一个苹果。"])[0]
    assert layers.shape == (3, 8, dim) and layers.dtype == np.float32


# -- the spaCy blocks: in .venv (the `spacy` extra), on the shipped model in the checkout, no server needed ----------
SPACY_BLOCK = re.compile(r"^<!-- spacy -->\n```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def spacy_blocks() -> list[str]:
    """The ```python blocks of DOCUMENTS marked ``<!-- spacy -->`` (they need spaCy, which .venv-serve lacks)."""
    return [block for text in documents_text().values() for block in SPACY_BLOCK.findall(text)]


def test_readme_spacy_blocks_run_as_written() -> None:
    """The spaCy blocks (README, docs/how-to/spacy.md), verbatim, from the repo root in .venv. The README's: 苹果 as the
    company is further from 苹果 the fruit than another fruit is, and the layers are (3, 8, dim) float32; the docs':
    whitespace tokens are tokens with zero vectors."""
    blocks = spacy_blocks()
    assert len(blocks) == 2 and all('nlp.add_pipe("elmo"' in block for block in blocks), blocks
    dim = json.loads((DEFAULT_MODEL / "onnx.json").read_text())["dim"]
    python = shlex.quote(str(REPO / ".venv" / "bin" / "python"))
    readme, docs = (
        run_command(f"{python} -c {shlex.quote(python_block_runner(block))}", REPO).strip().splitlines()
        for block in blocks
    )
    company, fruit = (float(v) for v in readme[-2].split())
    assert company < fruit < 1.0, readme[-2]
    assert json.loads(readme[-1])["layers"] == {"shape": [3, 8, dim], "dtype": "float32"}
    assert json.loads(docs[-1])["spaced"] == {"shape": [3, 6, dim], "dtype": "float32"}


def test_docs_spacy_commands_run_in_order(tmp_path) -> None:
    """docs/how-to/spacy.md's commands, in page order, in a scratch folder holding a copy of models/default (export-task
    writes into it) and the checkout's configs/, bench/ and .venv: data, a short `spacy train`, the export of the
    learned mix as a served task."""
    (tmp_path / ".venv").symlink_to(REPO / ".venv")
    for folder in ("configs", "bench"):
        (tmp_path / folder).symlink_to(REPO / folder)
    shutil.copytree(DEFAULT_MODEL, tmp_path / "models" / "default", ignore=shutil.ignore_patterns("report", "*.png"))
    commands = commands_covered_by(SPACY)
    assert len(commands) == 3, commands
    outputs = [run_command(README_COMMANDS[command].run_as or command, tmp_path, timeout=900) for command in commands]
    assert json.loads(outputs[0].strip().splitlines()[-1])["train"]["sentences"] == 300
    task = json.loads((tmp_path / "models" / "default" / "tasks" / "spacy_pos" / "task.json").read_text())
    assert task["data"]["component"] == "tagger" and len(task["mix"]["weights"]) == 3


# -- the OpenAI-compatible clients' snippets, in the clients' own environment, against `make serve` ----------------
CLIENTS_VENV = REPO / ".venv-clients"  # `make test` creates it: the `clients` extra (pinned releases from PyPI)
SNIPPET_RUNNER = REPO / "tests" / "clients" / "run_snippet.py"
CLIENT_BLOCK = re.compile(r"^<!-- client: (\w+) -->\n```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
CLIENTS = ("openai", "langchain", "llamaindex", "litellm", "chroma")
# what each raises for a model the server does not serve (404): the client's own exception type
CLIENT_NOT_FOUND = {
    "openai": "openai.NotFoundError",
    "langchain": "openai.NotFoundError",  # langchain-openai lets the openai client's errors through
    "llamaindex": "openai.NotFoundError",
    "litellm": "litellm.exceptions.NotFoundError",
    "chroma": "openai.NotFoundError",
}
N_DOCUMENTS = 300


def client_snippets(text: str) -> dict[str, str]:
    """A page's client blocks, by the name in the ``<!-- client: NAME -->`` line above each."""
    return dict(CLIENT_BLOCK.findall(text))


def documented_snippets() -> dict[str, str]:
    """The client blocks of DOCUMENTS (the README's, now in docs/how-to/clients.md), each client on one page only."""
    found: dict[str, str] = {}
    for page, text in documents_text().items():
        snippets = client_snippets(text)
        assert not set(snippets) & set(found), f"{page} repeats the snippets of {sorted(set(snippets) & set(found))}"
        found |= snippets
    return found


def paragraphs(n: int = N_DOCUMENTS) -> list[str]:
    """``n`` paragraph-length documents (40-60 words) of real prose: this repository's docs, cut into pieces."""
    words = " ".join(
        line
        for path in sorted((REPO / "docs").rglob("*.md"))
        for line in path.read_text().splitlines()
        if len(line.split()) > 8 and not line.startswith(("|", "```", "#", "    "))
    ).split()
    out, start = [], 0
    for i in range(n):
        size = 40 + (i * 7) % 21
        if start + size > len(words):
            start = 0
        out.append(" ".join(words[start : start + size]))
        start += size
    return out


def clients_python() -> Path:
    python = CLIENTS_VENV / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"{CLIENTS_VENV.name} is missing: `make test` creates it (pip install -e '.[clients]' in its own venv: "
            "the clients bring onnxruntime, which must not meet onnxruntime-gpu in .venv)",
            pytrace=False,
        )
    return python


def run_snippet(code: str, documents: list[str], folder: Path) -> tuple[np.ndarray | None, dict | None]:
    """(vectors, None) or (None, the error the snippet raised) from tests/clients/run_snippet.py."""
    snippet, documents_path, out = folder / "snippet.py", folder / "documents.json", folder / "vectors.npy"
    snippet.write_text(code)
    documents_path.write_text(json.dumps(documents, ensure_ascii=False))
    finished = subprocess.run(
        [str(clients_python()), str(SNIPPET_RUNNER), str(snippet), str(documents_path), str(out)],
        cwd=folder,  # nothing the client writes lands in the repository
        capture_output=True,
        text=True,
        timeout=600,
        env=fresh_shell_environment(),
    )
    if finished.returncode == 0:
        return np.load(out), None
    lines = finished.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), f"the snippet runner failed:\n{finished.stdout}\n{finished.stderr}"
    return None, json.loads(lines[-1])


def pooled_answer(documents: list[str]) -> np.ndarray:
    request = urllib.request.Request(
        f"http://127.0.0.1:{HTTP_PORT}/v1/embeddings",
        json.dumps({"model": "default", "input": documents}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float32)


def test_readme_has_one_snippet_per_client_and_docs_show_the_same() -> None:
    snippets = documented_snippets()
    assert tuple(snippets) == CLIENTS
    clients_page = (DOCS / "how-to" / "clients.md").read_text()
    assert tuple(client_snippets(clients_page)) == CLIENTS  # where the README sends readers


@pytest.mark.parametrize("client", CLIENTS)
def test_readme_client_snippet_embeds_300_documents_as_the_server_does(served, client, tmp_path) -> None:
    documents = paragraphs()
    vectors, error = run_snippet(documented_snippets()[client], documents, tmp_path)
    assert error is None, error
    direct = pooled_answer(documents)
    assert vectors.shape == direct.shape == (N_DOCUMENTS, direct.shape[1])
    np.testing.assert_allclose(vectors, direct, rtol=0, atol=1e-6)


@pytest.mark.parametrize("client", CLIENTS)
def test_readme_client_snippet_errors_are_the_clients_own_types(served, client, tmp_path) -> None:
    snippet = documented_snippets()[client]
    wrong = snippet.replace('"default"', '"no-such-model"').replace('"openai/default"', '"openai/no-such-model"')
    assert wrong.count("no-such-model") == 1
    vectors, error = run_snippet(wrong, paragraphs(3), tmp_path)
    assert vectors is None and error["error"] == CLIENT_NOT_FOUND[client], error
    assert "unknown model 'no-such-model'" in error["message"], error


def test_readme_serve_command_serves_embeds_and_stops_cleanly(served) -> None:
    process, log_path = served
    address = f"127.0.0.1:{GRPC_PORT}"
    embeds_before = embed_count(scrape_metrics())  # the tour tests above call Embed too
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EmbedderStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        reply = stub.Embed(pb.EmbedRequest(inputs=[pb.Input(text=SENTENCE)], request_id="readme-test"), timeout=60)
    (embedding,) = reply.embeddings
    layers = from_tensor(embedding.layers)
    assert embedding.tokens == SENTENCE.split()
    assert layers.shape == (info.n_layers, len(embedding.tokens), info.dim)
    assert np.isfinite(layers).all() and np.abs(layers).sum() > 0
    assert reply.request_id == "readme-test"

    metrics = scrape_metrics()
    assert embed_count(metrics) == embeds_before + 1, f"the Embed call is not counted:\n{metrics}"

    pid = serve_process(process.pid)
    assert pid is not None, f"no `elmo serve` process under `make serve`:\n{tail(log_path)}"
    os.kill(pid, signal.SIGTERM)  # what `docker stop` / Kubernetes do
    try:
        code = process.wait(timeout=EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`elmo serve` still running {EXIT_DEADLINE_S} s after SIGTERM:\n{tail(log_path)}")
    assert code == 0, f"`make serve` exited with {code} after SIGTERM (elmo serve must drain and exit 0):\n" + tail(
        log_path
    )
    log_text = log_path.read_text(errors="replace")
    assert "drained and stopped" in log_text
    # One line names the provider and why; onnxruntime's own CUDA error block never shows (issue 14): the runtime
    # asks for CUDA only where a GPU is visible and its libraries load.
    provider_lines = [line for line in log_text.splitlines() if "onnxruntime provider:" in line]
    assert len(provider_lines) == 1, provider_lines
    for block in ("libonnxruntime_providers_cuda", "Require cuDNN", "Failed to load library"):
        assert block not in log_text, f"onnxruntime's CUDA error block in the `make serve` log:\n{tail(log_path)}"
