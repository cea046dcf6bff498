import json
import logging

from elmo.cli import JsonLogFormatter, main


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


def test_library_errors_print_one_line_not_a_traceback(tmp_path, capsys):
    code = main(["export", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("elmo export: error:") and "Traceback" not in err
