"""Tests of the block's non-matmul forward kernels in nxhpc._kernels: rmsnorm, qknorm_rope,
attention, swiglu, gated_residual, norm_residual (and the SIMD exp/tanh polynomials behind them).

Oracles: plain float64 numpy written in this file (sharing no code with the C), torch's
scaled_dot_product_attention, and the generic variant. Every tolerance is a bound derived from the
arithmetic (u = 2^-24, the float32 unit roundoff), written next to the check.
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernelutil import (assert_bitwise, assert_within, band_edges, bits, expected_variant,
                        ref_attention_gqa)
from nxhpc import _kernels as K

ISAS = K.supported_isas()
SIMD_ISAS = [i for i in ISAS if i != "generic"]
U = 2.0 ** -24                    # float32 unit roundoff
TINY = 2.0 ** -149 * 4            # absolute floor: a few subnormal ulps
SIZES = [1, 7, 31, 33, 4097]

rng_global = np.random.default_rng(1234)


def f32(*shape, rng=None, scale=1.0):
    rng = rng or rng_global
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ----------------------------------------------------------------------------- references (float64)

def ref_rmsnorm(x, w, eps, mod=None):
    x = x.astype(np.float64)
    inv = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + float(eps))
    out = x * inv * w.astype(np.float64)
    if mod is not None:
        out = out * mod.astype(np.float64)
    return out


def ref_qknorm_rope(qkv, q_w, k_w, pe, H, KVH, eps):
    """Returns (q [H,T,hd], k [KVH,T,hd], |terms| bound helper) in float64."""
    hd = qkv.shape[1] // (H + 2 * KVH)
    x = qkv.astype(np.float64)
    pe = pe.astype(np.float64)
    qs, ks, qa, ka = [], [], [], []
    for j in range(H + KVH):
        v = x[:, j * hd:(j + 1) * hd]
        w = (q_w if j < H else k_w).astype(np.float64)
        y = v / np.sqrt((v * v).mean(axis=1, keepdims=True) + float(eps)) * w
        y0, y1 = y[:, 0::2], y[:, 1::2]
        o = np.empty_like(y)
        a = np.empty_like(y)
        for r in (0, 1):
            o[:, r::2] = pe[:, :, r, 0] * y0 + pe[:, :, r, 1] * y1
            a[:, r::2] = np.abs(pe[:, :, r, 0] * y0) + np.abs(pe[:, :, r, 1] * y1)
        (qs if j < H else ks).append(o)
        (qa if j < H else ka).append(a)
    return np.stack(qs), np.stack(ks), np.stack(qa), np.stack(ka)


def ref_attention(q, k, qkv, KVH, scale, mask=None):
    """Returns (out [T, H*hd], bound [T, H*hd]) in float64: every query row over the keys of
    ``mask`` (all without one), the bound of :func:`kernelutil.ref_attention_gqa` over T terms.
    """
    T = q.shape[1]
    keys = np.ones(T, bool) if mask is None else mask.astype(bool)
    return ref_attention_gqa(q, k, qkv, KVH, scale, np.broadcast_to(keys, (T, T)), T)


def ref_silu(a):
    a = a.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        out = a / (1.0 + np.exp(-a))
    return np.where(a == -np.inf, 0.0, out)  # the limit x -> -inf


# ----------------------------------------------------------------------------- vector math hooks

def ulp_err(got, ref):
    r32 = np.abs(ref).astype(np.float32)
    return np.abs(got.astype(np.float64) - ref) / np.spacing(r32).astype(np.float64)


@pytest.mark.parametrize("isa", ISAS)
def test_exp_within_2ulp_over_float_range(isa):
    # every float32 in [-110, 90] at a stride, plus random points: normal results within 2 ulp,
    # subnormal results within 2 subnormal steps, overflow -> inf, underflow -> 0.
    x = np.concatenate([np.linspace(-110, 90, 400_001, dtype=np.float32),
                        f32(100_000, scale=30.0), np.float32([0, -0.0, 1e-30, -1e-30, 88.72, 88.73])])
    out = np.empty_like(x)
    K._vmath("exp", x, out, isa=isa)
    ref = np.exp(x.astype(np.float64))
    normal = (ref >= np.finfo(np.float32).tiny) & (ref <= np.finfo(np.float32).max)
    assert ulp_err(out[normal], ref[normal]).max() <= 2.0
    sub = ref < np.finfo(np.float32).tiny
    assert np.all(np.abs(out[sub] - ref[sub]) <= 2 * 2.0 ** -149)
    assert np.all(np.isposinf(out[ref > np.finfo(np.float32).max]))
    # negative control: the check would see a 1-ulp-scale perturbation of a normal result
    assert ulp_err(np.nextafter(out[normal][:1], np.float32(np.inf)) * np.float32(1 + 8 * U),
                   ref[normal][:1]).max() > 2.0


@pytest.mark.parametrize("isa", ISAS)
def test_exp_special_values(isa):
    x = np.float32([np.inf, -np.inf, np.nan, 1e30, -1e30, 0.0, -0.0])
    out = np.empty_like(x)
    K._vmath("exp", x, out, isa=isa)
    assert np.isposinf(out[0]) and out[1] == 0 and np.isnan(out[2])
    assert np.isposinf(out[3]) and out[4] == 0 and out[5] == 1 and out[6] == 1


@pytest.mark.parametrize("isa", ISAS)
def test_exp_without_underflow_has_the_bits_of_exp(isa):
    """The float32 attention's exp (nx_exp_nosub: results below 2^-125 as integers, so that no
    scaling step underflows) is exp bit for bit: every float32 of [-105, -86] (subnormal results
    and the two binades above them, ~2.5e6 values), a sweep of the clamped range, beyond it,
    and the special values."""
    band = np.arange(np.float32(-86.0).view(np.uint32), np.float32(-105.0).view(np.uint32) + 1,
                     dtype=np.uint32).view(np.float32)
    x = np.concatenate([band, np.linspace(-130, 100, 400_001, dtype=np.float32),
                        f32(100_000, scale=40.0),
                        np.float32([np.inf, -np.inf, np.nan, -1e30, 1e30, 0.0, -0.0])])
    a, b = np.empty_like(x), np.empty_like(x)
    K._vmath("exp", x, a, isa=isa)
    K._vmath("exp_nosub", x, b, isa=isa)
    assert_bitwise(b, a, f"exp_nosub vs exp [{isa}]")
    # not vacuous: the band's results are subnormal (and 2^-126 where they round up to it)
    tiny = np.finfo(np.float32).tiny
    assert ((a[:band.size] > 0) & (a[:band.size] < tiny)).sum() > 1_000_000
    assert (a[:band.size] == 0).sum() > 100_000 and (a[:band.size] >= tiny).sum() > 100_000


@pytest.mark.parametrize("isa", ISAS)
def test_tanh_within_3ulp_and_saturates(isa):
    # SIMD polynomial measured <= 1.2 ulp; glibc's tanhf (the generic variant) ~2.03 ulp.
    x = np.concatenate([np.linspace(-12, 12, 400_001, dtype=np.float32), f32(100_000, scale=3.0),
                        np.float32([1e-30, -1e-30, 1e-40, 0.624, 0.625, 0.626, 9.0, 9.1, 20, 1e30])])
    out = np.empty_like(x)
    K._vmath("tanh", x, out, isa=isa)
    ref = np.tanh(x.astype(np.float64))
    nz = np.abs(ref) >= np.finfo(np.float32).tiny
    assert ulp_err(out[nz], ref[nz]).max() <= 3.0
    sp = np.float32([np.inf, -np.inf, np.nan, 0.0, -0.0, 50.0, -50.0])
    o = np.empty_like(sp)
    K._vmath("tanh", sp, o, isa=isa)
    assert o[0] == 1 and o[1] == -1 and np.isnan(o[2]) and o[5] == 1 and o[6] == -1
    assert bits(o[3:4])[0] == 0 and bits(o[4:5])[0] == 0x80000000  # tanh(+-0) = +-0


# ----------------------------------------------------------------------------- rmsnorm

@given(T=st.integers(1, 9), D=st.sampled_from(SIZES + [3840]), use_mod=st.booleans(),
       eps=st.sampled_from([1e-5, 1e-6, 0.0, 0.5]), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([1e-3, 1.0, 300.0]))
def test_rmsnorm_vs_float64(T, D, use_mod, eps, seed, scale):
    rng = np.random.default_rng(seed)
    x, w = f32(T, D, rng=rng, scale=scale), f32(D, rng=rng)
    mod = (1 + f32(D, rng=rng)) if use_mod else None
    ref = ref_rmsnorm(x, w, eps, mod)
    # float64 sum of squares (error ~D*2^-53, negligible); then r rounded to float32 and
    # ((x*r)*w)*mod: at most 4 float32 roundings -> 5u relative per element.
    bound = 5 * U * np.abs(ref) + TINY
    outs = {}
    for isa in ISAS:
        out = np.full((T, D), np.nan, np.float32)
        K.rmsnorm(x, w, out, eps, mod=mod, isa=isa)
        assert_within(out, ref, bound, f"rmsnorm[{isa}]")
        outs[isa] = out
    for isa in SIMD_ISAS:  # promised: identical arithmetic order in every variant
        assert_bitwise(outs[isa], outs["generic"], f"rmsnorm {isa} vs generic")


@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm_band_invariance_and_untouched(isa):
    T, D = 37, 33
    x, w, mod = f32(T, D), f32(D), f32(D)
    full = np.zeros((T, D), np.float32)
    K.rmsnorm(x, w, full, 1e-6, mod=mod, isa=isa)
    rng = np.random.default_rng(5)
    for _ in range(5):
        edges = band_edges(rng, T, 6)
        out = np.full((T, D), 7.0, np.float32)
        for a, b in zip(edges[:-1], edges[1:]):
            K.rmsnorm(x, w, out, 1e-6, mod=mod, r0=a, r1=b, isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
    out = np.full((T, D), 7.0, np.float32)
    K.rmsnorm(x, w, out, 1e-6, mod=mod, r0=10, r1=20, isa=isa)
    assert np.all(out[:10] == 7.0) and np.all(out[20:] == 7.0)
    assert_bitwise(out[10:20], full[10:20])
    # in place (out is x)
    y = x.copy()
    K.rmsnorm(y, w, y, 1e-6, mod=mod, isa=isa)
    assert_bitwise(y, full, "in place")


# ----------------------------------------------------------------------------- qknorm + rope

def make_pe(T, hd, rng):
    ang = rng.uniform(-50, 50, size=(T, hd // 2))
    c, s = np.cos(ang), np.sin(ang)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


@given(T=st.sampled_from([1, 7, 31, 33]), heads=st.sampled_from([(1, 1), (3, 3), (6, 2), (4, 1)]),
       hd=st.sampled_from([2, 8, 30, 34, 64, 96, 128]), eps=st.sampled_from([1e-5, 1e-6]),
       seed=st.integers(0, 2**31 - 1), generic_pe=st.booleans())
def test_qknorm_rope_vs_float64(T, heads, hd, eps, seed, generic_pe):
    H, KVH = heads
    rng = np.random.default_rng(seed)
    qkv = f32(T, (H + 2 * KVH) * hd, rng=rng, scale=3.0)
    q_w, k_w = f32(hd, rng=rng), f32(hd, rng=rng)
    # pe: real rotations, or arbitrary 2x2 matrices (the kernel must not assume rotation structure)
    pe = f32(T, hd // 2, 2, 2, rng=rng) if generic_pe else make_pe(T, hd, rng)
    rq, rk, aq, ak = ref_qknorm_rope(qkv, q_w, k_w, pe, H, KVH, eps)
    # y = ((x*r)*w): r and two products -> 3u on each y; rope pe0*y0 + pe1*y1: two products and a
    # sum -> error <= (3u + 2u) * (|pe0 y0| + |pe1 y1|) (cancellation-safe form); 6u for margin.
    outs = {}
    for isa in ISAS:
        qo = np.full((H, T, hd), np.nan, np.float32)
        ko = np.full((KVH, T, hd), np.nan, np.float32)
        K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, eps, isa=isa)
        assert_within(qo, rq, 6 * U * aq + TINY, f"q[{isa}]")
        assert_within(ko, rk, 6 * U * ak + TINY, f"k[{isa}]")
        outs[isa] = (qo, ko)
    for isa in SIMD_ISAS:
        assert_bitwise(outs[isa][0], outs["generic"][0], f"q {isa} vs generic")
        assert_bitwise(outs[isa][1], outs["generic"][1], f"k {isa} vs generic")


def test_qknorm_rope_zimage_heads():
    T, H, hd = 5, 30, 128
    qkv = f32(T, 3 * H * hd, scale=2.0)
    q_w, k_w, pe = f32(hd), f32(hd), make_pe(T, hd, np.random.default_rng(3))
    rq, rk, aq, ak = ref_qknorm_rope(qkv, q_w, k_w, pe, H, H, 1e-6)
    for isa in ISAS:
        qo, ko = np.empty((H, T, hd), np.float32), np.empty((H, T, hd), np.float32)
        K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, H, 1e-6, isa=isa)
        assert_within(qo, rq, 6 * U * aq + TINY)
        assert_within(ko, rk, 6 * U * ak + TINY)


@pytest.mark.parametrize("isa", ISAS)
def test_qknorm_rope_band_invariance_and_untouched(isa):
    T, H, KVH, hd = 37, 6, 2, 34           # T: the SIMD loops' token blocks (16) and a tail
    qkv = f32(T, (H + 2 * KVH) * hd)
    q_w, k_w, pe = f32(hd), f32(hd), make_pe(T, hd, np.random.default_rng(0))
    fq, fk = np.zeros((H, T, hd), np.float32), np.zeros((KVH, T, hd), np.float32)
    K.qknorm_rope(qkv, q_w, k_w, pe, fq, fk, H, KVH, 1e-6, isa=isa)
    rng = np.random.default_rng(9)
    for _ in range(5):
        edges = band_edges(rng, H + KVH, 5)
        qo, ko = np.full_like(fq, 7.0), np.full_like(fk, 7.0)
        for a, b in zip(edges[:-1], edges[1:]):
            K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, 1e-6, h0=a, h1=b, isa=isa)
        assert_bitwise(qo, fq, f"q bands {edges}")
        assert_bitwise(ko, fk, f"k bands {edges}")
    qo, ko = np.full_like(fq, 7.0), np.full_like(fk, 7.0)
    K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, 1e-6, h0=4, h1=7, isa=isa)  # q 4,5 + k 0
    assert np.all(qo[:4] == 7.0) and np.all(ko[1:] == 7.0)
    assert_bitwise(qo[4:], fq[4:])
    assert_bitwise(ko[:1], fk[:1])


# ----------------------------------------------------------------------------- attention

def attn_inputs(T, H, KVH, hd, rng, scale=1.0):
    q = f32(H, T, hd, rng=rng, scale=scale)
    k = f32(KVH, T, hd, rng=rng, scale=scale)
    qkv = f32(T, (H + 2 * KVH) * hd, rng=rng)
    return q, k, qkv


@given(T=st.sampled_from([1, 2, 7, 31, 33, 65, 100]),
       heads=st.sampled_from([(1, 1), (2, 2), (6, 2), (4, 1), (3, 3)]),
       hd=st.sampled_from([1, 8, 16, 30, 64, 96, 128]), seed=st.integers(0, 2**31 - 1),
       mask_kind=st.sampled_from(["none", "random", "sparse", "all"]),
       qscale=st.sampled_from([0.3, 1.0, 3.0]))
def test_attention_vs_float64(T, heads, hd, seed, mask_kind, qscale):
    H, KVH = heads
    rng = np.random.default_rng(seed)
    q, k, qkv = attn_inputs(T, H, KVH, hd, rng, qscale)
    mask = {"none": None, "random": rng.random(T) < 0.6, "sparse": rng.random(T) < 0.1,
            "all": np.ones(T, bool)}[mask_kind]
    scale = 1.0 / math.sqrt(hd)
    ref, bound = ref_attention(q, k, qkv, KVH, scale, mask)
    outs = {}
    for isa in ISAS:
        out = np.full((T, H * hd), np.nan, np.float32)
        K.attention(q, k, qkv, out, KVH, scale, mask=mask, isa=isa)
        assert_within(out, ref, bound, f"attention[{isa}]")
        outs[isa] = out
    for isa in SIMD_ISAS:  # both within `bound` of the truth -> within 2*bound of each other
        assert_within(outs[isa], outs["generic"].astype(np.float64), 2 * bound, f"{isa} vs generic")


def test_attention_subnormal_weights_reach_the_output():
    """A row whose weights but one are subnormal (scores 88 to 103 below the maximum), where the
    dominant key's value is 0 in column 0: that column's output is the sum of the subnormal
    weights' contributions alone. The SIMD kernels skip a subnormal weight's FMA only where it
    cannot change the accumulator (|p v| below half its spacing); here the accumulator starts
    at 0, so skipping would give 0. Every column within the float64 bound, at every ISA."""
    T, hd, A = 64, 16, 10.0
    q = np.zeros((1, T, hd), np.float32)
    q[0, :, 0] = A
    k = np.zeros((1, T, hd), np.float32)
    k[0, :, 0] = A - np.concatenate([[0.0], np.linspace(8.8, 10.3, T - 1)]).astype(np.float32)
    qkv = np.ones((T, 3 * hd), np.float32)
    qkv[0, 2 * hd] = 0.0                       # the dominant key's value, column 0
    ref, bound = ref_attention(q, k, qkv, 1, 1.0)
    y = (q[0, 0].astype(np.float64) @ k[0].T.astype(np.float64)) - A * A
    w = np.exp(y[1:]).astype(np.float32)       # the weights as float32 values: subnormal
    assert ((w > 0) & (w < np.finfo(np.float32).tiny)).all()
    assert (bound[:, 0] < 0.01 * np.abs(ref[:, 0])).all()   # a zeroed column would fail
    for isa in ISAS:
        out = np.full((T, hd), np.nan, np.float32)
        K.attention(q, k, qkv, out, 1, 1.0, isa=isa)
        assert_within(out, ref, bound, f"attention[{isa}]")
        assert (out[:, 0] > 0).all()


def test_attention_zimage_heads_small_T():
    T, H, hd = 20, 30, 128
    rng = np.random.default_rng(7)
    q, k, qkv = attn_inputs(T, H, H, hd, rng)
    ref, bound = ref_attention(q, k, qkv, H, hd ** -0.5)
    for isa in ISAS:
        out = np.empty((T, H * hd), np.float32)
        K.attention(q, k, qkv, out, H, hd ** -0.5, isa=isa)
        assert_within(out, ref, bound, isa)


def test_attention_vs_torch_sdpa():
    torch = pytest.importorskip("torch")
    T, H, KVH, hd = 77, 6, 2, 64
    rng = np.random.default_rng(11)
    q, k, qkv = attn_inputs(T, H, KVH, hd, rng, 2.0)
    mask = rng.random(T) < 0.7
    v = qkv[:, (H + KVH) * hd:].reshape(T, KVH, hd).transpose(1, 0, 2)
    rep = H // KVH
    tq = torch.from_numpy(q)[None]
    tk = torch.from_numpy(np.repeat(k, rep, axis=0))[None]
    tv = torch.from_numpy(np.ascontiguousarray(np.repeat(v, rep, axis=0)))[None]
    tm = torch.from_numpy(mask)[None, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm,
                                                           scale=hd ** -0.5)
    ref = ref[0].permute(1, 0, 2).reshape(T, H * hd).numpy().astype(np.float64)
    # torch is itself a float32 evaluation: allow our bound plus torch's (same form) -> 2x.
    _, bound = ref_attention(q, k, qkv, KVH, hd ** -0.5, mask)
    for isa in ISAS:
        out = np.empty((T, H * hd), np.float32)
        K.attention(q, k, qkv, out, KVH, hd ** -0.5, mask=mask, isa=isa)
        assert_within(out, ref, 2 * bound, f"{isa} vs torch sdpa")


@pytest.mark.parametrize("isa", ISAS)
def test_attention_masks(isa):
    T, H, KVH, hd = 70, 4, 2, 32
    rng = np.random.default_rng(2)
    q, k, qkv = attn_inputs(T, H, KVH, hd, rng)
    sc = hd ** -0.5
    run = lambda m, qkv_=qkv, k_=k: K.attention(q, k_, qkv_, np.empty((T, H * hd), np.float32),
                                                KVH, sc, mask=m, isa=isa)
    base = run(None)
    # a mask masking nothing == no mask, bit for bit (bool and uint8, any nonzero value)
    assert_bitwise(run(np.ones(T, bool)), base, "all-true mask")
    assert_bitwise(run(np.full(T, 3, np.uint8)), base, "uint8 nonzero mask")
    # every key masked -> zeros (documented), for every query row
    z = run(np.zeros(T, bool))
    assert np.all(bits(z) == 0)
    # masked keys are excluded: changing their k and v must not change a bit
    mask = rng.random(T) < 0.5
    mask[0] = True
    a = run(mask)
    k2, qkv2 = k.copy(), qkv.copy()
    k2[:, ~mask] = f32(KVH, int((~mask).sum()), hd, rng=rng)
    qkv2[~mask, (H + KVH) * hd:] = 1e3
    assert_bitwise(run(mask, qkv2, k2), a, "masked keys changed")
    # negative control: the same change on an attended key does change the output
    qkv3 = qkv.copy()
    qkv3[0, (H + KVH) * hd:] = 1e3
    assert not np.array_equal(run(mask, qkv3), a)
    # uint8 mask == bool mask
    assert_bitwise(run(mask.astype(np.uint8)), a, "uint8 vs bool")


@pytest.mark.parametrize("isa", ISAS)
def test_attention_row_invariance(isa):
    # The same query vector placed at rows that fall in different micro-blocks / tails must give
    # bit-identical outputs (rows never interact inside the kernel).
    T, H, KVH, hd = 101, 2, 1, 40
    rng = np.random.default_rng(4)
    q, k, qkv = attn_inputs(T, H, KVH, hd, rng)
    rows = [0, 5, 6, 47, 48, 53, 96, 100]
    q[:, rows] = q[:, 3:4]
    out = np.empty((T, H * hd), np.float32)
    K.attention(q, k, qkv, out, KVH, hd ** -0.5, isa=isa)
    for r in rows:
        assert_bitwise(out[r], out[3], f"row {r}")
    assert not np.array_equal(out[1], out[3])  # negative control


@pytest.mark.parametrize("isa", ISAS)
def test_attention_band_invariance_and_untouched(isa):
    T, H, KVH, hd = 45, 6, 3, 24
    rng = np.random.default_rng(8)
    q, k, qkv = attn_inputs(T, H, KVH, hd, rng)
    mask = rng.random(T) < 0.8
    full = np.zeros((T, H * hd), np.float32)
    K.attention(q, k, qkv, full, KVH, 0.2, mask=mask, isa=isa)
    for _ in range(5):
        edges = band_edges(rng, H, 4)
        out = np.full_like(full, 7.0)
        for a, b in zip(edges[:-1], edges[1:]):
            K.attention(q, k, qkv, out, KVH, 0.2, mask=mask, h0=a, h1=b, isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
    out = np.full_like(full, 7.0)
    K.attention(q, k, qkv, out, KVH, 0.2, mask=mask, h0=1, h1=3, isa=isa)
    assert np.all(out[:, :hd] == 7.0) and np.all(out[:, 3 * hd:] == 7.0)
    assert_bitwise(out[:, hd:3 * hd], full[:, hd:3 * hd])


# ----------------------------------------------------------------------------- swiglu

@given(shape=st.sampled_from([(1,), (7,), (31,), (33,), (4097,), (3, 33), (2, 3, 17)]),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([0.5, 5.0, 60.0]))
def test_swiglu_vs_float64(shape, seed, scale):
    rng = np.random.default_rng(seed)
    a, b = f32(*shape, rng=rng, scale=scale), f32(*shape, rng=rng)
    ref = ref_silu(a) * b.astype(np.float64)
    # silu: e = exp(-|x|) within 2 ulp, x*e, 1+e, the division (and their propagation, each
    # <= 1 since e/(1+e) < 1): <= 6u; times b: +1u -> 8u relative per element. Below x = -87.3
    # e is subnormal (absolute error <= 2^-149 * 2 ulp), which x*e scales: + |x| 2^-148 |b|.
    bound = 8 * U * np.abs(ref) + np.abs(a.astype(np.float64) * b) * 2.0 ** -148 + TINY
    for isa in ISAS:
        out = np.full(shape, np.nan, np.float32)
        K.swiglu(a, b, out, isa=isa)
        assert_within(out, ref, bound, f"swiglu[{isa}]")


@pytest.mark.parametrize("isa", ISAS)
def test_silu_range_and_special_values(isa):
    a = np.concatenate([np.linspace(-120, 120, 200_001, dtype=np.float32),
                        np.float32([np.inf, -np.inf, 1e30, -1e30, 0.0, -0.0, 1e-40])])
    one = np.ones_like(a)
    out = np.empty_like(a)
    K.swiglu(a, one, out, isa=isa)
    ref = ref_silu(a)
    a64 = np.where(np.isfinite(a), a, 0).astype(np.float64)
    assert_within(out, ref, 8 * U * np.abs(ref) + np.abs(a64) * 2.0 ** -148 + TINY, "silu")
    assert np.isposinf(out[-7]) and out[-6] == 0 and out[-5] == 1e30 and out[-4] == 0
    nan = np.float32([np.nan, 1.0])
    o = np.empty_like(nan)
    K.swiglu(nan, np.ones_like(nan), o, isa=isa)
    assert np.isnan(o[0]) and not np.isnan(o[1])


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_band_invariance_and_untouched(isa):
    a, b = f32(4, 1025, scale=4.0), f32(4, 1025)
    full = np.zeros_like(a)
    K.swiglu(a, b, full, isa=isa)
    n = a.size
    rng = np.random.default_rng(1)
    for _ in range(5):
        edges = band_edges(rng, n, 8)
        out = np.full_like(a, 7.0)
        for lo, hi in zip(edges[:-1], edges[1:]):
            K.swiglu(a, b, out, i0=lo, i1=hi, isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
    out = np.full_like(a, 7.0)
    K.swiglu(a, b, out, i0=3, i1=2000, isa=isa)
    flat = out.reshape(-1)
    assert np.all(flat[:3] == 7.0) and np.all(flat[2000:] == 7.0)
    assert_bitwise(flat[3:2000], full.reshape(-1)[3:2000])
    c = a.copy()
    K.swiglu(c, b, c, isa=isa)  # out is a
    assert_bitwise(c, full, "in place")


# ----------------------------------------------------------------------------- gated residual

@given(T=st.integers(1, 6), D=st.sampled_from(SIZES + [3840]), seed=st.integers(0, 2**31 - 1),
       gscale=st.sampled_from([0.1, 1.0, 20.0]))
def test_gated_residual_vs_float64(T, D, seed, gscale):
    rng = np.random.default_rng(seed)
    resid, y, gate = f32(T, D, rng=rng), f32(T, D, rng=rng), f32(D, rng=rng, scale=gscale)
    tg = np.tanh(gate.astype(np.float64))
    ref = resid.astype(np.float64) + tg * y.astype(np.float64)
    # tanh within 3 ulp (6u), the product 1u (or an FMA), the sum 1u of the result:
    # |err| <= 7u |tanh(g) y| + 1u |out|, doubled for margin.
    bound = 2 * (7 * U * np.abs(tg * y) + U * np.abs(ref)) + TINY
    for isa in ISAS:
        out = np.full((T, D), np.nan, np.float32)
        K.gated_residual(resid, y, gate, out, isa=isa)
        assert_within(out, ref, bound, f"gated_residual[{isa}]")


@pytest.mark.parametrize("isa", ISAS)
def test_gated_residual_band_invariance_alias_untouched(isa):
    T, D = 23, 31
    resid, y, gate = f32(T, D), f32(T, D), f32(D)
    full = np.zeros((T, D), np.float32)
    K.gated_residual(resid, y, gate, full, isa=isa)
    rng = np.random.default_rng(3)
    for _ in range(5):
        edges = band_edges(rng, T, 5)
        out = np.full((T, D), 7.0, np.float32)
        for a, b in zip(edges[:-1], edges[1:]):
            K.gated_residual(resid, y, gate, out, r0=a, r1=b, isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
    out = np.full((T, D), 7.0, np.float32)
    K.gated_residual(resid, y, gate, out, r0=4, r1=9, isa=isa)
    assert np.all(out[:4] == 7.0) and np.all(out[9:] == 7.0)
    assert_bitwise(out[4:9], full[4:9])
    r2 = resid.copy()
    K.gated_residual(r2, y, gate, r2, isa=isa)  # out aliases resid (documented)
    assert_bitwise(r2, full, "aliasing resid")


# ----------------------------------------------------------------------------- norm + residual

def _composed(y, w, resid, gate, eps, w2, mod2, isa, r0=0, r1=None):
    """norm_residual's promise: rmsnorm into a float32 buffer, gated_residual, rmsnorm again."""
    T, D = y.shape
    r1 = T if r1 is None else r1
    tmp = np.zeros((T, D), np.float32)
    out = np.zeros((T, D), np.float32)
    K.rmsnorm(y, w, tmp, eps, r0=r0, r1=r1, isa=isa)
    K.gated_residual(resid, tmp, gate, out, r0=r0, r1=r1, isa=isa)
    h = None
    if w2 is not None:
        h = np.zeros((T, D), np.float32)
        K.rmsnorm(out, w2, h, eps, mod=mod2, r0=r0, r1=r1, isa=isa)
    return out, h


