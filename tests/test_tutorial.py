"""docs/tutorial.md, followed as a reader follows it: every block, in page order, as written, in a fresh folder.

The page is a sequence of fenced blocks, read by three rules (parse_tutorial):

- a ```python block right under ``<!-- file: NAME -->`` is a file the reader saves (the prose before it must name
  `NAME`): it is written into the folder when the reader reaches it, and a later ```bash block must run it;
- a ```bash block is pasted into a shell in the folder and must exit 0 (``set -eo pipefail``: a failing command or
  pipe fails the test). The block that is `make serve` alone is the server's terminal: it runs in the background,
  in its own process group, until grpc.health says SERVING; at the end the test presses Ctrl-C (SIGINT to the
  group), and the server must drain and stop;
- a ```text block is what the block before it prints (the server's block: its log): every line of it must be a
  line of that output, whitespace runs counting as one blank and ``…`` standing for any text.

The fresh folder holds what a clone holds where `make serve` and `make dev` have run: the Makefile and
pyproject.toml (links), .venv-serve and .venv (links to the checkout's, which are brought up to date in the checkout
first, so `make` in the folder has nothing to install), and a copy of models/default (the tutorial trains a task
into it; the shipped model must not gain one). The tutorial's ports are `make serve`'s own (50051/8080/9090), so no
command is substituted: when something already holds one of them the served test skips with the README test's
reason, and in CI (a fresh machine) fails instead (tests/test_readme_commands.py, readme_ports_decision).

Step 1's advice to serve with a token is prose (inline code), not a block: a test of its own takes the command, the
client's `export` and curl's header from the page and checks what the page says they do.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from tests.test_readme_commands import (
    DEFAULT_MODEL,
    GRPC_PORT,
    README,
    README_PORTS,
    REPO,
    fresh_shell_environment,
    health_status,
    readme_command,
    readme_ports_decision,
    run_command,
    tail,
)

TUTORIAL = REPO / "docs" / "tutorial.md"
pytestmark = pytest.mark.usefixtures("make_serve_ports")  # `make serve`'s ports and .venv-serve: one module at a time
SERVE_COMMAND = "make serve"
SERVING_DEADLINE_S = 120  # the venvs exist already: loading and warming models/default
STOP_DEADLINE_S = 60
BLOCK_DEADLINE_S = 600  # `mix train` and spaCy on 2 busy cores take well under a minute; this only stops a hang
BLOCK = re.compile(
    r"^(?:<!-- file: (?P<file>[\w.-]+) -->\n)?```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$",
    flags=re.DOTALL | re.MULTILINE,
)


@dataclass(frozen=True)
class Step:
    """One block of the page: ``kind`` is "file" (``name``: where the reader saves it), "bash", "serve" (the
    `make serve` block) or "output" (what the block before prints)."""

    kind: str
    body: str
    name: str = ""


def parse_tutorial(text: str) -> list[Step]:
    """The page's blocks as steps, in order; an AssertionError names a block that fits none of the rules."""
    steps: list[Step] = []
    prose_start = 0
    for match in BLOCK.finditer(text):
        lang, body, name = match["lang"], match["body"], match["file"] or ""
        prose, prose_start = text[prose_start : match.start()], match.end()
        if name:
            assert lang == "python", f"<!-- file: {name} --> marks a ```{lang} block: only Python files are saved"
            assert f"`{name}`" in prose, f"the text before {name} never tells the reader to save it as `{name}`"
            steps.append(Step("file", body, name))
        elif lang == "bash":
            steps.append(Step("serve" if body.strip() == SERVE_COMMAND else "bash", body))
        elif lang == "text":
            assert steps and steps[-1].kind in ("bash", "serve"), f"an output block follows no command:\n{body}"
            steps.append(Step("output", body))
        else:
            raise AssertionError(f"a ```{lang} block without a rule (a saved file needs <!-- file: NAME -->):\n{body}")
    return steps


def missing_lines(expected: str, output: str) -> list[str]:
    """The lines of ``expected`` that are no line of ``output`` (blanks collapsed; ``…`` matches any text)."""

    def squeeze(line: str) -> str:
        return " ".join(line.split())

    lines = [squeeze(line) for line in output.splitlines()]
    missing = []
    for line in filter(None, map(squeeze, expected.splitlines())):
        pattern = re.compile(".*?".join(re.escape(part) for part in line.split("…")))
        if not any(pattern.fullmatch(candidate) for candidate in lines):
            missing.append(line)
    return missing


