"""``elmo`` command line. Thin: each subcommand lives in the module that owns the idea and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen module is imported, so serving
commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import sys
from types import ModuleType

from elmo.errors import ElmoError
from elmo.flags import FlagParser, make_configurable, order_groups, parse_configured

# name -> (module, one-line help, extra). Modules are imported lazily. ``extra``: the pyproject extra whose packages
# the command needs beyond the core; the serving install (`serve`) has no torch, so it lists only what it can run.
TRAIN = "train"
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "data": ("elmo.train.corpus", "fetch the corpora by package name and write train/valid/test splits", None),
    "train": ("elmo.train.loop", "train the biLM language model", TRAIN),
    "adapt": ("elmo.train.adapt_cli", "continue training a model on your own text (before/after perplexity)", TRAIN),
    "eval-lm": ("elmo.train.evaluate", "forward/backward perplexity of a model on a text file", TRAIN),
    "baseline": ("elmo.train.ngram", "Kneser-Ney n-gram baseline on the same splits and vocabulary", TRAIN),
    "export": ("elmo.export.onnx_export", "export a model directory to ONNX and verify it", TRAIN),
    "serve": ("elmo.service.server", "serve a model over gRPC and HTTP", None),
    "embed": ("elmo.client", "embed text through a running server", None),
    "embed-file": ("elmo.batch.cli", "embed a file into hdf5 / Parquet", None),
    "mix": ("elmo.mix.cli", "train / report task scalar mixes", TRAIN),
    "import-allennlp": ("elmo.importers.allennlp", "import AllenNLP / bilm-tf options.json + weights.hdf5", TRAIN),
    "import-manylangs": ("elmo.importers.manylangs", "import an ELMoForManyLangs (HIT-SCIR) model folder", TRAIN),
    "pull": ("elmo.importers.pull", "download a published ELMo by name, check it, import, export (servable)", TRAIN),
    "spacy": ("elmo.spacy.cli", "spaCy: labelled sets as DocBin files, a listener's mix as a served task", "spacy"),
    "bench": ("elmo.bench.run", "throughput / latency benchmarks", TRAIN),
}
# The commands whose every flag is also ELMO_<NAME> and a key of --config FILE (elmo.flags)
CONFIGURABLE = ("serve", "embed-file")
# what each extra brings that the core does not (checked without importing it)
EXTRA_MODULES = {TRAIN: ("torch", "onnx", "safetensors"), "spacy": ("spacy",)}


def missing_for(extra: str | None) -> list[str]:
    """The modules of ``extra`` this environment lacks (none for a core command)."""
    return [name for name in EXTRA_MODULES.get(extra or "", ()) if importlib.util.find_spec(name) is None]


def install_hint(extra: str) -> str:
    return (
        f"install the `{extra}` extra (pip install -e '.[{extra}]' in the repository), or use .venv/bin/elmo, "
        "which `make dev` creates"
    )


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line (time, level, logger, message, exception) for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextLogFormatter(logging.Formatter):
    """``time LEVEL logger: message``, one record per line: control characters in the message (a client's model name
    with a newline) are escaped, so no input can forge a log line; a traceback keeps its own lines."""

    CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F) if c != 0x09} | {0x0A: "\\n", 0x0D: "\\r"}

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = record.message.translate(self.CONTROL)
        return super().formatMessage(record)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter() if fmt == "json" else TextLogFormatter())
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def _usage() -> str:
    lines = ["usage: elmo COMMAND [options]", "", "commands:"]
    unavailable = []
    for name, (_, help_, extra) in COMMANDS.items():
        if missing_for(extra):
            unavailable.append(name)
        else:
            lines.append(f"  {name:<16} {help_}")
    if unavailable:
        lines += ["", f"not in this environment: {', '.join(unavailable)}: {install_hint(TRAIN)}"]
    lines += ["", "`elmo COMMAND --help` for a command's options."]
    return "\n".join(lines)


def command_parser(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of command ``name`` and its full parser (the flags every command shares, then its own)."""
    module_name, help_, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = FlagParser(prog=f"elmo {name}", description=help_)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    module.add_arguments(parser)
    if name in CONFIGURABLE:
        make_configurable(parser)
        order_groups(parser, getattr(module, "HELP_ORDER", ()))  # the essentials first, --help and the logs last
    return module, parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"elmo: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    extra = COMMANDS[name][2]
    if missing := missing_for(extra):
        print(
            f"elmo {name}: needs {', '.join(missing)} (the `{extra}` extra), not in this environment: "
            f"{install_hint(extra)}",
            file=sys.stderr,
        )
        return 2
    from elmo.train.threads import apply_wait_policy  # torch-free: libgomp reads it once, as the module loads torch

    apply_wait_policy()
    module, parser = command_parser(name)
    args = parse_configured(parser, argv[1:]) if name in CONFIGURABLE else parser.parse_args(argv[1:])
    args.command_line = argv  # the command as given (`elmo serve --processes N` starts N of it)
    configure_logging(str(args.log_level), args.log_format)
    try:
        return int(module.run(args) or 0)
    except ElmoError as exc:
        print(f"elmo {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"elmo {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
