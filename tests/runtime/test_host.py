"""elmo.runtime.host: the CPU facts every figure and the load-time check name."""

from __future__ import annotations

import json

import pytest

from elmo.runtime import host
from elmo.runtime.host import cpu_facts, host_facts, host_summary

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""


@pytest.fixture(autouse=True)
def _no_hidden_flags(monkeypatch):
    """The suite may itself run under bench/kit/isa.py, which hides flags by ELMO_CPUID_HIDDEN: these tests read
    their own cpuinfo text, whole, unless one hides flags itself."""
    monkeypatch.delenv(host.HIDDEN_ENV, raising=False)


def test_the_first_processor_s_model_and_kernel_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    facts = cpu_facts(path)
    assert facts["model"] == "Intel(R) Xeon(R) Platinum 8480+" and facts["vendor"] == "GenuineIntel"
    flags = facts["flags"]
    assert flags["AVX2"] and flags["AVX-512"] and flags["AVX-512 VNNI"] and flags["AMX-INT8"]
    assert not flags["AVX-VNNI"] and not flags["AVX-512 FP16"]


def test_an_unreadable_cpuinfo_is_unknown_not_an_error(tmp_path):
    facts = cpu_facts(tmp_path / "missing")
    assert facts["model"] and not any(facts["flags"].values())


def test_this_machine_s_facts_are_json_and_the_summary_names_the_cpu(monkeypatch, tmp_path):
    facts = host_facts()
    assert json.loads(json.dumps(facts)) == facts
    assert facts["cores"] >= 1 and "onnxruntime" in facts["libraries"] and "numpy" in facts["libraries"]
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO.replace("avx512f avx512_vnni amx_tile amx_int8", ""))
    monkeypatch.setattr(host, "cpu_facts", lambda: cpu_facts(path))
    summary = host_summary()
    assert summary.startswith("Intel(R) Xeon(R) Platinum 8480+, ") and "AVX2 FMA F16C" in summary
    assert "(no AVX-512, AVX-512 VNNI, AVX-VNNI, AMX-INT8)" in summary


def test_features_hidden_from_this_process_s_cpuid_are_not_claimed(monkeypatch, tmp_path):
    # bench/kit/isa.py runs a process that sees an AVX2 CPU and names what it hides in ELMO_CPUID_HIDDEN
    path = tmp_path / "cpuinfo"
    path.write_text(CPUINFO)
    monkeypatch.setenv(host.HIDDEN_ENV, "avx512f avx512_vnni amx_tile amx_int8")
    flags = cpu_facts(path)["flags"]
    assert flags["AVX2"] and flags["FMA"] and flags["F16C"]
    assert not flags["AVX-512"] and not flags["AVX-512 VNNI"] and not flags["AMX-INT8"]
    assert host_facts()["cpuid_hidden"] == ["avx512f", "avx512_vnni", "amx_tile", "amx_int8"]  # the JSON says so
    monkeypatch.delenv(host.HIDDEN_ENV)
    assert "cpuid_hidden" not in host_facts()
