"""What machine this is, in the terms that decide onnxruntime's CPU kernels. Torch-free (serving path).

onnxruntime's CPU library (MLAS) picks its float32 and int8 kernels by instruction set when it loads: AVX2 + FMA,
AVX-512, AVX-VNNI / AVX-512 VNNI (int8 dot products that accumulate straight into int32), AMX (int8 tiles). The same
graph therefore rounds differently, and before VNNI its u8 x s8 kernels can saturate. Every figure this project
records names the CPU it was measured on (:func:`host_facts`, in the benchmarks' JSON), and the load-time check of a
model (elmo.runtime.probe) names it in its one log line (:func:`host_summary`).

The flags are those of /proc/cpuinfo less any this process is told its CPUID hides (``ELMO_CPUID_HIDDEN``, the
/proc/cpuinfo names, space-separated; set by bench/kit/isa.py, which makes a process see an AVX2 CPU): what the
kernels were chosen from, not what the kernel lists.
"""

from __future__ import annotations

import os
import platform
import sys
from functools import cache
from pathlib import Path

# /proc/cpuinfo flag -> the name a reader knows; the instruction sets that change onnxruntime's CPU kernels.
KERNEL_FLAGS = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "amx_int8": "AMX-INT8",
    "f16c": "F16C",
    "avx512_fp16": "AVX-512 FP16",
}
CPUINFO = Path("/proc/cpuinfo")
HIDDEN_ENV = "ELMO_CPUID_HIDDEN"


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (``model name``, ``flags``, ``vendor_id``)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@cache
def cpu_facts(cpuinfo: Path = CPUINFO) -> dict:
    """{model, vendor, flags: {name: bool}} of this CPU as this process sees it (model 'unknown' where
    /proc/cpuinfo cannot be read)."""
    try:
        fields = _cpuinfo_fields(cpuinfo.read_text(errors="replace"))
    except OSError:
        fields = {}
    present = set(fields.get("flags", "").split()) - set(hidden_flags())
    return {
        "model": fields.get("model name") or platform.processor() or "unknown",
        "vendor": fields.get("vendor_id", "unknown"),
        "flags": {name: flag in present for flag, name in KERNEL_FLAGS.items()},
    }


# The kernels whose u8 x s8 products accumulate in int32 (VPDPBUSD, AMX tiles), not through a saturating int16 step.
INT32_INT8_KERNELS = ("AVX-512 VNNI", "AVX-VNNI", "AMX-INT8")


def int8_accumulates_in_int32() -> bool:
    """Whether onnxruntime's u8 x s8 kernels are exact on this CPU as this process sees it: VNNI or AMX, where AVX2
    and AVX-512 without VNNI add two products into a saturating int16 (export/quantize.py)."""
    flags = cpu_facts()["flags"]
    return any(flags[name] for name in INT32_INT8_KERNELS)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _versions() -> dict[str, str]:
    """The numeric libraries whose kernels a figure depends on, where installed (torch only when already loaded:
    the serving path never imports it)."""
    versions = {"python": platform.python_version()}
    for name in ("numpy", "onnxruntime", "onnx", "torch"):
        if name == "torch" and "torch" not in sys.modules:
            continue
        try:
            module = __import__(name)
        except ImportError:
            continue
        versions[name] = str(getattr(module, "__version__", "unknown"))
    return versions


def host_facts() -> dict:
    """What every benchmark JSON records of the machine: CPU model, vendor, kernel-relevant flags (as this process
    sees them), usable cores, the platform and the library versions."""
    cpu = cpu_facts()
    return {
        "cpu": cpu["model"],
        "cpu_vendor": cpu["vendor"],
        "cpu_flags": cpu["flags"],
        "cores": usable_cores(),
        "platform": platform.platform(),
        "libraries": _versions(),
    } | _hidden()


def _hidden() -> dict:
    """``cpuid_hidden`` where this process's CPUID hides flags: a figure measured so names the kernels it ran on,
    and that the CPU has more."""
    hidden = hidden_flags()
    return {"cpuid_hidden": hidden} if hidden else {}


def hidden_flags() -> list[str]:
    """The /proc/cpuinfo flags this process is told its CPUID hides (``ELMO_CPUID_HIDDEN``)."""
    return os.environ.get(HIDDEN_ENV, "").split()


def host_summary() -> str:
    """One line: 'AMD EPYC, 2 cores, AVX2 FMA F16C (no AVX-512, AVX-512 VNNI, AVX-VNNI, AMX-INT8)'."""
    cpu = cpu_facts()
    has = [name for name, present in cpu["flags"].items() if present]
    lacks = [name for name, present in cpu["flags"].items() if not present and name != "AVX-512 FP16"]
    text = f"{cpu['model']}, {usable_cores()} cores, {' '.join(has) or 'no AVX2'}"
    return text + (f" (no {', '.join(lacks)})" if lacks else "")
