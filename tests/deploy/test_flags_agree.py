"""The ways to run the server agree on ports and flags: the Makefile (`make serve`), the Dockerfile,
deploy/compose.yaml, the Kubernetes manifests and the deployment page of the docs (found by what it says,
wherever the docs keep it). gRPC 50051, HTTP 8080 and metrics 9090 everywhere; every flag they pass is one
`elmo serve` shows today; the container listens on every interface and says so, `make serve` on this machine
only."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from elmo.cli import command_parser
from elmo.flags import DeprecatedAlias, visible_flags
from tests.conftest import REPO

PORTS = {"--port": "50051", "--http-port": "8080", "--metrics-port": "9090"}
DEPLOY = REPO / "deploy"


def serve_flags() -> tuple[set[str], set[str]]:
    """(the flags `elmo serve --help` shows, every flag it accepts: old names kept as hidden aliases too)."""
    parser = command_parser("serve")[1]
    shown = set(visible_flags(parser))
    hidden = {s for a in parser._actions if isinstance(a, DeprecatedAlias) for s in a.option_strings}
    return shown, shown | hidden


def as_pairs(args: list[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` -> {flag: value}; a flag with no value -> ''."""
    pairs: dict[str, str] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("--") and "=" in word:
            flag, value = word.split("=", 1)
            pairs[flag] = value
        elif word.startswith("--"):
            following = args[i + 1] if i + 1 < len(args) else ""
            pairs[word] = "" if following.startswith("--") or not following else following
            i += 0 if not following or following.startswith("--") else 1
        i += 1
    return pairs


def dockerfile_cmd() -> dict[str, str]:
    text = (REPO / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert cmd, "the Dockerfile has a CMD in exec form"
    return as_pairs(json.loads(cmd.group(1)))


def dockerfile_exposed() -> set[str]:
    return set(re.search(r"^EXPOSE (.*)$", (REPO / "Dockerfile").read_text(), re.M).group(1).split())


def compose_command() -> dict[str, str]:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return as_pairs(compose["x-replica"]["command"])


def k8s_args() -> tuple[dict[str, str], set[str]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text()) if d]
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    return as_pairs(container["args"]), {str(p["containerPort"]) for p in container["ports"]}


def make_serve() -> tuple[dict[str, str], dict[str, str]]:
    """(the Makefile's variables' defaults, the flags of its `elmo serve` line with the variables filled in)."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+) \?= (.*)$", text, re.M))
    line = next(line for line in text.splitlines() if "bin/elmo serve" in line)
    filled = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), line)
    return variables, as_pairs(shlex.split(filled.split("elmo serve", 1)[1]))


def test_every_way_to_run_it_uses_the_same_ports() -> None:
    docker, compose, (k8s, k8s_ports) = dockerfile_cmd(), compose_command(), k8s_args()
    _, make = make_serve()
    for name, flags in {"Dockerfile CMD": docker, "compose": compose, "k8s": k8s, "make serve": make}.items():
        assert {flag: flags.get(flag) for flag in PORTS} == PORTS, name
    assert set(PORTS.values()) <= dockerfile_exposed()
    dockerfile = (REPO / "Dockerfile").read_text().splitlines()
    runs = [line for line in dockerfile if re.search(r"docker run .*elmo-service", line)]
    assert runs and all(set(re.findall(r"-p (\d+):\1", line)) == set(PORTS.values()) for line in runs), runs
    assert set(PORTS.values()) == k8s_ports
    services = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "service.yaml").read_text()) if d]
    target = {p["targetPort"] for p in services[0]["spec"]["ports"]}
    assert target == {"grpc", "http", "metrics"}
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert set(PORTS.values()) == set(compose["x-replica"]["expose"])


def test_the_container_listens_everywhere_and_make_serve_on_this_machine() -> None:
    variables, make = make_serve()
    assert variables["HOST"] == "127.0.0.1" and make["--host"] == "127.0.0.1"
    assert dockerfile_cmd()["--host"] == compose_command()["--host"] == k8s_args()[0]["--host"] == "0.0.0.0"
    assert "--host 0.0.0.0" in (REPO / "Dockerfile").read_text()  # and says why, beside the CMD


def test_every_flag_passed_is_one_serve_shows() -> None:
    shown, _ = serve_flags()
    for name, flags in {
        "Dockerfile CMD": dockerfile_cmd(),
        "compose": compose_command(),
        "k8s": k8s_args()[0],
        "make serve": make_serve()[1],
    }.items():
        assert not set(flags) - shown, f"{name}: {sorted(set(flags) - shown)}"
    compose, k8s = compose_command(), k8s_args()[0]
    shared = {"--shutdown-delay-s", "--drain-timeout-s", "--threads"}
    assert {f: compose[f] for f in shared} == {f: k8s[f] for f in shared}


def deployment_page() -> Path:
    """The docs page that explains running the container: the one that shows `docker run ... elmo-service` with
    its ports published."""
    pages = [
        p for p in sorted((REPO / "docs").rglob("*.md")) if re.search(r"docker run .*-p 50051:50051", p.read_text())
    ]
    assert pages, "a docs page shows `docker run -p 50051:50051 ... elmo-service`"
    return pages[0]


def serve_command_lines(text: str) -> list[str]:
    """The lines of the page's `elmo serve` and `docker run ... elmo-service` commands, continuations included."""
    lines, inside = [], False
    for line in text.splitlines():
        inside = inside or "elmo serve" in line or ("docker run" in line and "elmo-service" in line)
        if inside:
            lines.append(line.split(" # ")[0])  # a shell comment may name other tools' flags
        inside = inside and line.split(" # ")[0].rstrip().endswith("\\")
    return lines


def test_the_deployment_page_agrees() -> None:
    """Its `elmo serve` and `docker run` command lines publish and pass the same ports, and name only flags the
    server shows (today's names, never a hidden old one)."""
    accepted, _ = serve_flags()
    text = deployment_page().read_text()
    published = set(re.findall(r"-p (\d+):\1", text))
    assert set(PORTS.values()) <= published
    for flag, port in PORTS.items():
        given = set(re.findall(rf"{flag}[ =](\d+)", text))
        assert given <= {port, "0"}, (flag, given)
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", "\n".join(serve_command_lines(text))))
    docker_flags = {"--gpus", "--rm", "--name", "--env", "--network"}
    assert not named - accepted - docker_flags, sorted(named - accepted - docker_flags)
