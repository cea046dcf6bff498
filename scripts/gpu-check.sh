#!/usr/bin/env bash
# GPU check for the onnxruntime runtime, from a fresh checkout, in under 5 minutes on a GPU machine:
#   scripts/gpu-check.sh [MODEL_DIR]
# 1. a venv (.venv-gpu) with onnxruntime-gpu[cuda,cudnn] (CUDA 13 + cuDNN 9 come as pip wheels) and the project;
# 2. without MODEL_DIR: torch (CPU is enough) + onnx, then a random-weight ELMo-original model is written and
#    exported (verified against PyTorch) into runs/gpu-check/original; with MODEL_DIR: that exported directory;
# 3. the serve memory defaults reach the CUDA provider (its arena grows by what a run asks) and the idle release
#    shrinks the device arena (onnxruntime accepts memory.enable_memory_arena_shrinkage for gpu:N);
# 4. scripts/gpu_check.py: a plain start picks CUDA by itself, CUDA vs CPU parity, ELMo-original tokens/s at batch
#    1/64/512 sentences, and `elmo serve` on CUDA under 16 gRPC clients (bench/kit/load.py).
# Environment: PYTHON=/path/to/python uses that interpreter as it is (no venv, no installs: for machines that
# cannot reach a registry and already hold onnxruntime-gpu); GPU_SITE=DIR (implies PYTHON=python3 unless set):
# onnxruntime-gpu and the gRPC wheels come from that private folder (scripts/gpu-wheels.sh receive fills it),
# first on PYTHONPATH for the check so that a CPU `onnxruntime` elsewhere cannot shadow them; the model export
# runs without it (the machine's torch and onnx). SECONDS_PER=10 per throughput figure; GPU_CHECK_JSON=path writes
# the report as JSON; GPU_CHECK_TORCH=1 also times PyTorch eager on the GPU.
# On the borrowed GPU machine (no network): see scripts/gpu-wheels.sh, e.g. the last call
#   scripts/gpu-wheels.sh receive && GPU_SITE=/tmp/elmo-gpu-site GPU_CHECK_JSON=$OUT/gpu-check.json SECONDS_PER=5 \
#       scripts/gpu-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR="${1:-}"
started=$(date +%s)
if [[ -n "${GPU_SITE:-}" ]]; then
    [[ -d "$GPU_SITE" ]] || { echo "GPU_SITE=$GPU_SITE is not a folder (run scripts/gpu-wheels.sh receive)" >&2; exit 1; }
    PYTHON="${PYTHON:-python3}"
    CHECK_PYTHONPATH="$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    CHECK_PYTHONPATH="${PYTHONPATH:-}"
fi

if [[ -z "${PYTHON:-}" ]]; then
    python3 -m venv .venv-gpu
    PYTHON=.venv-gpu/bin/python
    "$PYTHON" -m pip install -q --upgrade pip
    # Never the CPU `onnxruntime` package beside onnxruntime-gpu: they share the module and the CPU one wins.
    "$PYTHON" -m pip install -q 'onnxruntime-gpu[cuda,cudnn]==1.31.1' 'numpy>=1.26' 'tokenizers>=0.20'
    if [[ -z "$MODEL_DIR" ]]; then
        "$PYTHON" -m pip install -q 'torch==2.13.0' 'safetensors>=0.4' 'onnx>=1.17'
    fi
    "$PYTHON" -m pip install -q --no-deps -e .
fi
PYTHONPATH="$CHECK_PYTHONPATH" "$PYTHON" -c \
    "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_device(), o.__file__, o.get_available_providers())"

if [[ -z "$MODEL_DIR" ]]; then
    MODEL_DIR=runs/gpu-check/original
    if ! "$PYTHON" -c "import sys; from elmo.runtime.modeldir import read_onnx_metadata; read_onnx_metadata(sys.argv[1])" \
        "$MODEL_DIR" 2>/dev/null; then
        echo "exporting a random-weight ELMo-original model into $MODEL_DIR (verified against PyTorch on the CPU)"
        "$PYTHON" -m elmo.bench.random_model --preset original --out "$MODEL_DIR" --export
    fi
fi

# `elmo serve`'s memory defaults reach the CUDA provider (elmo/runtime/memory.py, --cpu-memory-arena): its device
# arena grows by what a run asks, not to the next power of two; and the release the server runs once idle shrinks
# the arenas of a runtime on CUDA (onnxruntime raises if it refuses a device named in the shrinkage option).
PYTHONPATH="$CHECK_PYTHONPATH" "$PYTHON" - "$MODEL_DIR" <<'PY'
import sys
from pathlib import Path

from elmo.runtime.memory import MemoryOptions, configure_memory
from elmo.runtime.providers import CPU, CUDA, open_session

configure_memory(MemoryOptions())
graph = next(p for p in (Path(sys.argv[1]) / n for n in ("encoder.onnx", "model.onnx")) if p.is_file())
session = open_session(graph, [CUDA, CPU])
cuda = session.get_provider_options().get(CUDA)
assert cuda is not None, f"the CUDA provider did not load for {graph}: {session.get_providers()}"
print("CUDA provider memory:", {k: cuda.get(k) for k in ("arena_extend_strategy", "gpu_mem_limit")})
assert cuda.get("arena_extend_strategy") == "kSameAsRequested", f"serve's memory defaults did not reach CUDA: {cuda}"

from elmo.runtime import Embedder
from elmo.runtime.providers import SHRINK_ARENAS, shrink_run_options

runtime = Embedder(sys.argv[1], providers=[CUDA, CPU], check_on_load=False)
runtime.embed_tokens([["a", "burst", "of", "words"] * 64] * 64)
devices = shrink_run_options(runtime.context).get_run_config_entry(SHRINK_ARENAS)
assert "gpu:" in devices, devices
runtime.release_memory()
print("idle release on CUDA: arenas shrunk for", devices)
PY

extra=()
[[ -n "${GPU_CHECK_JSON:-}" ]] && extra+=(--json "$GPU_CHECK_JSON")
[[ "${GPU_CHECK_TORCH:-0}" == "1" ]] && extra+=(--torch)
[[ -n "${GPU_SITE:-}" ]] && extra+=(--onnxruntime-from "$GPU_SITE")
PYTHONPATH="$CHECK_PYTHONPATH" "$PYTHON" scripts/gpu_check.py "$MODEL_DIR" --seconds "${SECONDS_PER:-10}" \
    ${extra[@]+"${extra[@]}"}
echo "gpu-check took $(( $(date +%s) - started )) s"
