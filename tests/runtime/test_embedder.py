import json
import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest

from elmo.errors import ElmoError, InputError, ModelFileError
from elmo.model.checkpoint import load_model
from elmo.runtime import (
    CPU,
    CPU_STEP_COST,
    CUDA,
    CUDA_STEP_COST,
    Embedder,
    TokenVectorCache,
    gpu_visibility,
    missing_cuda_libraries,
    plan_batches,
    requested_providers,
)
from elmo.text import plain
from tests.conftest import REPO
from tests.numpy_reference import config_dict, elmo_forward, from_torch_state

SENTENCES = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["苹", "果", "很", "好", "吃"],
    ["a"],
    ["x" * 70, "😀", "👍🏽", "naïve", "!"],
    [],
    ["One", "more", "sentence", "with", "a", "few", "more", "tokens", "than", "the", "others", "have", "."],
]


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = load_model(tiny_model_dir)
    weights, cfg = from_torch_state(model.state_dict(), model.cfg), config_dict(model.cfg)
    return lambda sentence: elmo_forward(weights, sentence, cfg)


def test_matches_independent_float64_reference(embedder, reference):
    outputs = embedder.embed_tokens(SENTENCES)
    assert len(outputs) == len(SENTENCES)
    for sentence, layers in zip(SENTENCES, outputs):
        assert layers.dtype == np.float32
        assert layers.shape == (embedder.info.n_layers, len(sentence), embedder.info.dim)
        if sentence:
            np.testing.assert_allclose(layers, reference(sentence), atol=1e-5, rtol=0)


