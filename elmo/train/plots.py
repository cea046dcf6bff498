"""The training curves of a run folder (``curve.png``): training and validation perplexity against tokens seen,
and the word-sense benchmark where the run measured it; a staged recipe's runs drawn as one curve. Without
matplotlib (a borrowed training machine) there is no plot: one warning, and training goes on."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from elmo.train.rundir import read_train_state

log = logging.getLogger("elmo.train.loop")  # the training's logger: its lines read as the loop's
_warned_no_plot = False  # plot_curve warns once per process when matplotlib is missing


def plot_stages(run_dirs: list[Path], path: Path) -> None:
    """One curve for a staged recipe: each run's history shifted by the tokens of the runs before it."""
    history: list[dict] = []
    boundaries: list[float] = []
    offset = 0
    for run_dir in run_dirs:
        state = read_train_state(Path(run_dir))
        history += [{**h, "tokens": h["tokens"] + offset} for h in state["history"]]
        offset += state["tokens"]
        boundaries.append(offset / 1e6)
    plot_curve(history, path, stage_ends=boundaries[:-1])


def plot_curve(history: list[dict], path: Path, stage_ends: list[float] = ()) -> None:
    """Training (sampled) and validation (full softmax) perplexity against tokens seen; ``stage_ends`` (millions
    of tokens) draws where one stage of a staged recipe handed over to the next. Without matplotlib (a borrowed
    training machine) there is no plot: one warning, and training goes on."""
    global _warned_no_plot
    try:
        import matplotlib
    except ImportError:
        if not _warned_no_plot:
            log.warning("matplotlib is not installed: no %s (training goes on)", path.name)
            _warned_no_plot = True
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [h for h in history if "loss" in h]
    valid = [h for h in history if "valid_avg_ppl" in h]
    senses = [h for h in valid if "sense_en_best" in h]
    width = 12 if senses else 7
    fig, axes = plt.subplots(1, 2 if senses else 1, figsize=(width, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(
            [h["tokens"] / 1e6 for h in train],
            [math.exp(min(h["loss"], 30)) for h in train],
            label="train ppl (sampled softmax)" if train[0].get("sampled") else "train ppl",
            alpha=0.6,
        )
    curves = (("valid_forward_ppl", "valid fwd"), ("valid_backward_ppl", "valid bwd"), ("valid_avg_ppl", "valid avg"))
    for key, label in curves:
        if valid:
            ax.plot([h["tokens"] / 1e6 for h in valid], [h[key] for h in valid], marker="o", ms=3, label=label)
    for end in stage_ends:
        ax.axvline(end, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("perplexity")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a run stopped before its first log line has no curve yet
        ax.legend()
    if senses:
        _plot_senses(axes[0][1], senses, stage_ends)
    # fixed margins (inches) on a fixed-size figure: tight_layout drew the whole figure once more at every
    # checkpoint only to measure its labels, doubling the plot's cost for the same picture
    fig.subplots_adjust(
        left=0.65 / width, right=1 - 0.12 / width, bottom=0.13, top=0.92 if senses else 0.96, wspace=0.25
    )
    fig.savefig(path.with_suffix(".tmp.png"), dpi=90)
    plt.close(fig)
    os.replace(path.with_suffix(".tmp.png"), path)


def _plot_senses(ax, history: list[dict], stage_ends: list[float]) -> None:
    """Word-sense benchmark accuracy (elmo.senses) of the best layer per language against tokens seen."""
    for language in ("en", "zh"):
        ax.plot(
            [h["tokens"] / 1e6 for h in history],
            [h[f"sense_{language}_best"] for h in history],
            marker="o",
            ms=3,
            label=f"{language}: best layer",
        )
    for end in stage_ends:
        ax.axvline(end, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("same-sense nearest neighbour")
    ax.set_title("word-sense benchmark", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
