"""elmo.flags's one way of turning a frozen dataclass into flags and back (every module's options use it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from elmo.flags import FlagParser, add_fields_as_flags, fields_from_args


@dataclass(frozen=True)
class _Options:
    wait_s: float = 2.5
    mode: str = "on"
    endpoint: str = ""


_HELP = {"wait_s": "how long", "mode": "which way", "endpoint": "where to"}
_FLAGS = {"wait_s": "thing-wait-s", "mode": "thing-mode", "endpoint": "thing-endpoint"}


def _parser(**kwargs) -> argparse.ArgumentParser:
    parser = FlagParser(prog="elmo thing")
    add_fields_as_flags(parser, _Options(), _HELP, _FLAGS.__getitem__, **kwargs)
    return parser


def test_each_field_is_a_typed_flag_read_back_into_the_dataclass():
    parser = _parser(choices={"mode": ["on", "off"]}, metavars={"endpoint": "URL"})
    assert fields_from_args(_Options, parser.parse_args([]), _FLAGS.__getitem__) == _Options()
    args = parser.parse_args(["--thing-wait-s", "0.5", "--thing-mode", "off", "--thing-endpoint", "http://x"])
    assert fields_from_args(_Options, args, _FLAGS.__getitem__) == _Options(0.5, "off", "http://x")
    text = parser.format_help()
    assert "how long (default 2.5)" in text and "where to (default: none)" in text and "--thing-endpoint URL" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--thing-mode", "sideways"])


def test_under_the_field_name_and_an_old_name_still_accepted(capsys):
    parser = _parser(dest_is_field=True, aliases={"wait_s": "--thing-wait"})
    args = parser.parse_args(["--thing-wait", "7"])
    assert fields_from_args(_Options, args) == _Options(wait_s=7.0)
    assert "--thing-wait is now --thing-wait-s" in capsys.readouterr().err
    assert "--thing-wait " not in parser.format_help()