def run_block(body: str, folder: Path, env: dict[str, str]) -> str:
    """A bash block pasted into a shell in ``folder``: its output; the test fails unless every command succeeds."""
    return run_command(f"set -eo pipefail\n{body}", folder, timeout=BLOCK_DEADLINE_S, env=env)


def reader_environment() -> dict[str, str]:
    """A person's shell (tests/test_readme_commands.py), without a token of the developer's own: the tutorial serves
    without one."""
    env = fresh_shell_environment()
    env.pop("ELMO_AUTH_TOKEN", None)
    return env


# -- the static rules: cheap, no server -----------------------------------------------------------------------------
def test_the_parser_reads_files_commands_and_outputs() -> None:
    page = (
        "Save this as `a.py`:\n\n<!-- file: a.py -->\n```python\nprint(1)\n```\n\n"
        "```bash\nmake serve\n```\n\n```text\n… SERVING\n```\n\n```bash\npython a.py\n```\n\n```text\n1\n```\n"
    )
    assert parse_tutorial(page) == [
        Step("file", "print(1)\n", "a.py"),
        Step("serve", "make serve\n"),
        Step("output", "… SERVING\n"),
        Step("bash", "python a.py\n"),
        Step("output", "1\n"),
    ]
    with pytest.raises(AssertionError, match="never tells the reader"):
        parse_tutorial("<!-- file: a.py -->\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="without a rule"):
        parse_tutorial("```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match="follows no command"):
        parse_tutorial("```text\n1\n```\n")


def test_expected_lines_must_be_whole_lines_of_the_output() -> None:
    output = "2026-12-06 19:10:02 INFO service.server: SERVING\nlayer 2: cosine  0.934\n"
    assert missing_lines("… INFO service.server: SERVING\nlayer 2: cosine 0.934\n", output) == []
    assert missing_lines("layer 2: cosine 0.935", output) == ["layer 2: cosine 0.935"]
    assert missing_lines("cosine 0.934", output) == ["cosine 0.934"]  # a part of a line is not the line
    assert missing_lines("layer …: cosine 0.9…", output) == []


def test_a_failing_command_of_a_block_fails_the_run(tmp_path) -> None:
    env = reader_environment()
    assert run_block("echo one\necho two", tmp_path, env).split() == ["one", "two"]
    for broken in ("false\necho after", "echo x | grep -q y | cat\necho after", "ls /no/such/path\necho after"):
        with pytest.raises(AssertionError, match="exited with"):
            run_block(broken, tmp_path, env)


def test_the_tutorial_saves_each_file_before_a_command_runs_it_and_serves_first() -> None:
    steps = parse_tutorial(TUTORIAL.read_text(encoding="utf-8"))
    kinds = [step.kind for step in steps]
    assert kinds.count("serve") == 1 and kinds.index("serve") < kinds.index("bash"), kinds
    # the same server as the README's set-up block starts
    assert SERVE_COMMAND == readme_command(README.read_text(encoding="utf-8"), "make serve")
    for index, step in enumerate(steps):
        if step.kind == "file":
            later = " ".join(s.body for s in steps[index + 1 :] if s.kind == "bash")
            assert re.search(rf"\bpython {re.escape(step.name)}\b", later), f"no command runs {step.name}"
    # the order the reader was promised: serve, gRPC, HTTP, the batch job, a task mix, spaCy
    commands = " ".join(step.body for step in steps if step.kind == "bash")
    milestones = ["elmo embed --server", "/v1/embed ", "/v1/embeddings", "embed-file", "mix train", "spacy_apple.py"]
    positions = [commands.find(milestone) for milestone in milestones]
    assert -1 not in positions and positions == sorted(positions), dict(zip(milestones, positions))


# -- the page, run ---------------------------------------------------------------------------------------------------
def serve_stamp() -> str:
    """The stamp `make serve` needs here: the Makefile's own choice of flavour (a GPU that nvidia-smi lists)."""
    gpu = subprocess.run(["bash", "-c", "nvidia-smi -L 2>/dev/null | grep -q '^GPU'"], check=False).returncode == 0
    return f".venv-serve/.installed-{'gpu' if gpu else 'cpu'}"


def fresh_folder(folder: Path) -> Path:
    """A clone's worth of the checkout in ``folder``, where `make serve` and `make dev` have nothing left to do."""
    stamps = [".venv/.installed", serve_stamp()]
    # Brought up to date in the checkout, where pip finds the sources; `make` in the folder would reinstall the
    # checkout's venvs (through the links) from a folder that has none.
    run_command(f"make --no-print-directory {' '.join(stamps)}", REPO, timeout=900)
    folder.mkdir()
    for name in ("Makefile", "pyproject.toml", ".venv", ".venv-serve"):
        (folder / name).symlink_to(REPO / name)
    shutil.copytree(DEFAULT_MODEL, folder / "models" / "default", ignore=shutil.ignore_patterns("report", "*.png"))
    up_to_date = subprocess.run(["make", "-q", *stamps], cwd=folder, env=fresh_shell_environment(), check=False)
    assert up_to_date.returncode == 0, f"`make` in {folder} would install into the checkout's venvs: {stamps}"
    return folder


@dataclass
class Server:
    """`make serve`, started as the page's block in a terminal of its own."""

    process: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def reader_folder(tmp_path) -> Path:
    decision = readme_ports_decision(README_PORTS)
    if decision is not None:
        verdict, why = decision
        (pytest.fail if verdict == "fail" else pytest.skip)(why)
    assert shutil.which("curl"), "the tutorial needs curl"
    return fresh_folder(tmp_path / "clone")


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """The servers a test starts; any still up at the end is killed with its whole process group."""
    started: list[Server] = []
    yield started
    for server in started:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)


def start_server(body: str, folder: Path, env: dict[str, str]) -> Server:
    log = folder.parent / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["bash", "-c", body],
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own, as a terminal's job
        )
    server = Server(process, log)
    deadline = time.monotonic() + SERVING_DEADLINE_S
    while health_status(f"127.0.0.1:{GRPC_PORT}") != health_pb2.HealthCheckResponse.SERVING:
        assert process.poll() is None, f"`{body.strip()}` exited with {process.returncode}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"`{body.strip()}` not SERVING after {SERVING_DEADLINE_S} s:\n{tail(log)}"
        time.sleep(0.5)
    return server