@given(T=st.integers(1, 5), D=st.sampled_from(SIZES + [3840]), seed=st.integers(0, 2**31 - 1),
       second=st.sampled_from(["none", "norm", "norm+mod"]), yscale=st.sampled_from([1e-3, 1.0, 30.0]))
def test_norm_residual_vs_float64_and_the_composition(T, D, seed, second, yscale):
    rng = np.random.default_rng(seed)
    y, resid = f32(T, D, rng=rng, scale=yscale), f32(T, D, rng=rng)
    w, gate, w2 = f32(D, rng=rng), f32(D, rng=rng), f32(D, rng=rng)
    mod2 = (1 + f32(D, rng=rng)) if second == "norm+mod" else None
    if second == "none":
        w2 = None
    eps = 1e-6
    n = ref_rmsnorm(y, w, eps)                      # float64 throughout
    tg = np.tanh(gate.astype(np.float64))
    ref = resid.astype(np.float64) + tg * n
    # the norm: 5u relative per element (test_rmsnorm_vs_float64), tanh 3 ulp (6u), the product
    # 1u, the sum 1u of the result: |err| <= (5 + 7)u |tanh(g) n| + 1u |out|, doubled for margin
    bound = 2 * (12 * U * np.abs(tg * n) + U * np.abs(ref)) + TINY
    y0, r0_ = y.copy(), resid.copy()
    for isa in ISAS:
        out = np.full((T, D), np.nan, np.float32)
        h = np.full((T, D), np.nan, np.float32) if w2 is not None else None
        K.norm_residual(y, w, resid, gate, out, eps, w2=w2, mod2=mod2, h=h, isa=isa)
        assert_within(out, ref, bound, f"norm_residual[{isa}] out")
        c_out, c_h = _composed(y, w, resid, gate, eps, w2, mod2, isa)
        assert_bitwise(out, c_out, f"norm_residual[{isa}] out vs rmsnorm + gated_residual")
        if w2 is not None:
            # h against the float64 norm of the float32 out it read: rmsnorm's own bound
            href = ref_rmsnorm(out, w2, eps, mod2)
            assert_within(h, href, 5 * U * np.abs(href) + TINY, f"norm_residual[{isa}] h")
            assert_bitwise(h, c_h, f"norm_residual[{isa}] h vs rmsnorm")
        assert_bitwise(y, y0, "y is read only")
        assert_bitwise(resid, r0_, "resid is read only")


