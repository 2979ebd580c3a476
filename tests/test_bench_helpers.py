"""Helpers the benchmarks lean on: ``nxhpc.runtime.peak.variant_at`` (a requested ISA -> the code
that runs a kernel slot, so that a speed is set against that code's unit) checked against the
kernel table as a process capped at that ISA reads it (``NXHPC_MAX_ISA``) and the peak kinds'
ISAs; and bench_sdcpp's launcher, whose child's peak RSS must not start at its caller's."""
import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import nxhpc
from nxhpc.runtime import peak as P

ROOT = Path(__file__).resolve().parents[1]
K = nxhpc.kernels()
ISAS = K.supported_isas()
#: slot -> the precision of the code in it, as the benchmarks set it against a peak
SLOTS = {"attention": "f32", "attention_backward": "f32", "q8_0_matmul": "f32",
         "attention_bf16": "bf16", "matmul_q8": "q8"}


def _capped_table(isa: str) -> dict:
    """kernel_variants() of a fresh process whose default ISA is capped at ``isa``."""
    env = dict(os.environ, NXHPC_MAX_ISA=isa)
    env.pop("NXHPC_DISABLE_SIMD", None)
    code = "import json, nxhpc; print(json.dumps(nxhpc.kernel_variants()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(r.stdout)


@pytest.mark.parametrize("isa", ISAS)
def test_variant_at_is_the_capped_default(isa):
    table = _capped_table(isa)
    for slot, prec in SLOTS.items():
        v = P.variant_at(slot, isa)
        assert v == table[slot], (slot, isa)
        # the unit it is then set against is one of that code's ISA (K.peak_kinds' table; the
        # AVX2 bf16 code runs float32 FMAs, fma_ymm, an AVX2 kind too)
        kind = P.kind_for(prec, v)
        if v != "generic" and kind is not None:
            assert K.peak_kinds()[kind]["isa"] == v, (slot, isa, v, kind)


def test_variant_at_named_cases():
    if "avxvnni" in ISAS:
        # the reviewer's case: the float32 attention asked for at avxvnni is the AVX2 code,
        # bounded by fma_ymm, not by the fastest float32 unit
        assert P.variant_at("attention", "avxvnni") == "avx2"
        assert P.kind_for("f32", P.variant_at("attention", "avxvnni")) == "fma_ymm"
        assert P.variant_at("matmul_q8", "avxvnni") == "avxvnni"
    if "amx" in ISAS:
        assert P.variant_at("attention", "amx") == "avx512"
        assert P.variant_at("attention_bf16", "amx") == "amx"
    if "avx512bf16" in ISAS:
        # a dot label keeps its dot where the ISA runs its own code, loses it where it does not
        assert P.variant_at("attention_bf16", "avx512bf16:vdpbf16ps") == "avx512bf16:vdpbf16ps"
        assert P.kind_for("bf16", "avx512bf16:vdpbf16ps") == "bf16_zmm"
        assert P.variant_at("attention", "avx512bf16:fma") == "avx512"
    with pytest.raises(ValueError, match="unknown kernel"):
        P.variant_at("no_such_slot", "generic")
    with pytest.raises(ValueError, match="isa"):
        P.variant_at("attention", "sse9")


# ------------------------------------------------------------------ bench_sdcpp's launcher


@pytest.fixture(scope="module")
def sdcpp():
    """benchmarks/bench_sdcpp.py as a module (its imports need benchmarks/ on sys.path)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_sdcpp_under_test",
                                                      ROOT / "benchmarks" / "bench_sdcpp.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss inheritance is Linux's")
def test_launcher_child_peak_is_its_own(sdcpp):
    big = np.ones((400 << 20) // 8)                    # 400 MB touched in this process
    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert mine >= 400
    # control: a child started straight from here reports this process's peak (the defect)
    p = subprocess.Popen(["true"])
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)     # reaped here: Popen must not wait
    direct = ru.ru_maxrss / 1024
    assert direct >= 400
    out, rc, wall, rss = sdcpp._launch(["true"])
    assert (out, rc) == (None, 0) and 0 <= wall < 30
    assert 0 < rss < 50, rss                          # the do-nothing child's own few MB
    # the launcher reports the child's peak, not its own: a child that holds 200 MB
    code = "b = b'x' * (200 << 20)"
    out, rc, wall, rss = sdcpp._launch([sys.executable, "-c", code])
    assert rc == 0 and 200 <= rss < 350, rss
    del big


def test_launcher_streams_and_exit_codes(sdcpp):
    text, wall, rss, load = sdcpp._run(["sh", "-c", "echo out; echo err >&2"])
    assert text == "out\nerr\n" and wall >= 0 and rss > 0
    text, *_ = sdcpp._run(["sh", "-c", "echo out; echo err >&2"], merge=False)
    assert text == "out\n"
    text, *_ = sdcpp._run(["sh", "-c", 'echo "$X"'], env=dict(os.environ, X="seen"))
    assert text == "seen\n"
    assert sdcpp._launch(["sh", "-c", "exit 3"])[1] == 3
    assert sdcpp._launch(["sh", "-c", "kill -9 $$"])[1] == -9
    assert sdcpp._launch(["/nonexistent/tool"], stderr=subprocess.DEVNULL)[1] == 127
    with pytest.raises(AssertionError, match="failed"):
        sdcpp._run(["sh", "-c", "echo boom; exit 2"])
