"""bench.kit.sample's thread CPU sampler: this process's CPU by thread between start and stop, pools summed."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from bench.kit.sample import ThreadCpuSampler


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_thread_cpu_is_counted_from_start_to_stop_by_name_with_a_pools_numbers_summed():
    _spin(0.4)  # before start: not counted
    sampler = ThreadCpuSampler(interval=0.05).start()
    spun, release = threading.Barrier(3), threading.Event()

    def work() -> None:
        _spin(0.3)
        spun.wait()
        release.wait()  # alive until stop() has read it: none of its time is lost between two readings

    workers = [threading.Thread(target=work, name=f"spinner_{i}") for i in range(2)]
    for worker in workers:
        worker.start()
    spun.wait()
    by_name = sampler.stop()
    release.set()
    for worker in workers:
        worker.join()
    assert 0.55 <= by_name["spinner"] <= 0.75  # both threads' 0.3 s, in one entry
    assert "spinner_0" not in by_name and "thread-cpu-sampler" not in by_name
    assert by_name.get("MainThread", 0.0) < 0.3  # its 0.4 s before start() are not in it


def test_embed_file_bench_reports_the_jobs_cpu_by_thread(tiny_model_dir, tmp_path):
    """bench.batch.throughput's embed-file run: its CPU by thread adds up to about the process's CPU meanwhile.
    This job lasts well under 0.1 s, as long as the model's loading threads live: read every 5 ms, so that they are
    seen (at the bench's 0.1 s they ended unread and half of the job's CPU went missing on a fast CPU)."""
    from bench.batch.throughput import time_embed_file

    source = tmp_path / "in.txt"
    source.write_text("The quick brown fox jumps over the lazy dog .\n" * 40 + "苹果 公司 发布 了 新 手机 。\n" * 40)
    args = SimpleNamespace(layers="all", format="hdf5", dtype="float32", batch_tokens=None, shard_lines=20, threads=2)
    seconds, cpu, _, by_thread = time_embed_file(tiny_model_dir, source, tmp_path / "out.h5", args, cpu_interval=0.005)
    assert (tmp_path / "out.h5").is_file() and seconds > 0
    assert {"MainThread", "elmo-load"} <= set(by_thread)
    assert 0.5 * cpu <= sum(by_thread.values()) <= cpu + 0.2