def press_ctrl_c(server: Server) -> None:
    """What Ctrl-C in the server's terminal does: SIGINT to its foreground group (make and elmo serve)."""
    os.killpg(server.process.pid, signal.SIGINT)
    try:
        server.process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`make serve` still running {STOP_DEADLINE_S} s after Ctrl-C:\n{tail(server.log)}")
    assert "drained and stopped" in server.log_text(), tail(server.log)


@pytest.mark.slow  # about a minute: a server, two batch jobs, a mix trained, spaCy
def test_the_tutorial_runs_as_written_in_a_fresh_folder(reader_folder, servers) -> None:
    folder, env = reader_folder, reader_environment()
    printed: list[str] = []  # each bash block's output, in order
    last: str | Server = ""  # what the block before an output block printed: its text, or the server (its log)
    for step in parse_tutorial(TUTORIAL.read_text(encoding="utf-8")):
        if step.kind == "file":
            (folder / step.name).write_text(step.body, encoding="utf-8")
        elif step.kind == "serve":
            last = start_server(step.body, folder, env)
            servers.append(last)
        elif step.kind == "bash":
            last = run_block(step.body, folder, env)
            printed.append(last)
        else:
            shown = last.log_text() if isinstance(last, Server) else last
            missing = missing_lines(step.body, shown)
            assert not missing, f"the tutorial shows {missing}; the block printed:\n{shown[-4000:]}"
    press_ctrl_c(servers[0])

    # what the page's prose says of what the commands left behind and printed
    task = json.loads((folder / "models" / "default" / "tasks" / "apple_sense" / "task.json").read_text())
    assert task["kind"] == "tagging" and sorted(task["labels"]) == ["BRAND", "FRUIT", "O"], task
    assert not (DEFAULT_MODEL / "tasks" / "apple_sense").exists()  # the shipped model gained nothing
    weights = task["mix"]["softmax"]
    assert max(weights) == weights[2], f"the page says layer 2 gets the largest weight: {weights}"
    layer_2, mix = (printed_value(printed, prefix) for prefix in ("layer 2: cosine ", "mix: cosine "))
    assert layer_2 < mix < 1.0, (layer_2, mix)  # "between layer 2's (0.934) and 1"
    company, fruit = (printed_value(printed, f"苹果, fruit vs {other}:") for other in ("company", "fruit"))
    assert company < fruit, (company, fruit)  # "The fruit is closer to the other fruit than to the company."
    assert (folder / "out.hdf5").is_file() and list((folder / "out").glob("*.parquet"))


