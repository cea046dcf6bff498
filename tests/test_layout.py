"""The house's plan holds: no import cycle among the project's modules, no module over MAX_LINES, and the serving
side (docs/architecture.md, "The torch line") imports without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("elmo", "service", "export", "bench")
MAX_LINES = 600
TORCH_FREE = [
    "elmo.text.chars",
    "elmo.text.tokenize",
    "elmo.model.config",
    "elmo.runtime",
    "elmo.runtime.modeldir",
    "elmo.mix.store",
    "elmo.batch.cli",
    "elmo.batch.ray_engine",
    "elmo.client",
    "elmo.wire",
    "elmo.features",
    "elmo.cli",
    "service.server",
]


def project_modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file, for every module of the project's packages (generated protobuf code left out)."""
    found = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if "v1" in parts:
                continue
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (function-level imports included)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(import_graph(project_modules())) == []


def test_no_module_is_over_the_size_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in project_modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_serving_side_imports_no_torch(module):
    code = f"import sys, {module}; sys.exit(2 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{module} imported torch\n{result.stderr}"
