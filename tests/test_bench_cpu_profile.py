"""bench/runtime/cpu_profile.py on the tiny model: the cut char rows agree bit for bit, the profile finds the groups."""

from bench.runtime.cpu_profile import char_cnn, context_profile, one_row_per_position, render, typical_batch
from elmo.runtime import CPU, Embedder
from elmo.runtime.modeldir import CONTEXT_IN_STEP_FILE

SENTENCES = [["The", "cat", "sat", "."], ["苹", "果", "很", "好", "吃"], ["a", "b" * 30, "c"], ["x"] * 12]


def test_cut_rows_agree_and_every_profile_group_is_found(tiny_model_dir):
    embedder = Embedder(tiny_model_dir, providers=[CPU], intra_op_threads=1)
    cnn = char_cnn(embedder, SENTENCES, repeat=1)
    assert cnn["bit_identical"] and cnn["distinct_tokens"] == 13 and embedder._trim_window == cnn["trim_window"]
    feeds = typical_batch(embedder, SENTENCES)
    assert feeds["index"].max() < len(feeds["table"]) <= feeds["index"].size
    context = context_profile(tiny_model_dir, feeds, runs=1)
    assert set(context["kernel_ms_per_run"]) == {
        "input projections (outer Gemm)",
        "recurrent products (Gemm in the Scans)",
        "projection products (MatMul in the Scans)",
        "layer 0 gathers (in the Scans)",
        "element-wise and the rest",
    }
    spread = one_row_per_position(feeds)
    assert len(spread["table"]) == spread["index"].size > len(feeds["table"])
    assert (spread["table"][spread["index"]] == feeds["table"][feeds["index"]]).all()
    result = {"model": "tiny", "corpus": "four sentences", "threads": 1, "char_cnn": cnn, "context": context}
    result["context_one_row_per_position"] = context_profile(tiny_model_dir, spread, runs=1)
    # The batch job's graph on the same feeds: its gate products fused with their activations by onnxruntime
    in_step = context_profile(tiny_model_dir, feeds, runs=1, graph=CONTEXT_IN_STEP_FILE)
    assert "gate products with their activation (FusedGemm in the Scans)" in in_step["kernel_ms_per_run"]
    assert "recurrent products (Gemm in the Scans)" not in in_step["kernel_ms_per_run"]
    result["context_in_step"] = in_step
    table = render(result)
    assert "| cut rows |" in table and "bit-identical: True" in table and "one row per position" in table
    assert f"| {CONTEXT_IN_STEP_FILE} (the batch job's graph)" in table and "FusedGemm in the Scans) |" in table
