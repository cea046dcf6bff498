"""Every command block of every docs page is run by a test, or says why not.

A command block is a fenced block in one of COMMAND_LANGUAGES (configuration, data and diagrams are not commands).
The line right above it says how it is covered, as an HTML comment (invisible on the rendered page):

- ``<!-- not run here: REASON -->``: no test runs it, and REASON says why (it needs a GPU, Docker, a cluster, your
  own corpus, hours of training, ...);
- ``<!-- run: served -->``: this file runs it (test_served_blocks_run_as_written) against a real `elmo serve` of
  models/default on free ports: a bash block in a scratch folder with the ports of `make serve` (50051, 8080, 9090)
  replaced by the server's, every command must succeed (``set -eo pipefail``); a python block likewise, as a script;
- a marker that another test reads: ``<!-- client: NAME -->``, ``<!-- spacy -->`` (tests/test_readme_commands.py),
  ``<!-- file: NAME -->`` (tests/test_tutorial.py).

The pages of tests/test_readme_commands.py's DOCUMENTS (their bash commands are each run or listed with a reason in
its README_COMMANDS; their python blocks run against `make serve`) and docs/tutorial.md (run block by block in a
fresh folder by tests/test_tutorial.py) follow their own tests' rules and are left to them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serve_process import ServeProcess
from tests.test_readme_commands import DOCUMENTS

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
TUTORIAL = DOCS / "tutorial.md"
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "python", "pycon")
OTHER_TESTS = re.compile(r"client: \w+|spacy|file: [\w.-]+")
NOT_RUN = re.compile(r"not run here: (?P<why>.{12,})")
SERVED = "run: served"
BLOCK = re.compile(
    r"^(?:<!-- (?P<marker>[^\n]*?) -->\n)?```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
    flags=re.DOTALL | re.MULTILINE,
)
MAKE_SERVE_PORTS = {"50051": "grpc", "8080": "http", "9090": "metrics"}
BLOCK_DEADLINE_S = 300


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    marker: str
    body: str


def command_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    page = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    return [
        Block(
            page, text.count("\n", 0, match.start()) + 1, match["lang"], (match["marker"] or "").strip(), match["body"]
        )
        for match in BLOCK.finditer(text)
        if match["lang"] in COMMAND_LANGUAGES
    ]


def pages_under_this_rule() -> list[Path]:
    left_to_others = {*DOCUMENTS, TUTORIAL}
    return [path for path in sorted(DOCS.rglob("*.md")) if path not in left_to_others]


def uncovered(blocks: list[Block]) -> list[str]:
    """The blocks without a marker that says how they are covered: 'page:line (why)'."""
    problems = []
    for block in blocks:
        if block.marker == SERVED or OTHER_TESTS.fullmatch(block.marker) or NOT_RUN.fullmatch(block.marker):
            continue
        if block.marker.startswith("not run here"):
            problems.append(f"{block.page}:{block.line} (say why it is not run, in a few words)")
        else:
            problems.append(
                f"{block.page}:{block.line} (no marker: `<!-- not run here: WHY -->` or `<!-- {SERVED} -->`)"
            )
    return problems


def test_every_command_block_is_run_or_says_why_not() -> None:
    blocks = [block for path in pages_under_this_rule() for block in command_blocks(path)]
    assert blocks, "no command blocks found: the parser is broken"
    problems = uncovered(blocks)
    assert not problems, "command blocks that no test runs and that do not say why:\n" + "\n".join(problems)


INDENTED_COMMAND = re.compile(
    r"^ {4,}(?:\$ )?(?:\.venv[\w-]*/|elmo |curl |docker |python |make |kubectl |ray ).*$", re.MULTILINE
)
FENCED = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def indented_commands(text: str) -> list[str]:
    """Commands written as indented code (outside fenced blocks), which no marker can precede: the lines."""
    return [match.group(0).strip() for match in INDENTED_COMMAND.finditer(FENCED.sub("", text))]


def test_commands_are_written_in_fenced_blocks() -> None:
    found = {
        page.relative_to(REPO).as_posix(): indented_commands(page.read_text(encoding="utf-8"))
        for page in pages_under_this_rule()
    }
    assert {page: lines for page, lines in found.items() if lines} == {}, "write these as ```bash blocks with a marker"
    assert indented_commands("text\n\n    elmo serve --model DIR\n\n```bash\n    elmo embed x\n```\n") == [
        "elmo serve --model DIR"
    ]


def test_the_rule_finds_an_unmarked_block_and_a_reason_too_short(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\nelmo serve\n```\n\n<!-- not run here: needs a GPU and CUDA 13 -->\n```bash\nnvidia-smi\n```\n\n"
        "<!-- not run here: no -->\n```python\nprint(1)\n```\n\n```yaml\nnot: a command\n```\n\n"
        "<!-- run: served -->\n```bash\ncurl localhost:8080/health\n```\n"
    )
    blocks = command_blocks(page)
    assert [(b.line, b.lang) for b in blocks] == [(1, "bash"), (5, "bash"), (10, "python"), (19, "bash")]
    problems = uncovered(blocks)
    assert (
        len(problems) == 2 and problems[0].startswith("page.md:1 (no marker") and "page.md:10 (say why" in problems[1]
    )


# -- the served blocks, run ------------------------------------------------------------------------------------------
def served_blocks() -> list[Block]:
    return [block for path in pages_under_this_rule() for block in command_blocks(path) if block.marker == SERVED]


def with_ports(body: str, ports: dict[str, int]) -> str:
    """``body`` with `make serve`'s ports (after a colon: `localhost:8080`, `127.0.0.1:50051`) replaced."""
    for port, name in MAKE_SERVE_PORTS.items():
        body = re.sub(rf"(?<=:){port}\b", str(ports[name]), body)
    return body


