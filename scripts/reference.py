"""Write docs/reference/commands.md from the parsers: every `elmo` command and subcommand, every flag with its default
and its help, in the groups `--help` shows. The page is generated, never edited by hand:

    .venv/bin/python scripts/reference.py          # rewrite docs/reference/commands.md
    .venv/bin/python scripts/reference.py --check  # exit 1 if the page differs from the parsers

tests/test_docs_reference.py fails when the page and the parsers differ, so a renamed or added flag forces a
regeneration. Run it in .venv (`make dev`): the training and spaCy commands need their extras to build their parsers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from any folder
    sys.path.insert(0, str(REPO))

from elmo.cli import COMMANDS, command_parser  # noqa: E402

PAGE = REPO / "docs" / "reference" / "commands.md"
COMMAND = ".venv/bin/python scripts/reference.py"
SHARED = ("--log-level", "--log-format")  # every command has them: listed once, at the top
HEADER = f"""# Reference: commands and flags

Every `elmo` command and its flags, as `elmo COMMAND --help` prints them. This page is generated from the parsers
(`{COMMAND}`; a test fails when it differs from them). How-to guides show the commands in use; [the docs
index](../README.md) lists them. A flag's environment variable or configuration file entry, where it has one, is
in [configuration.md](configuration.md).

Run a command as `.venv-serve/bin/elmo` (the serving install: `serve`, `embed`, `embed-file`, `data`) or
`.venv/bin/elmo` (everything; `make dev`). `elmo --help` lists the commands.
"""


def parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``elmo NAME [SUB]``, parser) for ``parser`` and every subcommand under it, depth first."""
    yield name, parser
    for action in parser._actions:  # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def cell(text: str) -> str:
    """``text`` as one Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def flag_name(action: argparse.Action) -> str:
    if not action.option_strings:  # a positional argument
        return f"`{action.metavar or action.dest}`"
    names = " / ".join(f"`{option}`" for option in action.option_strings)
    takes_value = action.nargs != 0
    metavar = action.metavar or (
        action.dest.upper() if not action.choices else "{" + ",".join(map(str, action.choices)) + "}"
    )
    return f"{names} {cell(metavar)}" if takes_value else names


def default_of(action: argparse.Action) -> str:
    if not action.option_strings:
        return "(required)" if action.nargs not in ("?", "*") else "—"
    if action.nargs == 0:  # a switch
        return "off" if action.default in (False, None) else "on"
    if action.default in (None, argparse.SUPPRESS, [], ""):
        return "—"
    return f"`{cell(action.default)}`"


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return cell(parser._get_formatter()._expand_help(action))  # %(default)s and the like, as --help writes them


def shown(action: argparse.Action, top: bool) -> bool:
    if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
        return False  # --help, sub-commands (their own sections), old flag names kept as hidden aliases
    return top or not set(action.option_strings) & set(SHARED)


def command_section(title: str, parser: argparse.ArgumentParser) -> list[str]:
    """One (sub)command: its heading, then one table of its flags, a group of its own in
    `--help` opened by a row with the group's title."""
    lines = [f"## `{title}`"]  # a short heading, so that other pages can link to #elmo-serve
    subcommands = [
        f"`{name}`"
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]
    if subcommands:
        lines += ["", f"Subcommands: {', '.join(subcommands)}."]
    rows = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if shown(a, False)]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments", "positional arguments"):
            rows.append(f"| *{cell(group.title)}* | | |")
        rows += [f"| {flag_name(a)} | {default_of(a)} | {help_of(parser, a)} |" for a in actions]
    if rows:
        lines += (
            ["| flag | default | what it does |", "|---|---|---|"]
            if not subcommands
            else ["", "| flag | default | what it does |", "|---|---|---|"]
        )
        lines += rows
    lines.append("")
    return lines


def render() -> str:
    lines = [HEADER]
    _, first = command_parser(next(iter(COMMANDS)))
    shared = [a for a in first._actions if set(a.option_strings) & set(SHARED)]
    every = "; ".join(f"{flag_name(a)} ({help_of(first, a)}; default {default_of(a)})" for a in shared)
    index = ", ".join(f"[`elmo {name}`](#elmo-{name}) ({cell(help_)})" for name, (_, help_, _) in COMMANDS.items())
    lines += [f"The commands: {index}.", "", f"Every command also takes {every}.", ""]
    for name in COMMANDS:
        _, parser = command_parser(name)
        for title, sub in parsers(parser, f"elmo {name}"):
            lines += command_section(title, sub)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write docs/reference/commands.md from the `elmo` parsers")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page differs from the parsers; write nothing"
    )
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = PAGE.is_file() and PAGE.read_text(encoding="utf-8") == text
        if not same:
            print(f"{PAGE.relative_to(REPO)} differs from the parsers: run `{COMMAND}`", file=sys.stderr)
        return 0 if same else 1
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
