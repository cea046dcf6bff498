"""bench.batch.throughput's in-process runtime paths: each runs the job's own context graph from a cold token cache."""

from __future__ import annotations

from types import SimpleNamespace

LINES = ["Zebras quietly graze near rivers .", "苹果 公司 发布 了 新 手机 。", "A dog sleeps ."] * 6


def test_each_runtime_path_starts_cold_on_the_jobs_context_graph(tiny_model_dir):
    """The raw-text path once ran on the token path's Embedder and found every char-CNN vector cached: it then
    reads as faster than the ceiling. Both now miss the cache alike, and run the graph the batch job runs."""
    from bench.batch.throughput import time_runtime
    from elmo.batch.engines import local_backend

    args = SimpleNamespace(layers="all", batch_tokens=None, shard_lines=5, threads=2)
    measured = time_runtime(tiny_model_dir, LINES, args)
    misses = measured["cache_misses"]
    assert misses["tokens"] > 0 and misses["texts"] == misses["tokens"]
    job = local_backend(tiny_model_dir, None, 2)
    job_layout = job.embedder.context_layout
    job.embedder.close()  # its sessions and run pools, not left to the collector
    assert measured["context_layout"] == job_layout == "in_step"
    assert set(measured["timings"]) == {"tokens", "texts"}
