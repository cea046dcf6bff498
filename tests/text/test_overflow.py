"""Long sentences: the window plan covers every token once, from the window where it has the most context, and
stitching puts each window's vectors back exactly; on a real model, window vectors match the vectors of the same
window run alone and come close to whole-sentence vectors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from elmo.errors import InputError
from elmo.runtime import Embedder
from elmo.text.overflow import Overflow, embed_windowed, plan_windows, windowed


def context(i: int, window, n: int) -> int:
    left = i - window.start if window.start > 0 else n
    right = window.end - 1 - i if window.end < n else n
    return min(left, right)


@given(n=st.integers(1, 3000), size=st.integers(2, 600), overlap_share=st.floats(0, 0.5))
def test_windows_cover_each_token_once_from_its_best_window(n, size, overlap_share):
    overlap = int(size * overlap_share)
    windows = plan_windows(n, size, overlap)
    assert windows[0].keep_start == 0 and windows[-1].keep_end == n
    for left, right in zip(windows, windows[1:]):
        assert left.keep_end == right.keep_start  # contiguous, no token twice
        assert left.end - right.start >= overlap  # no gap, and at least the asked overlap
    all_starts = [w.start for w in windows]
    for w in windows:
        assert w.end - w.start == min(size, n) and 0 <= w.start <= w.keep_start < w.keep_end <= w.end <= n
        for i in (w.keep_start, w.keep_end - 1):  # no window holding token i gives it more context
            candidates = [type(w)(s, s + size, 0, 0) for s in all_starts if s <= i < s + size]
            assert context(i, w, n) == max(context(i, c, n) for c in candidates)


def test_every_token_keeps_half_the_overlap_of_context_on_each_side():
    n, size, overlap = 5000, 512, 128
    for w in plan_windows(n, size, overlap):
        for i in range(w.keep_start, w.keep_end):
            assert context(i, w, n) >= overlap // 2


def test_stitching_takes_each_token_from_its_window():
    sentences = [[f"t{i}" for i in range(23)], ["short"]]
    batch = windowed(sentences, size=8, overlap=4)
    # fake "vectors": (n_layers=2, n_tokens, dim=1) holding (piece index, token index in the sentence)
    outputs = []
    for k, piece in enumerate(batch.pieces):
        positions = np.array([int(t[1:]) if t != "short" else 0 for t in piece], dtype=np.float32)
        outputs.append(np.stack([np.full_like(positions, k), positions])[:, :, None])
    long, short = batch.stitch(outputs)
    assert long.shape == (2, 23, 1) and short.shape == (2, 1, 1)
    np.testing.assert_array_equal(long[1, :, 0], np.arange(23))  # every token once, in order
    owners = long[0, :, 0].astype(int)
    plan = batch.plans[0]
    for piece_index, window in enumerate(plan):
        assert (owners[window.keep_start : window.keep_end] == piece_index).all()


def test_bad_settings_and_policies_are_named():
    with pytest.raises(InputError, match="overlap"):
        plan_windows(100, 10, 6)
    with pytest.raises(InputError, match="overflow policy 'chop' is not one of reject, truncate, window"):
        Overflow.parse("chop")
    assert Overflow.parse(" Window ") is Overflow.WINDOW


def test_window_vectors_are_the_windows_own_and_near_the_whole_sentence(tiny_model_dir):
    runtime = Embedder(tiny_model_dir, intra_op_threads=1, max_tokens_per_sentence=10_000)
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "苹果", "很", "好吃", "."]
    tokens = [words[i] for i in rng.integers(0, len(words), 700)]
    stitched = embed_windowed(runtime.embed_tokens, [tokens], size=200, overlap=64)[0]
    whole = runtime.embed_tokens([tokens])[0]
    assert stitched.shape == whole.shape == (3, 700, 16)
    for window in plan_windows(700, 200, 64):  # exact: each token's vectors are those of its window run alone
        alone = runtime.embed_tokens([tokens[window.start : window.end]])[0]
        kept = slice(window.keep_start - window.start, window.keep_end - window.start)
        np.testing.assert_array_equal(stitched[:, window.keep_start : window.keep_end], alone[:, kept])
    np.testing.assert_array_equal(stitched[0], whole[0])  # the token layer sees no context at all
    cos = np.sum(stitched * whole, -1) / (np.linalg.norm(stitched, axis=-1) * np.linalg.norm(whole, axis=-1))
    assert cos[1:].min() > 0.99  # 32+ tokens of context on each side: the random tiny LSTM forgets faster
