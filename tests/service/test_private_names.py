"""The service reaches into no other library's internals: no private attribute (``x._name``, ``getattr(x, "_name")``)
of asyncio's, aiohttp's or grpc's objects, and no swapping of a foreign object's class, anywhere in service/.

Statically, an access counts as the service's own when it is on ``self``/``cls`` or names a private attribute that
service/ itself defines (a ``def _name`` or an assignment to ``self._name``); every other one is foreign and must be
in ALLOWED with the reason it stays.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICE = REPO / "service"

# (module, the access as written) -> why it stays. Each entry is read by a reviewer: keep it short and true.
ALLOWED: dict[tuple[str, str], str] = {
    ("service/common/limits.py", "parser._action_groups"): "argparse (standard library, not a serving library) has "
    "no public way to find an argument group by its title; read once at start-up, never while serving",
    ("service/config.py", "parser._optionals"): "argparse: the only way to retitle the shared options group in --help",
    ("service/config.py", "argparse._ArgumentGroup"): "argparse: the argument group's type, in annotations only",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(root: Path = SERVICE) -> set[str]:
    """Private names service/ defines itself: methods, functions, classes and attributes assigned on self."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and private(node.target.id):
                names.add(node.target.id)
    return names


def foreign_accesses(source: str, own: set[str]) -> list[str]:
    """The private accesses in ``source`` that are not the service's own, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                found.append(ast.unparse(node))  # another object's class swapped at run time
            elif private(node.attr) and not on_self and node.attr not in own:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and private(name.value):
                found.append(ast.unparse(node))
    return found


def test_the_service_reads_no_private_attribute_of_another_library():
    own = own_private_names()
    found = {
        (path.relative_to(REPO).as_posix(), access)
        for path in sorted(SERVICE.rglob("*.py"))
        for access in foreign_accesses(path.read_text(encoding="utf-8"), own)
    }
    unexplained = sorted(found - set(ALLOWED))
    assert not unexplained, f"private attributes of other libraries (remove, or add to ALLOWED with why): {unexplained}"


def test_the_check_finds_what_it_must():
    own = {"_pump"}
    source = (
        "ready = getattr(self._loop, '_ready', None)\n"
        "n = len(loop._ready)\n"
        "handler.__class__ = Mine\n"
        "self._pump()\n"
        "other._pump()\n"
        "x = obj.__dict__\n"
    )
    assert sorted(foreign_accesses(source, own)) == [
        "getattr(self._loop, '_ready', None)",
        "handler.__class__",
        "loop._ready",
    ]