def test_norm_residual_composition_check_can_fail():
    """Negative controls: the composition the kernel is compared with tells the norms' weights
    apart and sees the mod, so agreeing with it says something."""
    T, D = 4, 100
    rng = np.random.default_rng(11)
    y, resid = f32(T, D, rng=rng), f32(T, D, rng=rng)
    w, gate, w2, mod2 = f32(D, rng=rng), f32(D, rng=rng), f32(D, rng=rng), 1 + f32(D, rng=rng)
    out, h = np.zeros((T, D), np.float32), np.zeros((T, D), np.float32)
    K.norm_residual(y, w, resid, gate, out, 1e-6, w2=w2, mod2=mod2, h=h)
    swapped, _ = _composed(y, w2, resid, gate, 1e-6, None, None, None)
    assert not np.array_equal(bits(out), bits(swapped))
    _, no_mod = _composed(y, w, resid, gate, 1e-6, w2, None, None)
    assert not np.array_equal(bits(h), bits(no_mod))


@pytest.mark.parametrize("isa", ISAS)
def test_norm_residual_bands_aliases_untouched(isa):
    T, D = 23, 37
    rng = np.random.default_rng(4)
    y, resid, w, gate, w2, mod2 = (f32(T, D, rng=rng), f32(T, D, rng=rng), f32(D, rng=rng),
                                   f32(D, rng=rng), f32(D, rng=rng), f32(D, rng=rng))
    full, hfull = np.zeros((T, D), np.float32), np.zeros((T, D), np.float32)
    K.norm_residual(y, w, resid, gate, full, 1e-6, w2=w2, mod2=mod2, h=hfull, isa=isa)
    for _ in range(5):
        edges = band_edges(rng, T, 5)
        out, h = np.full((T, D), 7.0, np.float32), np.full((T, D), 7.0, np.float32)
        for a, b in zip(edges[:-1], edges[1:]):
            K.norm_residual(y, w, resid, gate, out, 1e-6, w2=w2, mod2=mod2, h=h, r0=a, r1=b,
                            isa=isa)
        assert_bitwise(out, full, f"bands {edges}")
        assert_bitwise(h, hfull, f"bands {edges} (h)")
    out, h = np.full((T, D), 7.0, np.float32), np.full((T, D), 7.0, np.float32)
    K.norm_residual(y, w, resid, gate, out, 1e-6, w2=w2, mod2=mod2, h=h, r0=4, r1=9, isa=isa)
    for a in (out, h):
        assert np.all(a[:4] == 7.0) and np.all(a[9:] == 7.0)
    assert_bitwise(out[4:9], full[4:9])
    for alias in ("resid", "y"):                  # out may be either input (documented)
        r2, y2 = resid.copy(), y.copy()
        o = r2 if alias == "resid" else y2
        h2 = np.zeros((T, D), np.float32)
        K.norm_residual(y2, w, r2, gate, o, 1e-6, w2=w2, mod2=mod2, h=h2, isa=isa)
        assert_bitwise(o, full, f"out is {alias}")
        assert_bitwise(h2, hfull, f"out is {alias} (h)")


