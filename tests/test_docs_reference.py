"""The reference pages say what the product has, no more and no less:

- docs/reference/commands.md is what scripts/reference.py writes from the `elmo` parsers (every command, subcommand
  and flag, with its default and help), so a renamed or added flag fails here until the page is regenerated;
- docs/reference/grpc.md names every service, method, message, field and enum value of proto/ (the compiled
  descriptors), and names no field a message does not have;
- docs/reference/http.md names every route (method and path) a running server lists in `/openapi.json`, every field
  of every request body, and every status code a route may answer, and no request field the server does not take.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest
from elmo.service.server import RepositoryOptions

from elmo.cli import COMMANDS, missing_for
from elmo.runtime import Embedder
from elmo.v1 import embedder_pb2
from tests.service_helpers import EDGE_LIMITS, ServerThread

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference"
REGENERATE = ".venv/bin/python scripts/reference.py"


def generator():
    spec = importlib.util.spec_from_file_location("docs_reference", REPO / "scripts" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- commands: generated from the parsers --------------------------------------------------------------------------
def test_commands_page_is_what_the_parsers_say() -> None:
    missing = sorted({name for _, _, extra in COMMANDS.values() for name in missing_for(extra)})
    if missing:
        pytest.skip(f"the parsers of some commands need {missing} (run in .venv: `make dev`)")
    page = (REFERENCE / "commands.md").read_text(encoding="utf-8")
    assert page == generator().render(), (
        f"docs/reference/commands.md differs from the `elmo` parsers: regenerate it with `{REGENERATE}`"
    )


def test_the_generator_writes_every_flag_with_its_default_and_help() -> None:
    reference = generator()
    parser = argparse.ArgumentParser(prog="elmo demo", description="a demo command")
    parser.add_argument("--log-level", default="INFO", help="shared, listed once")
    parser.add_argument("input", help="the file to read")
    parser.add_argument("--max-wait-s", type=float, default=2.5, help="give up after this (default %(default)s)")
    group = parser.add_argument_group("limits")
    group.add_argument("--max-tokens", type=int, default=512, help="a | pipe in help")
    group.add_argument("--fast", action="store_true", help="a switch")
    text = "\n".join(reference.command_section("elmo demo", parser))
    assert text.startswith("## `elmo demo`\n")
    assert "| `input` | (required) | the file to read |" in text
    assert "| `--max-wait-s` MAX_WAIT_S | `2.5` | give up after this (default 2.5) |" in text
    assert "| *limits* | | |" in text and "| `--max-tokens` MAX_TOKENS | `512` | a \\| pipe in help |" in text
    assert "| `--fast` | off | a switch |" in text
    assert "--log-level" not in text  # the flags every command shares are listed once, at the top of the page
    renamed = argparse.ArgumentParser(prog="elmo demo")
    renamed.add_argument("--max-wait-ms", default=2500, help="give up after this")
    assert "--max-wait-s`" not in "\n".join(reference.command_section("elmo demo", renamed))


# -- gRPC: the proto's descriptors ---------------------------------------------------------------------------------
def rows_by_first_cell(section: str) -> dict[str, set[str]]:
    """A table's rows grouped by their first cell (an empty first cell continues the row above): the backticked
    names in the second cell of each group."""
    groups: dict[str, set[str]] = {}
    current = ""
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 3 or re.fullmatch(r":?-+:?", cells[0]):  # not a row, or the header's separator
            continue
        current = cells[0].strip("`") or current
        groups.setdefault(current, set()).update(re.findall(r"`(\w+)`", cells[1]))
    return groups


def section(page: str, heading: str) -> str:
    start = page.index(f"\n## {heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else len(page)]


def proto_fields() -> dict[str, set[str]]:
    return {
        name: {field.name for field in message.fields}
        for name, message in embedder_pb2.DESCRIPTOR.message_types_by_name.items()
    }


def field_gaps(page: str, fields: dict[str, set[str]]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(fields the page does not name, fields the page names that the message lacks), per message."""
    documented = rows_by_first_cell(section(page, "Messages"))
    missing = {m: names - documented.get(m, set()) for m, names in fields.items() if names - documented.get(m, set())}
    stale = {m: names - fields.get(m, set()) for m, names in documented.items() if names - fields.get(m, set())}
    return missing, stale


