"""``elmo`` command line. Thin: each subcommand lives in the module that owns the idea and exposes
``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen module is imported, so serving
commands never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from elmo.errors import ElmoError

# name -> (module, one-line help). Modules are imported lazily.
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("elmo.train.corpus", "fetch the corpora by package name and write train/valid/test splits"),
    "train": ("elmo.train.loop", "train the biLM language model"),
    "adapt": ("elmo.export.adapt", "continue training a model on your own text (before/after perplexity)"),
    "eval-lm": ("elmo.train.evaluate", "forward/backward perplexity of a model on a text file"),
    "baseline": ("elmo.train.ngram", "Kneser-Ney n-gram baseline on the same splits and vocabulary"),
    "export": ("elmo.export.onnx_export", "export a model directory to ONNX and verify it"),
    "serve": ("elmo.service.server", "serve a model over gRPC"),
    "embed": ("elmo.client", "embed text through a running server"),
    "embed-file": ("elmo.batch.cli", "embed a file into hdf5 / Parquet"),
    "mix": ("elmo.mix.cli", "train / report task scalar mixes"),
    "import-allennlp": ("elmo.importers.allennlp", "import AllenNLP / bilm-tf options.json + weights.hdf5"),
    "import-manylangs": ("elmo.importers.manylangs", "import an ELMoForManyLangs (HIT-SCIR) model folder"),
    "bench": ("elmo.bench.run", "throughput / latency benchmarks"),
}


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


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def _usage() -> str:
    lines = ["usage: elmo COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`elmo COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name = argv[0]
    if name not in COMMANDS:
        print(f"elmo: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"elmo {name}", description=help_)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="json: one object per line")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
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
