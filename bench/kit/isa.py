"""Run a command as if this x86-64 CPU had AVX2 and FMA but no AVX-512, VNNI or AMX: the kernels onnxruntime (MLAS),
numpy and the rest pick on such a CPU (the AMD EPYC of issue 33), measured on the cores at hand.

    .venv/bin/python -m bench.kit.isa -- .venv/bin/python -m bench.export.int8 --model models/default --no-tasks
    .venv/bin/python -m bench.kit.isa -- .venv/bin/python -m pytest tests/export/test_quantize.py

bench/kit/cpuid_mask.c, compiled here with the C compiler (``cc``) into runs/isa/ and LD_PRELOADed into the command
and every process it starts, hides those features from CPUID through Linux's CPUID faulting (the ``cpuid_fault``
flag of /proc/cpuinfo: Intel CPUs since Ivy Bridge and KVM guests on them). The command also gets
``ELMO_CPUID_HIDDEN``, the /proc/cpuinfo names of what is hidden, which elmo.runtime.host subtracts from the flags
that every figure and the load-time check's line name: what the process sees, not what the kernel lists.

What it is not: an AVX2 CPU's clocks, caches and memory. Ratios measured under it (int8 against float32, both on AVX2
kernels) carry over better than rates.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.kit.revision import REPO

SOURCE = Path(__file__).with_name("cpuid_mask.c")
BUILD = REPO / "runs" / "isa"
# What cpuid_mask.c clears, as /proc/cpuinfo names them (the same list as the bits in its HIDE_* masks).
HIDDEN = (
    "avx512f avx512dq avx512ifma avx512pf avx512er avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 "
    "avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_4vnniw avx512_4fmaps avx512_vp2intersect amx_bf16 "
    "avx512_fp16 amx_tile amx_int8 avx_vnni avx512_bf16 avx_ifma avx_vnni_int8 avx_ne_convert "
    "avx_vnni_int16"
).split()


class MaskUnavailable(RuntimeError):
    """This machine cannot hide CPU features from a process (no CPUID faulting, no C compiler); says which."""


def mask_library(build: Path = BUILD) -> Path:
    """The shim, compiled once per version of its source (runs/isa/cpuid_mask-<sha>.so). Raises MaskUnavailable."""
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").is_file() else ""
    if " cpuid_fault" not in flags:
        raise MaskUnavailable("this CPU or kernel has no CPUID faulting (no cpuid_fault in /proc/cpuinfo)")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise MaskUnavailable("no C compiler (cc, or $CC) to build bench/kit/cpuid_mask.c")
    source = SOURCE.read_bytes()
    library = build / f"cpuid_mask-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if not library.is_file():
        build.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run(
            [compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-ldl"],
            capture_output=True,
            text=True,
        )
        if built.returncode:
            raise MaskUnavailable(f"{compiler} could not build {SOURCE.name}: {built.stderr.strip()}")
        partial.replace(library)
    return library


def avx2_env(env: dict[str, str] | None = None, build: Path = BUILD) -> dict[str, str]:
    """``env`` (default: this process's) for a child that sees an AVX2 CPU. Raises MaskUnavailable."""
    out = dict(os.environ if env is None else env)
    preload = out.get("LD_PRELOAD", "")
    out["LD_PRELOAD"] = " ".join(filter(None, (str(mask_library(build)), preload)))
    out["ELMO_CPUID_HIDDEN"] = " ".join(HIDDEN)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        env = avx2_env()
    except MaskUnavailable as exc:
        print(f"bench.kit.isa: cannot hide AVX-512 / VNNI / AMX here: {exc}", file=sys.stderr)
        return 2
    code = subprocess.run(command, env=env).returncode
    return 128 - code if code < 0 else code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    sys.exit(main())
