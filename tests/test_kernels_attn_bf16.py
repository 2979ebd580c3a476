"""Tests of the `bf16` attention, ``K.attention(..., precision="bf16")`` (csrc/nx_attn_bf16.h):
q, k, v and P rounded to bfloat16, Q K^T and P V on the bfloat16 dot step, softmax max/sum in
float32.

Oracles, sharing no code with the C:
  * a numpy transcription of the header's contract (``contract_attention``): bfloat16 rounding on
    the bit pattern, the dot step as an exact fma (the float64 sum made round-to-odd, then one
    rounding to float32: exact for float32 operands), the exp polynomial op for op. Every variant
    must equal it bit for bit; variants of it with one rule broken (P not rounded, l in bfloat16,
    the pair order swapped) must not.
  * float64 softmax attention on the float32 inputs, with the header's error bound per row.
Structure: generic == SIMD bit for bit, head bands bit for bit, f32 unchanged by the option.
"""
import math

import numpy as np
import pytest

from kernelutil import ISAS, SIMD_ISAS, assert_bitwise, band_edges, bits

from nxhpc import _kernels as K
from nxhpc.runtime import peak

# The AVX-512 BF16 variant has two dots with the same bits (K.attention_bf16_dot: vfmadd231ps
# steps under DAZ|FTZ, or vdpbf16ps); the process runs the faster one, so each test that loops
# over the variants runs both, as "avx512bf16:fma" and "avx512bf16:vdpbf16ps".
DOTS = ("fma", "vdpbf16ps")


def _with_dots(isas):
    return [lab for i in isas
            for lab in ([f"{i}:{d}" for d in DOTS] if i == "avx512bf16" else [i])]


VARIANTS = _with_dots(ISAS)
# the variants whose bits are the contract's: all but AMX's (tdpbf16ps sums the dots its own
# way: the AMX clause of nx_attn_bf16.h; checked below against the contract's output instead)
SPEC_ISAS = [i for i in VARIANTS if i != "amx"]
SPEC_SIMD = [i for i in _with_dots(SIMD_ISAS) if i != "amx"]
AMX = [i for i in ISAS if i == "amx"]


def attention(q, k, qkv, out, KVH, scale, isa=None, **kw):
    """K.attention at a variant label of VARIANTS ("avx512bf16:vdpbf16ps": that ISA with that
    dot, the process's choice restored after)."""
    if isa is None or ":" not in isa:
        return K.attention(q, k, qkv, out, KVH, scale, isa=isa, **kw)
    base, dot = isa.split(":")
    before = K.attention_bf16_dot()
    K.attention_bf16_dot(dot)
    try:
        return K.attention(q, k, qkv, out, KVH, scale, isa=base, **kw)
    finally:
        K.attention_bf16_dot(before)

F32 = np.float32
U = 2.0 ** -8      # bfloat16 unit roundoff
E = 2.0 ** -24     # float32 unit roundoff
TILE = 64


# ------------------------------------------------------------------ the contract in numpy

def bf(x):
    """float32 -> bfloat16 -> float32 as the contract's bf(): subnormals to the zero of their sign,
    NaN quieted, else round to nearest even on the bit pattern."""
    u = np.ascontiguousarray(x, F32).view(np.uint32).astype(np.uint64)
    sub = (u & 0x7F800000) == 0
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where(sub, (u >> 16) & 0x8000, np.where(nan, (u >> 16) | 0x40, r))
    return (r.astype(np.uint32) << 16).view(F32)


def fma32(a, b, c):
    """Correctly rounded float32 fma(a, b, c) of float32 arrays: a*b is exact in float64, the sum's
    rounding error comes from TwoSum; rounding the float64 sum to odd and then to float32 rounds
    once (53 >= 24 + 2 bits)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.asarray(c).astype(np.float64)
    s = p + c
    bp = s - p
    e = (p - (s - bp)) + (c - bp)
    even = (s.view(np.int64) & 1) == 0
    fix = (e != 0) & even & np.isfinite(s)
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def daz(x):
    x = np.asarray(x, F32)
    return np.where(np.abs(x) < F32(2.0 ** -126), np.copysign(F32(0), x), x).astype(F32)


FTZ_EDGE = 2.0 ** -126 - 2.0 ** -151  # x86 FTZ flushes exact results below this (tiny after
# rounding to 24 bits, unbounded exponent); flushing a gradual-underflow fmaf's subnormal results
# flushes below 2^-126 - 2^-150


def fmaf_ftz_step(acc, a, b):
    """The step as first stated (a negative control, not the contract): a gradual-underflow fmaf,
    then its subnormal results flushed. It keeps as 2^-126 the exact a*b + acc in
    (2^-126 - 2^-150, 2^-126 - 2^-151), which fmaf rounds up but x86 calls tiny."""
    return daz(fma32(daz(a), daz(b), daz(acc)))


def step(acc, a, b):
    """The bf16 dot step of nx_lowp.h: ftz(fma(daz(a), daz(b), daz(acc))) with x86's ftz (the
    zero of the result's sign where the exact value is below FTZ_EDGE in magnitude). The float64
    a*b + acc is exact or misses by far less than its distance to FTZ_EDGE (a, b bfloat16)."""
    r = fmaf_ftz_step(acc, a, b)
    ex = daz(a).astype(np.float64) * daz(b).astype(np.float64) + daz(acc).astype(np.float64)
    return np.where(np.abs(ex) < FTZ_EDGE, np.copysign(F32(0), r), r).astype(F32)


LOG2E = 1.4426950408889634


def scale2(scale):
    """c of the contract: the scores' base-2 factor, (float)((double)scale * log2 e)."""
    return F32(np.float64(F32(scale)) * LOG2E)


