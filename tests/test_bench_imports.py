"""bench/ stays small and leans on the product's public face only: no bench file imports a private name of the
product (``from elmo.x import _name``) or reaches for one through what it imported (``module._name``,
``Class._name``), so a product refactor never has to keep a private name alive for the lab; and the lab's Python
stays under 4,000 lines (what a reader or a test uses; the rest lives in git history)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
PRODUCT = {"elmo", "service", "export"}  # the installed packages, as a checkout imports them too
MAX_LINES = 4000


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def from_product(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in PRODUCT


def private_uses(source: str) -> list[str]:
    """Every private product name that ``source`` imports or reaches through a name bound by a product import."""
    tree = ast.parse(source)
    bound: set[str] = set()  # local names that stand for a product module or object
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and from_product(node.module):
            for alias in node.names:
                if private(alias.name) or any(private(part) for part in node.module.split(".")):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if from_product(alias.name):
                    if any(private(part) for part in alias.name.split(".")):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda use: int(use.split()[1].rstrip(":")))


def bench_files() -> list[Path]:
    return sorted(BENCH.rglob("*.py"))


def test_the_checker_finds_each_kind_of_private_use():
    source = """
from elmo.runtime.probe import _cases, token_cosines
from elmo import _internal as inner
import elmo.batch.job
import elmo.runtime as rt
from service.models import versions
from bench.kit.load import _private_of_the_lab
x = elmo.batch.job._size(3)
y = rt.host._flags
z = versions._cache.clear
token_cosines._memo
"""
    assert private_uses(source) == [
        "line 2: from elmo.runtime.probe import _cases",
        "line 3: from elmo import _internal",
        "line 8: elmo.batch.job._size",
        "line 9: rt.host._flags",
        "line 10: versions._cache",
        "line 11: token_cosines._memo",
    ]
    assert private_uses("import os\nos._exit(0)\nfrom elmo.runtime import Embedder\nEmbedder.__name__\n") == []


def test_no_bench_file_uses_a_private_name_of_the_product():
    offences = {
        str(path.relative_to(REPO)): uses
        for path in bench_files()
        if (uses := private_uses(path.read_text(encoding="utf-8")))
    }
    assert offences == {}, "bench/ uses the product's private names (make them public, or do without):\n" + "\n".join(
        f"{path}: {uses}" for path, uses in offences.items()
    )


def test_bench_stays_under_its_line_budget():
    lines = {str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines()) for path in bench_files()}
    total = sum(lines.values())
    largest = sorted(lines.items(), key=lambda item: -item[1])[:5]
    assert 0 < total < MAX_LINES, f"bench/ holds {total} lines of Python (largest: {largest}); keep what the docs cite"
