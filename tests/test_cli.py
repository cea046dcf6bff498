import json
import logging
import sys

from elmo.cli import JsonLogFormatter, TextLogFormatter, main


def test_usage_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in ("serve", "train", "export", "embed-file", "import-allennlp", "mix"):
        assert name in out


def test_unknown_command_is_a_clear_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_json_log_lines_are_one_object_each():
    record = logging.LogRecord("service.batcher", logging.INFO, __file__, 1, "batch of %d sentences", (3,), None)
    entry = json.loads(JsonLogFormatter().format(record))
    assert entry["level"] == "INFO" and entry["logger"] == "service.batcher"
    assert entry["message"] == "batch of 3 sentences"


def test_text_log_lines_cannot_be_forged_by_input():
    """A client's model name with a newline must not start a new, fake log line (the json format escapes by itself)."""
    name = "default\n2026-12-03 12:00:00,000 ERROR service.grpc.admin: admin token accepted\r\x1b[2J"
    record = logging.LogRecord("service.core", logging.WARNING, __file__, 1, "unknown model %r, %s", (1, name), None)
    line = TextLogFormatter().format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(
        "unknown model 1, default\\n2026-12-03 12:00:00,000 ERROR service.grpc.admin: admin token accepted\\r\\x1b[2J"
    )
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "\nTraceback (most recent call last):" in TextLogFormatter().format(failed)  # a traceback keeps its lines


def test_library_errors_print_one_line_not_a_traceback(tmp_path, capsys):
    code = main(["export", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("elmo export: error:") and "Traceback" not in err


def test_an_environment_without_torch_lists_only_what_it_can_run(monkeypatch, capsys):
    """The serving install (.venv-serve) has no torch: `elmo` lists the commands it can run and names the extra for
    the others; a training command is one line and exit 2, not a ModuleNotFoundError, even for --help."""
    monkeypatch.setitem(sys.modules, "torch", None)  # as if not installed: find_spec answers None
    assert main([]) == 0
    usage = capsys.readouterr().out
    listed = {line.split()[0] for line in usage.split("commands:")[1].split("\n\n")[0].splitlines() if line.strip()}
    assert {"serve", "embed", "embed-file"} <= listed and not listed & {"train", "adapt", "export", "mix", "eval-lm"}
    assert "not in this environment: train, adapt" in usage and "'.[train]'" in usage
    for argv in (["train", "--help"], ["adapt", "--model", "m", "--text", "t", "--out", "o"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs torch" in err and "Traceback" not in err
