"""Product text speaks to users in today's terms: README.md, every page of docs/ and the ``--help`` of every ``elmo``
command (its subcommands included) name no issue numbers, measurement rounds, revisions used as baselines or commit
hashes. The lab's record lives in bench/notes/, which this test does not read."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from elmo.cli import COMMANDS, command_parser, missing_for

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
    "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|last|latest|next|this"
)
# Each pattern names one kind of development history; what it must not catch is in its own (?!...) or test below.
HISTORY = {
    "an issue number": re.compile(r"\bissues?\s*#?\d+|#\d{1,4}\b(?!-)", re.IGNORECASE),
    "a measurement round": re.compile(
        rf"\b(?:{ORDINALS}|\d+(?:st|nd|rd|th))[ -]rounds?\b|(?<!-)\brounds?\s+(?:\d+|one|two|three)\b(?! of)"
        r"|\b(?:measurement|earlier|previous|later)\s+rounds?\b",
        re.IGNORECASE,
    ),
    "a revision as a baseline": re.compile(
        r"\b(?:before|after)\s*/\s*after\s+revision|\bthe revision\b|\bagainst\s+the\s+revision|"
        r"\b(?:earlier|previous)\s+revision|\((?:added|open)\)",
        re.IGNORECASE,
    ),
    # seven to forty hex digits with at least one digit and one letter: a commit hash (a SHA-256 is longer, and a
    # checksum's first digits are shown with an ellipsis)
    "a commit hash": re.compile(
        r"(?<![0-9a-zA-Z_/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9a-zA-Z_]|…|\.\.\.)"
    ),
}


def history_in(text: str) -> list[str]:
    """Each piece of development history in ``text``: 'line N: <kind>: <the words>'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in HISTORY.items():
            found += [f"line {number}: {kind}: {match.group(0)!r}" for match in pattern.finditer(line)]
    return found


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser under it."""
    yield parser
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from parsers(sub)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_docs_page_has_no_development_history(page: Path):
    assert history_in(page.read_text()) == []


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_command_help_has_no_development_history(name: str):
    if missing_for(COMMANDS[name][2]):
        pytest.skip(f"elmo {name} needs the {COMMANDS[name][2]} extra, not in this environment")
    _, parser = command_parser(name)
    helps = {sub.prog: sub.format_help() for sub in parsers(parser)}
    assert {prog: history_in(text) for prog, text in helps.items() if history_in(text)} == {}


@pytest.mark.parametrize(
    "text",
    [
        "as issue 42 asks",
        "(issue 31)",
        "issues 28, 29",
        "the eighteenth round",
        "the 7th round",
        "round 3 showed",
        "in an earlier round",
        "against the revision issue 42 started from",
        "before/after revision",
        "a flag (added)",
        "bar 0.6 (open)",
        "measured at 5b3928c",
        "git checkout 292b92a7",
    ],
)
def test_each_kind_of_history_is_found(text: str):
    assert history_in(text)


@pytest.mark.parametrize(
    "text",
    [
        "--rounds 3 alternates the two sides",
        "rounding to float16",
        "a round trip",
        "round-robin DNS",
        "sha256 9f2c4a1e0b7d6c5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a",
        "models/default/model.onnx",
        "3 rounds of 8 s each",
        "SHA-256 pinned (a6b92b9ccbb1…)",
        "HTTP 404 for an unknown route",
        "the vectors of layer 2",
    ],
)
def test_todays_words_are_not_taken_for_history(text: str):
    assert history_in(text) == []
