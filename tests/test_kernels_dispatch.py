"""Tests of the CPU probe and the per-ISA dispatch tables (csrc/nx_cpu.*, csrc/nx_dispatch.h).

Independent references: the kernel's own view of the CPU (/proc/cpuinfo flags, which Linux
derives from CPUID and the XSAVE state it enabled), and the documented inheritance rules
(a kernel missing at an ISA comes from the nearest ancestor that has it). The tables are read
through kernel_variants() and _variant(), which read the C tables.
"""
import os
import platform
import subprocess
import sys

import pytest
from kernelutil import ISAS

from nxhpc import _kernels as K

FEATURES = ("sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
            "avx512vnni", "avx512bf16", "os_ymm", "os_zmm", "avx512vbmi", "avxvnni", "amx_tile",
            "amx_int8", "amx_bf16", "os_amx", "amx_permitted")
# our CPUID feature -> the /proc/cpuinfo flag Linux prints for it
CPUINFO_FLAG = {"sse2": "sse2", "avx": "avx", "avx2": "avx2", "fma": "fma", "f16c": "f16c",
                "avx512f": "avx512f", "avx512bw": "avx512bw", "avx512vl": "avx512vl",
                "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16",
                "avx512vbmi": "avx512vbmi", "avxvnni": "avx_vnni", "amx_tile": "amx_tile",
                "amx_int8": "amx_int8", "amx_bf16": "amx_bf16"}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _cpuinfo_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_probe_reports_every_feature_bit():
    f = K.cpu_features()
    for name in FEATURES:
        assert isinstance(f[name], bool), name
    assert set(FEATURES) <= set(f)


@pytest.mark.skipif(not (X86 and sys.platform == "linux"), reason="x86 Linux /proc/cpuinfo")
def test_probe_agrees_with_proc_cpuinfo():
    """Linux prints a flag when CPUID has it and (for AVX/AVX-512/AMX) the XSAVE state is on."""
    flags, f = _cpuinfo_flags(), K.cpu_features()
    assert flags, "no flags line"
    for ours, linux in CPUINFO_FLAG.items():
        assert f[ours] == (linux in flags), f"{ours}: probe {f[ours]}, /proc/cpuinfo {linux in flags}"
    assert f["sse2"], "negative control: an x86-64 CPU has SSE2"


def test_os_state_bits_are_consistent():
    f = K.cpu_features()
    assert not f["os_zmm"] or f["os_ymm"]
    assert not f["os_amx"] or f["amx_tile"]
    assert not f["amx_permitted"] or f["os_amx"]
    if f["avx512f"] and f["os_zmm"]:
        assert f["avx2"]


def test_isa_tree():
    """Every ISA's parent is an ISA listed before it, chains end at generic, a child needs at
    least its parent's features (inherited code must run wherever the child does), and
    "supported" means every needed feature is present."""
    f = K.cpu_features()
    isas = f["isas"]
    assert list(isas) == list(K.ISA_NAMES) and K.ISA_NAMES[0] == "generic"
    assert {"generic", "avx2", "avx512", "avx512bf16"} <= set(isas)
    assert isas["avx512bf16"]["parent"] == "avx512" and "avx512bf16" in isas["avx512bf16"]["needs"]
    for i, (name, info) in enumerate(isas.items()):
        if name == "generic":
            assert info["parent"] == "generic" and info["needs"] == [] and info["supported"]
            continue
        assert K.ISA_NAMES.index(info["parent"]) < i, name
        assert set(isas[info["parent"]]["needs"]) <= set(info["needs"]), name
        assert info["supported"] == all(f[n] for n in info["needs"]), name
    # supported_isas() lists them by preference rank (the list order means nothing beyond a
    # parent coming before its children): the last is the default
    assert K.supported_isas() == sorted((n for n, i in isas.items() if i["supported"]),
                                        key=lambda n: isas[n]["rank"])
    assert "avx512bw" in isas["avx512"]["needs"] and "os_zmm" in isas["avx512"]["needs"]