def test_norm_residual_refuses_bad_pairs_and_overlaps():
    T, D = 3, 8
    y, resid, w, gate = f32(T, D), f32(T, D), f32(D), f32(D)
    out, h = np.zeros((T, D), np.float32), np.zeros((T, D), np.float32)
    with pytest.raises(ValueError, match="w2 and h go together"):
        K.norm_residual(y, w, resid, gate, out, 1e-6, w2=f32(D))
    with pytest.raises(ValueError, match="w2 and h go together"):
        K.norm_residual(y, w, resid, gate, out, 1e-6, h=h)
    with pytest.raises(ValueError, match="mod2 multiplies the second norm"):
        K.norm_residual(y, w, resid, gate, out, 1e-6, mod2=f32(D))
    with pytest.raises(ValueError, match="h overlaps out"):
        K.norm_residual(y, w, resid, gate, out, 1e-6, w2=f32(D), h=out)
    with pytest.raises(ValueError, match="h overlaps resid"):
        K.norm_residual(y, w, resid, gate, out, 1e-6, w2=f32(D), h=resid)
    with pytest.raises(ValueError, match="out overlaps gate"):
        big = f32(T + 1, D)
        K.norm_residual(y, w, resid, big[1], big[1:], 1e-6)  # gate is a row of out
    assert np.all(out == 0) and np.all(h == 0)


