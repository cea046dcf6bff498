"""elmo.runtime.memory: with `elmo serve`'s memory defaults, the runtime's memory comes back after the largest calls.

Each measurement runs in a fresh interpreter (the mmap threshold is process-wide): open models/default with the
given options, one warm-up call, resident memory (VmRSS), one call of the largest request the server's default
limits allow (16 sentences x 512 tokens), the release the server runs every --memory-trim-interval-s, resident memory
again. Memory, not time: no timing is judged here. The
arena kept as onnxruntime has it is measured beside it, so that the test shows it tells the two apart."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from elmo.errors import ConfigError
from elmo.runtime.memory import MemoryOptions, add_memory_arguments, cuda_memory_options, memory_from_args
from tests.conftest import REPO

MODEL = REPO / "models" / "default"
MARGIN = 1.25  # resident memory after the calls, at most this times what it was before them

MEASURE = """
import json, random, sys
from elmo.runtime.memory import MemoryOptions, configure_memory, release_free_memory
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
release_free_memory()  # what `elmo serve` does every --memory-trim-interval-s
print(json.dumps({"before": before, "after": rss_mib()}))
"""


def measure(arena: str, mmap_threshold: int) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(MODEL), arena, str(mmap_threshold)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow  # two interpreters, each the largest call on models/default: seconds, `make test` only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS and glibc's mallopt are Linux's")
def test_memory_comes_back_after_the_largest_calls_with_the_serve_defaults():
    defaults = MemoryOptions()
    served = measure(defaults.cpu_memory_arena, defaults.malloc_mmap_threshold_bytes)
    kept = measure("on", 0)  # onnxruntime's arena and glibc's own threshold: the largest call's memory stays
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
    assert cuda_memory_options(MemoryOptions(cpu_memory_arena="on")) == {}
