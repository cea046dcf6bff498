"""`elmo serve`'s configuration (service/config.py, elmo/flags.py): every flag can be set from its ELMO_ variable and
from --config FILE, with the documented precedence (flag > variable > file > default); --print-config writes a file
that --config reads back to the same configuration, tokens left out; the essentials lead --help; a mistyped flag is
one line naming the right one."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from elmo.service.config import ServeConfig, serve_config

from elmo.cli import command_parser
from elmo.flags import DeprecatedAlias, config_toml, configurable, env_name, parse_configured
from tests.conftest import REPO

ESSENTIALS = ("--model", "--host", "--port", "--http-port", "--auth-token")


def serve_parser() -> argparse.ArgumentParser:
    return command_parser("serve")[1]


def flag(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def other_value(action: argparse.Action) -> tuple[str, Any]:
    """A value for the flag that is not its default: (as written in a variable or on the command line, as parsed)."""
    if action.nargs == 0:
        return ("false", False) if action.default else ("true", True)
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return str(choice), choice
    default = action.default[0] if isinstance(action.default, list) and action.default else action.default
    if isinstance(default, bool):
        raise AssertionError(f"{flag(action)}: a boolean that takes a value")
    if isinstance(default, int) and not isinstance(default, bool):
        text = str(default + 3)
    elif isinstance(default, float):
        text = str(default + 1.5)
    elif flag(action) == "--http-port":
        text = "8181"
    elif action.type is int:
        text = "7"
    elif action.type is float:
        text = "2.5"
    else:
        text = f"value-of-{flag(action).strip('-')}"
    parsed = action.type(text) if action.type is not None else text
    if isinstance(action, argparse._AppendAction):
        return text, [parsed]
    return text, parsed


def test_every_flag_is_read_from_its_variable() -> None:
    parser = serve_parser()
    actions = list(configurable(parser))
    assert {"--max-batch-tokens", "--model", "--auth-token", "--health-check-max"} <= {flag(a) for a in actions}
    environ = {}
    expected = {}
    for action in actions:
        text, parsed = other_value(action)
        environ[env_name(action)] = text
        expected[action.dest] = parsed
    args = parse_configured(serve_parser(), [], environ)
    wrong = {dest: (getattr(args, dest), value) for dest, value in expected.items() if getattr(args, dest) != value}
    assert not wrong, wrong
    assert env_name(next(a for a in actions if flag(a) == "--max-batch-tokens")) == "ELMO_MAX_BATCH_TOKENS"


def test_the_help_names_each_flags_variable() -> None:
    parser = serve_parser()
    missing = [flag(a) for a in configurable(parser) if f"[env {env_name(a)}]" not in (a.help or "")]
    assert not missing


def test_every_flag_is_read_from_the_config_file_and_the_precedence_holds(tmp_path: Path) -> None:
    """Each flag set in the file, one in the environment, one on the command line: the command line wins over the
    variable, the variable over the file, the file over the default."""
    parser = serve_parser()
    lines, expected = [], {}
    for action in configurable(parser):
        text, parsed = other_value(action)
        value = parsed if not isinstance(parsed, Path) else str(parsed)
        value = [str(v) if isinstance(v, Path) else v for v in value] if isinstance(value, list) else value
        lines.append(f"{flag(action)[2:]} = {_toml(value)}")
        expected[action.dest] = parsed
    config = tmp_path / "serve.toml"
    config.write_text("[anything]\n" + "\n".join(lines) + "\n")
    args = parse_configured(serve_parser(), ["--config", str(config)], {})
    wrong = {dest: (getattr(args, dest), value) for dest, value in expected.items() if getattr(args, dest) != value}
    assert not wrong, wrong

    environ = {"ELMO_MAX_BATCH_TOKENS": "1000", "ELMO_MAX_INPUTS": "9"}
    args = parse_configured(serve_parser(), ["--config", str(config), "--max-inputs", "11"], environ)
    assert args.max_batch_tokens == 1000  # the variable over the file
    assert args.max_inputs == 11  # the flag over the variable
    assert args.max_queue_tokens == expected["max_queue_tokens"]  # the file over the default
    assert parse_configured(serve_parser(), [], {}).max_queue_tokens == 65536  # the default


def _toml(value: Any) -> str:
    from elmo.flags import toml_value

    return toml_value(value)


def test_print_config_round_trips_and_leaves_tokens_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    environ = {"ELMO_AUTH_TOKEN": "s3cret-token", "ELMO_MAX_DELAY_MS": "4.5"}
    argv = [
        "--model",
        "a=/models/a",
        "--model",
        "/models/b",
        "--http-port",
        "off",
        "--drain-timeout-s",
        "12",
        "--model-alias",
        "ada=a",
        "--normalize",
        "--tls-cert",
        "c.pem",
        "--tls-key",
        "k.pem",
    ]
    with pytest.raises(SystemExit) as exit_:
        parse_configured(serve_parser(), [*argv, "--print-config"], environ)
    assert exit_.value.code == 0
    printed = capsys.readouterr().out
    assert "s3cret-token" not in printed and "# auth-token: set" in printed
    tomllib.loads(printed)  # a TOML file
    path = tmp_path / "printed.toml"
    path.write_text(printed)

    original = parse_configured(serve_parser(), argv, environ)
    again = parse_configured(serve_parser(), ["--config", str(path)], {"ELMO_AUTH_TOKEN": "s3cret-token"})
    skip = {"config", "print_config", "flag_sources"}
    differ = {k: (v, vars(again)[k]) for k, v in vars(original).items() if k not in skip and vars(again)[k] != v}
    assert not differ, differ
    assert again.http_port is None and again.drain_seconds == 12.0 and again.max_delay_ms == 4.5
    assert config_toml(serve_parser(), again) == printed  # printed again: the same file


def test_the_typed_configuration_holds_what_was_parsed() -> None:
    args = parse_configured(
        serve_parser(),
        ["--model", "/m", "--port", "0", "--max-batch-tokens", "4096", "--health-check-max", "64"],
        {"ELMO_AUTH_TOKEN": "t"},
    )
    config = serve_config(args)
    assert isinstance(config, ServeConfig)
    assert (config.models.model, config.network.port, config.network.host) == (("/m",), 0, "127.0.0.1")
    assert config.network.http_port == 8080  # HTTP on by default
    assert (config.limits.max_batch_tokens, config.health.max_checks) == (4096, 64)
    assert config.security.auth_token == "t" and "'t'" not in repr(config.security)
    assert args.flag_sources == {"auth_token": "$ELMO_AUTH_TOKEN"}


def test_a_bad_value_in_a_variable_or_the_file_is_one_error_naming_it(tmp_path: Path) -> None:
    cases = {
        "variable": (["--model", "m"], {"ELMO_PORT": "fifty"}, "ELMO_PORT='fifty': not a value for --port"),
        "unknown key": (["--config", str(tmp_path / "typo.toml")], {}, "unknown key modle: did you mean model?"),
        "missing file": (["--config", str(tmp_path / "none.toml")], {}, "none.toml: No such file or directory"),
    }
    (tmp_path / "typo.toml").write_text('modle = "x"\n')
    for name, (argv, environ, expected) in cases.items():
        done = _serve(argv, environ)
        assert done.returncode == 2, name
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elmo serve: error: ") and expected in lines[0], (name, lines)


def test_old_flag_names_still_work_hidden_from_help() -> None:
    parser = serve_parser()
    hidden = {s for a in parser._actions if isinstance(a, DeprecatedAlias) for s in a.option_strings}
    assert {"--drain-seconds", "--shutdown-delay", "--max-tokens-per-sentence", "--max-model-memory"} <= hidden
    args = parser.parse_args(["--drain-seconds", "7", "--max-tokens-per-sentence", "100"])
    assert (args.drain_seconds, args.max_tokens_per_sentence) == (7.0, 100)
    assert "--drain-seconds" not in parser.format_help()


def _serve(argv: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **environ}
    return subprocess.run(
        [sys.executable, "-m", "elmo.cli", "serve", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_essentials_come_first_in_help() -> None:
    done = _serve(["--help"], {"COLUMNS": "80"})
    assert done.returncode == 0
    first = "\n".join(done.stdout.splitlines()[:25])
    missing = [name for name in ESSENTIALS if f"\n  {name} " not in first]
    assert not missing, first


def test_a_mistyped_flag_is_one_line_naming_the_right_one() -> None:
    done = _serve(["--modle", "x"], {})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["elmo serve: error: unknown flag --modle: did you mean --model?"]