def test_best_isa_is_the_supported_one_of_highest_rank():
    """Preference is an explicit rank, not list order: ranks are distinct, a child ranks above
    its parent, avx512 above avx2 (an ISA added under avx2, e.g. AVX-VNNI, must rank below
    avx512), and the default is the supported ISA of highest rank."""
    f = K.cpu_features()
    isas = f["isas"]
    ranks = {n: i["rank"] for n, i in isas.items()}
    assert len(set(ranks.values())) == len(ranks), ranks
    for name, info in isas.items():
        if name != "generic":
            assert ranks[name] > ranks[info["parent"]], name
    assert ranks["generic"] < ranks["avx2"] < ranks["avx512"] < ranks["avx512bf16"]
    want = "generic" if f["simd_disabled"] else max(K.supported_isas(), key=ranks.__getitem__)
    assert f["best_isa"] == want


def _chain(isa):
    out = [isa]
    while out[-1] != "generic":
        out.append(K.cpu_features()["isas"][out[-1]]["parent"])
    return out


def test_every_slot_resolves_on_its_isa_chain():
    """For every family, slot and requested ISA the tables name a variant, and it is the ISA
    itself or one of its ancestors (never a sibling or a descendant)."""
    for isa in K.ISA_NAMES:
        table = K._variants_at(K.ISA_NAMES.index(isa))
        assert len(table) > 20
        for kernel, got in table.items():
            assert got in _chain(isa), f"{kernel} at {isa}: runs {got}, not on {_chain(isa)}"
    gen = K._variants_at(0)
    assert set(gen.values()) == {"generic"}


def test_documented_inheritance():
    v = K._variant
    for kernel in ("matmul", "rmsnorm", "layernorm_mod", "attention", "swiglu", "dequantize[F16]",
                   "dequantize[BF16]", "dequantize[Q8_0]", "swiglu_backward", "q8_0_quantize"):
        assert v(kernel, "avx2") == "avx2" and v(kernel, "avx512") == "avx512", kernel
    # no variant at a level: inherited from below
    assert v("rmsnorm_backward", "avx2") == "generic" and v("rmsnorm_backward", "avx512") == "avx512"
    assert v("qknorm_rope_backward", "avx512") == "generic"
    assert v("dequantize[F32]", "avx512") == "generic"  # a memcpy: no SIMD variant
    # the older name follows the slot that runs it
    for isa in K.ISA_NAMES:
        assert v("q8_0_matmul", isa) == v("matmul", isa)
    # avx512bf16 has no table of these families: everything inherits avx512's
    for kernel in ("matmul", "rmsnorm", "layernorm_mod", "attention", "dequantize[BF16]",
                   "attention_backward", "qknorm_rope_backward", "q8_0_quantize"):
        assert v(kernel, "avx512bf16") == v(kernel, "avx512"), kernel
    with pytest.raises(ValueError, match="unknown kernel"):
        v("no_such_kernel", "avx2")


def test_kernel_variants_is_the_table_at_the_default_isa():
    best = K.cpu_features()["best_isa"]
    assert K.kernel_variants() == K._variants_at(K.ISA_NAMES.index(best))
    assert {"dequantize[F32]", "dequantize[F16]", "dequantize[BF16]", "dequantize[Q8_0]", "matmul",
            "layernorm_mod"} <= set(K.kernel_variants())


def test_disable_simd_forces_generic_everywhere():
    code = "import nxhpc, json; print(json.dumps(nxhpc.kernel_variants()))"
    env = dict(os.environ, NXHPC_DISABLE_SIMD="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert set(eval(res.stdout).values()) == {"generic"}
    if len(ISAS) > 1:  # negative control: "0" means enabled
        env["NXHPC_DISABLE_SIMD"] = "0"
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True)
        assert eval(res.stdout)["matmul"] == K._variant("matmul", ISAS[-1]) != "generic"


def test_isa_argument_takes_names():
    import numpy as np
    x = np.ones((2, 32), np.float32)
    out = np.empty((2, 32), np.float32)
    for isa in ISAS:
        K.rmsnorm(x, np.ones(32, np.float32), out, 1e-6, isa=isa)
    for bad in ("AVX2", "sse4", 1, b"avx2"):
        with pytest.raises(ValueError, match="isa"):
            K.rmsnorm(x, np.ones(32, np.float32), out, 1e-6, isa=bad)