def test_a_sentence_gets_the_same_vectors_alone_and_in_any_batch(embedder):
    together = embedder.embed_tokens(SENTENCES)
    for sentence, vectors in zip(SENTENCES, together):
        np.testing.assert_allclose(embedder.embed_tokens([sentence])[0], vectors, atol=1e-6, rtol=0)
    reversed_order = embedder.embed_tokens(SENTENCES[::-1])[::-1]
    for a, b in zip(together, reversed_order):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_small_token_budget_splits_batches_without_changing_results(tiny_model_dir, embedder):
    small = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, max_batch_tokens=8)
    assert len(small._batches([len(s) for s in SENTENCES])) > 2
    for a, b in zip(small.embed_tokens(SENTENCES), embedder.embed_tokens(SENTENCES)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_long_sentence_beyond_any_tracing_length(embedder, reference):
    sentence = [f"w{i % 37}" for i in range(300)]
    (layers,) = embedder.embed_tokens([sentence])
    assert layers.shape[1] == 300
    np.testing.assert_allclose(layers, reference(sentence), atol=1e-5, rtol=0)


def test_empty_inputs(embedder):
    assert embedder.embed_tokens([]) == []
    (empty,) = embedder.embed_tokens([[]])
    assert empty.shape == (embedder.info.n_layers, 0, embedder.info.dim)


def test_embed_texts_tokenizes_with_offsets(embedder):
    text = "Hello, world! 你好。"
    (result,) = embedder.embed([text])
    assert result.tokens == ["Hello", ",", "world", "!", "你", "好", "。"]
    assert [text[a:b] for a, b in result.offsets] == result.tokens
    np.testing.assert_allclose(result.layers, embedder.embed_tokens([result.tokens])[0], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(embedder.embed_texts([text])[0], result.layers)  # the same layers, without tokens


def test_info_describes_the_model(embedder, tiny_model_dir):
    info = embedder.info
    assert (info.n_layers, info.dim, info.provider) == (3, 16, CPU)
    assert info.model_dir == tiny_model_dir


def test_warmup_builds_the_tokenizers_fast_path(embedder, monkeypatch):
    """A server's first requests must not pay for the fast path's tables (elmo.text.plain: a process that only
    tokenizes builds them after 8,192 texts)."""
    monkeypatch.setattr(plain, "_texts_without_tables", 0)
    plain._patterns.cache_clear()
    embedder.warmup()
    assert plain._patterns.cache_info().currsize == 1 and plain.fast_path_ready()


@pytest.mark.parametrize(
    "bad, message",
    [("a sentence", "not one string"), (["not", "tokenized"], "is a string"), ([["ok", ""]], "non-empty strings")],
)
def test_bad_input_is_an_input_error(embedder, bad, message):
    with pytest.raises(InputError, match=message):
        embedder.embed_tokens(bad)


def test_too_long_sentence_is_refused(tiny_model_dir):
    short = Embedder(tiny_model_dir, providers=[CPU], max_tokens_per_sentence=4)
    with pytest.raises(InputError, match="5 tokens; the limit is 4"):
        short.embed_tokens([["a"] * 5])


# -- provider selection --------------------------------------------------------------------------------------------
def test_one_log_line_names_the_active_provider_and_why(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="elmo.runtime"):
        embedder = Embedder(tiny_model_dir)  # default: CUDA where a GPU is visible, else CPU
    records = [r for r in caplog.records if "onnxruntime provider" in r.getMessage()]
    assert len(records) == 1
    (record,) = records
    assert embedder.info.provider == embedder.encoder.get_providers()[0] == embedder.context.get_providers()[0]
    assert embedder.info.provider in record.getMessage()
    request = requested_providers(None)
    if embedder.info.provider == CPU:
        assert request.reason and request.reason in record.getMessage()  # why not the GPU
    visible, _ = gpu_visibility(os.environ)
    # A visible GPU left unused shows under any logging set-up; a host without one is the normal case.
    assert record.levelno == (logging.WARNING if visible and embedder.info.provider == CPU else logging.INFO)


@pytest.mark.parametrize(
    ("environ", "paths", "visible"),
    [
        ({}, [], False),
        ({}, ["dev/nvidia0"], True),
        ({}, ["proc/driver/nvidia/gpus/0000:01:00.0/information"], True),
        ({}, ["usr/lib/wsl/lib/libcuda.so.1"], True),
        ({}, ["dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-caps/x"], False),  # driver nodes, no GPU node
        ({"CUDA_VISIBLE_DEVICES": "0"}, ["dev/nvidia0"], True),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5f3c2a"}, ["dev/nvidia0"], True),
        ({"CUDA_VISIBLE_DEVICES": ""}, ["dev/nvidia0"], False),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, ["dev/nvidia0"], False),
        ({"CUDA_VISIBLE_DEVICES": "-1,0"}, ["dev/nvidia0"], False),  # CUDA stops at the first invalid entry
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, [], False),  # a container-runtime request, not a GPU
    ],
)
def test_gpu_visibility_reads_devices_and_cuda_visible_devices(tmp_path, environ, paths, visible):
    for path in paths:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    seen, evidence = gpu_visibility(environ, root=tmp_path)
    assert seen is visible
    if visible:
        assert evidence.startswith(str(tmp_path))  # the path that proves it
    else:
        assert "CUDA_VISIBLE_DEVICES" in evidence or "no GPU visible" in evidence


def test_without_a_visible_gpu_only_cpu_is_requested(tmp_path):
    request = requested_providers(None, environ={}, root=tmp_path)
    assert request.providers == [CPU] and not request.gpu_unused
    assert "no GPU visible" in request.reason or "no CUDA provider" in request.reason
    # Named providers are a demand, whatever the host.
    assert requested_providers([CUDA], environ={}, root=tmp_path).providers == [CUDA]
    assert requested_providers([CPU], environ={}, root=tmp_path).providers == [CPU]


def test_a_visible_gpu_gets_cuda_only_when_its_libraries_load(tmp_path):
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").touch()
    request = requested_providers(None, environ={}, root=tmp_path)
    if CUDA not in ort.get_available_providers():
        assert request.providers == [CPU] and "no CUDA provider" in request.reason
        return
    missing = missing_cuda_libraries()  # the real preload: this host's libraries, whatever they are
    if missing:  # e.g. this CPU host: no nvidia wheels, no driver -> CPU, one warning naming them
        assert request.providers == [CPU] and request.gpu_unused
        assert all(name in request.reason for name in missing) and "gpu" in request.reason
    else:
        assert request.providers == [CUDA, CPU] and not request.gpu_unused