# ----------------------------------------------------------------------------- variants + bad input

def test_variants_registered():
    kv = K.kernel_variants()
    best = K.cpu_features()["best_isa"]
    for fam in ("rmsnorm", "qknorm_rope", "attention", "swiglu", "gated_residual",
                "norm_residual"):
        # every family has avx2 and avx512 variants: the best ISA's, or what it inherits
        assert kv[fam] == expected_variant({"avx2", "avx512"}, best), (fam, kv[fam], best)


def _noncontig(shape):
    big = np.zeros(shape[:-1] + (shape[-1] * 2,), np.float32)
    return big[..., ::2]


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _cases():
    """(name, fn, valid kwargs, list of (arg, bad value, expected exception))."""
    T, D, H, KVH, hd = 5, 8, 4, 2, 8
    W = (H + 2 * KVH) * hd
    rms = dict(x=f32(T, D), w=f32(D), out=np.zeros((T, D), np.float32), eps=1e-6, mod=f32(D))
    rms_bad = [("x", f32(T, D).astype(np.float64), TypeError), ("x", [[1.0] * D] * T, TypeError),
               ("x", None, TypeError), ("x", f32(D), ValueError), ("x", _noncontig((T, D)), ValueError),
               ("x", f32(T, 0), ValueError),
               ("w", f32(D + 1), ValueError), ("w", f32(D).astype(np.float16), TypeError),
               ("mod", f32(D - 1), ValueError), ("mod", [1.0] * D, TypeError),
               ("out", np.zeros((T, D + 1), np.float32), ValueError),
               ("out", _readonly(np.zeros((T, D), np.float32)), ValueError),
               ("out", np.zeros((T, D), np.float64), TypeError), ("out", _noncontig((T, D)), ValueError),
               ("eps", -1.0, ValueError), ("eps", float("nan"), ValueError), ("eps", "1e-6", TypeError),
               ("eps", None, TypeError), ("r0", -1, ValueError), ("r1", T + 1, ValueError),
               ("r0", 4, ValueError, dict(r1=3)), ("r0", "a", TypeError), ("isa", "sse9", ValueError),
               ("isa", 3, ValueError),
               # finite as a double, inf in float32 (the kernels' type); an int beyond a double
               ("eps", 1e39, ValueError), ("eps", np.float64(3.5e38), ValueError),
               ("eps", 2 ** 1024, ValueError),
               # a bool is not a band bound (True would be row 1)
               ("r0", True, TypeError), ("r1", np.bool_(True), TypeError)]
    qk = dict(qkv=f32(T, W), q_w=f32(hd), k_w=f32(hd), pe=f32(T, hd // 2, 2, 2),
              q_out=np.zeros((H, T, hd), np.float32), k_out=np.zeros((KVH, T, hd), np.float32),
              n_heads=H, n_kv_heads=KVH, eps=1e-6)
    qk_bad = [("qkv", f32(T, W + 1), ValueError), ("qkv", f32(T, W).astype(np.float64), TypeError),
              ("qkv", _noncontig((T, W)), ValueError), ("qkv", f32(T, (H + 2 * KVH) * 7), ValueError),
              ("n_heads", 3, ValueError), ("n_heads", 0, ValueError), ("n_heads", True, TypeError),
              ("n_heads", 4.0, TypeError), ("n_kv_heads", 3, ValueError), ("n_kv_heads", None, TypeError),
              ("q_w", f32(hd + 2), ValueError), ("k_w", None, TypeError),
              ("pe", f32(T, hd // 2, 2), ValueError), ("pe", f32(T + 1, hd // 2, 2, 2), ValueError),
              ("pe", f32(T, hd, 2, 2), ValueError),
              ("q_out", np.zeros((H, T, hd + 1), np.float32), ValueError),
              ("q_out", _readonly(np.zeros((H, T, hd), np.float32)), ValueError),
              ("k_out", np.zeros((H, T, hd), np.float32), ValueError),
              ("k_out", np.zeros((KVH, T, hd), np.float64), TypeError),
              ("h1", H + KVH + 1, ValueError), ("h0", -2, ValueError), ("eps", float("inf"), ValueError),
              ("n_kv_heads", 2 ** 63, ValueError), ("n_heads", 2 ** 31, ValueError)]
    at = dict(q=f32(H, T, hd), k=f32(KVH, T, hd), qkv=f32(T, W),
              out=np.zeros((T, H * hd), np.float32), n_kv_heads=KVH, scale=0.3,
              mask=np.ones(T, bool))
    at_bad = [("q", f32(H, T, hd).astype(np.float64), TypeError), ("q", f32(T, hd), ValueError),
              ("q", _noncontig((H, T, hd)), ValueError), ("q", [[[0.0]]], TypeError),
              ("k", f32(KVH, T + 1, hd), ValueError), ("k", f32(H, T, hd), ValueError),
              ("qkv", f32(T, W - hd), ValueError), ("qkv", None, TypeError),
              ("out", np.zeros((T, H * hd - 1), np.float32), ValueError),
              ("out", _readonly(np.zeros((T, H * hd), np.float32)), ValueError),
              ("n_kv_heads", 3, ValueError), ("n_kv_heads", -1, ValueError), ("n_kv_heads", "2", TypeError),
              ("scale", float("nan"), ValueError), ("scale", None, TypeError),
              ("scale", 3.5e38, ValueError), ("scale", -1e39, ValueError),
              ("mask", np.ones(T + 1, bool), ValueError), ("mask", np.ones(T, np.float32), TypeError),
              ("mask", [True] * T, TypeError), ("mask", np.ones((T, 1), bool), ValueError),
              ("mask", np.ones(2 * T, bool)[::2], ValueError),
              ("h1", H + 1, ValueError), ("h0", 3, ValueError, dict(h1=2))]
    sw = dict(a=f32(3, 7), b=f32(3, 7), out=np.zeros((3, 7), np.float32))
    sw_bad = [("a", f32(3, 7).astype(np.float64), TypeError), ("b", f32(21), ValueError),
              ("b", _noncontig((3, 7)), ValueError), ("out", np.zeros((3, 8), np.float32), ValueError),
              ("out", _readonly(np.zeros((3, 7), np.float32)), ValueError), ("a", 1.0, TypeError),
              ("i1", 22, ValueError), ("i0", -1, ValueError), ("i0", 5, ValueError, dict(i1=4))]
    gr = dict(resid=f32(T, D), y=f32(T, D), gate=f32(D), out=np.zeros((T, D), np.float32))
    gr_bad = [("resid", f32(T, D).astype(np.float64), TypeError), ("y", f32(T, D + 1), ValueError),
              ("gate", f32(D + 1), ValueError), ("gate", f32(1, D), ValueError),
              ("out", _readonly(np.zeros((T, D), np.float32)), ValueError),
              ("out", np.zeros((D, T), np.float32), ValueError), ("y", None, TypeError),
              ("resid", _noncontig((T, D)), ValueError), ("r1", T + 1, ValueError)]
    nr = dict(y=f32(T, D), w=f32(D), resid=f32(T, D), gate=f32(D),
              out=np.zeros((T, D), np.float32), eps=1e-6, w2=f32(D), mod2=f32(D),
              h=np.zeros((T, D), np.float32))
    nr_bad = [("y", f32(T, D).astype(np.float64), TypeError), ("y", f32(T, 0), ValueError),
              ("y", None, TypeError), ("resid", f32(T + 1, D), ValueError),
              ("resid", _noncontig((T, D)), ValueError), ("w", None, TypeError),
              ("w", f32(D + 1), ValueError), ("gate", f32(1, D), ValueError),
              ("w2", f32(D - 1), ValueError), ("mod2", [1.0] * D, TypeError),
              ("out", _readonly(np.zeros((T, D), np.float32)), ValueError),
              ("out", np.zeros((D, T), np.float32), ValueError),
              ("h", np.zeros((T, D), np.float64), TypeError),
              ("h", _readonly(np.zeros((T, D), np.float32)), ValueError),
              ("eps", float("nan"), ValueError), ("eps", None, TypeError),
              ("r1", T + 1, ValueError), ("r0", 2, ValueError, dict(r1=1)),
              ("isa", "sse9", ValueError)]
    return [("rmsnorm", K.rmsnorm, rms, rms_bad), ("qknorm_rope", K.qknorm_rope, qk, qk_bad),
            ("attention", K.attention, at, at_bad), ("swiglu", K.swiglu, sw, sw_bad),
            ("gated_residual", K.gated_residual, gr, gr_bad),
            ("norm_residual", K.norm_residual, nr, nr_bad)]


def test_bad_input_battery():
    for name, fn, good, bads in _cases():
        fn(**good)  # the valid call works (so each failure below is due to the one bad argument)
        for case in bads:
            arg, val, exc = case[:3]
            extra = case[3] if len(case) > 3 else {}
            kw = dict(good, **extra)
            kw[arg] = val
            outs = [v for v in kw.values() if isinstance(v, np.ndarray) and v.flags.writeable]
            before = [o.copy() for o in outs]
            with pytest.raises(exc) as ei:
                fn(**kw)
            msg = str(ei.value)
            assert msg.startswith(name), (name, arg, msg)
            assert arg in msg or arg in ("r0", "r1", "h0", "h1", "i0", "i1", "n_heads", "isa") \
                or "band" in msg, (name, arg, msg)
            for o, b in zip(outs, before):
                assert np.array_equal(o, b, equal_nan=True), (name, arg, "output written")


def test_overlapping_output_rejected():
    x = f32(4, 8)
    with pytest.raises(ValueError, match="out overlaps w"):
        w = x[0]
        K.rmsnorm(x, w, x, 1e-6)  # out == x is allowed, but w lies inside out
    T, H, hd = 4, 2, 8
    qkv = f32(T, 6 * hd)
    q, k = f32(H, T, hd), f32(H, T, hd)
    with pytest.raises(ValueError, match="out overlaps qkv"):
        K.attention(q, k, qkv, qkv.reshape(-1)[:T * H * hd].reshape(T, H * hd), H, 0.3)
    qo = np.zeros((H, T, hd), np.float32)
    with pytest.raises(ValueError, match="q_out overlaps k_out"):
        K.qknorm_rope(qkv, f32(hd), f32(hd), f32(T, hd // 2, 2, 2), qo, qo, H, H, 1e-6)


def test_empty_inputs_return_early():
    out = np.zeros((0, 8), np.float32)
    K.rmsnorm(np.zeros((0, 8), np.float32), f32(8), out, 1e-6)
    K.gated_residual(np.zeros((0, 8), np.float32), np.zeros((0, 8), np.float32), f32(8), out)
    K.norm_residual(np.zeros((0, 8), np.float32), f32(8), np.zeros((0, 8), np.float32), f32(8),
                    out, 1e-6)
    e = np.zeros(0, np.float32)
    K.swiglu(e, e.copy(), np.zeros(0, np.float32))
    x = f32(3, 8)
    o = np.full((3, 8), 7.0, np.float32)
    K.rmsnorm(x, f32(8), o, 1e-6, r0=2, r1=2)
    assert np.all(o == 7.0)
    q = np.zeros((2, 0, 4), np.float32)
    K.attention(q, q.copy(), np.zeros((0, 24), np.float32), np.zeros((0, 8), np.float32), 2, 0.5)