def test_ports_are_replaced_only_after_a_colon() -> None:
    ports = {"grpc": 1, "http": 2, "metrics": 3}
    assert with_ports("curl localhost:8080/v1 -d '8080' 127.0.0.1:50051 :9090x :90901", ports) == (
        "curl localhost:2/v1 -d '8080' 127.0.0.1:1 :9090x :90901"
    )


def run_block(block: Block, folder: Path, ports: dict[str, int]) -> subprocess.CompletedProcess:
    body = with_ports(block.body, ports)
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("ELMO_AUTH_TOKEN", None)
    if block.lang == "python":
        command = [str(REPO / ".venv" / "bin" / "python"), "-c", body]
    else:
        command = ["bash", "-c", f"set -eo pipefail\n{body}"]
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=BLOCK_DEADLINE_S)


@pytest.mark.slow  # a server of models/default: a few seconds to warm up, then the blocks
def test_served_blocks_run_as_written(tmp_path) -> None:
    blocks = served_blocks()
    assert blocks, "no `run: served` blocks: the marker is parsed wrong, or the pages lost them"
    folder = tmp_path / "reader"
    folder.mkdir()
    shutil.copytree(REPO / "proto", folder / "proto")  # a clone's proto/, for the blocks that generate code from it
    (folder / "models").symlink_to(REPO / "models")  # read only: the served blocks write nothing into a model
    args = ["--model", str(REPO / "models" / "default"), "--http-port", "0", "--metrics-port", "0"]
    with ServeProcess(args, tmp_path / "server") as server:
        server.wait_serving(timeout=180)
        grpc_port, metrics_port, http_port = server.port_file.read_text().split()
        ports = {"grpc": int(grpc_port), "http": int(http_port), "metrics": int(metrics_port)}
        for block in blocks:
            finished = run_block(block, folder, ports)
            assert finished.returncode == 0, (
                f"{block.page}:{block.line} exited with {finished.returncode}:\n{finished.stdout[-2000:]}\n"
                f"{finished.stderr[-2000:]}"
            )
            # curl exits 0 on an HTTP error: the server's error answer is what fails the block then
            assert '"error"' not in finished.stdout, (
                f"{block.page}:{block.line} got an error answer:\n{finished.stdout}"
            )