def test_a_cpu_host_starts_without_onnxruntime_cuda_errors(tiny_model_dir):
    # onnxruntime writes its CUDA failures from C++ straight to stderr: only a separate process shows them.
    code = (
        "import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
        f"from elmo.runtime import Embedder; Embedder({str(tiny_model_dir)!r}).embed_texts(['a b'])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "onnxruntime provider:" in line]
    assert len(lines) == 1, done.stderr
    if gpu_visibility(os.environ)[0]:
        pytest.skip(f"a GPU is visible here: CUDA is requested, so this host is not the CPU-only case ({lines[0]})")
    assert f"{CPU} active for" in lines[0]
    assert "no GPU visible" in lines[0] or "no CUDA provider" in lines[0]
    for text in ("libonnxruntime_providers_cuda", "Require cuDNN", "CUDAExecutionProvider"):
        assert text not in done.stderr.replace(lines[0], ""), done.stderr
    assert done.stdout == ""


def test_demanding_cuda_without_a_gpu_fails_loudly(tiny_model_dir):
    try:
        embedder = Embedder(tiny_model_dir, providers=[CUDA])
    except ElmoError as exc:
        assert "CUDAExecutionProvider was demanded" in str(exc)
    else:
        assert embedder.info.provider == CUDA


# -- bad model directories -----------------------------------------------------------------------------------------
@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


@pytest.mark.parametrize("name", ["encoder.onnx", "context.onnx"])
def test_missing_graph_names_the_file(model_copy, name):
    (model_copy / name).unlink()
    with pytest.raises(ModelFileError, match=f"{name}: ONNX graph not found"):
        Embedder(model_copy, providers=[CPU])


def _name_in_onnx_json(directory, edit) -> None:
    meta = json.loads((directory / "onnx.json").read_text())
    edit(meta)
    (directory / "onnx.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda d: _name_in_onnx_json(d, lambda m: m["graphs"].update(encoder="/etc/passwd")), "plain file name"),
        (lambda d: _name_in_onnx_json(d, lambda m: m["graphs"].update(context="../context.onnx")), "plain file name"),
        (lambda d: _name_in_onnx_json(d, lambda m: m["weights_data"].update(file="/etc/hostname")), "plain file name"),
        (lambda d: _relink(d / "encoder.onnx"), "encoder graph is a symlink: refused"),
        (lambda d: _relink(d / "model.onnx.data"), "weight file is a symlink: refused"),
        (lambda d: _relink(d / "probe.bin"), "probe file is a symlink: refused"),
    ],
    ids=[
        "absolute-graph",
        "graph-outside",
        "absolute-weights",
        "symlinked-graph",
        "symlinked-weights",
        "symlinked-probe",
    ],
)
def test_files_outside_the_model_folder_are_refused(model_copy, tamper, message):
    """onnx.json names files inside its folder, and those are the folder's own: a path or a symlink could make the
    runtime read (or the repository count) any file on the host."""
    tamper(model_copy)
    with pytest.raises(ModelFileError, match=message):
        Embedder(model_copy, providers=[CPU])


def _relink(path) -> None:
    """``path`` moved out of the folder and replaced by a symlink to it (same bytes: only the link can tell)."""
    outside = path.parent.parent / f"outside-{path.name}"
    path.rename(outside)
    path.symlink_to(outside)


def test_an_oversized_onnx_json_is_refused_unread(model_copy, monkeypatch):
    import elmo.runtime.modeldir as modeldir

    monkeypatch.setattr(modeldir, "MAX_META_BYTES", 1000)
    with pytest.raises(ModelFileError, match=r"onnx.json: [\d,]+ bytes, over the 1,000 an export's metadata may"):
        Embedder(model_copy, providers=[CPU])


