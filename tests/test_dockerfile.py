"""The service image, checked without Docker (which cannot run on these machines).

- Docker's own parser reads the Dockerfile (the PyPI ``dockerfile`` package wraps the official Go parser).
- House rules on the parsed instructions: pinned base, non-root user, gRPC HEALTHCHECK through
  scripts/healthcheck.py, no torch, onnxruntime-gpu with its CUDA/cuDNN extras at the `serve` pin, both ports
  exposed, the default model copied and served, ``elmo serve`` as the entry point, the CUDA wheels where the
  runtime's preload finds them.
- The .dockerignore lets every COPY source in and keeps the junk out (Docker's matching rules, re-implemented).
- Every ``pip install`` in the image resolves (``pip install --dry-run``) for the image's Python and platform.

Every rule has a test that feeds it a broken Dockerfile and sees it flagged.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = REPO / "pyproject.toml"

GRPC_PORT, HTTP_PORT, METRICS_PORT = "50051", "8080", "9090"
HEALTH_SCRIPT = "scripts/healthcheck.py"
DEFAULT_MODEL = "models/default"
ALLOWED_LOCAL_EXTRAS = {"serve", "gpu"}  # gpu: the CUDA/cuDNN wheels, torch-free
TORCH_PACKAGES = {"torch", "torchvision", "torchaudio", "triton", "pytorch-lightning", "lightning"}
ROOT_USERS = {"root", "0"}
# Debian release named in the base tag -> the glibc minor version of its C library (newest manylinux tag allowed).
DEBIAN_GLIBC_MINOR = {"bullseye": 31, "bookworm": 36, "trixie": 41}
KNOWN_INSTRUCTIONS = {
    "FROM",
    "RUN",
    "CMD",
    "LABEL",
    "EXPOSE",
    "ENV",
    "ADD",
    "COPY",
    "ENTRYPOINT",
    "VOLUME",
    "USER",
    "WORKDIR",
    "ARG",
    "ONBUILD",
    "STOPSIGNAL",
    "HEALTHCHECK",
    "SHELL",
    "MAINTAINER",
}
# pip options that take a value as the next word (everything else starting with '-' is a switch).
PIP_OPTIONS_WITH_VALUE = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-e",
    "--editable",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--python-version",
    "--platform",
    "--abi",
    "--implementation",
    "--src",
    "--upgrade-strategy",
    "--progress-bar",
    "--report",
    "--cache-dir",
    "--log",
    "--timeout",
    "--retries",
    "--trusted-host",
    "--no-binary",
    "--only-binary",
    "-C",
    "--config-settings",
    "--global-option",
    "--use-feature",
    "--proxy",
    "--cert",
    "--client-cert",
    "--exists-action",
    "--python",
}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&", ";;", "(", ")"}
# pip options that install somewhere else than the environment's site-packages (where onnxruntime.preload_dlls
# looks for the nvidia-* wheels' libraries, beside onnxruntime itself).
PIP_RELOCATING_OPTIONS = {"-t", "--target", "--prefix", "--root", "--user"}


# ----------------------------------------------------------------------------------------------- the model of a file


@dataclass
class PipInstall:
    """One ``pip install`` command of a RUN: its requirement strings, with a local project expanded."""

    line: int
    workdir: str
    requirements: list[str] = field(default_factory=list)
    local_extras: set[str] | None = None  # extras of a `pip install .[...]`; None when no local project
    problems: list[str] = field(default_factory=list)
    relocations: list[str] = field(default_factory=list)  # PIP_RELOCATING_OPTIONS it uses


@dataclass
class Copy:
    line: int
    sources: list[str]
    destinations: list[str]  # absolute path in the image of each source
    chown: str | None = None


@dataclass
class Image:
    """What the rules need from a parsed Dockerfile. ``final`` is the last stage (what `docker run` starts)."""

    instructions: list[dockerfile.Command]
    final: list[dockerfile.Command]
    stage_names: set[str]
    copies: list[Copy]
    pip_installs: list[PipInstall]


def parse_image(text: str, pyproject: dict) -> Image:
    """Parse with Docker's parser (raises dockerfile.GoParseError on what Docker rejects)."""
    instructions = list(dockerfile.parse_string(text))
    starts = [i for i, ins in enumerate(instructions) if ins.cmd == "FROM"]
    final = instructions[starts[-1] :] if starts else instructions
    stage_names = {ins.value[2].lower() for ins in instructions if ins.cmd == "FROM" and len(ins.value) == 3}
    copies, installs, workdir = [], [], "/"
    for ins in final:
        if ins.cmd == "WORKDIR" and ins.value:
            workdir = posixpath.normpath(posixpath.join(workdir, ins.value[0]))
        elif ins.cmd in ("COPY", "ADD") and not any(f.startswith("--from=") for f in ins.flags):
            copies.append(_copy(ins, workdir))
        elif ins.cmd == "RUN":
            installs += [_pip_install(argv, ins.start_line, workdir, pyproject) for argv in run_commands(ins)]
    return Image(instructions, final, stage_names, copies, [p for p in installs if p is not None])


