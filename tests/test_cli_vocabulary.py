"""One name per idea across every `elmo` command (elmo.cli.command_parser): durations end in -s or -ms, sizes in
-bytes or -tokens, threads, processes and actors are named as such, every flag has help, no choice is empty, and
the same knob has the same flag in every command that has it (the table below). Old names kept as hidden aliases
(elmo.flags.DeprecatedAlias) are left out: --help does not show them."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from elmo.cli import COMMANDS, command_parser, missing_for

AVAILABLE = [name for name, (_, _, extra) in COMMANDS.items() if not missing_for(extra)]

# words that make a flag a duration, or a size in bytes or tokens
DURATION_WORDS = ("timeout", "delay", "interval", "age", "wait", "seconds", "minutes", "deadline", "stall", "budget")
SIZE_WORDS = ("bytes", "memory", "tokens")
SIZE_QUALIFIERS = ("-per-peer",)  # what a size may end with after its unit: --in-flight-answer-bytes-per-peer
# one knob, one flag: knob -> (flag, the commands that have it)
SAME_KNOB = {
    "onnxruntime intra-op threads": ("--threads", ("serve", "embed-file", "bench")),
    "rows x tokens per onnxruntime run": ("--runtime-batch-tokens", ("serve", "embed-file")),
    "a sentence's tokens run at once": ("--max-sentence-tokens", ("serve", "embed-file")),
    "sentences over the limit": ("--overflow", ("serve", "embed", "embed-file")),
    "tokens shared by neighbouring windows": ("--window-overlap-tokens", ("serve", "embed-file")),
    "the bearer token": ("--auth-token", ("serve", "embed", "embed-file")),
    "a running server": ("--server", ("embed", "embed-file")),
    "a model's name on the server": ("--server-model", ("embed", "embed-file")),
    "the CA of the server's certificate": ("--tls-ca", ("embed", "embed-file")),
    "the vectors' number type": ("--dtype", ("embed", "embed-file")),
    "a model repository": ("--model-root", ("serve", "pull")),
    "the weights' size before reading": ("--max-weight-bytes", ("import-allennlp", "import-manylangs", "pull")),
    "padded tokens per training batch": ("--batch-tokens", ("adapt", "eval-lm")),
    "how long a run may take": ("--time-budget-s", ("adapt", "bench")),
    "the progress bar off": ("--no-progress", ("embed-file", "pull")),
}
# the names each knob had before: no command shows them any more
RETIRED = (
    "--batch-tokens@embed-file",
    "--max-tokens-per-sentence",
    "--max-tokens-per-request",
    "--workers",
    "--request-workers",
    "--shutdown-delay",
    "--drain-seconds",
    "--grpc-idle-timeout",
    "--window-overlap",
    "--tokens-per-batch",
    "--server-wait",
    "--minutes",
    "--seconds",
    "--timeout",
    "--model@embed",  # a model's name on the server is --server-model: --model names a directory
    "--token-cache",
)


def parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """The command's parser and its sub-commands' (`elmo mix train`, ...)."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def shown_flags() -> Iterator[tuple[str, str, argparse.Action]]:
    """(command, long flag, action) of every flag --help shows, in every command."""
    for command in AVAILABLE:
        for name, parser in parsers(command_parser(command)[1], command):
            for action in parser._actions:
                if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
                    continue
                for option in action.option_strings:
                    if option.startswith("--"):
                        yield name, option, action


FLAGS = list(shown_flags())


def words(flag: str) -> set[str]:
    return set(flag.strip("-").split("-"))


def takes_a_number(action: argparse.Action) -> bool:
    return action.nargs != 0 and not action.choices and action.type in (int, float, None) and action.const is None


def test_the_commands_are_checked() -> None:
    assert {"serve", "embed", "embed-file"} <= set(AVAILABLE)
    assert len(FLAGS) > 150


def test_durations_end_in_s_or_ms() -> None:
    wrong = [
        f"{command} {flag}"
        for command, flag, action in FLAGS
        if takes_a_number(action) and words(flag) & set(DURATION_WORDS) and not re.search(r"-(s|ms)$", flag)
    ]
    assert not wrong


def test_sizes_end_in_bytes_or_tokens() -> None:
    def unit_last(flag: str) -> bool:
        for qualifier in SIZE_QUALIFIERS:
            flag = flag.removesuffix(qualifier)
        return flag.endswith(("-bytes", "-tokens"))

    wrong = [
        f"{command} {flag}"
        for command, flag, action in FLAGS
        if takes_a_number(action)
        and words(flag) & set(SIZE_WORDS)
        and not unit_last(flag)
        and not re.search(r"-(s|ms)$", flag)
    ]  # a duration about memory: --memory-trim-interval-s
    assert not wrong


def test_threads_processes_and_actors_are_named_as_such() -> None:
    assert not [f"{command} {flag}" for command, flag, _ in FLAGS if "worker" in flag]


def test_every_flag_has_help() -> None:
    assert not [f"{command} {flag}" for command, flag, action in FLAGS if not (action.help or "").strip()]


def test_no_choice_is_empty() -> None:
    assert not [f"{command} {flag}" for command, flag, action in FLAGS if action.choices and "" in action.choices]


@pytest.mark.parametrize("knob", list(SAME_KNOB))
def test_the_same_knob_has_the_same_flag_in_every_command(knob: str) -> None:
    flag, commands = SAME_KNOB[knob]
    have = {command for command, shown, _ in FLAGS if shown == flag}
    assert set(commands) <= have, f"{knob}: {flag} missing from {set(commands) - have}"


def test_retired_names_are_shown_nowhere() -> None:
    shown = {(command, flag) for command, flag, _ in FLAGS}
    found = []
    for retired in RETIRED:
        flag, _, only = retired.partition("@")
        found += [f"{command} {flag}" for command, name in shown if name == flag and (not only or command == only)]
    assert not found


def test_the_checks_catch_what_they_are_for() -> None:
    """The rules above on flags made to break them."""
    parser = argparse.ArgumentParser()
    bad = {
        "--drain-seconds": parser.add_argument("--drain-seconds", type=float, help="x"),
        "--grpc-idle-timeout": parser.add_argument("--grpc-idle-timeout", type=float, help="x"),
        "--max-tokens-per-request": parser.add_argument("--max-tokens-per-request", type=int, help="x"),
        "--max-model-memory": parser.add_argument("--max-model-memory", help="x"),
    }
    durations = [f for f in bad if words(f) & set(DURATION_WORDS) and not re.search(r"-(s|ms)$", f)]
    sizes = [f for f in bad if words(f) & set(SIZE_WORDS) and not f.endswith(("-bytes", "-tokens"))]
    assert durations == ["--drain-seconds", "--grpc-idle-timeout"]
    assert sizes == ["--max-tokens-per-request", "--max-model-memory"]
    assert all(takes_a_number(a) for a in bad.values())


@pytest.mark.parametrize(
    ("command", "old", "new", "dest"),
    [
        ("embed", "--model", "--server-model", "model"),
        ("serve", "--token-cache", "--token-cache-entries", "token_cache"),
    ],
)
def test_a_renamed_flag_still_works_under_its_old_name(command, old, new, dest, capsys) -> None:
    """A script written with the old name keeps working, and is told the new one."""
    parser = command_parser(command)[1]
    needed = ["a text"] if command == "embed" else []
    assert getattr(parser.parse_args([*needed, new, "7"]), dest) in ("7", 7)
    assert getattr(parser.parse_args([*needed, old, "7"]), dest) in ("7", 7)
    assert f"{old} is now {new}" in capsys.readouterr().err
