"""The flags of a command as a configuration a person can hold: every flag also read from the environment
(``ELMO_<NAME>``) and from a TOML file (``--config FILE``), printed back as that file (``--print-config``), and a
mistyped flag answered in one line.

Precedence, highest first: the flag on the command line, then its ``ELMO_<NAME>`` variable, then ``--config FILE``,
then the built-in default. The machinery works on the argparse parser itself, so a flag any module adds is
covered without being listed anywhere.

A TOML file has one key per flag, its name without the dashes in front (``max-batch-tokens = 8192``); tables
(``[limits]``) only group keys for the reader: a key means the same flag in any table. ``--print-config`` writes the
effective values in that form, one table per ``--help`` group, with unset flags and secrets (tokens) as comments, so
that its output read back with ``--config`` gives the same configuration (a token comes from its variable).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

ENV_PREFIX = "ELMO_"
SECRET_DESTS = frozenset({"auth_token", "admin_token"})  # never printed, only said to be set
CONFIG_DEST, PRINT_DEST = "config", "print_config"
TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class FlagParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``elmo serve: error: ...``, with "did you mean --model?" for a
    mistyped flag (argparse's own prints its whole usage block first). Sub-commands' parsers are of this class too
    (argparse makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self._with_suggestion(message)}\n")

    def _with_suggestion(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return f"{message} ({self.prog} --help lists the options)"
        unknown = message[len(prefix) :].split()
        flags = [word.split("=", 1)[0] for word in unknown if word.startswith("-")]
        if not flags:
            return f"unexpected argument {unknown[0]!r} ({self.prog} --help lists the options)"
        flag = flags[0]
        close = difflib.get_close_matches(flag, visible_flags(self), n=1, cutoff=0.6)
        hint = f": did you mean {close[0]}?" if close else f" ({self.prog} --help lists the options)"
        return f"unknown flag {flag}{hint}"


def visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every long flag ``--help`` shows."""
    return [s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")]


class DeprecatedAlias(argparse.Action):
    """An old flag name that still works, hidden from ``--help``: it sets the new flag's value and says once, on
    stderr, what the flag is called now."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs: Any) -> None:
        kwargs["default"] = argparse.SUPPRESS
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {option_string} is now {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_alias(group: Any, old: str, new_action: argparse.Action) -> None:
    """``old`` (e.g. ``--drain-seconds``) as a hidden alias of ``new_action``."""
    kwargs: dict[str, Any] = {"type": new_action.type} if new_action.type is not None else {}
    if new_action.nargs == 0:  # a store_true flag
        kwargs["nargs"] = 0
        kwargs["const"] = new_action.const
    group.add_argument(old, action=DeprecatedAlias, dest=new_action.dest, new=new_action.option_strings[0], **kwargs)


# -- a configuration's dataclass as flags --------------------------------------------------------------------------
def dashed(field_name: str) -> str:
    """A field's flag, without the dashes, where the flag is named as the field: ``max_age_s`` -> ``max-age-s``."""
    return field_name.replace("_", "-")


def add_fields_as_flags(
    group: Any,
    defaults: object,
    help_of: Mapping[str, str],
    flag_of: Callable[[str], str] = dashed,
    choices: Mapping[str, Sequence[str]] | None = None,
    group_of: Mapping[str, Any] | None = None,
    dest_is_field: bool = False,
    aliases: Mapping[str, str] | None = None,
    metavars: Mapping[str, str] | None = None,
) -> None:
    """One flag per field of the frozen dataclass instance ``defaults`` in ``group`` (a parser or an argument group,
    or ``group_of[name]`` where given): ``--{flag_of(name)}``, typed and defaulted by the field's value, its help
    from ``help_of`` with the default said ("(default: none)" for an empty one). The parsed value lands under the
    flag's own name, dashes as underscores (under the field's name with ``dest_is_field``): what
    :func:`fields_from_args` reads back. ``aliases`` maps a field to an older flag name still accepted (hidden)."""
    for f in fields(defaults):  # type: ignore[arg-type]
        default = getattr(defaults, f.name)
        where = (group_of or {}).get(f.name, group)
        extra: dict[str, Any] = {}
        if choices and f.name in choices:
            extra["choices"] = list(choices[f.name])
        if dest_is_field:
            extra["dest"] = f.name
            extra["metavar"] = flag_of(f.name).upper().replace("-", "_")
        if metavars and f.name in metavars:
            extra["metavar"] = metavars[f.name]
        said = f"(default {default})" if default not in ("", None) else "(default: none)"
        action = where.add_argument(
            f"--{flag_of(f.name)}", type=type(default), default=default, help=f"{help_of[f.name]} {said}", **extra
        )
        if aliases and f.name in aliases:
            add_alias(where, aliases[f.name], action)


def fields_from_args(cls: type, args: argparse.Namespace, flag_of: Callable[[str], str] | None = None) -> Any:
    """``cls`` from the flags :func:`add_fields_as_flags` added for it: each field from the flag's value, read under
    the field's name (``dest_is_field``, or a flag named as its field), else under ``flag_of``'s name."""
    dest = (lambda name: name) if flag_of is None else (lambda name: flag_of(name).replace("-", "_"))
    return cls(**{f.name: getattr(args, dest(f.name)) for f in fields(cls)})


# -- the environment and the file ----------------------------------------------------------------------------------
def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + _name(action).upper().replace("-", "_")


def _name(action: argparse.Action) -> str:
    """The flag's name without its dashes: its key in a TOML file."""
    return next(s for s in action.option_strings if s.startswith("--")).removeprefix("--")


def configurable(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The flags the environment and a file may set: every shown long flag but --help, --config, --print-config."""
    for action in parser._actions:
        shown = action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
        long = any(s.startswith("--") for s in action.option_strings)
        if shown and long and action.dest not in (CONFIG_DEST, PRINT_DEST):
            yield action


def make_configurable(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config FILE`` and ``--print-config`` to ``parser`` (in its last group) and names each flag's
    variable in its help. Call once every flag is added."""
    group = parser._optionals  # --help's own group, which comes last
    group.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="read flags from this TOML file (one key per flag, e.g. max-batch-tokens = 8192; what "
        "--print-config writes); a flag given on the command line, then its ELMO_ variable, "
        "wins over the file [env ELMO_CONFIG]",
    )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="print the configuration these flags, variables and file give, as a --config file "
        "(tokens left out), and exit",
    )
    for action in configurable(parser):
        action.help = f"{action.help} [env {env_name(action)}]"