def test_missing_weight_data_names_the_file(model_copy):
    (model_copy / "model.onnx.data").unlink()
    with pytest.raises(ModelFileError, match="model.onnx.data: the graphs' weight file is missing"):
        Embedder(model_copy, providers=[CPU])


@pytest.mark.parametrize("name", ["encoder.onnx", "context.onnx"])
def test_corrupt_graph_names_the_file(model_copy, name):
    (model_copy / name).write_bytes(b"\x08\x07 this is not a protobuf" * 10)
    with pytest.raises(ModelFileError, match=f"{name}: onnxruntime cannot load"):
        Embedder(model_copy, providers=[CPU])


def test_truncated_weight_data_names_the_file(model_copy):
    data = (model_copy / "model.onnx.data").read_bytes()
    (model_copy / "model.onnx.data").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError, match=r"model.onnx.data: \d+ bytes, onnx.json says \d+"):
        Embedder(model_copy, providers=[CPU])


def test_altered_weight_data_names_the_file(model_copy):
    data = bytearray((model_copy / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (model_copy / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="model.onnx.data: sha256 differs from onnx.json"):
        Embedder(model_copy, providers=[CPU])


def test_missing_metadata_names_the_file(model_copy):
    (model_copy / "onnx.json").unlink()
    with pytest.raises(ModelFileError, match="onnx.json: export metadata not found"):
        Embedder(model_copy, providers=[CPU])


def test_metadata_that_contradicts_config_names_both_files(model_copy):
    meta = json.loads((model_copy / "onnx.json").read_text())
    meta["dim"] = 32
    (model_copy / "onnx.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFileError, match=r"onnx.json: does not match .*config.json \(dim: 32 vs 16\)"):
        Embedder(model_copy, providers=[CPU])


def test_metadata_of_another_checkpoint_is_refused(model_copy):
    meta = json.loads((model_copy / "onnx.json").read_text())
    meta["checkpoint_sha256"] = "0" * 64
    (model_copy / "onnx.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFileError, match="onnx.json: exported from a different model.safetensors"):
        Embedder(model_copy, providers=[CPU])


def test_graph_that_contradicts_metadata_names_the_graph(model_copy):
    # onnx.json and config.json agree on 3 LSTM layers (4 output layers); the graph itself has 2 LSTM layers.
    config = json.loads((model_copy / "config.json").read_text())
    meta = json.loads((model_copy / "onnx.json").read_text())
    config["n_layers"], meta["n_layers"] = 3, 4
    (model_copy / "config.json").write_text(json.dumps(config))
    (model_copy / "onnx.json").write_text(json.dumps(meta))
    (model_copy / "model.safetensors").unlink()  # no checkpoint to compare against
    with pytest.raises(ModelFileError, match="context.onnx: graph does not match onnx.json"):
        Embedder(model_copy, providers=[CPU])


def test_missing_directory(tmp_path):
    with pytest.raises(ModelFileError, match="model directory not found"):
        Embedder(tmp_path / "nope")


def test_runtime_never_imports_torch(tiny_model_dir):
    code = (
        "import sys; from elmo.runtime import Embedder; "
        f"e = Embedder({str(tiny_model_dir)!r}, providers=['CPUExecutionProvider']); e.embed_texts(['a b']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- batching and the token cache ----------------------------------------------------------------------------------
def test_plan_batches_respects_the_budget_and_covers_every_sentence():
    rng = np.random.default_rng(0)
    steps = sorted(int(n) for n in rng.integers(3, 90, size=300))
    for step_cost in (CPU_STEP_COST, CUDA_STEP_COST):
        sizes = plan_batches(steps, 512, step_cost)
        assert sum(sizes) == len(steps) and min(sizes) >= 1
        start = 0
        for size in sizes:
            assert size * steps[start + size - 1] <= 512
            start += size


def test_plan_batches_separates_short_from_long_sentences():
    # 63 short sentences and one long one: padding all to the long one would waste ~10x the work.
    sizes = plan_batches([5] * 63 + [100], 100_000, CPU_STEP_COST)
    assert sizes == [63, 1]
    # With expensive steps (CUDA: a step costs as much as many rows), one batch is cheaper.
    assert plan_batches([12] * 8 + [14], 100_000, CUDA_STEP_COST) == [9]


def test_plan_batches_plain_python_and_numpy_windows_make_the_same_plan(monkeypatch):
    # Narrow windows are searched in plain Python (numpy's argmin gives the GIL away), wide ones with numpy: the two
    # kernels must break ties alike and sum alike, or a plan would depend on the budget's size.
    from elmo.runtime import batching

    rng = np.random.default_rng(1)
    cases = [
        (sorted(int(n) for n in rng.integers(lo, hi, size=size)), budget, cost)
        for size, lo, hi in ((40, 3, 12), (200, 3, 90), (300, 20, 21))
        for budget in (64, 512, 4096, 16384)
        for cost in (CPU_STEP_COST, CUDA_STEP_COST)
    ]
    plans = {}
    for window in (0, 10**9):  # every window in numpy, every window in Python
        monkeypatch.setattr(batching, "PYTHON_WINDOW", window)
        plans[window] = [plan_batches(steps, budget, cost) for steps, budget, cost in cases]
    assert plans[0] == plans[10**9]
    assert any(len(plan) > 2 for plan in plans[0])  # real choices were made, not one batch each


def test_a_sentence_longer_than_the_budget_runs_alone():
    assert plan_batches([3, 3, 50], 20, CPU_STEP_COST) == [2, 1]


def test_cache_serves_repeated_tokens_and_gives_the_same_vectors(tiny_model_dir):
    cached = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, cache_size=3)
    uncached = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, cache_size=0)
    sentences = [["a", "b", "c", "d"], ["a", "b", "e"]]
    first = cached.embed_tokens(sentences)
    assert len(cached.cache) == 3  # bounded: least recently used tokens evicted
    hits = cached.cache.hits
    second = cached.embed_tokens(sentences)
    assert cached.cache.hits > hits
    reference = uncached.embed_tokens(sentences)
    assert len(uncached.cache) == 0
    for a, b, c in zip(first, second, reference):
        np.testing.assert_allclose(a, c, atol=1e-6, rtol=0)
        np.testing.assert_allclose(b, c, atol=1e-6, rtol=0)


def test_token_cache_is_least_recently_used():
    cache = TokenVectorCache(2)
    cache.store(["a", "b"], np.eye(2, dtype=np.float32))
    cache.lookup(["a"])  # "a" is now the most recent
    cache.store(["c"], np.ones((1, 2), dtype=np.float32))
    assert [v is not None for v in cache.lookup(["a", "b", "c"])] == [True, False, True]


def test_cuda_paths_give_the_same_vectors_on_cpu(tiny_model_dir, embedder):
    # The IOBinding run and the padded encoder batches are what CUDA uses; both work on the CPU provider too.
    cuda_like = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, cache_size=0, io_binding=True)
    cuda_like._pad_encoder_batches = True
    for a, b in zip(cuda_like.embed_tokens(SENTENCES), embedder.embed_tokens(SENTENCES)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_every_context_layout_gives_the_same_vectors(tiny_model_dir, embedder):
    assert embedder.context_layout == "separate"  # the CPU choice; CUDA gets "fused"
    for layout in ("fused", "in_step"):
        other = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, context_layout=layout)
        assert other.context_layout == layout
        for a, b in zip(other.embed_tokens(SENTENCES), embedder.embed_tokens(SENTENCES)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    with pytest.raises(InputError, match="context_layout"):
        Embedder(tiny_model_dir, providers=[CPU], context_layout="sideways")


def test_a_caller_of_wide_batches_gets_the_in_step_graph_where_the_export_has_one(tiny_model_dir, tmp_path):
    wide = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, wide_batches=True)
    assert wide.context_layout == "in_step" and wide._paths["context"].name == "context_in_step.onnx"
    # An export without it (older, or int8): the wide caller gets the separate graph; asking for it by name fails.
    older = tmp_path / "older"
    shutil.copytree(tiny_model_dir, older)
    meta = json.loads((older / "onnx.json").read_text())
    del meta["graphs"]["context_in_step"]
    (older / "onnx.json").write_text(json.dumps(meta))
    (older / "context_in_step.onnx").unlink()
    assert Embedder(older, providers=[CPU], intra_op_threads=1, wide_batches=True).context_layout == "separate"
    with pytest.raises(ModelFileError, match="context_in_step.onnx"):
        Embedder(older, providers=[CPU], intra_op_threads=1, context_layout="in_step")


def test_embed_stats_count_the_positions_the_runtime_ran(tiny_model_dir):
    from elmo.runtime import EmbedStats

    # A budget of 10 positions per run, rows x (longest + 2): 6 and 8 tokens (8 and 10 positions) run alone; 1 and
    # 2 tokens (3 and 4 positions) share a run, since 4 x (2 + 8) + 64 = 104 beats 3 x 9 + 64 + 4 x 9 + 64 = 191
    # (plan_batches' cost at CPU_STEP_COST 8); the empty sentence runs nowhere.
    small = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1, max_batch_tokens=10)
    sentences = [["w"] * 8, ["a"], [], ["b", "c"], ["d"] * 6]
    vectors, stats = small.embed_tokens_with_stats(sentences)
    assert stats == EmbedStats(sentences=5, tokens=17, padded_tokens=2 * (2 + 2) + (6 + 2) + (8 + 2), runs=3)
    assert [v.tobytes() for v in vectors] == [v.tobytes() for v in small.embed_tokens(sentences)]
    assert small.embed_tokens_with_stats([])[1] == EmbedStats(0, 0, 0, 0)


def test_embed_stats_belong_to_their_own_call_under_concurrency(tiny_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    # One shared Embedder, several threads: each call must get the cost of its own sentences (one run each under
    # the default budget, so rows x (longest + 2)), never another thread's.
    shared = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    calls = [[["t"] * n for n in range(1, k + 1)] for k in range(1, 9)]
    with ThreadPoolExecutor(4) as pool:
        stats = list(pool.map(lambda sentences: shared.embed_tokens_with_stats(sentences)[1], calls * 3))
    expected = [(k, k * (k + 1) // 2, k * (k + 2)) for k in range(1, 9)] * 3
    assert [(s.sentences, s.tokens, s.padded_tokens) for s in stats] == expected


def test_parallel_runs_give_the_vectors_of_one_run_at_a_time(tiny_model_dir, embedder):
    # Two biLSTM batches in flight on CPU (a second session, a pool) against the default one-at-a-time embedder;
    # a budget of 8 positions cuts SENTENCES into several batches, so the pool really runs them concurrently.
    parallel = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=2, runs_in_flight=2, max_batch_tokens=8)
    assert parallel.runs_in_flight == 2 and embedder.runs_in_flight == 1
    assert len(parallel._batches([len(s) for s in SENTENCES])) > 2
    for a, b in zip(parallel.embed_tokens(SENTENCES), embedder.embed_tokens(SENTENCES)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_lone_large_batch_is_cut_in_two_for_parallel_runs(tiny_model_dir, embedder):
    from elmo.runtime.embedder import SPLIT_BATCH_TOKENS

    rows = SPLIT_BATCH_TOKENS // 20 + 1  # rows x (18 + 2) positions just past the threshold, within the budget
    sentences = [[f"w{(i * 7 + k) % 31}" for k in range(18)] for i in range(rows)]
    one, two = (
        Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=2, runs_in_flight=runs, max_batch_tokens=10**6)
        for runs in (1, 2)
    )
    assert [len(b) for b in one._batches([18] * rows)] == [rows]
    assert [len(b) for b in two._batches([18] * rows)] == [rows // 2, rows - rows // 2]
    assert [len(b) for b in two._batches([18] * 4)] == [4]  # small lone batches stay whole: lower latency
    for a, b in zip(two.embed_tokens(sentences), one.embed_tokens(sentences)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_views_give_the_same_vectors_read_only_and_in_one_buffer_per_batch(tiny_model_dir, embedder):
    # views=True (what the service asks for): no copy per sentence, so nothing gives the GIL away per sentence.
    shared = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    views, stats = shared.embed_tokens_with_stats(SENTENCES, views=True)
    copies, _ = shared.embed_tokens_with_stats(SENTENCES)
    for view, copy, want in zip(views, copies, embedder.embed_tokens(SENTENCES)):
        np.testing.assert_array_equal(view, copy)
        np.testing.assert_allclose(view, want, atol=1e-6, rtol=0)
        assert copy.flags.c_contiguous and copy.flags.writeable
    non_empty = [v for v in views if v.shape[1]]
    assert not any(v.flags.writeable for v in non_empty)  # none can change another's vectors in their buffer
    assert stats.runs < len(non_empty)  # several sentences in a batch: their views share its output
    assert any(a.base is not None and a.base is b.base for i, a in enumerate(non_empty) for b in non_empty[i + 1 :])


def test_feeds_are_the_batch_rows_in_order_and_each_sentence_indexed_into_them(embedder):
    # The table rows a batch uses, ascending, and [<S>, tokens, </S>] + padding as indices into them; the padding
    # row only when some sentence is shorter (what np.unique(index, return_inverse=True) gave, without its sort).
    table = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    for rows in ([[5, 3, 9], [4]], [[7, 7], [3, 11]], [[3]]):
        feeds = Embedder._feeds(table, rows)
        longest = max(map(len, rows))
        full = np.array([[1, *r, 2] + [0] * (longest - len(r)) for r in rows])
        used, inverse = np.unique(full, return_inverse=True)
        np.testing.assert_array_equal(feeds["table"], table[used])
        np.testing.assert_array_equal(feeds["index"], inverse.reshape(full.shape))
        np.testing.assert_array_equal(feeds["lengths"], [len(r) for r in rows])
        assert feeds["index"].dtype == feeds["lengths"].dtype == np.int64
        np.testing.assert_array_equal(feeds["table"][feeds["index"]], table[full])  # every position its own row


class _WatchedSession:
    """A real onnxruntime session whose runs are recorded: which session, and how many runs of each session were
    executing when it started (each run held a little, so that concurrent calls really overlap)."""

    def __init__(self, session, label: str, log: list, state: dict):
        self.session, self.label, self.log, self.state = session, label, log, state

    def run(self, names, feeds):
        running = self.state["running"]
        with self.state["lock"]:
            self.log.append((self.label, running.copy()))
            running[self.label] += 1
        try:
            time.sleep(0.02)
            return self.session.run(names, feeds)
        finally:
            with self.state["lock"]:
                running[self.label] -= 1


def test_calls_from_several_threads_share_the_runs(tiny_model_dir, embedder):
    # The service's batcher calls from two threads at once, each call one small batch. A lone batch may take the
    # all-threads session only while no other run executes; else both calls would start every thread at once on
    # the same cores (measured: bench/notes/front-door.md). So no run ever starts beside an all-threads run,
    # none starts while one executes, and never more runs than runs_in_flight execute together.
    import threading
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    shared = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=2, runs_in_flight=2)
    log: list = []
    state = {"lock": threading.Lock(), "running": Counter()}
    shared.context = _WatchedSession(shared.context, "all-threads", log, state)
    shared._parallel = _WatchedSession(shared._parallel, "parallel", log, state)
    calls = [SENTENCES[:2], SENTENCES[2:]] * 6
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(shared.embed_tokens, calls))
    assert {label for label, _ in log} == {"all-threads", "parallel"}  # both paths ran
    assert all(sum(running.values()) == 0 for label, running in log if label == "all-threads"), log
    assert all(running["all-threads"] == 0 for _, running in log), log
    assert max(running["parallel"] for _, running in log) < 2, log  # one run beside another: runs_in_flight = 2
    for got, sentences in zip(results, calls):
        for a, b in zip(got, embedder.embed_tokens(sentences)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_cpu_only_request_loads_its_graphs_side_by_side(tiny_model_dir, monkeypatch):
    # Where only the CPU was asked for, the context graph's layout is known before the encoder loads, so the
    # encoder, the context graph and the parallel runs' copy of it load at once (bench/notes/front-door.md).
    # Each load here waits until all three began: loads one after another break the barrier instead.
    import threading

    import elmo.runtime.embedder as module

    all_began = threading.Barrier(3, timeout=20)
    real = module.open_session

    def after_the_others_began(path, *args):
        all_began.wait()
        return real(path, *args)

    monkeypatch.setattr(module, "open_session", after_the_others_began)
    embedder = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=2, runs_in_flight=2)
    assert embedder.runs_in_flight == 2 and embedder._parallel is not None
    assert [s.get_providers()[0] for s in (embedder.encoder, embedder.context, embedder._parallel)] == [CPU] * 3


@pytest.mark.parametrize("runs", [0, -1])
def test_runs_in_flight_below_one_is_an_input_error(tiny_model_dir, runs):
    with pytest.raises(InputError, match="runs_in_flight"):
        Embedder(tiny_model_dir, providers=[CPU], runs_in_flight=runs)


def _full_width_vectors(embedder, rows):
    return embedder.encoder.run(["token_vectors"], {"char_ids": rows.astype(np.int64)})[0]


def test_cut_token_rows_give_the_full_rows_vectors_bit_for_bit(embedder):
    tokens = sorted({t for s in SENTENCES for t in s} | {"y" * 30, "z" * 45, "é"})
    rows = np.stack([embedder.scheme.token_ids(t) for t in tokens])
    assert embedder._trim_window == max(w for w, _ in embedder.meta["config"]["filters"])
    np.testing.assert_array_equal(embedder._encode(rows), _full_width_vectors(embedder, rows))


def test_a_cut_into_the_padding_window_changes_the_vectors(tiny_model_dir):
    """The equality above has teeth: rows cut to their token + 1 padding id lose the wider filters' all-padding
    windows, and the vectors change."""
    embedder = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    letters = np.random.default_rng(0).choice(list("abcdefghijklmnopqrstuvwxyz"), size=(50, 6))
    rows = np.stack([embedder.scheme.token_ids("".join(word)) for word in letters])
    embedder._trim_window = 1
    assert not np.array_equal(embedder._encode(rows), _full_width_vectors(embedder, rows))


def test_an_export_of_the_previous_format_asks_for_a_new_export(model_copy):
    meta = json.loads((model_copy / "onnx.json").read_text())
    meta["format_version"] = 1  # context graphs that took (tokens, lengths)
    (model_copy / "onnx.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFileError, match=r"format_version 1, this runtime reads 2: export the model again"):
        Embedder(model_copy, providers=[CPU])


def test_options_come_as_one_object_or_by_name(tiny_model_dir):
    from elmo.runtime import EmbedderOptions

    options = EmbedderOptions(providers=[CPU], intra_op_threads=1, cache_size=0, max_tokens_per_sentence=7)
    by_object = Embedder(tiny_model_dir, options)
    by_name = Embedder(tiny_model_dir, options, max_tokens_per_sentence=9)  # a name over the object
    assert by_object.options == options and by_object.info.max_tokens_per_sentence == 7
    assert by_name.info.max_tokens_per_sentence == 9 and by_name.options.intra_op_threads == 1
    np.testing.assert_array_equal(by_object.embed_tokens([["a", "b"]])[0], by_name.embed_tokens([["a", "b"]])[0])
    with pytest.raises(TypeError, match="no_such_option"):
        Embedder(tiny_model_dir, no_such_option=1)
    with pytest.raises(InputError, match="background_nice must be in 0..19"):
        EmbedderOptions(background_nice=99).check()  # refused before any model is opened
