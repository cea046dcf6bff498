"""docs/explanation/architecture.md stays true to the tree: every module under elmo/, service/ and export/ is named
there, by its path or by its file name in a paragraph (a bullet) that names its folder."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "explanation" / "architecture.md"
FOLDERS = ("elmo", "service", "export")


def modules(root: Path = REPO) -> list[str]:
    """Repository-relative paths of the modules that must be named (generated protobuf code and empty package
    markers left out)."""
    found = []
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if "/v1/" in relative or "__pycache__" in relative:
                continue
            if path.name == "__init__.py" and len(path.read_text().strip().splitlines()) <= 4:
                continue  # a package's docstring only: the folder is what is named
            found.append(relative)
    return found


def named(doc: str) -> set[str]:
    """The module paths the document names: written out, or a file name inside a paragraph that names the folder
    (a bullet of the list, with its continuation lines, is one paragraph)."""
    paths = set(re.findall(r"[\w/]+\.py", doc))
    for paragraph in re.split(r"\n(?=\s*- )|\n\n", doc):
        folders = re.findall(r"`((?:elmo|service|export)(?:/\w+)*)/`", paragraph)
        files = re.findall(r"`(\w+\.py)`", paragraph)
        paths |= {f"{folder}/{name}" for folder in folders for name in files}
    return paths


def unnamed(doc: str, paths: list[str]) -> list[str]:
    have = named(doc)
    return [path for path in paths if path not in have]


def test_every_module_is_named_in_the_architecture_doc():
    missing = unnamed(DOC.read_text(), modules())
    assert not missing, f"docs/explanation/architecture.md does not name: {missing} (add each to its part's paragraph)"


def test_the_check_finds_a_module_the_doc_does_not_name():
    doc = "- **Core** (`service/core/`): `requests.py` (the core).\n- **Other**: `checks.py` alone.\n"
    assert unnamed(doc, ["service/core/requests.py", "service/core/checks.py", "export/verify.py"]) == [
        "service/core/checks.py",
        "export/verify.py",
    ]
    assert unnamed("see `export/verify.py`", ["export/verify.py"]) == []


def test_the_doc_says_first_where_an_import_lives():
    opening = DOC.read_text().split("\n## ", 1)[0]
    assert "package-dir" in opening and "service/core/requests.py" in opening