def printed_value(outputs: list[str], prefix: str) -> float:
    """The number after ``prefix`` on the first line of ``outputs`` that starts with it."""
    for line in (line for output in outputs for line in output.splitlines()):
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    raise AssertionError(f"no line starting {prefix!r} in the tutorial's outputs")


# -- the token advice of step 1: prose, not a block, so its commands are taken from the page's inline code ----------
TOKEN_SERVE = re.compile(r"`(ELMO_AUTH_TOKEN=(\S+) make serve)`")
EMBED_ONE = '.venv-serve/bin/elmo embed --server 127.0.0.1:50051 "我吃了一个苹果。"'
CLIENT_ONE = (
    ".venv-serve/bin/python -c 'from elmo.client import EmbedderClient\n"
    'with EmbedderClient("127.0.0.1:50051") as client: print(client.embed_texts(["苹果"])[0].shape)\''
)
POST_ONE = "curl -s -o /dev/null -w '%{http_code}' localhost:8080/v1/embed -H 'Content-Type: application/json' " + (
    '-d \'{"inputs": ["苹果"]}\''
)


@dataclass(frozen=True)
class TokenAdvice:
    serve: str  # how to start the server with a token
    export: str  # what a client's terminal sets
    header: str  # what curl sends


def token_advice(text: str) -> TokenAdvice:
    """Step 1's token advice, as the page writes it: the serve command, the client's export and curl's header."""
    found = TOKEN_SERVE.findall(text)
    assert len(found) == 1, f"the tutorial should say once how to serve with a token: {found}"
    serve, token = found[0]
    export, header = f"export ELMO_AUTH_TOKEN={token}", f"-H 'Authorization: Bearer {token}'"
    for code in (export, header):
        assert f"`{code}`" in text, f"the token advice lacks `{code}`"
    return TokenAdvice(serve, export, header)


def shell(body: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``body`` in a shell in ``folder``, whatever its exit status (the token test expects refusals)."""
    return subprocess.run(
        ["bash", "-c", body], cwd=folder, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120
    )


def test_the_token_advice_is_read_from_the_page() -> None:
    advice = token_advice(TUTORIAL.read_text(encoding="utf-8"))
    assert advice.serve.endswith(f" {SERVE_COMMAND}") and advice.export.startswith("export ELMO_AUTH_TOKEN=")
    with pytest.raises(AssertionError, match="lacks"):
        token_advice("start it as `ELMO_AUTH_TOKEN=s3cret make serve`, then `export ELMO_AUTH_TOKEN=s3cret`")


@pytest.mark.slow  # a server of its own
def test_the_token_advice_of_step_1_holds(reader_folder, servers) -> None:
    """Served as step 1 says, with a token: API calls without it are refused (gRPC UNAUTHENTICATED, HTTP 401); the
    `elmo` command and the Python client pass with the variable exported in their terminal, curl with the header; the
    page and the metrics stay open."""
    folder, env = reader_folder, reader_environment()
    advice = token_advice(TUTORIAL.read_text(encoding="utf-8"))
    server = start_server(advice.serve, folder, env)
    servers.append(server)

    for command in (EMBED_ONE, CLIENT_ONE):
        refused = shell(command, folder, env)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stdout + refused.stderr, refused
        assert shell(f"{advice.export}\n{command}", folder, env).returncode == 0, command
    assert shell(POST_ONE, folder, env).stdout == "401"
    assert shell(POST_ONE.replace(" -d ", f" {advice.header} -d ", 1), folder, env).stdout == "200"
    for open_url in ("localhost:8080/", "localhost:9090/metrics"):
        assert shell(f"curl -s -o /dev/null -w '%{{http_code}}' {open_url}", folder, env).stdout == "200", open_url
    press_ctrl_c(server)
