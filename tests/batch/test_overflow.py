"""Long lines in the batch job (``--overflow``): rejected naming the line, truncated, or embedded in windows stitched
back exactly as the runtime's own windowing does; locally and through a server whose sentence limit is small."""

from __future__ import annotations

import numpy as np
import pytest

from elmo.runtime import CPU, Embedder
from elmo.text.overflow import embed_windowed
from elmo.text.tokenize import tokenize
from tests.batch.test_job import embed_file, error_lines, read_hdf5, write_lines

WORDS = ["the", "cat", "sat", "on", "a", "mat", "苹果", "很", "好吃", "."]
LONG = " ".join(WORDS[i % 7] for i in range(70))
TOKENS = tokenize(LONG).tokens  # 80: every CJK character is a token
LINES = ["short line", LONG, "x"]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)


def test_reject_names_the_line_and_the_way_out(tmp_path, tiny_model_dir, capsys):
    source = write_lines(tmp_path / "in.txt", LINES)
    args = ["--model", tiny_model_dir, "--max-sentence-tokens", "32"]
    assert embed_file(source, tmp_path / "out.h5", *args) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert "line 2 has 80 tokens, over the limit of 32 tokens per line (--max-sentence-tokens)" in line
    assert "--overflow truncate" in line and "--overflow window" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]  # refused in the scan: nothing written


def test_window_and_truncate_locally(tmp_path, tiny_model_dir, embedder):
    source = write_lines(tmp_path / "in.txt", LINES)
    args = ["--model", tiny_model_dir, "--max-sentence-tokens", "32", "--window-overlap-tokens", "8"]
    assert embed_file(source, tmp_path / "window.h5", *args, "--overflow", "window") == 0
    assert embed_file(source, tmp_path / "cut.h5", *args, "--overflow", "truncate") == 0
    tokens = TOKENS
    windowed = read_hdf5(tmp_path / "window.h5")["1"]
    expected = embed_windowed(embedder.embed_tokens, [tokens], size=32, overlap=8)[0]
    assert windowed.shape == (3, 80, 16)
    np.testing.assert_allclose(windowed, expected, atol=1e-6, rtol=0)
    cut = read_hdf5(tmp_path / "cut.h5")
    np.testing.assert_allclose(cut["1"], embedder.embed_tokens([tokens[:32]])[0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(cut["0"], read_hdf5(tmp_path / "window.h5")["0"])  # short lines untouched


def test_window_through_a_server_with_a_small_sentence_limit(tmp_path, tiny_model_dir, embedder):
    from tests.service_helpers import EDGE_LIMITS, ServerThread  # 20 tokens per sentence, 60 per request

    server = ServerThread({"tiny": embedder}, EDGE_LIMITS)
    try:
        server.warm_up()
        source = write_lines(tmp_path / "in.txt", LINES)
        remote = ["--server", server.target, "--overflow", "window", "--window-overlap-tokens", "6"]
        assert embed_file(source, tmp_path / "remote.h5", *remote) == 0
    finally:
        server.stop()
    got = read_hdf5(tmp_path / "remote.h5")["1"]
    expected = embed_windowed(embedder.embed_tokens, [TOKENS], size=20, overlap=6)[0]
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_reject_through_a_server_names_the_servers_limit(tmp_path, embedder, capsys):
    from tests.service_helpers import EDGE_LIMITS, ServerThread  # 20 tokens per sentence

    server = ServerThread({"tiny": embedder}, EDGE_LIMITS)
    try:
        server.warm_up()
        source = write_lines(tmp_path / "in.txt", LINES)
        capsys.readouterr()
        assert embed_file(source, tmp_path / "remote.h5", "--server", server.target) == 2
    finally:
        server.stop()
    (line,) = error_lines(capsys.readouterr().err)
    assert "line 2 has 80 tokens, over the limit of 20 tokens per line (the server's limit, its " in line
    assert "--max-sentence-tokens; --max-sentence-tokens can lower it, not raise it)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
