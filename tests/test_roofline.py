"""Tests of nxhpc.dit.roofline: a block's work per timed stage, the unit that bounds each part,
and the limit arithmetic, plus ``blockrun --roofline`` end to end.

Oracles: the work is counted from the shapes of the matrices a real model's block multiplies
(2 T rows cols per projection, 2 x 2 T^2 hd per head for Q K^T and P V, the heads and head
width read off the weights, not the config); the limit is recomputed by hand from made-up peaks
and timings; the kinds are the instructions each kernel variant issues (nxhpc.runtime.peak's
table, docs/kernels.md). Negative control: a config one FFN column off does not match the
count. A stage measured faster than its unit's peak (``frac`` > 1) would be a miscount. No
speed is asserted.
"""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from nxhpc import _kernels as K
from nxhpc.dit.config import block_view
from nxhpc.dit.roofline import (block_limit_s, block_ops, machine_kinds, report_fields, roofline,
                                unit_kinds)
from nxhpc.models import open_model
from nxhpc.runtime import peak


def _count(w, T):
    """Operations of one block from its weight matrices' shapes (rows = outputs)."""
    mm = lambda a: 2 * T * a.shape[0] * a.shape[1]  # noqa: E731
    hd_total = w.out.shape[1]                 # attn [T, H*hd] @ Wout^T
    return {"us_prenorm_qkv": {"matmul": mm(w.qkv)}, "us_qknorm_rope": {},
            "us_sdpa": {"attention": 2 * (2 * T * T * hd_total)},
            "us_attn_tail": {"matmul": mm(w.out)},
            "us_ffn": {"matmul": mm(w.w1) + mm(w.w3) + mm(w.w2)}}


@pytest.mark.parametrize("T", [1, 37, 256])
def test_block_ops_count_the_weights_work(T):
    with open_model("tiny") as m:
        cfg, w = block_view(m.config), m.layer_weights(0)
        want = _count(w, T)
    assert block_ops(cfg, T) == want
    # negative control: a config whose FFN width is off by one column is caught
    off = dataclasses.replace(cfg, ffn_dim=cfg.ffn_dim + 1)
    assert block_ops(off, T) != want


def test_block_ops_gqa_and_validation():
    """Grouped-query attention: qkv is (H + 2 KVH) hd wide, the attention H hd."""
    with open_model("tiny") as m:
        cfg = block_view(m.config)
    g = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads // 2)
    T, H, KVH, hd, D = 50, g.n_heads, g.n_kv_heads, g.head_dim, g.dim
    ops = block_ops(g, T)
    assert ops["us_prenorm_qkv"]["matmul"] == 2 * T * D * (H + 2 * KVH) * hd
    assert ops["us_sdpa"]["attention"] == 4 * T * T * H * hd
    for bad in (0, -3, 2.0, True, None):
        with pytest.raises(ValueError, match="T must be"):
            block_ops(cfg, bad)


def test_roofline_arithmetic():
    ops = {"us_a": {"matmul": 4_000_000_000}, "us_b": {},
           "us_c": {"attention": 1_000_000_000, "matmul": 2_000_000_000}}
    rates = {"m": 1e11, "t": 5e10}
    tm = {"us_a": 40_000, "us_b": 5_000, "us_c": 100_000, "block_us": 150_000}
    r = roofline(tm, ops, {"matmul": "m", "attention": "t"}, rates.get, workers=2, layers=3)
    # us_a: 3 layers x 4e9 ops at 2 x 1e11 = 0.06 s over 0.04 s measured
    assert r["us_a"]["limit_s"] == pytest.approx(0.06)
    assert r["us_a"]["frac"] == pytest.approx(1.5)
    assert r["us_a"]["gops"] == pytest.approx(12e9 / 0.04 / 1e9)
    # us_c: 3e9 / 1e11 + 6e9 / 2e11 = 0.03 + 0.03
    assert r["us_c"]["limit_s"] == pytest.approx(0.06)
    assert "us_b" not in r                           # no work: no fraction
    assert r["limit_s"] == pytest.approx(0.12)
    assert r["x_limit"] == pytest.approx(0.15 / 0.12)
    # a part whose unit this CPU lacks leaves its stage's and the block's limit unknown
    r = roofline(tm, ops, {"matmul": "m", "attention": None}, rates.get, workers=2)
    assert r["us_c"]["limit_s"] is None and r["limit_s"] is None and r["x_limit"] is None
    assert r["us_a"]["limit_s"] == pytest.approx(0.02)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="workers"):
            roofline(tm, ops, {}, rates.get, workers=bad)


