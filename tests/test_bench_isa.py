"""bench/kit/isa.py: a process that sees an AVX2 CPU gets onnxruntime's AVX2 kernels, on whatever CPU runs the test
(where the kernel offers CPUID faulting and a C compiler is installed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.kit.isa import MaskUnavailable, avx2_env, main

# u8 x s8 and u8 x u8 integer products of 255s and 127s, K = 64: exact, 255 * 127 * 64 = 2,072,640, where VNNI or AMX
# accumulates in int32; on AVX2 (and AVX-512 without VNNI) u8 x s8 adds each pair of products into a saturating int16
# (255 * 127 * 2 > 32,767), so it comes out smaller. u8 x u8 widens both to int16 first: exact on every kernel.
PRODUCTS = """
import json, numpy as np, onnxruntime as ort
from numpy._core._multiarray_umath import __cpu_features__
from onnx import TensorProto, helper
from elmo.runtime.host import host_summary

def product(weights):
    a = helper.make_tensor_value_info("a", TensorProto.UINT8, [None, None])
    b = helper.make_tensor_value_info("b", helper.np_dtype_to_tensor_dtype(weights.dtype), [None, None])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [None, None])
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "g", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return int(session.run(None, {"a": np.full((64, 64), 255, np.uint8), "b": weights})[0][0, 0])

print(json.dumps({"u8s8": product(np.full((64, 64), 127, np.int8)), "u8u8": product(np.full((64, 64), 127, np.uint8)),
                  "numpy": {k: __cpu_features__[k] for k in ("AVX2", "FMA3", "AVX512F", "AVX512VNNI")},
                  "summary": host_summary()}))
"""
EXACT = 255 * 127 * 64


def masked_env() -> dict[str, str]:
    try:
        return avx2_env()
    except MaskUnavailable as exc:
        pytest.skip(f"this machine cannot hide CPU features from a process: {exc}")


def test_a_masked_process_sees_an_avx2_cpu_and_gets_onnxruntime_s_avx2_int8_kernels():
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", PRODUCTS],
        env=masked_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["numpy"] == {"AVX2": True, "FMA3": True, "AVX512F": False, "AVX512VNNI": False}
    assert seen["u8s8"] < EXACT  # saturated: the AVX2 kernel, whatever this CPU has
    assert seen["u8u8"] == EXACT
    assert "AVX2 FMA" in seen["summary"] and "(no AVX-512, AVX-512 VNNI, AVX-VNNI, AMX-INT8" in seen["summary"]


def test_a_real_fault_still_reaches_the_program_s_own_handler():
    # faulthandler installs its SIGSEGV handler after the mask's: a genuine fault must still be reported by it
    crash = "import ctypes; ctypes.string_at(0)"
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", crash],
        env=masked_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == -11 and "Fatal Python error: Segmentation fault" in run.stderr
    sent = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV); print('survived')"  # no handler of its own
    run = subprocess.run([sys.executable, "-c", sent], env=masked_env(), capture_output=True, text=True, timeout=60)
    assert run.returncode == -11 and "survived" not in run.stdout


def test_the_command_line_runs_the_command_masked_and_passes_its_exit_code(capfd):
    masked_env()
    check = "import sys; from numpy._core._multiarray_umath import __cpu_features__ as f; sys.exit(3 * f['AVX512F'])"
    assert main(["--", sys.executable, "-c", check]) == 0
    assert main(["--", sys.executable, "-c", "import sys; sys.exit(5)"]) == 5
    assert main(["--", sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == 128 + 9
