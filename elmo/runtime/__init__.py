"""The torch-free serving core: an exported model directory in, per-sentence layer vectors out (onnxruntime).

- :mod:`elmo.runtime.modeldir`: what an exported model directory holds and the checks made when it is opened;
- :mod:`elmo.runtime.providers`: CUDA or CPU, and the sessions opened on it;
- :mod:`elmo.runtime.batching`: the token-vector cache and the batch plan;
- :mod:`elmo.runtime.embedder`: :class:`Embedder`, the one entry point the service, the batch job and the
  features use.

``from elmo.runtime import Embedder`` is the public API; the names below are re-exported for it.
"""

from elmo.runtime.batching import CPU_STEP_COST, CUDA_STEP_COST, EmbedStats, TokenVectorCache, plan_batches
from elmo.runtime.embedder import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_TOKENS_CUDA,
    DEFAULT_MAX_TOKENS_PER_SENTENCE,
    Embedder,
    EmbedderInfo,
    EmbedderOptions,
)
from elmo.runtime.providers import CPU, CUDA, gpu_visibility, missing_cuda_libraries, requested_providers

__all__ = [
    "CPU",
    "CPU_STEP_COST",
    "CUDA",
    "CUDA_STEP_COST",
    "DEFAULT_CACHE_SIZE",
    "DEFAULT_MAX_BATCH_TOKENS",
    "DEFAULT_MAX_BATCH_TOKENS_CUDA",
    "DEFAULT_MAX_TOKENS_PER_SENTENCE",
    "EmbedStats",
    "Embedder",
    "EmbedderInfo",
    "EmbedderOptions",
    "TokenVectorCache",
    "gpu_visibility",
    "missing_cuda_libraries",
    "plan_batches",
    "requested_providers",
]