def test_block_limit_is_the_sum_over_stages():
    with open_model("tiny") as m:
        cfg, w = block_view(m.config), m.layer_weights(0)
    T, rates = 96, {"m": 3e11, "t": 7e10}
    want = sum(n / (rates["m" if p == "matmul" else "t"] * 2)
               for parts in _count(w, T).values() for p, n in parts.items())
    got = block_limit_s(cfg, T, {"matmul": "m", "attention": "t"}, rates.get, 2)
    assert got == pytest.approx(want)


VARIANTS = {  # a CPU's kernel variants -> (precision -> (matmul kind, attention kind))
    "amx": ({"matmul": "avx512", "matmul_bf16": "amx", "matmul_q8": "amx",
             "attention": "avx512", "attention_bf16": "amx"},
            {"f32": ("fma_zmm", "fma_zmm"), "bf16": ("amx_bf16", "amx_bf16"),
             "q8": ("amx_int8", "amx_bf16")}),
    "avx2": ({"matmul": "avx2", "matmul_bf16": "avx2", "matmul_q8": "avx2",
              "attention": "avx2", "attention_bf16": "avx2"},
             {"f32": ("fma_ymm", "fma_ymm"), "bf16": ("fma_ymm", "fma_ymm"),
              "q8": ("i8_ymm", "fma_ymm")}),
}


@pytest.mark.parametrize("cpu", sorted(VARIANTS))
def test_unit_kinds_name_the_instructions_each_variant_issues(cpu):
    variants, want = VARIANTS[cpu]
    needed = {k for pair in want.values() for k in pair}
    if not needed <= set(peak.supported()):
        pytest.skip(f"this CPU lacks {sorted(needed - set(peak.supported()))}")
    for prec, (mm, att) in want.items():
        assert unit_kinds(prec, variants) == {"matmul": mm, "attention": att}, prec


def test_unit_kinds_follow_the_bf16_attention_dot():
    if "bf16_zmm" not in peak.supported():
        pytest.skip("no AVX-512 BF16 here")
    v = {"matmul_bf16": "avx512bf16", "attention_bf16": "avx512bf16"}
    assert unit_kinds("bf16", v, attention_dot="fma")["attention"] == "fma_zmm"
    assert unit_kinds("bf16", v, attention_dot="vdpbf16ps")["attention"] == "bf16_zmm"
    # the process's own choice by default
    want = "fma_zmm" if K.attention_bf16_dot() == "fma" else "bf16_zmm"
    assert unit_kinds("q8", v)["attention"] == want
    with pytest.raises(ValueError, match="precision"):
        unit_kinds("fp8", v)


def test_machine_kinds_take_the_fastest_supported_unit():
    sup = peak.reachable()
    if not sup:
        assert machine_kinds(lambda k: 1.0) == {"matmul": None, "attention": None}
        return
    rates = {k: float(i + 1) for i, k in enumerate(sup)}   # the last supported kind fastest
    got = machine_kinds(rates.get)
    every = [k for ks in peak.PRECISION_KINDS.values() for k in ks if k in sup]
    assert got["matmul"] == max(every, key=rates.get)
    att = [k for k in peak.PRECISION_KINDS["bf16"] + peak.PRECISION_KINDS["f32"] if k in sup]
    assert got["attention"] == (max(att, key=rates.get) if att else None)
    # a kind the rate function does not know is never chosen
    assert machine_kinds(lambda k: None) == {"matmul": None, "attention": None}


