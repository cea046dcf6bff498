"""Sentences longer than the limit: ``reject`` them, ``truncate`` them, or embed them in overlapping ``window``s.

One module for the service (gRPC and HTTP) and the batch job, so that all three cut and stitch the same way.

Windows: a sentence of ``n`` tokens, ``n`` over the limit ``size``, is cut into windows of ``size`` tokens that
overlap by ``overlap`` tokens (the last one is moved left to end at the sentence's end). Every token takes its
vectors from the window where it has the most context, i.e. the largest ``min(tokens to its left, tokens to its
right)`` inside the window, counting a side where the window reaches the sentence's edge as complete. Between two
neighbouring windows that is a single cut in the middle of their overlap, so each token keeps at least
``overlap // 2`` tokens of context on each side that the whole sentence gives it. docs/reference/grpc.md ("Long inputs")
has the measured distance to whole-sentence vectors.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from elmo.errors import InputError

DEFAULT_WINDOW_OVERLAP = 128


class Overflow(enum.Enum):
    REJECT = "reject"
    TRUNCATE = "truncate"
    WINDOW = "window"

    @classmethod
    def parse(cls, value: str | Overflow) -> Overflow:
        if isinstance(value, Overflow):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            choices = ", ".join(o.value for o in cls)
            raise InputError(f"overflow policy '{value}' is not one of {choices}") from None


@dataclass(frozen=True)
class Window:
    start: int  # first token of the window in the sentence
    end: int  # one past its last token
    keep_start: int  # the tokens [keep_start, keep_end) take their vectors from this window
    keep_end: int


def check_window_settings(size: int, overlap: int) -> None:
    if size < 1:
        raise InputError(f"window size must be at least 1 token (got {size})")
    if not 0 <= overlap <= size // 2:
        raise InputError(f"window overlap must be between 0 and half the window size, {size // 2} (got {overlap})")


def plan_windows(n_tokens: int, size: int, overlap: int) -> list[Window]:
    """The windows of a sentence of ``n_tokens`` tokens (one window when it fits): as few as cover it with
    neighbours overlapping by at least ``overlap``, spread evenly, each token kept by its best window."""
    check_window_settings(size, overlap)
    if n_tokens <= size:
        return [Window(0, n_tokens, 0, n_tokens)]
    count = -(-(n_tokens - overlap) // (size - overlap))  # ceil: windows needed at the full stride
    starts = [round(k * (n_tokens - size) / (count - 1)) for k in range(count)]
    best = np.zeros(n_tokens, dtype=np.int64)
    best_score = np.full(n_tokens, -1, dtype=np.int64)
    unbounded = n_tokens  # more context than any window holds: the window reaches the sentence's edge
    for k, start in enumerate(starts):
        positions = np.arange(start, start + size)
        left = positions - start if start > 0 else np.full(size, unbounded)
        right = start + size - 1 - positions if start + size < n_tokens else np.full(size, unbounded)
        score = np.minimum(left, right)
        better = score > best_score[start : start + size]  # ties stay with the earlier window
        best[start : start + size][better] = k
        best_score[start : start + size][better] = score[better]
    # the best window never decreases along the sentence (same-width context "tents" shifted right), so each
    # window keeps one contiguous run; a window that keeps nothing is dropped
    windows = []
    for k, start in enumerate(starts):
        kept = np.flatnonzero(best == k)
        if kept.size:
            windows.append(Window(start, start + size, int(kept[0]), int(kept[-1]) + 1))
    return windows


@dataclass(frozen=True)
class WindowedBatch:
    """Sentences expanded into the pieces the model runs; :meth:`stitch` puts its outputs back together."""

    pieces: list[list[str]]  # what to embed, each within the limit
    plans: list[list[Window]]  # per original sentence, its windows (one per piece, in order)

    def stitch(self, outputs: Sequence[np.ndarray], token_axis: int = -2) -> list[np.ndarray]:
        """Per-piece outputs (token axis ``token_axis``) -> per-sentence outputs, each token from its best window."""
        if len(outputs) != len(self.pieces):
            raise InputError(f"{len(outputs)} outputs for {len(self.pieces)} windows")
        stitched, k = [], 0
        for plan in self.plans:
            parts = []
            for window in plan:
                index = [slice(None)] * outputs[k].ndim
                index[token_axis] = slice(window.keep_start - window.start, window.keep_end - window.start)
                parts.append(outputs[k][tuple(index)])
                k += 1
            stitched.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=token_axis))
        return stitched


def windowed(sentences: Sequence[Sequence[str]], size: int, overlap: int = DEFAULT_WINDOW_OVERLAP) -> WindowedBatch:
    """Cut every sentence longer than ``size`` tokens into windows; shorter ones are one piece each. ``overlap`` is
    capped at half the window (a configured overlap stays valid under a smaller per-sentence limit)."""
    overlap = min(overlap, size // 2)
    pieces, plans = [], []
    for tokens in sentences:
        plan = plan_windows(len(tokens), size, overlap)
        pieces.extend(list(tokens[w.start : w.end]) for w in plan)
        plans.append(plan)
    return WindowedBatch(pieces, plans)


def embed_windowed(
    embed: Callable[[list[list[str]]], list[np.ndarray]],
    sentences: Sequence[Sequence[str]],
    size: int,
    overlap: int = DEFAULT_WINDOW_OVERLAP,
    token_axis: int = -2,
) -> list[np.ndarray]:
    """``embed`` (a list of token lists in, one array per sentence out) over sentences of any length."""
    batch = windowed(sentences, size, overlap)
    if all(len(plan) == 1 for plan in batch.plans):
        return embed(batch.pieces)
    return batch.stitch(embed(batch.pieces), token_axis)


def over_limit_message(what: str, n_tokens: int | str, limit: int) -> str:
    """The one wording of a refusal under ``reject``, naming the way out."""
    return (
        f"{what} has {n_tokens} tokens, over the limit of {limit} per sentence; split it, or ask for overflow "
        f"'window' (overlapping windows stitched back) or 'truncate' (keep the first {limit} tokens)"
    )


__all__ = [
    "DEFAULT_WINDOW_OVERLAP",
    "Overflow",
    "Window",
    "WindowedBatch",
    "check_window_settings",
    "embed_windowed",
    "over_limit_message",
    "plan_windows",
    "windowed",
]
