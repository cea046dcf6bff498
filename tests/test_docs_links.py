"""Every relative link of README.md and docs/ leads somewhere: the file exists, and a `#anchor` into a Markdown page
names one of its headings (GitHub's anchors: lower case, punctuation dropped, spaces as dashes). Pages move; this
catches the links they leave behind."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", flags=re.DOTALL | re.MULTILINE)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and destination.suffix == ".md" and fragment not in anchors(destination):
            broken.append(f"{target} (no heading #{fragment})")
    return broken


def test_every_relative_link_leads_somewhere() -> None:
    found = {page.relative_to(REPO).as_posix(): broken_links(page) for page in PAGES}
    assert {page: links for page, links in found.items() if links} == {}


def test_the_check_finds_a_missing_file_and_a_missing_heading(tmp_path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Long inputs: how close `windows` come\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md) [b](other.md#long-inputs-how-close-windows-come) [c](gone.md) [d](other.md#nowhere) "
        "[e](https://example.org/x.md) [f](#top)\n\n# Top\n"
    )
    assert broken_links(page) == ["gone.md (no such file)", "other.md#nowhere (no heading #nowhere)"]