def parse_configured(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with each flag's default taken from its variable, else from ``--config FILE``,
    else the parser's own; ``--print-config`` prints the result and exits 0."""
    environ = os.environ if environ is None else environ
    from_file = _read_config(parser, _config_path(parser, argv, environ))
    sources: dict[str, str] = {}
    for action in configurable(parser):
        variable = env_name(action)
        if variable in environ:
            action.default = _convert(parser, action, environ[variable], variable)
            sources[action.dest] = f"${variable}"
        elif _name(action) in from_file:
            action.default = _convert(parser, action, from_file[_name(action)], f"{_name(action)} in --config")
            sources[action.dest] = f"{_name(action)} in --config"
    args = parser.parse_args(list(argv))
    defaults = {action.dest: action.default for action in configurable(parser)}
    # where each value that is not the command line's came from (a message names it: "$ELMO_AUTH_TOKEN is empty")
    args.flag_sources = {dest: source for dest, source in sources.items() if getattr(args, dest) is defaults[dest]}
    if getattr(args, PRINT_DEST, False):
        sys.stdout.write(config_toml(parser, args))
        parser.exit(0)
    return args


def _config_path(parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str]) -> Path | None:
    """``--config FILE`` as given (the last one), else ``ELMO_CONFIG``."""
    path = environ.get(ENV_PREFIX + "CONFIG") or None
    for i, word in enumerate(argv):
        if word == "--config":
            if i + 1 >= len(argv):
                parser.error("argument --config: expected one argument")
            path = argv[i + 1]
        elif word.startswith("--config="):
            path = word.split("=", 1)[1]
    return Path(path) if path else None