def test_grpc_reference_names_every_method_message_field_and_enum_value() -> None:
    page = (REFERENCE / "grpc.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`(\w+)", page))
    methods = {m.name for s in embedder_pb2.DESCRIPTOR.services_by_name.values() for m in s.methods}
    services = set(embedder_pb2.DESCRIPTOR.services_by_name)
    values = {v.name for e in embedder_pb2.DESCRIPTOR.enum_types_by_name.values() for v in e.values}
    enums = set(embedder_pb2.DESCRIPTOR.enum_types_by_name)
    assert not (services | methods | enums | values) - named, sorted((services | methods | enums | values) - named)
    missing, stale = field_gaps(page, proto_fields())
    assert not missing, f"docs/reference/grpc.md does not name these fields of proto/: {missing}"
    assert not stale, f"docs/reference/grpc.md names fields that proto/ does not have: {stale}"


def test_the_grpc_check_finds_a_missing_and_a_stale_field() -> None:
    page = (
        "x\n## Messages\n\n| message | field | meaning |\n|---|---|---|\n| `A` | `one` | x |\n| | `two`, `old` | y |\n"
    )
    assert field_gaps(page, {"A": {"one", "two"}}) == ({}, {"A": {"old"}})
    assert field_gaps(page, {"A": {"one", "two", "old", "new"}}) == ({"A": {"new"}}, {})


# -- HTTP: the running server's /openapi.json ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def openapi(tiny_model_dir, tmp_path_factory) -> dict:
    """A real server's /openapi.json: a model repository with the admin API, so every route is there, and a clients'
    token, so the bearer scheme and the 401 answers are there too."""
    root = tmp_path_factory.mktemp("reference-repository")
    shutil.copytree(tiny_model_dir, root / "tiny" / "1")
    repository = RepositoryOptions(root, lambda folder: Embedder(folder, intra_op_threads=1))
    server = ServerThread({}, EDGE_LIMITS, http=True, repository=repository, admin_token="admin", auth_token="t")
    try:
        with urllib.request.urlopen(f"{server.http_url}/openapi.json", timeout=60) as response:
            return json.loads(response.read())
    finally:
        server.stop()


def http_gaps(page: str, document: dict) -> list[str]:
    """What the page lacks or names beyond the document: routes, request fields, status codes."""
    gaps = []
    schemas = document["components"]["schemas"]
    taken: set[str] = set()
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if method == "parameters":
                continue
            if f"`{method.upper()} {path}`" not in page:
                gaps.append(f"route `{method.upper()} {path}` is not named")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "$ref" in body:
                taken |= set(schemas[body["$ref"].rsplit("/", 1)[-1]].get("properties", {}))
            statuses = section(page, "Status codes")
            for code in operation.get("responses", {}):
                if code != "200" and f"| {code}" not in statuses:
                    gaps.append(f"status {code} ({method.upper()} {path}) is not in the status table")
    documented = set().union(*rows_by_first_cell(section(page, "Request fields")).values())
    gaps += [f"request field `{name}` is not named" for name in sorted(taken - documented)]
    gaps += [f"request field `{name}` is named but no route takes it" for name in sorted(documented - taken)]
    return sorted(set(gaps))


def test_http_reference_names_every_route_field_and_status(openapi) -> None:
    page = (REFERENCE / "http.md").read_text(encoding="utf-8")
    assert http_gaps(page, openapi) == [], "docs/reference/http.md and the server's /openapi.json differ"


def test_the_http_check_finds_a_missing_route_and_a_renamed_field(openapi) -> None:
    page = (REFERENCE / "http.md").read_text(encoding="utf-8")
    assert "route `POST /v1/tokenize` is not named" in http_gaps(page.replace("`POST /v1/tokenize`", "`POST`"), openapi)
    renamed = json.loads(json.dumps(openapi))
    properties = renamed["components"]["schemas"]["EmbedRequest"]["properties"]
    properties["input_texts"] = properties.pop("inputs")
    gaps = http_gaps(page, renamed)
    assert (
        "request field `input_texts` is not named" in gaps
        and "request field `inputs` is named but no route takes it" in gaps
    )
