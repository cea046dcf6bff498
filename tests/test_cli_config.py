"""`elmo embed-file` takes its flags the way `elmo serve` does (elmo.flags): from ELMO_<NAME> variables and from
--config FILE, a flag winning over its variable and the variable over the file; --print-config reads back; the
commands without a configuration answer a mistyped flag in one line too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elmo.cli import command_parser
from elmo.flags import parse_configured
from tests.conftest import REPO


def embed_file_parser():
    return command_parser("embed-file")[1]


def test_embed_file_reads_variables_and_the_file_with_the_same_precedence(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text('runtime-batch-tokens = 2048\nray-actors = 3\noverflow = "window"\nno-progress = true\n')
    argv = ["in.txt", "out.h5", "--config", str(config)]
    args = parse_configured(embed_file_parser(), argv, {"ELMO_RAY_ACTORS": "5", "ELMO_THREADS": "2"})
    assert (args.runtime_batch_tokens, args.ray_actors, args.threads) == (2048, 5, 2)  # file, variable, variable
    assert (args.overflow, args.no_progress) == ("window", True)
    args = parse_configured(embed_file_parser(), [*argv, "--ray-actors", "7"], {"ELMO_RAY_ACTORS": "5"})
    assert args.ray_actors == 7  # the flag first


def test_embed_file_print_config_reads_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["in.txt", "out.h5", "--model", "models/default", "--runtime-batch-tokens", "1024", "--tokenized"]
    with pytest.raises(SystemExit):
        parse_configured(embed_file_parser(), [*argv, "--print-config"], {"ELMO_AUTH_TOKEN": "secret"})
    printed = capsys.readouterr().out
    assert "secret" not in printed
    (tmp_path / "job.toml").write_text(printed)
    again = parse_configured(embed_file_parser(), ["in.txt", "out.h5", "--config", str(tmp_path / "job.toml")], {})
    original = parse_configured(embed_file_parser(), argv, {})
    skip = {"config", "print_config", "flag_sources"}
    assert {k: v for k, v in vars(again).items() if k not in skip} == {
        k: v for k, v in vars(original).items() if k not in skip
    }


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["embed", "--servr", "x:1", "hi"], "elmo embed: error: unknown flag --servr: did you mean --server?"),
        (
            ["embed-file", "a", "b", "--overflw", "window"],
            "elmo embed-file: error: unknown flag --overflw: did you mean --overflow?",
        ),
    ],
)
def test_a_mistyped_flag_is_one_line_in_every_command(argv: list[str], expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elmo.cli", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [expected]