def _read_config(parser: argparse.ArgumentParser, path: Path | None) -> dict[str, Any]:
    """The file's keys, tables flattened; an unknown key is an error naming the nearest flag."""
    if path is None:
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        parser.error(f"--config {path}: {exc.strerror}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        parser.error(f"--config {path}: not TOML: {exc}")
    known = {_name(a) for a in configurable(parser)}
    flat: dict[str, Any] = {}
    for key, value in _flatten(document):
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f": did you mean {close[0]}?" if close else " (no such flag)"
            parser.error(f"--config {path}: unknown key {key}{hint}")
        flat[key] = value
    return flat


def _flatten(document: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in document.items():
        if isinstance(value, dict):
            yield from _flatten(value)
        else:
            yield key, value


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, raw: Any, source: str) -> Any:
    """A value from the environment (a string) or a file (a TOML value) as the flag would have parsed it."""
    try:
        if action.nargs == 0:  # store_true / store_false
            return _boolean(raw, action)
        if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
            items = raw if isinstance(raw, list) else [part for part in str(raw).split(",") if part.strip()]
            return [_one(parser, action, item) for item in items]
        return _one(parser, action, raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"{source}={raw!r}: not a value for --{_name(action)} ({exc})")


def _boolean(raw: Any, action: argparse.Action) -> bool:
    if isinstance(raw, bool):
        value = raw
    elif str(raw).strip().lower() in TRUE_WORDS:
        value = True
    elif str(raw).strip().lower() in FALSE_WORDS:
        value = False
    else:
        raise ValueError(f"give one of {', '.join(TRUE_WORDS)} or {', '.join(w for w in FALSE_WORDS if w)}")
    return value if action.const is True else not value


def _one(parser: argparse.ArgumentParser, action: argparse.Action, raw: Any) -> Any:
    if isinstance(raw, (dict, list, bool)):
        raise ValueError(f"expected a {getattr(action.type, '__name__', 'string')}")
    value = action.type(str(raw)) if action.type is not None else str(raw)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"choose from {', '.join(map(str, action.choices))}")
    return value


# -- printing it back ----------------------------------------------------------------------------------------------
def order_groups(parser: argparse.ArgumentParser, first: Sequence[str]) -> None:
    """``--help``'s groups: those titled in ``first`` in that order, then the others as added, the parser's own
    (--help, --log-level, ...) last."""
    rank = {title: i for i, title in enumerate(first)}
    groups = [g for g in parser._action_groups if g is not parser._optionals]
    groups.sort(key=lambda g: rank.get(g.title or "", len(first)))  # stable: the others keep their order
    parser._action_groups[:] = [*groups, parser._optionals]


def config_toml(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The effective values as a ``--config`` file: one table per help group, unset flags and secrets commented."""
    lines = [
        "# elmo configuration: read it back with --config FILE. Precedence: flag > ELMO_ variable > this file"
        " > default."
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a in set(configurable(parser))]
        if not actions:
            continue
        lines += ["", f"[{_table(group.title or 'options')}]"]
        for action in actions:
            lines.append(_toml_line(action, getattr(args, action.dest, None)))
    return "\n".join(lines) + "\n"


def _table(title: str) -> str:
    """A help group's title as a TOML table name: ``batching and limits`` -> ``batching-and-limits``."""
    words = "".join(c if c.isalnum() else " " for c in title.split("(")[0].lower()).split()
    return "-".join(words) or "options"


def _toml_line(action: argparse.Action, value: Any) -> str:
    key = _name(action)
    if action.dest in SECRET_DESTS:
        state = "set" if value else "not set"
        return f"# {key}: {state}; never written here: give it with {env_name(action)} (or --{key})"
    if value is None and getattr(action.type, "none_text", None):  # a value that turns the thing off: --http-port off
        return f"{key} = {toml_value(action.type.none_text)}"
    if value is None or value == []:
        return f"# {key} =  (not set)"
    return f"{key} = {toml_value(value)}"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value) if not math.isnan(value) else "nan"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


__all__ = [
    "DeprecatedAlias",
    "ENV_PREFIX",
    "FlagParser",
    "add_alias",
    "add_fields_as_flags",
    "config_toml",
    "configurable",
    "dashed",
    "env_name",
    "fields_from_args",
    "make_configurable",
    "order_groups",
    "parse_configured",
    "visible_flags",
]
