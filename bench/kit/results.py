"""Where a bench's results go and how it says so: JSON (and a plot, a Markdown table) under bench/results/ unless
``--out`` says otherwise, every result with the machine beside it (elmo.bench.figures.machine). Also the parser every
script starts from, with the module docstring as its help."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.kit.models import DEFAULT_MODEL
from bench.kit.revision import REPO

RESULTS = REPO / "bench" / "results"


def result_path(name: str) -> Path:
    """bench/results/NAME: the default ``--out`` of every bench."""
    return RESULTS / name


def write_json(path: Path, result: dict, indent: int = 1) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent, ensure_ascii=False) + "\n")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def save_result(out: Path, result: dict, plot, no_plot: bool) -> None:
    """Write ``result`` as JSON to ``out`` and, unless ``no_plot``, ``plot(result, png)`` beside it; say where."""
    write_json(out, result)
    png = out.with_suffix(".png")
    if not no_plot:
        plot(result, png)
    print(f"\nwrote {out}" + ("" if no_plot else f" and {png}"))


def fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    """A bench's figure as a PNG at ``path`` (tight layout, 110 dpi), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bench_parser(module: str, doc: str | None, model: bool = True) -> argparse.ArgumentParser:
    """``python -m bench.MODULE``'s parser (MODULE: ``service.latency``), with the module docstring as its help and,
    when ``model``, the common ``--model`` (default models/default)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.{module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if model:
        parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="default: models/default")
    return parser