def _copy(ins: dockerfile.Command, workdir: str) -> Copy:
    *sources, dest = ins.value
    dest_abs = posixpath.join(workdir, dest)
    into_directory = dest.endswith("/") or len(sources) > 1
    destinations = [
        posixpath.join(dest_abs, posixpath.basename(src.rstrip("/"))) if into_directory else dest_abs for src in sources
    ]
    chown = next((f.split("=", 1)[1] for f in ins.flags if f.startswith("--chown=")), None)
    sources = [posixpath.normpath(s) for s in sources]
    return Copy(ins.start_line, sources, [posixpath.normpath(d) for d in destinations], chown)


def run_commands(ins: dockerfile.Command) -> list[list[str]]:
    """The simple commands of a RUN (exec form: one; shell form: split at &&, ||, ;, |)."""
    if ins.json:
        return [list(ins.value)]
    lexer = shlex.shlex(" ".join(ins.value), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for word in lexer:
        if word in SHELL_SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in commands + [current] if c]


def _pip_install_arguments(argv: list[str]) -> list[str] | None:
    """The words after `pip install` (pip, pip3, /opt/venv/bin/pip, python -m pip), or None for other commands."""
    words = list(argv)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # leading VAR=value
        words.pop(0)
    if len(words) >= 2 and re.fullmatch(r"(.*/)?pip3?(\.\d+)?", words[0]) and words[1] == "install":
        return words[2:]
    is_python = len(words) >= 4 and re.fullmatch(r"(.*/)?python3?(\.\d+)?", words[0])
    if is_python and words[1:4] == ["-m", "pip", "install"]:
        return words[4:]
    return None


def _pip_install(argv: list[str], line: int, workdir: str, pyproject: dict) -> PipInstall | None:
    args = _pip_install_arguments(argv)
    if args is None:
        return None
    install = PipInstall(line, workdir)
    words = iter(args)
    for word in words:
        if word.split("=", 1)[0] in PIP_RELOCATING_OPTIONS:
            install.relocations.append(word.split("=", 1)[0])
        if word in ("-r", "--requirement"):
            install.problems.append(f"line {line}: `pip install -r` is not supported by this check; list the packages")
            next(words, None)
        elif word in ("-e", "--editable"):
            _add_requirement(install, next(words, ""), pyproject)
        elif word in PIP_OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            _add_requirement(install, word, pyproject)
    return install


def _add_requirement(install: PipInstall, word: str, pyproject: dict) -> None:
    local = re.fullmatch(r"(?P<path>[./][^\[]*)(\[(?P<extras>[^\]]*)\])?", word)
    if local is None:
        try:
            Requirement(word)
        except InvalidRequirement as exc:
            install.problems.append(f"line {install.line}: not a requirement: {word!r} ({exc})")
            return
        install.requirements.append(word)
        return
    path = posixpath.normpath(posixpath.join(install.workdir, local["path"]))
    if path != install.workdir:
        install.problems.append(f"line {install.line}: local install of {path}, expected the project in the WORKDIR")
    extras = {e.strip() for e in (local["extras"] or "").split(",") if e.strip()}
    optional = pyproject["project"].get("optional-dependencies", {})
    unknown = extras - set(optional)
    if unknown:
        install.problems.append(f"line {install.line}: unknown extra(s) {sorted(unknown)} of the project")
    install.local_extras = extras
    install.requirements += list(pyproject["project"].get("dependencies", []))
    for extra in sorted(extras & set(optional)):
        install.requirements += optional[extra]


def requirement_names(installs: list[PipInstall]) -> dict[str, list[Requirement]]:
    names: dict[str, list[Requirement]] = {}
    for install in installs:
        for text in install.requirements:
            requirement = Requirement(text)
            names.setdefault(canonicalize_name(requirement.name), []).append(requirement)
    return names