def test_report_fields_put_the_parts_together():
    if not peak.supported():
        pytest.skip("no peak kind runs here (NXHPC_DISABLE_SIMD?)")
    with open_model("tiny") as m:
        cfg = block_view(m.config)
    T, rates = 64, {k: 1e11 * (i + 1) for i, k in enumerate(peak.supported())}
    ops = block_ops(cfg, T)
    tm = {k: 1000.0 for k in ops}
    tm["block_us"] = 5000.0
    f = report_fields(tm, cfg, T, "bf16", 2, rate=rates.get)
    own = unit_kinds("bf16")
    lim = block_limit_s(cfg, T, own, rates.get, 2)
    assert f["limit_us"] == round(lim * 1e6)
    assert f["x_limit"] == pytest.approx(5e-3 / lim)
    assert f["frac_sdpa"] == pytest.approx(ops["us_sdpa"]["attention"]
                                           / (rates[own["attention"]] * 2) / 1e-3)
    assert "frac_qknorm_rope" not in f
    assert f["x_machine_limit"] >= f["x_limit"]      # the machine's units are no slower


def test_blockrun_roofline_end_to_end():
    if not peak.supported():
        pytest.skip("no peak kind runs here (NXHPC_DISABLE_SIMD?)")
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "2", "--precision",
                        "bf16", "--roofline", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["unit_matmul"] in peak.supported()
    for stage in ("prenorm_qkv", "sdpa", "attn_tail", "ffn"):
        # no stage may beat the peak of its unit: a fraction above 1 is a miscount
        assert 0 < rep[f"frac_{stage}"] <= 1, (stage, rep[f"frac_{stage}"])
    assert rep["x_limit"] >= 1 and rep["x_machine_limit"] >= rep["x_limit"]
    assert rep["limit_us"] > 0 and rep[f"peak_gops_{rep['unit_matmul']}"] > 0
    # without the flag: no peaks measured, no fields
    r = subprocess.run([sys.executable, "-m", "nxhpc.blockrun", "tiny", "1", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "x_limit" not in json.loads(r.stdout)


_REACH = """
import json
import nxhpc
from nxhpc.runtime import peak
info = nxhpc.kernels().peak_kinds()
print(json.dumps({"reach": peak.reachable(), "sup": peak.supported(),
                  "isa": {k: info[k]["isa"] for k in info}}))
"""


@pytest.mark.parametrize("cap", [None, "avx2", "avx512bf16"])
def test_reachable_kinds_follow_the_isa_cap(cap):
    """``peak.reachable()`` (what machine_kinds picks from): the supported kinds of the default
    ISA and its ancestors, so under NXHPC_MAX_ISA the capped CPU's units. The reference is the
    ISA tree written out here (csrc/nx_dispatch.h's parents)."""
    ancestors = {"generic": {"generic"}, "avx2": {"generic", "avx2"},
                 "avxvnni": {"generic", "avx2", "avxvnni"},
                 "avx512": {"generic", "avx2", "avx512"},
                 "avx512bf16": {"generic", "avx2", "avx512", "avx512bf16"},
                 "amx": {"generic", "avx2", "avx512", "avx512bf16", "amx"}}
    env = {k: v for k, v in os.environ.items() if k not in ("NXHPC_MAX_ISA", "NXHPC_DISABLE_SIMD")}
    if cap:
        env["NXHPC_MAX_ISA"] = cap
    r = subprocess.run([sys.executable, "-c", _REACH], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    sup = got["sup"]
    isas = K.supported_isas()
    rank = {n: v["rank"] for n, v in K.cpu_features()["isas"].items()}
    best = max((i for i in isas if cap is None or rank[i] <= rank[cap]), key=rank.get)
    want = [k for k in sup if got["isa"][k] in ancestors[best]]
    assert got["reach"] == want
    if cap in ("avx2", "avx512bf16") and cap in isas:
        # negative control: the tiles (and, at avx2, every 512-bit unit) are out of reach
        assert not any(k.startswith("amx") for k in got["reach"])
        if cap == "avx2":
            assert set(got["reach"]) <= {"fma_ymm", "i8_ymm"}
