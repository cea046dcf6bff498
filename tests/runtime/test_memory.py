"""elmo.runtime.memory: with `elmo serve`'s memory defaults, the runtime's memory comes back after the largest calls.

Each measurement runs in a fresh interpreter (the mmap threshold is process-wide): open models/default with the
given options, one warm-up call, resident memory (VmRSS), one call of the largest request the server's default
limits allow (16 sentences x 512 tokens), a release, resident memory again. The serve defaults get the release the
server runs once idle (every runtime's arenas shrunk, then glibc's heaps trimmed); beside them the same arena gets
glibc's trim alone, so that the test shows that the arena's shrinking is what gives the memory back. Memory, not
time: no timing is judged here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from elmo.errors import ConfigError
from elmo.runtime.memory import (
    MemoryOptions,
    add_memory_arguments,
    configure_memory,
    cuda_memory_options,
    memory_from_args,
    memory_options,
    register_release,
    release_memory,
)
from elmo.runtime.providers import CPU, SHRINK_ARENAS, open_session, shrink_run_options
from tests.conftest import REPO

MODEL = REPO / "models" / "default"
MARGIN = 1.25  # resident memory after the calls, at most this times what it was before them

MEASURE = """
import json, random, sys
from elmo.runtime.memory import MemoryOptions, configure_memory, release_free_memory, release_memory
configure_memory(MemoryOptions(sys.argv[2], int(sys.argv[3]), memory_trim_interval_s=0))
from elmo.runtime import Embedder

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

runtime = Embedder(sys.argv[1], intra_op_threads=1, check_on_load=False, cache_size=0)
runtime.embed_tokens_with_stats([["a", "warm", "up", "call"]] * 8)
before = rss_mib()
words = open(sys.argv[1] + "/vocab.txt", encoding="utf-8").read().split()[:5000]
rng = random.Random(0)
for _ in range(1):
    vectors, _ = runtime.embed_tokens_with_stats([[rng.choice(words) for _ in range(512)] for _ in range(16)])
    del vectors
(release_memory if sys.argv[4] == "all" else release_free_memory)()  # all: what `elmo serve` does once idle
print(json.dumps({"before": before, "after": rss_mib()}))
"""


def measure(arena: str, mmap_threshold: int, release: str) -> dict:
    """``release``: "all" (arenas shrunk, then glibc's trim) or "trim" (glibc's trim alone)."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(MODEL), arena, str(mmap_threshold), release],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow  # two interpreters, each the largest call on models/default: seconds, `make test` only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and glibc's mallopt are Linux's")
def test_memory_comes_back_after_the_largest_calls_with_the_serve_defaults():
    defaults = MemoryOptions()
    served = measure(defaults.cpu_memory_arena, defaults.malloc_mmap_threshold_bytes, "all")
    kept = measure("on", defaults.malloc_mmap_threshold_bytes, "trim")  # the arena unshrunk keeps the largest call's
    assert served["after"] <= MARGIN * served["before"], served
    assert kept["after"] > MARGIN * kept["before"], kept


def test_the_flags_build_the_options_and_refuse_bad_values():
    parser = argparse.ArgumentParser()
    add_memory_arguments(parser)
    assert memory_from_args(parser.parse_args([])) == MemoryOptions()
    flags = ["--cpu-memory-arena", "on", "--malloc-mmap-threshold-bytes", "0", "--memory-trim-interval-s", "2.5"]
    assert memory_from_args(parser.parse_args(flags)) == MemoryOptions("on", 0, 2.5)
    with pytest.raises(ConfigError, match="--malloc-mmap-threshold-bytes"):
        MemoryOptions(malloc_mmap_threshold_bytes=-1).validate()
    with pytest.raises(ConfigError, match="--memory-trim-interval-s"):
        MemoryOptions(memory_trim_interval_s=-1).validate()
    with pytest.raises(ConfigError, match="--cpu-memory-arena"):
        MemoryOptions(cpu_memory_arena="sometimes").validate()


def test_the_cuda_provider_gets_the_same_choice():
    """Without the arena's keeping, the CUDA provider's device arena grows by what a run asks."""
    assert cuda_memory_options(MemoryOptions()) == {"arena_extend_strategy": "kSameAsRequested"}
    assert cuda_memory_options(MemoryOptions(cpu_memory_arena="off")) == {"arena_extend_strategy": "kSameAsRequested"}
    assert cuda_memory_options(MemoryOptions("on", 0, memory_trim_interval_s=0)) == {}  # onnxruntime's own


class _Runtime:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def release_memory(self) -> None:
        self.calls.append("released")


def test_the_release_reaches_live_runtimes_only():
    """Registered runtimes are held weakly: an unloaded model version is neither kept alive nor released."""
    calls: list[str] = []
    live, gone = _Runtime(calls), _Runtime(calls)
    register_release(live.release_memory)
    register_release(gone.release_memory)
    del gone
    release_memory()
    assert calls == ["released"]


def test_shrinking_is_asked_only_of_sessions_with_an_arena():
    """onnxruntime refuses the shrinkage run option for a session without an arena: it is not asked there."""
    graph, before = MODEL / "encoder.onnx", memory_options()
    try:
        for arena, devices in (("on", "cpu:0"), ("off", None)):
            configure_memory(MemoryOptions(arena, 0, 0))
            options = shrink_run_options(open_session(graph, [CPU]))
            assert (options and options.get_run_config_entry(SHRINK_ARENAS)) == devices
    finally:
        configure_memory(before)