def pow2_e(y, down=True):
    """E(y) ~ 2^y of the contract (nx_vmath_ew.h's nx_exp2_, for y <= 0, -inf, NaN), op for op
    in float32. down=False: y - floor(y) rounded to nearest instead (a broken rule)."""
    y = np.asarray(y, F32)
    y = np.where(F32(-160) > y, F32(-160), y).astype(F32)
    n = np.floor(y).astype(F32)
    f = (y - n).astype(F32)
    # rounded toward -inf (VREDUCEPS): one ulp down where the subtraction rounded up (Fast2Sum:
    # -n >= |y|, so f + n and y - (f + n) are exact; the latter is the rounding error)
    up = ((y - (f + n).astype(F32)).astype(F32) < 0) & down
    f = np.where(up, np.nextafter(f, F32(-np.inf)), f).astype(F32)
    p = np.full_like(y, F32(float.fromhex("0x1.bc31dap-7")))
    for c in ("0x1.aa3fcap-5", "0x1.ee5884p-3", "0x1.62d51cp-1", "0x1p0"):
        p = fma32(p, f, F32(float.fromhex(c)))
    return (p.astype(np.float64) * np.exp2(n.astype(np.float64))).astype(F32)


def exp_nx(x):
    """E as it was until 2026-12-05 (e^x by nx_exp, the f32 kernels' exp: Cephes P5, on scores
    x = s * scale): a broken rule now (``broken="nx_exp"``), to show the tests tell them apart."""
    x = np.asarray(x, F32)
    x = np.where(F32(89) < x, F32(89), x)
    x = np.where(F32(-110) > x, F32(-110), x).astype(F32)
    n = np.rint(x * F32(1.44269504088896341)).astype(F32)
    r = fma32(-n, F32(0.693359375), x)
    r = fma32(-n, F32(-2.12194440e-4), r)
    p = np.full_like(x, F32(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fma32(p, r, F32(c))
    p = fma32(p, (r * r).astype(F32), r)
    p = (p + F32(1)).astype(F32)
    return (p.astype(np.float64) * np.exp2(n.astype(np.float64))).astype(F32)


E_REL = 2.0 ** -18   # the contract's bound on E: |E(y) - 2^y| <= E_REL 2^y + 2^-150


def contract_attention(q, k, qkv, KVH, scale, mask=None, causal=False, broken=None, record=None):
    """The header's contract, transcribed (all rows of a head at once). record: a list that gets
    the arguments x - m_use of E of every allowed key of every run tile. broken: None, or one rule
    replaced -- "p_f32" (P not rounded), "l_bf16" (l rounded to bfloat16 per tile), "pair_even"
    (the even element of each pair first), "no_ftz" (the dot steps without DAZ/FTZ), "fmaf_ftz"
    (the dot steps as gradual-underflow fmaf with subnormal results flushed: fmaf_ftz_step),
    "nx_exp" (the scores and E as they were until 2026-12-05: x = s * scale, E = exp_nx),
    "frac_nearest" (E's y - floor(y) rounded to nearest, not down)."""
    H, T, hd = q.shape
    group = H // KVH
    hd2, nt = (hd + 1) // 2 * 2, -(-T // TILE)
    Tp = nt * TILE
    out = np.zeros((T, H * hd), F32)
    c = F32(scale) if broken == "nx_exp" else scale2(scale)
    first, second = (0, 1) if broken == "pair_even" else (1, 0)
    dot = {"no_ftz": lambda acc, a, b: fma32(a, b, acc), "fmaf_ftz": fmaf_ftz_step}.get(broken, step)
    rows = np.arange(T)
    with np.errstate(invalid="ignore", over="ignore"):
        for h in range(H):
            g = h // group
            kb = np.zeros((Tp, hd2), F32)
            vb = np.zeros((Tp, hd2), F32)
            kb[:T, :hd] = bf(k[g])
            vb[:T, :hd] = bf(qkv[:, (H + KVH) * hd + g * hd:(H + KVH) * hd + (g + 1) * hd])
            qb = np.zeros((T, hd2), F32)
            qb[:, :hd] = bf(q[h])
            m = np.full(T, -np.inf, F32)
            l = np.zeros(T, F32)
            O = np.zeros((T, hd2), F32)
            for b in range(nt):
                run = (rows // TILE >= b) if causal else np.ones(T, bool)
                keys = b * TILE + np.arange(TILE)
                s = np.zeros((T, TILE), F32)
                for d in range(0, hd2, 2):
                    s = dot(s, qb[:, d + first, None], kb[keys, d + first][None, :])
                    s = dot(s, qb[:, d + second, None], kb[keys, d + second][None, :])
                allowed = np.broadcast_to(keys < T, (T, TILE)).copy()
                if mask is not None:
                    allowed &= np.concatenate([mask.astype(bool), np.zeros(Tp - T, bool)])[keys]
                if causal:
                    allowed &= keys[None, :] <= rows[:, None]
                x = np.where(allowed, (s * c).astype(F32), F32(-np.inf))
                mx = x.max(axis=1)
                m_new = np.where(mx > m, mx, m).astype(F32)
                m_use = np.where(m_new == -np.inf, F32(0), m_new).astype(F32)
                ex = {"nx_exp": exp_nx,
                      "frac_nearest": lambda y: pow2_e(y, down=False)}.get(broken, pow2_e)
                alpha = ex((m - m_use).astype(F32))
                p = ex((x - m_use[:, None]).astype(F32))
                if record is not None:
                    record.append((x - m_use[:, None])[allowed & run[:, None]])
                if broken != "p_f32":
                    p = bf(p)
                a = (((p[:, 0:16] + p[:, 16:32]) + p[:, 32:48]) + p[:, 48:64]).astype(F32)
                a = (a[:, :8] + a[:, 8:]).astype(F32)
                a = (a[:, :4] + a[:, 4:]).astype(F32)
                a = (a[:, :2] + a[:, 2:]).astype(F32)
                tot = (a[:, 0] + a[:, 1]).astype(F32)
                l_new = ((l * alpha).astype(F32) + tot).astype(F32)
                if broken == "l_bf16":
                    l_new = bf(l_new)
                o = (O * alpha[:, None]).astype(F32)
                for i in range(TILE // 2):
                    for jj in (2 * i + first, 2 * i + second):
                        o = dot(o, p[:, jj, None], vb[b * TILE + jj][None, :])
                l = np.where(run, l_new, l)
                m = np.where(run, m_new, m)
                O = np.where(run[:, None], o, O)
            inv = np.where(l == 0, F32(0), F32(1) / np.where(l == 0, F32(1), l)).astype(F32)
            res = np.where((l == 0)[:, None], F32(0), (O[:, :hd] * inv[:, None]).astype(F32))
            out[:, h * hd:(h + 1) * hd] = res
    return out


# ------------------------------------------------------------------ float64 reference + bound

def ref_and_bound(q, k, qkv, KVH, scale, mask=None, causal=False):
    """float64 attention (ref [T, H*hd]) and the header's error bound per element."""
    H, T, hd = q.shape
    group = H // KVH
    sc = float(F32(scale))
    allowed = np.ones((T, T), bool)
    if mask is not None:
        allowed &= mask.astype(bool)[None, :]
    if causal:
        allowed &= np.tril(np.ones((T, T), bool))
    nt = np.full(T, -(-T // TILE)) if not causal else np.arange(T) // TILE + 1
    P = 2 * ((hd + 1) // 2)
    gam = lambda n: n * E / (1 - n * E)  # noqa: E731
    ref = np.zeros((T, H * hd))
    bound = np.zeros((T, H * hd))
    for h in range(H):
        g = h // group
        q64, k64 = q[h].astype(np.float64), k[g].astype(np.float64)
        v64 = qkv[:, (H + KVH) * hd + g * hd:(H + KVH) * hd + (g + 1) * hd].astype(np.float64)
        s = sc * (q64 @ k64.T)
        mag = sc * (np.abs(q64) @ np.abs(k64).T)
        a = ((2 * U + U * U) + gam(P) * (1 + U) ** 2) * mag
        delta_j = a + gam(2) * (np.abs(s) + a)  # c's rounding and the product by c
        smax = np.where(allowed, s, -np.inf)
        with np.errstate(invalid="ignore"):  # rows with no allowed key: -inf - -inf
            w = np.exp(smax - smax.max(axis=1, keepdims=True))
        w = np.where(allowed, w, 0.0)
        z = w.sum(axis=1, keepdims=True)
        has = z[:, 0] > 0
        w = w / np.where(z > 0, z, 1.0)
        delta = np.where(allowed, delta_j, 0).max(axis=1)
        smin = np.where(allowed, s, np.inf).min(axis=1)
        R = np.where(has, smax.max(axis=1) - smin, 0) + 2 * delta
        rho = (1 + U) * (1 + E_REL) ** (nt + 1) * (1 + E) ** (2 * nt) * np.exp(2 * E * R) - 1
        eta = np.exp(delta) * (1 + rho) * (1 + gam(64 * nt + 2 * nt + 8)) - 1
        coef = (2 * eta + U * (1 + eta)) / (1 - eta) + 2.0 ** -21
        A = w @ np.abs(v64)
        ref[:, h * hd:(h + 1) * hd] = w @ v64
        tiny = 64 * nt * 2.0 ** -124 * (1 + np.abs(v64).max())
        bound[:, h * hd:(h + 1) * hd] = np.where(has[:, None], coef[:, None] * A + tiny[:, None],
                                                 0.0)
    return ref, bound


def inputs(rng, T, H, KVH, hd, qk_scale=1.0, v_scale=1.0):
    q = (rng.standard_normal((H, T, hd)) * qk_scale).astype(F32)
    k = (rng.standard_normal((KVH, T, hd)) * qk_scale).astype(F32)
    qkv = (rng.standard_normal((T, (H + 2 * KVH) * hd)) * v_scale).astype(F32)
    return q, k, qkv


def run(q, k, qkv, KVH, scale, isa, **kw):
    out = np.full((q.shape[1], q.shape[0] * q.shape[2]), np.nan, F32)
    return attention(q, k, qkv, out, KVH, scale, isa=isa, precision="bf16", **kw)


def make_mask(rng, kind, T):
    if kind == "none":
        return None
    if kind == "tail":  # right padding, as the DiT's caption pad
        return np.arange(T) < max(1, int(T * rng.uniform(0.3, 0.9)))
    return rng.random(T) < {"random": 0.6, "sparse": 0.05}[kind]


def amx_tolerance(q, k, qkv, KVH, scale, mask=None, causal=False):
    """How far the AMX variant may be from the contract's output, per element: the two differ
    only in how the dot products are summed. A score then moves by <= 2 scale gamma_P sum|q k|
    (both sums within gamma_P of the exact one), so each weight E(x - m) by that factor, which
    may also flip its bfloat16 rounding (one bfloat16 ulp, 2u, relative); the P V sums differ by
    <= 2 gamma_{64 nt}; O and l both carry the weight error. Far inside the contract's bound
    (whose input-rounding term is ~2u scale sum|q k|, ~15x this at hd = 128). Flushed subnormal
    partial sums (DAZ/FTZ in both) add <= 2^-126 per step to a score, times scale."""
    H, T, hd = q.shape
    group = H // KVH
    sc = float(F32(scale))
    P = 2 * ((hd + 1) // 2)
    gam = lambda n: n * E / (1 - n * E)  # noqa: E731
    nt = -(-T // TILE)
    allowed = np.ones((T, T), bool)
    if mask is not None:
        allowed &= mask.astype(bool)[None, :]
    if causal:
        allowed &= np.tril(np.ones((T, T), bool))
    tol = np.zeros((T, H * hd))
    for h in range(H):
        g = h // group
        q64, k64 = q[h].astype(np.float64), k[g].astype(np.float64)
        mag = sc * (np.abs(q64) @ np.abs(k64).T)
        s = np.where(allowed, sc * (q64 @ k64.T), -np.inf)
        with np.errstate(invalid="ignore"):
            w = np.exp(s - s.max(axis=1, keepdims=True))
        w = np.where(allowed, w, 0.0)
        w /= np.maximum(w.sum(axis=1, keepdims=True), 1e-300)
        # per row; plus each sum's flushed subnormal partial sums (< 2^-126 per step), scaled
        # (times 1 + 2^-22: the scores are multiplied by c ~ scale log2 e, not by scale)
        dx = (2 * gam(P) * mag.max(axis=1) + 2 * P * 2.0 ** -126 * sc) * (1 + 2.0 ** -22)
        rel = 2 * (np.expm1(2 * dx) + 2 * U + 2 * gam(64 * nt + 8))
        v = np.abs(qkv[:, (H + KVH) * hd + g * hd:(H + KVH) * hd + (g + 1) * hd]).astype(np.float64)
        # either output's weights are within exp(2 delta) of w (float64, unrounded inputs:
        # delta the bound's input-rounding term of a score), so sum_j w_j |v_j| times that
        delta = ((2 * U + U * U) + gam(P) * (1 + U) ** 2) * mag.max(axis=1)
        grow = np.exp(2 * delta) * (1 + rel)
        tol[:, h * hd:(h + 1) * hd] = (rel * grow)[:, None] * (w @ v) + 2.0 ** -100
    return tol


def assert_amx_near_contract(got, want, q, k, qkv, KVH, scale, mask, causal):
    tol = amx_tolerance(q, k, qkv, KVH, scale, mask, causal)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert np.isfinite(got).all() == np.isfinite(want).all()
    fin = np.isfinite(want)
    assert (err[fin] <= tol[fin]).all(), (err[fin] / tol[fin]).max()


# ------------------------------------------------------------------ tests

CONTRACT_CASES = [  # T, H, KVH, hd, causal, mask kind
    (1, 1, 1, 2, False, "none"), (5, 2, 1, 7, True, "none"), (64, 2, 2, 16, False, "random"),
    (65, 3, 1, 40, True, "tail"), (130, 2, 1, 33, False, "sparse"), (129, 4, 2, 128, True, "random"),
]


@pytest.mark.parametrize("case", CONTRACT_CASES)
def test_every_variant_is_the_contract_bit_for_bit(case):
    T, H, KVH, hd, causal, mk = case
    rng = np.random.default_rng(T * 31 + hd)
    q, k, qkv = inputs(rng, T, H, KVH, hd, qk_scale=rng.uniform(0.5, 3.0))
    mask = make_mask(rng, mk, T)
    scale = float(rng.uniform(0.5, 1.5) / math.sqrt(hd))
    _check_contract(q, k, qkv, KVH, scale, mask, causal, case)


def _check_contract(q, k, qkv, KVH, scale, mask, causal, what):
    want = contract_attention(q, k, qkv, KVH, scale, mask, causal)
    for isa in SPEC_ISAS:
        assert_bitwise(run(q, k, qkv, KVH, scale, isa, mask=mask, causal=causal), want,
                       f"{isa} vs contract {what}")
    for isa in AMX:
        assert_amx_near_contract(run(q, k, qkv, KVH, scale, isa, mask=mask, causal=causal),
                                 want, q, k, qkv, KVH, scale, mask, causal)
    return want


@pytest.mark.parametrize("seed", range(4))
def test_underflow_range_is_the_contract_bit_for_bit(seed):
    """Where DAZ/FTZ act: q.k products near 2^-126 (subnormal partial sums and scores, flushed
    in the dot chain), subnormal q/k/v inputs (bf() flushes them), tiny v (P V underflows), and
    scores spread so the rescale alpha = E(m_old - m_new) is subnormal (a running output O *
    alpha below 2^-126 enters the next chain, which flushes it)."""
    rng = np.random.default_rng(100 + seed)
    T, H, KVH, hd = int(rng.integers(60, 140)), 2, 1, int(rng.choice([16, 24, 33]))
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    mode = seed % 4
    if mode == 0:   # products ~2^-126: partial sums flushed; scale 2^122 makes that visible
        q *= F32(2.0 ** -63)
        k *= F32(2.0 ** -63)
        scale = 2.0 ** 122
    elif mode == 1:  # subnormal inputs mixed with normal ones
        for a in (q, k, qkv):
            sub = rng.random(a.shape) < 0.3
            a[sub] = (rng.standard_normal(sub.sum()) * 2.0 ** -130).astype(F32)
        scale = 0.3
    elif mode == 2:  # tiny v: P V partial sums below 2^-126
        qkv *= F32(2.0 ** -118)
        scale = 0.5
    else:            # large scores rising along the keys: alpha underflows, O * alpha subnormal
        k += np.linspace(0, 40, T, dtype=F32)[None, :, None] * np.sign(q.mean(axis=(0, 1)))
        qkv *= F32(1e3)
        scale = 1.0
    mask = make_mask(rng, "random", T) if seed > 1 else None
    causal = bool(seed % 2)
    want = _check_contract(q, k, qkv, KVH, scale, mask, causal, f"underflow mode {mode}")
    if mode in (0, 2):  # negative control: the flushes matter on these inputs
        other = contract_attention(q, k, qkv, KVH, scale, mask, causal, broken="no_ftz")
        assert (bits(other) != bits(want)).any(), mode


@pytest.mark.parametrize("seed", range(3))
def test_underflowing_weights_are_the_contract_bit_for_bit(seed):
    """Sharp attention: most weights E(x - m_use) of a row are far below 2^-126, where bf()
    flushes them to zero. The kernels evaluate those exponentials with FTZ set (and AMX masks
    the excluded keys' lanes instead of clamping them), so that no underflowing result costs a
    microcode assist (AMX Xeon: 6x the time of the kernel on such rows); the bits stay the
    contract's. With a causal diagonal, masked keys and a padded last tile. The data reaches E
    arguments below -149 (results that round to zero) and in [-149, -126) (subnormal results),
    where no FTZ and FTZ differ before bf()."""
    rng = np.random.default_rng(300 + seed)
    T, hd, qk, mk = [(100, 64, 6.0, "tail"), (190, 128, 8.0, "random"), (333, 40, 5.0, "none")][seed]
    H, KVH = 2, 1
    q, k, qkv = inputs(rng, T, H, KVH, hd, qk_scale=qk)
    mask = make_mask(rng, mk, T)
    causal = seed != 0
    scale = 1 / math.sqrt(hd)
    args = []
    contract_attention(q, k, qkv, KVH, scale, mask, causal, record=args)
    y = np.concatenate(args)
    assert (y < -149).sum() > 1000, (y < -149).sum()
    assert ((y >= -149) & (y < -126)).sum() > 20, ((y >= -149) & (y < -126)).sum()
    _check_contract(q, k, qkv, KVH, scale, mask, causal, f"sharp seed {seed}")


def ftz_edge_inputs(side):
    """One dot chain whose exact sum is 2^-126 - 1.5 * 2^-151: in the scores (side "qk": q, k
    chosen so; scale 2^126 makes the score 1 or 0) or in P V (side "pv": v chosen against the
    second key's rounded weight p0)."""
    H, KVH, T, hd = 1, 1, 4, 2
    q = np.zeros((H, T, hd), F32)
    k = np.zeros((KVH, T, hd), F32)
    qkv = np.zeros((T, (H + 2 * KVH) * hd), F32)
    v = qkv[:, (H + KVH) * hd:]
    if side == "qk":  # pair order odd first: s = 2^-126 (q1 k1), then + q0 k0 = -1.5 * 2^-151
        q[0, :, 0], q[0, :, 1] = F32(-1.5 * 2.0 ** -25), F32(1)
        k[0, :2, :] = F32(2.0 ** -126)
        v[:] = np.arange(1, 2 * T + 1, dtype=F32).reshape(T, 2)
        return q, k, qkv, KVH, 2.0 ** 126
    # pv: key 1 (position 0 of the tile, first step) p1 = 1, v1 = 2^-126; key 0 p0 = bf(E(-20 c)),
    # v0 with p0 v0 ~ -1.5 * 2^-151; keys 2, 3 excluded below by the mask
    q[0, :, 0] = F32(1)
    k[0, 0, 0] = F32(-20)
    p0 = float(bf(pow2_e(np.array([F32(-20) * scale2(1.0)], F32)))[0])
    v[1, 0] = F32(2.0 ** -126)
    v[0, 0] = bf(np.array([-1.5 * 2.0 ** -151 / p0], F32))[0]
    ex = p0 * float(v[0, 0]) + 2.0 ** -126
    assert 2.0 ** -126 - 2.0 ** -150 < ex < FTZ_EDGE, ex
    v[:, 1] = F32(1)
    return q, k, qkv, KVH, 1.0


@pytest.mark.parametrize("side", ["qk", "pv"])
@pytest.mark.parametrize("isa", SPEC_ISAS)
def test_ftz_rounding_boundary_is_the_contract(isa, side):
    """A dot chain's exact sum just below 2^-126, in (2^-126 - 2^-150, 2^-126 - 2^-151): x86 FTZ
    (the contract's ftz) flushes it to 0, a gradual-underflow fmaf rounds it up to 2^-126. The
    negative control shows the inputs reach that interval: the contract as first stated (fmaf,
    then subnormals flushed) gives other bits."""
    q, k, qkv, KVH, scale = ftz_edge_inputs(side)
    mask = None if side == "qk" else np.array([1, 1, 0, 0], bool)
    want = contract_attention(q, k, qkv, KVH, scale, mask)
    other = contract_attention(q, k, qkv, KVH, scale, mask, broken="fmaf_ftz")
    assert (bits(other) != bits(want)).any()
    assert_bitwise(run(q, k, qkv, KVH, scale, isa, mask=mask), want, f"{isa} {side}")


def test_broken_contracts_are_caught():
    """Negative controls: the same transcription with one rule changed (P left in float32, the
    running sum l held in bfloat16, the pair order swapped, the former E) differs from the
    kernels' bits."""
    rng = np.random.default_rng(7)
    T, H, KVH, hd = 100, 2, 1, 24
    q, k, qkv = inputs(rng, T, H, KVH, hd, qk_scale=2.0)
    scale = 1 / math.sqrt(hd)
    got = run(q, k, qkv, KVH, scale, SPEC_ISAS[-1], causal=True)
    assert_bitwise(got, contract_attention(q, k, qkv, KVH, scale, causal=True), "contract")
    for broken in ("p_f32", "l_bf16", "pair_even", "nx_exp"):
        other = contract_attention(q, k, qkv, KVH, scale, causal=True, broken=broken)
        assert (bits(other) != bits(got)).mean() > 0.05, broken


def test_pow2_fraction_rounds_down_in_every_variant():
    """E's y - floor(y) rounds toward -inf (AVX-512's VREDUCEPS; the spec and AVX2 correct the
    rounded-to-nearest difference): scores that rise by less than 1 (base 2) from tile to tile,
    so each tile's rescale alpha = E(y), y in (-1, 0), where 1 + y rounds. Every variant equals
    the contract; the contract with the fraction rounded to nearest differs (negative control:
    a plain subtraction in a variant would fail here, the bfloat16 weights alone would not)."""
    rng = np.random.default_rng(5)
    H, KVH, T, hd = 2, 1, 640, 8
    q = np.zeros((H, T, hd), F32)
    k = np.zeros((KVH, T, hd), F32)
    q[:, :, 0] = (1 + rng.uniform(0, 0.25, (H, T))).astype(F32)
    k[0, :, 0] = (np.arange(T) / T * 1.3 + rng.uniform(0, 0.01, T)).astype(F32)
    qkv = np.zeros((T, (H + 2 * KVH) * hd), F32)
    qkv[:, (H + KVH) * hd:] = rng.standard_normal((T, KVH * hd)).astype(F32)
    scale = 0.9
    want = _check_contract(q, k, qkv, KVH, scale, None, False, "fraction rounding")
    other = contract_attention(q, k, qkv, KVH, scale, broken="frac_nearest")
    assert (bits(other) != bits(want)).sum() >= 20  # 537 of 10240 here


def test_pow2_is_within_its_bound():
    """E (the transcription the kernels equal bit for bit) against float64 2^y: within
    2^-18 2^y + 2^-150 on 2e7 points of [-160, 0] (dense near 0, where the weights that matter
    are, and near -1, where floor(y) steps), 0 and -0 give exactly 1, -inf gives 0, NaN stays
    NaN, and E never exceeds 1 (so the running max's weight stays the largest). Not vacuous:
    the max relative error on the normal range exceeds 2^-19, and a degree-3 Taylor polynomial
    in the same form misses 2^-18."""
    rng = np.random.default_rng(11)
    y = np.concatenate([-rng.uniform(0, 160, 8_000_000), -rng.exponential(1.0, 4_000_000),
                        -rng.uniform(0, 2.0 ** -10, 4_000_000),
                        -1 + rng.uniform(-2.0 ** -10, 2.0 ** -10, 4_000_000)]).astype(F32)
    got = pow2_e(y).astype(np.float64)
    ref = np.exp2(y.astype(np.float64))
    err = np.abs(got - ref)
    assert np.all(err <= E_REL * ref + 2.0 ** -150)
    assert np.all(got <= 1.0)
    normal = ref >= 2.0 ** -126
    assert (err[normal] / ref[normal]).max() > 2.0 ** -19
    special = pow2_e(np.array([0.0, -0.0, -np.inf, np.nan], F32))
    assert special[0] == 1 and special[1] == 1 and special[2] == 0 and np.isnan(special[3])
    # the same reduction with 2^f's degree-3 Taylor polynomial: outside the bound
    z = y[:100_000]
    n = np.floor(z).astype(F32)
    f = (z - n).astype(F32)
    ln2 = math.log(2)
    p3 = np.full_like(f, F32(ln2 ** 3 / 6))
    for c in (ln2 ** 2 / 2, ln2, 1.0):
        p3 = fma32(p3, f, F32(c))
    worse = p3.astype(np.float64) * np.exp2(n.astype(np.float64))
    ref3 = np.exp2(z.astype(np.float64))
    assert (np.abs(worse - ref3) / ref3).max() > E_REL


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 200, 333])
@pytest.mark.parametrize("causal", [False, True])
def test_within_the_bound_of_float64(T, causal):
    rng = np.random.default_rng(T + 1000 * causal)
    for trial in range(2):
        H, KVH = [(1, 1), (4, 2), (6, 3), (3, 3)][rng.integers(4)]
        hd = int(rng.choice([8, 31, 64, 128]))
        qk_scale = float(rng.choice([0.1, 1.0, 2.5]))
        v_scale = float(rng.choice([1e-3, 1.0, 50.0]))
        q, k, qkv = inputs(rng, T, H, KVH, hd, qk_scale, v_scale)
        mask = make_mask(rng, ["none", "tail", "random", "sparse"][rng.integers(4)], T)
        scale = 1 / math.sqrt(hd)
        ref, bound = ref_and_bound(q, k, qkv, KVH, scale, mask, causal)
        for isa in ([VARIANTS[-1]] if T > 100 else VARIANTS):
            got = run(q, k, qkv, KVH, scale, isa, mask=mask, causal=causal).astype(np.float64)
            err = np.abs(got - ref)
            assert (err <= bound).all(), (f"{isa} T={T} H={H}/{KVH} hd={hd}: worst ratio "
                                          f"{(err / np.maximum(bound, 1e-300)).max():.3g}")
            # rows with no allowed key are zeros
            dead = ~(bound > 0).any(axis=1) if mask is not None else np.zeros(T, bool)
            assert (got[dead] == 0).all()


def test_bound_checks_catch_a_wrong_function():
    """Negative controls of the float64 check: the causal result fails the full attention's bound,
    and the bf16 result fails the float32 attention's own error scale (so bf16 does round)."""
    rng = np.random.default_rng(3)
    T, H, KVH, hd = 150, 2, 1, 64
    q, k, qkv = inputs(rng, T, H, KVH, hd, 1.5)
    scale = 1 / math.sqrt(hd)
    ref, bound = ref_and_bound(q, k, qkv, KVH, scale)
    causal = run(q, k, qkv, KVH, scale, ISAS[-1], causal=True).astype(np.float64)
    assert (np.abs(causal - ref) > bound).any()
    full = run(q, k, qkv, KVH, scale, ISAS[-1]).astype(np.float64)
    assert (np.abs(full - ref) <= bound).all()
    f32 = np.empty_like(causal, dtype=F32)
    K.attention(q, k, qkv, f32, KVH, scale)
    # the float32 kernel is ~2^-20 relative; bfloat16 inputs move outputs by ~2^-9
    assert np.abs(full - ref).max() > 100 * np.abs(f32 - ref).max()


@pytest.mark.parametrize("T", [7, 190, 450])
def test_simd_equals_generic_bit_for_bit(T):
    rng = np.random.default_rng(T)
    for causal in (False, True):
        H, KVH, hd = (4, 2, int(rng.choice([40, 128, 17]))) if T < 400 else (2, 1, 96)
        q, k, qkv = inputs(rng, T, H, KVH, hd, float(rng.uniform(0.2, 4.0)))
        mask = make_mask(rng, ["none", "random", "tail"][rng.integers(3)], T)
        scale = float(rng.uniform(0.05, 0.3))
        want = run(q, k, qkv, KVH, scale, "generic", mask=mask, causal=causal)
        for isa in SPEC_SIMD:
            assert_bitwise(run(q, k, qkv, KVH, scale, isa, mask=mask, causal=causal), want,
                           f"{isa} vs generic T={T} causal={causal}")
        for isa in AMX:
            assert_amx_near_contract(run(q, k, qkv, KVH, scale, isa, mask=mask, causal=causal),
                                     want, q, k, qkv, KVH, scale, mask, causal)


def test_head_bands_are_bit_identical():
    rng = np.random.default_rng(11)
    T, H, KVH, hd = 140, 6, 2, 48
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    scale = 1 / math.sqrt(hd)
    for isa in VARIANTS:
        for causal in (False, True):
            full = run(q, k, qkv, KVH, scale, isa, causal=causal)
            edges = band_edges(rng, H, 5)
            out = np.full_like(full, np.nan)
            for a, b in zip(edges[:-1], edges[1:]):
                attention(q, k, qkv, out, KVH, scale, h0=a, h1=b, isa=isa, causal=causal,
                          precision="bf16")
            assert_bitwise(out, full, f"{isa} bands {edges}")


@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_query_row_bands_are_bit_identical(precision):
    """Query rows [t0, t1) computed band by band (and crossed with head bands) give the bits of
    one whole call, at every ISA, with and without causality and a key mask; rows outside a band
    are never written. T = 300 puts band edges inside every variant's query blocks and
    micro-blocks (16 to 64 rows) and in a tail block."""
    rng = np.random.default_rng(23)
    T, H, KVH, hd = 300, 4, 2, 40
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    scale = 1 / math.sqrt(hd)
    for isa in VARIANTS:
        for causal, mask in ((False, None), (True, None), (False, make_mask(rng, "random", T)),
                             (True, make_mask(rng, "tail", T))):
            full = np.full((T, H * hd), np.nan, F32)
            attention(q, k, qkv, full, KVH, scale, mask=mask, isa=isa, causal=causal,
                      precision=precision)
            assert not np.isnan(full).any()
            rows = band_edges(rng, T, 6)
            heads = band_edges(rng, H, 3)
            out = np.full_like(full, np.nan)
            for ta, tb in zip(rows[:-1], rows[1:]):
                for ha, hb in zip(heads[:-1], heads[1:]):
                    attention(q, k, qkv, out, KVH, scale, mask=mask, h0=ha, h1=hb, t0=ta,
                              t1=tb, isa=isa, causal=causal, precision=precision)
            assert_bitwise(out, full, f"{precision} {isa} causal={causal} rows {rows}")
            # one band alone: its rows and heads only
            ta, tb = sorted(rng.integers(0, T + 1, 2).tolist())
            part = np.full_like(full, np.nan)
            attention(q, k, qkv, part, KVH, scale, mask=mask, h0=1, h1=3, t0=ta, t1=tb,
                      isa=isa, causal=causal, precision=precision)
            inside = np.zeros(full.shape, bool)
            inside[ta:tb, hd:3 * hd] = True
            assert_bitwise(part[inside], full[inside], f"{precision} {isa} band [{ta}, {tb})")
            assert np.isnan(part[~inside]).all(), f"{precision} {isa}: wrote outside the band"


def test_query_row_band_is_validated():
    rng = np.random.default_rng(4)
    T, H, KVH, hd = 20, 2, 1, 16
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    out = np.zeros((T, H * hd), F32)
    for t0, t1 in ((5, 4), (-1, 3), (0, T + 1)):
        with pytest.raises(ValueError, match="query rows"):
            K.attention(q, k, qkv, out, KVH, 0.3, t0=t0, t1=t1, precision="bf16")
    with pytest.raises(TypeError, match="query rows"):
        K.attention(q, k, qkv, out, KVH, 0.3, t0=1.5, precision="bf16")
    assert not out.any()
    K.attention(q, k, qkv, out, KVH, 0.3, t0=7, t1=7, precision="bf16")   # empty: no-op
    assert not out.any()


def test_rows_are_independent_of_later_keys_causal():
    """Causal: the first rows of a longer sequence equal the shorter sequence's (keys after a row
    never change it; only keys of its own tiles are read, all finite here)."""
    rng = np.random.default_rng(5)
    T, H, KVH, hd = 300, 2, 1, 32
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    n = 131
    W = (H + 2 * KVH) * hd
    short = [np.ascontiguousarray(a) for a in (q[:, :n], k[:, :n], qkv[:n, :W])]
    for isa in VARIANTS:
        long = run(q, k, qkv, KVH, 0.2, isa, causal=True)
        assert_bitwise(run(*short, KVH, 0.2, isa, causal=True), long[:n], isa)


def test_f32_default_is_unchanged_and_precision_is_validated():
    rng = np.random.default_rng(2)
    T, H, KVH, hd = 70, 2, 1, 32
    q, k, qkv = inputs(rng, T, H, KVH, hd)
    a, b = np.empty((T, H * hd), F32), np.empty((T, H * hd), F32)
    K.attention(q, k, qkv, a, KVH, 0.3)
    K.attention(q, k, qkv, b, KVH, 0.3, precision="f32")
    assert_bitwise(a, b, "f32")
    c = run(q, k, qkv, KVH, 0.3, None)
    assert (bits(c) != bits(a)).any()
    for bad in ("bf32", "BF16", None, 16):
        with pytest.raises(ValueError, match="precision"):
            K.attention(q, k, qkv, a, KVH, 0.3, precision=bad)
    with pytest.raises(ValueError, match="k must have shape"):
        K.attention(q, k[:, :-1], qkv, a, KVH, 0.3, precision="bf16")


def test_dot_choice_is_validated_and_kept():
    before = K.attention_bf16_dot()
    assert before in DOTS
    try:
        for bad in ("FMA", "dp", "", 2, b"fma"):
            with pytest.raises(ValueError, match="choice"):
                K.attention_bf16_dot(bad)
            assert K.attention_bf16_dot() == before
        if "avx512bf16" in ISAS:
            for d in DOTS + DOTS[::-1]:
                assert K.attention_bf16_dot(d) == d
                assert K.attention_bf16_dot() == d
            assert K.attention_bf16_dot("auto") in DOTS
        else:
            with pytest.raises(ValueError, match="cannot run here"):
                K.attention_bf16_dot("vdpbf16ps")
            assert K.attention_bf16_dot("fma") == "fma"
            assert K.attention_bf16_dot("auto") == "fma"
    finally:
        K.attention_bf16_dot(before)


@pytest.mark.skipif("bf16_zmm" not in peak.supported(), reason="no AVX-512 BF16 peak loop here")
def test_auto_dot_is_the_faster_peak_loop():
    """"auto" takes the dot whose peak loop runs more FLOP/s, here against nxhpc.runtime.peak's
    own measurement (thread CPU time, Python-timed): checked where the two rates differ by 1.5x
    either way (AMX Xeon ~0.5x, AMD Zen 4 ~2x), so noise cannot decide it."""
    rf = peak.measure("fma_zmm", 0.1)
    rb = peak.measure("bf16_zmm", 0.1)
    if 1 / 1.5 < rb / rf < 1.5:
        pytest.skip(f"vdpbf16ps / FMA FLOP rate {rb / rf:.2f}: too close to call")
    before = K.attention_bf16_dot()
    try:
        assert K.attention_bf16_dot("auto") == ("vdpbf16ps" if rb > rf else "fma"), rb / rf
    finally:
        K.attention_bf16_dot(before)


def test_dispatch_names_the_variant():
    assert K._variant("attention_bf16", "generic") == "generic"
    if "avx512bf16" in ISAS:
        assert K._variant("attention_bf16", "avx512bf16") == "avx512bf16"
    if "amx" in ISAS:
        assert K._variant("attention_bf16", "amx") == "amx"
    if "avx2" in ISAS:
        assert K._variant("attention_bf16", "avx2") == "avx2"
    if "avx512" in ISAS:
        assert K._variant("attention_bf16", "avx512") == "avx2"  # inherited: no avx512 table


@pytest.mark.skipif(not AMX, reason="no AMX on this CPU")
def test_amx_tolerance_is_not_vacuous():
    """The AMX check is tight: the contract's own output with the scale off by 2^-5 (a wrong
    scores' scale, as a kernel bug would give) is outside it, while the AMX output is inside."""
    rng = np.random.default_rng(77)
    T, H, KVH, hd = 150, 2, 1, 64
    q, k, qkv = inputs(rng, T, H, KVH, hd, qk_scale=1.5)
    scale = 1 / math.sqrt(hd)
    want = contract_attention(q, k, qkv, KVH, scale)
    assert_amx_near_contract(run(q, k, qkv, KVH, scale, "amx"), want, q, k, qkv, KVH, scale,
                             None, False)
    off = contract_attention(q, k, qkv, KVH, scale * (1 + 2.0 ** -5))
    tol = amx_tolerance(q, k, qkv, KVH, scale)
    assert (np.abs(off.astype(np.float64) - want) > tol).any()
