"""Which onnxruntime execution provider runs the graphs: CUDA where a GPU is visible and the CUDA/cuDNN
libraries load (the pip wheels of the `gpu` extra, preloaded here), else CPU; and the sessions opened on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from elmo.errors import ModelFileError
from elmo.runtime.memory import cuda_memory_options, memory_options

log = logging.getLogger("elmo.runtime")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# cuDNN's exhaustive conv-algorithm search runs again for every new input shape; the encoder sees a new token
# count on nearly every call, so ask for the heuristic choice (and pad token counts to a few sizes on CUDA).
# TF32 (onnxruntime's default on Ampere and later) rounds float32 matmul inputs to 10 bits: errors near 1e-3, a
# hundred times the float32 export's bound, which the load-time check (elmo.runtime.probe) holds the GPU to as well.
DEFAULT_CUDA_OPTIONS = {"cudnn_conv_algo_search": "HEURISTIC", "use_tf32": "0"}


# -- providers -----------------------------------------------------------------------------------------------------
# What makes CUDA usable, for the messages: the `gpu` extra is onnxruntime-gpu[cuda,cudnn] (CUDA 13 + cuDNN 9 wheels).
CUDA_LIBRARIES_HINT = "install the project's `gpu` extra: pip install '.[serve,gpu]'"
# The NVIDIA driver's user-space library: mounted by the container toolkit, never a pip wheel.
DRIVER_LIBRARY = "libcuda.so.1"


@dataclass(frozen=True)
class ProviderRequest:
    """What onnxruntime is asked for, and why CUDA is missing from it when the choice was ours."""

    providers: list[str]
    reason: str = ""  # why CUDA is left out (automatic choice only); empty when CUDA is requested or named
    gpu_unused: bool = False  # a GPU is visible but CUDA is not requested: the log line is a warning


def gpu_visibility(environ: Mapping[str, str], root: Path = Path("/")) -> tuple[bool, str]:
    """Whether this process can see an NVIDIA GPU, and the evidence; no CUDA call and no library load, so a CPU host
    never reaches the CUDA provider (which would print onnxruntime's error block).

    CUDA_VISIBLE_DEVICES empty or starting with a negative index hides every GPU (CUDA stops at the first invalid
    entry). Otherwise a GPU is visible when the driver lists one (``/proc/driver/nvidia/gpus/*``: present before
    any device node is made), a device node ``/dev/nvidiaN`` exists (what a container started with ``--gpus`` holds)
    or WSL's driver library is there. NVIDIA_VISIBLE_DEVICES is not read: the container runtime applies it when
    it creates the container, and its effect is exactly which device nodes exist."""
    cuda_visible = environ.get("CUDA_VISIBLE_DEVICES")
    if cuda_visible is not None:
        first = cuda_visible.split(",")[0].strip()
        if not first or first.startswith("-"):
            return False, f"CUDA_VISIBLE_DEVICES={cuda_visible!r} hides every GPU"
    evidence = [
        *sorted((root / "proc/driver/nvidia/gpus").glob("*")),
        *sorted((root / "dev").glob("nvidia[0-9]*")),
        *[path for path in [root / "usr/lib/wsl/lib" / DRIVER_LIBRARY] if path.exists()],
    ]
    if evidence:
        return True, str(evidence[0])
    return False, f"no GPU visible: no {root / 'dev'}/nvidia<N> device and no {root / 'proc/driver/nvidia/gpus'}/*"


def _probe_library(name: str) -> bool:
    """Whether the dynamic loader finds ``name`` now (a library already loaded answers by its soname)."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


_preload_lock = threading.Lock()  # redirect_stdout swaps a process-wide object: one preload at a time


def missing_cuda_libraries() -> tuple[str, ...]:
    """Make the pip-installed CUDA/cuDNN libraries loadable, once per process, and name those still missing.

    onnxruntime's CUDA provider carries no RPATH to the nvidia-* wheels; ``onnxruntime.preload_dlls`` loads them
    from the site-packages folder that holds onnxruntime (nvidia/cu13/lib, nvidia/cudnn/lib), then tries the
    default loader paths (a system CUDA, LD_LIBRARY_PATH). A library loaded by path then satisfies the provider's
    own dependency on its soname."""
    with _preload_lock:
        return _preload_cuda_libraries()


@functools.cache
def _preload_cuda_libraries() -> tuple[str, ...]:
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21
    if preload is not None:
        # It prints its complaints to stdout; the caller logs the missing names in one line instead.
        with contextlib.redirect_stdout(io.StringIO()):
            preload(cuda=True, cudnn=True, msvc=False)
    # The list preload_dlls itself walks (the CUDA major of this build); a private helper, pinned with onnxruntime.
    walked = getattr(ort, "_get_nvidia_dll_paths", None)
    needed = [path[-1] for path in walked(False, True, True)] if walked is not None else []
    return tuple(name for name in [*needed, DRIVER_LIBRARY] if not _probe_library(name))


def requested_providers(
    providers: Sequence[str] | None, environ: Mapping[str, str] | None = None, root: Path = Path("/")
) -> ProviderRequest:
    """The providers to ask onnxruntime for. Named ``providers`` are a demand, taken as they are (CUDA's libraries
    are preloaded first when CUDA is among them). None: CUDA then CPU only where this onnxruntime has CUDA, a GPU is
    visible (``gpu_visibility``) and the CUDA libraries load; CPU alone otherwise, with the reason."""
    if providers is not None:
        if CUDA in providers:
            missing_cuda_libraries()
        return ProviderRequest(list(providers))
    if CUDA not in ort.get_available_providers():
        return ProviderRequest([CPU], "this onnxruntime build has no CUDA provider")
    visible, evidence = gpu_visibility(os.environ if environ is None else environ, root)
    if not visible:
        return ProviderRequest([CPU], evidence)
    missing = missing_cuda_libraries()
    if missing:
        reason = f"GPU {evidence} visible but CUDA libraries missing: {', '.join(missing)}; {CUDA_LIBRARIES_HINT}"
        return ProviderRequest([CPU], reason, gpu_unused=True)
    return ProviderRequest([CUDA, CPU])


def cuda_hint(requested: Sequence[str]) -> str:
    """What keeps a demanded CUDA provider from loading, when it is a missing library (for the ElmoError)."""
    missing = missing_cuda_libraries() if CUDA in requested else ()
    return f" (not loadable: {', '.join(missing)}; {CUDA_LIBRARIES_HINT})" if missing else ""


def provider_reason(request: ProviderRequest, active: str) -> str:
    """Why ``active`` is the provider in use, for the one log line."""
    if active == CUDA:
        return "CUDA provider loaded: the graphs run on the GPU"
    if request.reason:
        return request.reason
    if CUDA in request.providers:
        return (
            "CUDA provider requested but onnxruntime could not use it (the CUDA 13 / cuDNN 9 libraries or the driver "
            f"do not load: {CUDA_LIBRARIES_HINT}); onnxruntime's own message above says which"
        )
    return f"providers={request.providers} were requested"


# onnxruntime's run option: when the run ends, the listed devices' arenas free every region no run is using.
SHRINK_ARENAS = "memory.enable_memory_arena_shrinkage"


def shrink_run_options(session: ort.InferenceSession) -> ort.RunOptions | None:
    """RunOptions whose run ends by handing ``session``'s unused arena regions back: its CPU arena where it has one,
    the CUDA device arena where CUDA runs it; None where it has no arena (onnxruntime refuses shrinkage there)."""
    devices = ["cpu:0"] if session.get_session_options().enable_cpu_mem_arena else []
    if session.get_providers()[0] == CUDA:
        devices.append(f"gpu:{session.get_provider_options().get(CUDA, {}).get('device_id', '0')}")
    if not devices:
        return None
    options = ort.RunOptions()
    options.add_run_config_entry(SHRINK_ARENAS, ";".join(devices))
    return options


def open_session(
    path: Path,
    providers: list[str],
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    cuda_options: dict | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for ``path``; ModelFileError naming the file when onnxruntime cannot load it.
    ``cuda_options`` go to the CUDA provider (default: DEFAULT_CUDA_OPTIONS); the arena follows
    :func:`configure_memory` (default: no CPU arena)."""
    if not path.is_file():
        raise ModelFileError(f"{path}: ONNX graph not found (run `elmo export --model {path.parent}`)")
    options = ort.SessionOptions()
    memory = memory_options()
    options.enable_cpu_mem_arena = memory.cpu_memory_arena == "on"
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Spinning worker threads keep the cores busy between runs and starve the gRPC threads and the tokenizer that
    # feed them: measured 35-40 % fewer served tokens/s with it on (docs/service.md).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    if intra_op_threads:
        options.intra_op_num_threads = int(intra_op_threads)
    if inter_op_threads:
        options.inter_op_num_threads = int(inter_op_threads)
    cuda = {**DEFAULT_CUDA_OPTIONS, **cuda_memory_options(memory), **(cuda_options or {})}
    with_options = [(name, cuda) if name == CUDA else name for name in providers]
    try:
        return ort.InferenceSession(str(path), options, providers=with_options)
    except Exception as exc:  # onnxruntime raises its own untyped errors for unreadable graphs
        raise ModelFileError(f"{path}: onnxruntime cannot load this graph ({type(exc).__name__}: {exc})") from None