def option_value(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    """Value of ``--flag VALUE`` or ``--flag=VALUE`` in an argument list."""
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def env_values(instructions: list[dockerfile.Command]) -> dict[str, str]:
    values: dict[str, str] = {}
    for ins in instructions:
        if ins.cmd == "ENV":
            values.update(zip(ins.value[0::2], ins.value[1::2]))
    return values


def last(instructions: list[dockerfile.Command], cmd: str) -> dockerfile.Command | None:
    found = [ins for ins in instructions if ins.cmd == cmd]
    return found[-1] if found else None


def base_image(image: Image) -> tuple[str, str]:
    """(python version like '3.11', Debian release) of the final stage's base image tag."""
    ref = image.final[0].value[0] if image.final and image.final[0].cmd == "FROM" else ""
    tag = ref.split("@")[0].rsplit("/", 1)[-1].partition(":")[2]
    version = re.match(r"(\d+)\.(\d+)", tag)
    release = next((name for name in DEBIAN_GLIBC_MINOR if name in tag), "")
    return (f"{version[1]}.{version[2]}" if version else ""), release


# ------------------------------------------------------------------------------------------------------- the rules


def rule_instructions(image: Image, pyproject: dict) -> list[str]:
    """Docker's parser is lenient; the builder is not: unknown instructions and missing arguments fail the build."""
    problems = []
    for ins in image.instructions:
        if ins.cmd not in KNOWN_INSTRUCTIONS:
            problems.append(f"line {ins.start_line}: unknown instruction {ins.cmd}")
        elif not any(v.strip() for v in ins.value) and ins.cmd != "HEALTHCHECK":
            problems.append(f"line {ins.start_line}: {ins.cmd} without arguments")
        elif ins.cmd in ("COPY", "ADD") and len(ins.value) < 2:
            problems.append(f"line {ins.start_line}: {ins.cmd} needs a source and a destination")
        elif ins.cmd == "ENV" and len(ins.value) % 2:
            problems.append(f"line {ins.start_line}: ENV needs KEY=VALUE pairs")
    if not image.instructions or image.instructions[0].cmd not in ("FROM", "ARG"):
        problems.append("the file must start with FROM")
    for install in image.pip_installs:
        problems += install.problems
    return problems


def rule_base_pinned(image: Image, pyproject: dict) -> list[str]:
    """Every external base image is pinned: an exact X.Y.Z tag or a digest, never latest or a floating tag."""
    problems = []
    for ins in image.instructions:
        if ins.cmd != "FROM" or not ins.value:
            continue
        ref = ins.value[0]
        if ref.lower() in image.stage_names or ref == "scratch":
            continue
        if "$" in ref:
            problems.append(f"line {ins.start_line}: base image {ref!r} comes from a build argument; pin it literally")
            continue
        if re.search(r"@sha256:[0-9a-f]{64}$", ref):
            continue
        tag = ref.rsplit("/", 1)[-1].partition(":")[2]
        if not tag or tag == "latest":
            problems.append(f"line {ins.start_line}: base image {ref!r} is not pinned (no tag or :latest)")
        elif not re.match(r"\d+\.\d+\.\d+", tag):
            problems.append(f"line {ins.start_line}: base image tag {tag!r} floats; use an exact X.Y.Z version")
    return problems


def rule_non_root(image: Image, pyproject: dict) -> list[str]:
    """The container runs as a non-root user: the final stage's last USER, set before the ENTRYPOINT."""
    users = [(i, ins) for i, ins in enumerate(image.final) if ins.cmd == "USER" and ins.value]
    entry = [i for i, ins in enumerate(image.final) if ins.cmd == "ENTRYPOINT"]
    if not users:
        return ["no USER in the final stage: the service would run as root"]
    index, user = users[-1]
    name = user.value[0].split(":")[0]
    problems = []
    if name in ROOT_USERS:
        problems.append(f"line {user.start_line}: USER {user.value[0]} is root")
    if entry and index > entry[-1]:
        problems.append(f"line {user.start_line}: USER comes after the ENTRYPOINT; set it before")
    return problems


def rule_healthcheck(image: Image, pyproject: dict) -> list[str]:
    """A HEALTHCHECK asks the gRPC health protocol through scripts/healthcheck.py, on the served port."""
    check = last(image.final, "HEALTHCHECK")
    if check is None or not check.value or check.value[0].upper() != "CMD":
        return ["no HEALTHCHECK CMD in the final stage"]
    argv = list(check.value[1:]) if check.json else shlex.split(" ".join(check.value[1:]))
    script_destinations = {d for c in image.copies for s, d in zip(c.sources, c.destinations) if s == HEALTH_SCRIPT}
    problems = []
    if not script_destinations:
        problems.append(f"{HEALTH_SCRIPT} is not copied into the image")
    if not any(word in script_destinations for word in argv):
        problems.append(f"line {check.start_line}: the HEALTHCHECK does not run {HEALTH_SCRIPT} (as copied)")
    if not any(word.endswith(f":{GRPC_PORT}") for word in argv):
        problems.append(f"line {check.start_line}: the HEALTHCHECK does not probe port {GRPC_PORT}")
    return problems


def rule_no_torch(image: Image, pyproject: dict) -> list[str]:
    """The serving image has no torch: no torch requirement directly or through an extra."""
    names = requirement_names(image.pip_installs)
    torch_names = sorted(TORCH_PACKAGES & set(names))
    return [f"`pip install` brings {name} ({names[name][0]}) into the image" for name in torch_names]


def rule_serve_extra_only(image: Image, pyproject: dict) -> list[str]:
    """The project goes in with the `serve` and `gpu` extras and nothing else (dev/train extras do not belong in the
    image; `gpu` says where the CUDA wheels come from, as `make serve` installs them on a GPU host)."""
    local = [p for p in image.pip_installs if p.local_extras is not None]
    if not local:
        return ['the project itself is never installed (`pip install ".[serve,gpu]"`)']
    return [
        f"line {p.line}: project installed with extras {sorted(p.local_extras)}, want {sorted(ALLOWED_LOCAL_EXTRAS)}"
        for p in local
        if p.local_extras != ALLOWED_LOCAL_EXTRAS
    ]


def rule_onnxruntime_gpu(image: Image, pyproject: dict) -> list[str]:
    """onnxruntime-gpu with the [cuda,cudnn] extras at the `serve` pin; never the CPU `onnxruntime` beside it."""
    names = requirement_names(image.pip_installs)
    problems = []
    if "onnxruntime" in names:
        problems.append("`onnxruntime` (CPU) is installed: it overwrites onnxruntime-gpu's module")
    serve_pins = {
        str(r.specifier)
        for r in map(Requirement, pyproject["project"]["optional-dependencies"]["serve"])
        if canonicalize_name(r.name) == "onnxruntime-gpu"
    }
    gpu = names.get("onnxruntime-gpu", [])
    # The first install of it is the heavy layer (~1.5 GB), before any code: it must bring the CUDA/cuDNN wheels.
    if not gpu or not {"cuda", "cudnn"} <= gpu[0].extras:
        problems.append("the first onnxruntime-gpu install lacks its [cuda,cudnn] extras (CUDA 13 + cuDNN 9 wheels)")
    for requirement in gpu:
        if str(requirement.specifier) not in serve_pins:
            problems.append(f"{requirement} disagrees with the serve extra's pin {sorted(serve_pins)}")
    return problems


def rule_expose(image: Image, pyproject: dict) -> list[str]:
    """EXPOSE names the gRPC, the HTTP and the metrics port."""
    ports = {v.split("/")[0] for ins in image.final if ins.cmd == "EXPOSE" for v in ins.value}
    return [f"port {port} is not EXPOSEd" for port in (GRPC_PORT, HTTP_PORT, METRICS_PORT) if port not in ports]


def rule_entrypoint(image: Image, pyproject: dict) -> list[str]:
    """ENTRYPOINT is `elmo serve` (exec form, so SIGTERM reaches it); CMD serves on all three ports from all
    interfaces."""
    entry, cmd = last(image.final, "ENTRYPOINT"), last(image.final, "CMD")
    problems = []
    if entry is None or not entry.json or list(entry.value[:2]) != ["elmo", "serve"]:
        problems.append('ENTRYPOINT must be the exec form ["elmo", "serve"] (shell form swallows SIGTERM)')
    if cmd is None or not cmd.json:
        return problems + ["CMD must give the default flags in exec form"]
    flags = list(entry.value[2:] if entry else ()) + list(cmd.value)
    expected_flags = (("--port", GRPC_PORT), ("--http-port", HTTP_PORT), ("--metrics-port", METRICS_PORT))
    for flag, expected in (*expected_flags, ("--host", "0.0.0.0")):
        if option_value(flags, flag) != expected:
            problems.append(f"CMD must pass {flag} {expected}, got {option_value(flags, flag)!r}")
    return problems


def rule_default_model(image: Image, pyproject: dict) -> list[str]:
    """The default model is copied into the image, readable by the service user, and the CMD serves that copy."""
    copies = [c for c in image.copies if DEFAULT_MODEL in c.sources]
    if not copies:
        return [f"{DEFAULT_MODEL} is not copied into the image"]
    problems = []
    user = last(image.final, "USER")
    owner = user.value[0] if user is not None and user.value else None
    for copy in copies:
        # COPY keeps the build context's modes: weights saved 0600 by training stay unreadable for another user.
        if owner is None or copy.chown != owner:
            problems.append(f"line {copy.line}: COPY {DEFAULT_MODEL} needs --chown={owner} (got {copy.chown!r})")
    destinations = {d for c in copies for s, d in zip(c.sources, c.destinations) if s == DEFAULT_MODEL}
    cmd = last(image.final, "CMD")
    served = option_value(cmd.value, "--model") if cmd is not None else None
    if served not in destinations:
        problems.append(f"CMD serves --model {served!r}, not the copied default model {sorted(destinations)}")
    return problems


def rule_cuda_libraries(image: Image, pyproject: dict) -> list[str]:
    """The CUDA/cuDNN wheels land where the runtime's onnxruntime.preload_dlls looks for them (the site-packages that
    holds onnxruntime: no pip install elsewhere), and the NVIDIA Container Toolkit is not told to leave out the
    driver's compute library (libcuda) when the container runs with --gpus (unset means compute,utility)."""
    problems = [
        f"line {p.line}: `pip install {option}` installs outside the venv, where preload_dlls does not look"
        for p in image.pip_installs
        for option in p.relocations
    ]
    capabilities = env_values(image.final).get("NVIDIA_DRIVER_CAPABILITIES")
    if capabilities is not None and not {c.strip() for c in capabilities.split(",")} & {"compute", "all"}:
        problems.append(f"NVIDIA_DRIVER_CAPABILITIES={capabilities} leaves out compute: no libcuda under --gpus")
    return problems


def rule_local_install_sources(image: Image, pyproject: dict) -> list[str]:
    """Before `pip install .`, the image holds what building the project needs (pyproject, readme, packages)."""
    problems = []
    for install in (p for p in image.pip_installs if p.local_extras is not None):
        copied = {d for c in image.copies if c.line < install.line for d in c.destinations}
        for needed in project_build_inputs(pyproject):
            if posixpath.join(install.workdir, needed) not in copied:
                problems.append(f"line {install.line}: {needed} is not copied before `pip install .`")
    return problems


RULES = {
    name.removeprefix("rule_").replace("_", "-"): function
    for name, function in list(globals().items())
    if name.startswith("rule_")
}


def check_dockerfile(text: str, pyproject: dict) -> dict[str, list[str]]:
    """Rule name -> problems, for the rules that found any."""
    image = parse_image(text, pyproject)
    found = {name: rule(image, pyproject) for name, rule in RULES.items()}
    return {name: problems for name, problems in found.items() if problems}


def project_build_inputs(pyproject: dict) -> list[str]:
    """Top-level paths `pip install .` needs: pyproject.toml, the readme, each package directory it finds."""
    needed = ["pyproject.toml"]
    readme = pyproject["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    setuptools = pyproject.get("tool", {}).get("setuptools", {})
    folders = {name: name for name in setuptools.get("packages", []) if "." not in name}  # top-level packages
    folders |= setuptools.get("package-dir", {})  # elmo.service -> service/, ...
    needed += sorted(set(folders.values()))
    return needed


# ------------------------------------------------------------------------------------------------ .dockerignore


def dockerignore_patterns(text: str) -> list[tuple[re.Pattern, bool]]:
    """(regex, re-include?) per line, as Docker reads .dockerignore (filepath.Match plus `**`, last match wins)."""
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        patterns.append((re.compile(_glob_to_regex(pattern)), include))
    return patterns


def _glob_to_regex(pattern: str) -> str:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "^" + "".join(out) + "$"


def ignored(path: str, patterns: list[tuple[re.Pattern, bool]]) -> bool:
    """Docker's rule: a pattern matches a path or any of its parent directories; the last matching line decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    verdict = False
    for regex, include in patterns:
        if any(regex.match(c) for c in candidates):
            verdict = not include
    return verdict


# ---------------------------------------------------------------------------------------------------- resolution


def resolve(requirements: list[str], python: str, glibc_minor: int, work: Path) -> tuple[int, dict, str]:
    """pip's resolver on ``requirements`` for CPython ``python`` on manylinux x86_64 up to glibc 2.``glibc_minor``.

    Returns (pip's exit code, its --report JSON or {}, its output). Only wheels count: the image has no compiler.
    """
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(5, glibc_minor + 1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    report = work / "report.json"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--no-cache-dir",
        "--quiet",
        "--report",
        str(report),
        "--target",
        str(work / "target"),
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--abi",
        "cp" + python.replace(".", ""),
        *(f"--platform={p}" for p in platforms),
        *requirements,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    data = json.loads(report.read_text()) if done.returncode == 0 and report.is_file() else {}
    return done.returncode, data, done.stdout + done.stderr


# --------------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return DOCKERFILE.read_text()


@pytest.fixture(scope="module")
def image(dockerfile_text: str, pyproject: dict) -> Image:
    return parse_image(dockerfile_text, pyproject)


def test_dockerfile_passes_every_rule(dockerfile_text: str, pyproject: dict) -> None:
    assert check_dockerfile(dockerfile_text, pyproject) == {}


@pytest.mark.parametrize(
    "text",
    ["", "FROM python:3.11.13-slim\nRUN <<EOF\necho unterminated\n", "# escape=x\nFROM python:3.11.13-slim\n"],
    ids=["empty", "unterminated-heredoc", "bad-escape-directive"],
)
def test_docker_parser_rejects_what_docker_rejects(text: str) -> None:
    with pytest.raises(dockerfile.GoParseError):
        dockerfile.parse_string(text)


BASE_LINE = "\nFROM python:3.11.13-slim-bookworm\n"
# (id, text in the real Dockerfile, replacement, the rule that must flag it[, text appended at the end])
BREAKAGES = [
    ("unknown-instruction", "STOPSIGNAL SIGTERM", "STOPSIGANL SIGTERM", "instructions"),
    ("copy-without-destination", "COPY bench ./bench", "COPY bench", "instructions"),
    ("pip-install-r", 'pip install ".[serve,gpu]"', 'pip install -r requirements.txt ".[serve,gpu]"', "instructions"),
    ("latest-base", BASE_LINE, "\nFROM python:latest\n", "base-pinned"),
    ("untagged-base", BASE_LINE, "\nFROM python\n", "base-pinned"),
    ("floating-base", BASE_LINE, "\nFROM python:3.11-slim-bookworm\n", "base-pinned"),
    ("arg-base", BASE_LINE, "\nARG BASE=python:3.11.13-slim-bookworm\nFROM $BASE\n", "base-pinned"),
    ("root-user", "USER 10001:10001", "USER root", "non-root"),
    ("uid-0", "USER 10001:10001", "USER 0:0", "non-root"),
    ("no-user", "USER 10001:10001", "", "non-root"),
    ("user-after-entrypoint", "USER 10001:10001", "", "non-root", "\nUSER 10001:10001"),
    ("no-healthcheck", "HEALTHCHECK --interval", "# HEALTHCHECK --interval", "healthcheck"),
    ("healthcheck-none", 'CMD ["python", "/app/scripts/healthcheck.py", "127.0.0.1:50051"]', "NONE", "healthcheck"),
    ("healthcheck-not-grpc", '"/app/scripts/healthcheck.py", "127.0.0.1:50051"', '"-c", "print(1)"', "healthcheck"),
    ("health-script-not-copied", "COPY scripts/healthcheck.py /app/scripts/healthcheck.py", "", "healthcheck"),
    ("healthcheck-wrong-port", '"127.0.0.1:50051"]', '"127.0.0.1:8080"]', "healthcheck"),
    ("torch-direct", 'RUN pip install "onnxruntime-gpu', 'RUN pip install torch==2.13.0 "onnxruntime-gpu', "no-torch"),
    ("torch-via-extra", 'pip install ".[serve,gpu]"', 'pip install ".[serve,gpu,train]"', "no-torch"),
    ("dev-extra", 'pip install ".[serve,gpu]"', 'pip install ".[serve,gpu,dev]"', "serve-extra-only"),
    ("no-gpu-extra", 'pip install ".[serve,gpu]"', 'pip install ".[serve]"', "serve-extra-only"),
    ("project-not-installed", 'RUN pip install ".[serve,gpu]"', 'RUN pip install "grpcio==1.85.3"', "serve-extra-only"),
    (
        "onnxruntime-cpu",
        'pip install "onnxruntime-gpu[cuda,cudnn]==1.31.1"',
        "pip install onnxruntime==1.31.1",
        "onnxruntime-gpu",
    ),
    ("no-cuda-extras", '"onnxruntime-gpu[cuda,cudnn]==1.31.1"', '"onnxruntime-gpu==1.31.1"', "onnxruntime-gpu"),
    ("pin-drift", '"onnxruntime-gpu[cuda,cudnn]==1.31.1"', '"onnxruntime-gpu[cuda,cudnn]==1.30.0"', "onnxruntime-gpu"),
    ("no-metrics-port", "EXPOSE 50051 8080 9090", "EXPOSE 50051 8080", "expose"),
    ("no-http-port", "EXPOSE 50051 8080 9090", "EXPOSE 50051 9090", "expose"),
    ("no-grpc-port", "EXPOSE 50051 8080 9090", "EXPOSE 8080 9090", "expose"),
    ("python-entrypoint", 'ENTRYPOINT ["elmo", "serve"]', 'ENTRYPOINT ["python"]', "entrypoint"),
    ("shell-entrypoint", 'ENTRYPOINT ["elmo", "serve"]', "ENTRYPOINT elmo serve", "entrypoint"),
    ("loopback-only", '"--host", "0.0.0.0"', '"--host", "127.0.0.1"', "entrypoint"),
    ("cmd-wrong-port", '"--port", "50051"', '"--port", "50052"', "entrypoint"),
    ("model-not-copied", "COPY --chown=10001:10001 models/default /app/models/default", "", "default-model"),
    ("model-root-owned", "COPY --chown=10001:10001 models/default", "COPY models/default", "default-model"),
    ("serves-other-model", '"--model", "/app/models/default"', '"--model", "/models/x"', "default-model"),
    ("cuda-wheels-elsewhere", 'RUN pip install "onnx', 'RUN pip install --target=/opt/x "onnx', "cuda-libraries"),
    ("cuda-wheels-user", 'RUN pip install "onnx', 'RUN pip install --user "onnx', "cuda-libraries"),
    ("no-compute-capability", "CAPABILITIES=compute,utility", "CAPABILITIES=utility", "cuda-libraries"),
    ("readme-not-copied", "COPY pyproject.toml README.md ./", "COPY pyproject.toml ./", "local-install-sources"),
    ("package-not-copied", "COPY service ./service", "", "local-install-sources"),
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=[b[0] for b in BREAKAGES])
def test_each_rule_flags_a_broken_dockerfile(breakage: tuple, dockerfile_text: str, pyproject: dict) -> None:
    _, old, new, rule, *appended = breakage
    assert old in dockerfile_text, f"the breakage no longer applies to the Dockerfile: {old!r}"
    broken = dockerfile_text.replace(old, new, 1) + "".join(appended)
    problems = check_dockerfile(broken, pyproject)
    assert rule in problems, f"rule {rule!r} missed the breakage; flagged: {problems}"


def test_every_rule_has_a_breakage() -> None:
    assert set(RULES) == {b[3] for b in BREAKAGES}


def test_run_commands_are_split_like_a_shell(image: Image) -> None:
    run = dockerfile.parse_string('FROM a\nRUN A=1 pip3 install -q "x[y]>=1" && python -m pip install --user z; ls\n')
    commands = run_commands(run[1])
    assert commands == [
        ["A=1", "pip3", "install", "-q", "x[y]>=1"],
        ["python", "-m", "pip", "install", "--user", "z"],
        ["ls"],
    ]
    assert [_pip_install_arguments(c) for c in commands] == [["-q", "x[y]>=1"], ["--user", "z"], None]


def test_pip_installs_of_the_image_are_found(image: Image, pyproject: dict) -> None:
    """The rules see both installs: the heavy onnxruntime layer and the project with its serve and gpu extras."""
    assert len(image.pip_installs) == 2
    extras = pyproject["project"]["optional-dependencies"]
    expected = set(pyproject["project"]["dependencies"]) | set(extras["serve"]) | set(extras["gpu"])
    assert set(image.pip_installs[1].requirements) == expected
    assert image.pip_installs[0].requirements == extras["gpu"] == ["onnxruntime-gpu[cuda,cudnn]==1.31.1"]
    assert [p.relocations for p in image.pip_installs] == [[], []]


def test_gpu_extra_is_the_serve_extras_onnxruntime_with_cuda_wheels(pyproject: dict) -> None:
    """`make serve` on a GPU host and the image add the `gpu` extra to `serve`: the same onnxruntime-gpu pin."""
    extras = pyproject["project"]["optional-dependencies"]
    serve = [Requirement(r) for r in extras["serve"] if canonicalize_name(Requirement(r).name) == "onnxruntime-gpu"]
    (gpu,) = map(Requirement, extras["gpu"])
    assert canonicalize_name(gpu.name) == "onnxruntime-gpu" and gpu.extras == {"cuda", "cudnn"}
    assert [str(r.specifier) for r in serve] == [str(gpu.specifier)]


# ---- .dockerignore


def test_dockerignore_matching_follows_docker_rules() -> None:
    patterns = dockerignore_patterns("*\n!src/\n**/__pycache__\n!src/keep/__pycache__\ndocs/*.md\n/top.txt\n")
    assert ignored("README.md", patterns) and ignored("other/deep/file", patterns)
    assert not ignored("src/a.py", patterns) and not ignored("src/sub/b.py", patterns)
    assert ignored("src/__pycache__/a.pyc", patterns) and ignored("src/sub/__pycache__/b.pyc", patterns)
    assert not ignored("src/keep/__pycache__/c.pyc", patterns)
    assert ignored("top.txt", patterns)
    docs = dockerignore_patterns("docs/*.md\n")
    assert ignored("docs/a.md", docs) and not ignored("docs/sub/a.md", docs) and not ignored("x.md", docs)


def test_dockerignore_lets_in_every_copy_source(image: Image) -> None:
    patterns = dockerignore_patterns(DOCKERIGNORE.read_text())
    for copy in image.copies:
        for source in copy.sources:
            assert not ignored(source, patterns), f"line {copy.line}: COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        ".venv-serve/bin/elmo",
        "data/corpus/train.txt",
        "runs/default/ckpt",
        "tests/test_dockerfile.py",
        ".pytest_cache/v/x",
        ".ruff_cache/x",
        ".hypothesis/examples/x",
        "node_modules/@grpc/grpc-js/index.js",
        "clients/node/node_modules/x/index.js",
        "elmo/__pycache__/cli.cpython-311.pyc",
        "models/default/__pycache__/x.pyc",
        "models/other/model.onnx",
        "elmo_service.egg-info/PKG-INFO",
        "Makefile",
        ".ci/run",
    ],
)
def test_dockerignore_keeps_junk_out_of_the_build_context(path: str) -> None:
    assert ignored(path, dockerignore_patterns(DOCKERIGNORE.read_text())), f"{path} would be sent to the daemon"


def test_copy_sources_exist(image: Image) -> None:
    """The build fails on a missing COPY source; the default model must be there with its ONNX graph."""
    for copy in image.copies:
        for source in copy.sources:
            assert (REPO / source).exists(), f"line {copy.line}: COPY source {source} does not exist"
    for name in ("config.json", "model.onnx", "onnx.json"):
        assert (REPO / DEFAULT_MODEL / name).is_file(), f"{DEFAULT_MODEL}/{name} is missing: the image serves it"


# ---- healthcheck script


def test_health_script_imports_no_torch_and_no_elmo() -> None:
    code = (
        f"import runpy, sys; runpy.run_path({str(REPO / HEALTH_SCRIPT)!r}, run_name='probe'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'elmo', 'service', 'numpy')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


# ---- dependency resolution


def test_every_pip_install_resolves_for_the_image(image: Image, pyproject: dict, tmp_path: Path) -> None:
    """All the image's `pip install` requirement sets together (what the final environment holds), plus the
    build backend `pip install .` fetches, resolve to wheels for the base image's Python and glibc: the image
    would build. The resolved set is torch-free and has the CUDA/cuDNN wheels."""
    python, release = base_image(image)
    assert python and release in DEBIAN_GLIBC_MINOR, f"cannot tell Python/Debian release from the base ({python!r})"
    requirements = [r for p in image.pip_installs for r in p.requirements]
    requirements += pyproject["build-system"]["requires"]
    code, report, output = resolve(requirements, python, DEBIAN_GLIBC_MINOR[release], tmp_path)
    assert code == 0, f"pip could not resolve the image's requirements:\n{output[-4000:]}"
    names = {canonicalize_name(item["metadata"]["name"]) for item in report["install"]}
    assert not names & TORCH_PACKAGES, f"torch would come in transitively: {sorted(names & TORCH_PACKAGES)}"
    assert "onnxruntime" not in names, "the CPU onnxruntime would come in and overwrite onnxruntime-gpu"
    assert {"onnxruntime-gpu", "grpcio", "grpcio-health-checking"} <= names
    assert any(n.startswith("nvidia-cudnn") for n in names) and any(n.startswith("nvidia-cublas") for n in names)


def test_resolution_check_fails_on_conflicting_requirements(tmp_path: Path) -> None:
    code, report, output = resolve(["packaging==24.1", "packaging==23.2"], "3.11", 36, tmp_path)
    assert code != 0 and report == {}, output


# ---- the page's fonts


CJK_FONTS = ("fonts-wqy-microhei", "fonts-wqy-zenhei", "fonts-noto-cjk")


def test_the_image_has_a_cjk_font_for_the_pages_chinese_examples(image: Image) -> None:
    """A browser in the container draws the page's example sentences (苹果...) with a CJK font, not empty boxes:
    one of Debian's CJK font packages is installed (without recommends, apt's lists removed in the same layer)."""
    runs = [argv for ins in image.final if ins.cmd == "RUN" for argv in run_commands(ins)]
    installs = [argv for argv in runs if argv[:2] == ["apt-get", "install"]]
    assert any(set(CJK_FONTS) & set(argv) for argv in installs), installs
    assert all("--no-install-recommends" in argv for argv in installs)
    assert ["rm", "-rf", "/var/lib/apt/lists/*"] in runs
