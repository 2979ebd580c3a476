"""Tests of rotate-half RoPE, ``K.qknorm_rope(..., rope_pairs="half")`` (Qwen3's NEOX layout):
pair i of a head is (i, i + hd/2), rotated by the same pe table [T, hd/2, 2, 2] as the adjacent
layout: o[i] = pe[t,i,0,0]*y[i] + pe[t,i,0,1]*y[i+hd/2], o[i+hd/2] = pe[t,i,1,0]*y[i] +
pe[t,i,1,1]*y[i+hd/2], y = rmsnorm(head, w).

Oracles: a float64 numpy reference written from that formula; an HF-style one, q*cos +
rotate_half(q)*sin with cos/sin built from Qwen3's inverse frequencies apart from pe; and
transformers' own ``apply_rotary_pos_emb`` of Qwen3 in float64. Tolerances as
tests/test_kernels_ops.py's qknorm_rope test (derived there); ISA variants bit for bit.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernelutil import ISAS, SIMD_ISAS, assert_bitwise, assert_within, band_edges
from nxhpc import _kernels as K

U = 2.0 ** -24
TINY = 2.0 ** -149 * 4


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ref_half(qkv, q_w, k_w, pe, H, KVH, eps):
    """float64 (q [H,T,hd], k [KVH,T,hd], |terms| of q, |terms| of k) of the rotate-half rule."""
    hd = qkv.shape[1] // (H + 2 * KVH)
    h = hd // 2
    x, pe = qkv.astype(np.float64), pe.astype(np.float64)
    outs, mags = [], []
    for j in range(H + KVH):
        v = x[:, j * hd:(j + 1) * hd]
        w = (q_w if j < H else k_w).astype(np.float64)
        y = v / np.sqrt((v * v).mean(axis=1, keepdims=True) + float(eps)) * w
        y0, y1 = y[:, :h], y[:, h:]
        o, a = np.empty_like(y), np.empty_like(y)
        for r in (0, 1):
            o[:, r * h:(r + 1) * h] = pe[:, :, r, 0] * y0 + pe[:, :, r, 1] * y1
            a[:, r * h:(r + 1) * h] = np.abs(pe[:, :, r, 0] * y0) + np.abs(pe[:, :, r, 1] * y1)
        outs.append(o)
        mags.append(a)
    return np.stack(outs[:H]), np.stack(outs[H:]), np.stack(mags[:H]), np.stack(mags[H:])


def run(qkv, q_w, k_w, pe, H, KVH, eps, isa, **kw):
    T, hd = qkv.shape[0], qkv.shape[1] // (H + 2 * KVH)
    qo = np.full((H, T, hd), np.nan, np.float32)
    ko = np.full((KVH, T, hd), np.nan, np.float32)
    return K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, eps, isa=isa, **kw)


def rotation_pe(angles):
    """pe[t, i] = [[cos, -sin], [sin, cos]] of angles [T, hd/2] (float64 -> float32)."""
    c, s = np.cos(angles), np.sin(angles)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


@given(T=st.sampled_from([1, 7, 31, 33]),
       heads=st.sampled_from([(1, 1), (3, 3), (6, 2), (8, 2)]),
       # hd/2 = 1, 4, 15, 17, 32, 48, 64: below, at and past one vector of 8 / 16 pairs
       hd=st.sampled_from([2, 8, 30, 34, 64, 96, 128]), eps=st.sampled_from([1e-5, 1e-6]),
       seed=st.integers(0, 2**31 - 1), rotations=st.booleans())
def test_half_vs_float64(T, heads, hd, eps, seed, rotations):
    H, KVH = heads
    rng = np.random.default_rng(seed)
    qkv = f32(rng, T, (H + 2 * KVH) * hd, scale=3.0)
    q_w, k_w = f32(rng, hd), f32(rng, hd)
    # real rotations, or arbitrary 2x2 matrices (the kernel must not assume rotation structure)
    pe = (rotation_pe(rng.uniform(-50, 50, (T, hd // 2))) if rotations
          else f32(rng, T, hd // 2, 2, 2))
    rq, rk, aq, ak = ref_half(qkv, q_w, k_w, pe, H, KVH, eps)
    # y = ((x*r)*w): 3u on each y; (pe0*y0) + (pe1*y1): two products and a sum -> error
    # <= (3u + 2u) * (|pe0 y0| + |pe1 y1|); 6u for margin (the adjacent layout's bound).
    outs = {}
    for isa in ISAS:
        outs[isa] = run(qkv, q_w, k_w, pe, H, KVH, eps, isa, rope_pairs="half")
        assert_within(outs[isa][0], rq, 6 * U * aq + TINY, f"q[{isa}]")
        assert_within(outs[isa][1], rk, 6 * U * ak + TINY, f"k[{isa}]")
    for isa in SIMD_ISAS:
        assert_bitwise(outs[isa][0], outs["generic"][0], f"q {isa} vs generic")
        assert_bitwise(outs[isa][1], outs["generic"][1], f"k {isa} vs generic")


def qwen3_case(T=9, H=8, KVH=2, hd=128, theta=1e6, seed=0):
    """Qwen3-shaped inputs: positions 0..T-1, inv_freq_i = theta^(-2i/hd)."""
    rng = np.random.default_rng(seed)
    qkv = f32(rng, T, (H + 2 * KVH) * hd, scale=2.0)
    q_w, k_w = 1.0 + f32(rng, hd, scale=0.1), 1.0 + f32(rng, hd, scale=0.1)
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    return qkv, q_w, k_w, rotation_pe(angles), angles


def hf_cos_sin(pe):
    """cos/sin [T, hd] as HF lays them out (the half-table repeated), from the float32 values
    the kernel was given: cos = pe[..., 0, 0], sin = pe[..., 1, 0]."""
    c = pe[:, :, 0, 0].astype(np.float64)
    s = pe[:, :, 1, 0].astype(np.float64)
    return np.concatenate([c, c], axis=1), np.concatenate([s, s], axis=1)


def rmsnorm_heads(qkv, w, j0, n, hd, eps):
    """float64 [n, T, hd]: rmsnorm of heads j0 .. j0+n-1 of qkv times w."""
    T = qkv.shape[0]
    x = qkv[:, j0 * hd:(j0 + n) * hd].astype(np.float64).reshape(T, n, hd).transpose(1, 0, 2)
    return x / np.sqrt((x * x).mean(axis=2, keepdims=True) + eps) * w.astype(np.float64)


def test_half_is_hf_rotate_half():
    """q*cos + rotate_half(q)*sin, rotate_half(x) = cat(-x[hd/2:], x[:hd/2]), numpy float64;
    negative control: the adjacent layout fails the same check."""
    T, H, KVH, hd, eps = 9, 8, 2, 128, 1e-6
    qkv, q_w, k_w, pe, _ = qwen3_case(T, H, KVH, hd)
    cos, sin = hf_cos_sin(pe)
    h = hd // 2
    rot = lambda x: np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    yq = rmsnorm_heads(qkv, q_w, 0, H, hd, eps)
    yk = rmsnorm_heads(qkv, k_w, H, KVH, hd, eps)
    want_q, want_k = yq * cos + rot(yq) * sin, yk * cos + rot(yk) * sin
    bq = 6 * U * (np.abs(yq * cos) + np.abs(rot(yq) * sin)) + TINY
    bk = 6 * U * (np.abs(yk * cos) + np.abs(rot(yk) * sin)) + TINY
    for isa in ISAS:
        qo, ko = run(qkv, q_w, k_w, pe, H, KVH, eps, isa, rope_pairs="half")
        assert_within(qo, want_q, bq, f"q[{isa}]")
        assert_within(ko, want_k, bk, f"k[{isa}]")
        qa, ka = run(qkv, q_w, k_w, pe, H, KVH, eps, isa, rope_pairs="adjacent")
        assert (np.abs(qa - want_q) > bq).any() and (np.abs(ka - want_k) > bk).any()


def test_half_equals_transformers_qwen3_rope():
    """transformers' Qwen3 apply_rotary_pos_emb (float64 torch) on the float64 rmsnorm output,
    cos/sin built from Qwen3's inverse frequencies (theta 1e6) without the pe table."""
    torch = pytest.importorskip("torch")
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    T, H, KVH, hd, eps = 11, 8, 2, 128, 1e-6
    qkv, q_w, k_w, pe, angles = qwen3_case(T, H, KVH, hd, seed=4)
    emb = np.concatenate([angles, angles], axis=1)  # HF: cat(freqs, freqs)
    cos, sin = torch.from_numpy(np.cos(emb))[None], torch.from_numpy(np.sin(emb))[None]
    yq = rmsnorm_heads(qkv, q_w, 0, H, hd, eps)
    yk = rmsnorm_heads(qkv, k_w, H, KVH, hd, eps)
    tq, tk = qwen3.apply_rotary_pos_emb(torch.from_numpy(yq)[None], torch.from_numpy(yk)[None],
                                        cos, sin)
    want_q, want_k = tq[0].numpy(), tk[0].numpy()
    # vs exact cos/sin, the float32 pe adds one rounding per entry: 7u instead of 6u
    bq = 7 * U * np.abs(yq).max() * 2 + TINY
    bk = 7 * U * np.abs(yk).max() * 2 + TINY
    for isa in ISAS:
        qo, ko = run(qkv, q_w, k_w, pe, H, KVH, eps, isa, rope_pairs="half")
        assert_within(qo, want_q, bq, f"q[{isa}]")
        assert_within(ko, want_k, bk, f"k[{isa}]")
    qa, _ = run(qkv, q_w, k_w, pe, H, KVH, eps, "generic")  # negative control: adjacent
    assert (np.abs(qa - want_q) > bq).any()


@pytest.mark.parametrize("isa", ISAS)
def test_half_band_invariance_and_untouched(isa):
    T, H, KVH, hd = 9, 6, 2, 34
    rng = np.random.default_rng(0)
    qkv = f32(rng, T, (H + 2 * KVH) * hd)
    q_w, k_w, pe = f32(rng, hd), f32(rng, hd), f32(rng, T, hd // 2, 2, 2)
    fq, fk = run(qkv, q_w, k_w, pe, H, KVH, 1e-6, isa, rope_pairs="half")
    for _ in range(5):
        edges = band_edges(rng, H + KVH, 5)
        qo, ko = np.full_like(fq, 7.0), np.full_like(fk, 7.0)
        for a, b in zip(edges[:-1], edges[1:]):
            K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, 1e-6, h0=a, h1=b, isa=isa,
                          rope_pairs="half")
        assert_bitwise(qo, fq, f"q bands {edges}")
        assert_bitwise(ko, fk, f"k bands {edges}")
    qo, ko = np.full_like(fq, 7.0), np.full_like(fk, 7.0)
    K.qknorm_rope(qkv, q_w, k_w, pe, qo, ko, H, KVH, 1e-6, h0=4, h1=7, isa=isa, rope_pairs="half")
    assert np.all(qo[:4] == 7.0) and np.all(ko[1:] == 7.0)
    assert_bitwise(qo[4:], fq[4:])
    assert_bitwise(ko[:1], fk[:1])


@pytest.mark.parametrize("isa", ISAS)
def test_adjacent_is_the_default_and_differs(isa):
    T, H, KVH, hd = 5, 4, 2, 16
    rng = np.random.default_rng(2)
    qkv = f32(rng, T, (H + 2 * KVH) * hd)
    q_w, k_w, pe = f32(rng, hd), f32(rng, hd), rotation_pe(rng.uniform(-3, 3, (T, hd // 2)))
    d = run(qkv, q_w, k_w, pe, H, KVH, 1e-6, isa)
    a = run(qkv, q_w, k_w, pe, H, KVH, 1e-6, isa, rope_pairs="adjacent")
    hq, hk = run(qkv, q_w, k_w, pe, H, KVH, 1e-6, isa, rope_pairs="half")
    assert_bitwise(a[0], d[0], "q")
    assert_bitwise(a[1], d[1], "k")
    assert not np.array_equal(hq, d[0]) and not np.array_equal(hk, d[1])
    # hd = 2 has the one pair (0, 1) in both layouts: the same numbers
    qkv2 = f32(rng, T, (H + 2 * KVH) * 2)
    w2, pe2 = f32(rng, 2), f32(rng, T, 1, 2, 2)
    x = run(qkv2, w2, w2, pe2, H, KVH, 1e-6, isa, rope_pairs="half")
    y = run(qkv2, w2, w2, pe2, H, KVH, 1e-6, isa)
    assert_bitwise(x[0], y[0], "hd=2 q")
    assert_bitwise(x[1], y[1], "hd=2 k")


@pytest.mark.parametrize("bad, exc", [("neox", ValueError), ("HALF", ValueError),
                                      ("", ValueError), (None, TypeError), (1, TypeError),
                                      (True, TypeError)])
def test_bad_rope_pairs(bad, exc):
    T, H, KVH, hd = 3, 2, 1, 8
    rng = np.random.default_rng(1)
    qkv = f32(rng, T, (H + 2 * KVH) * hd)
    qo, ko = np.full((H, T, hd), 7.0, np.float32), np.full((KVH, T, hd), 7.0, np.float32)
    with pytest.raises(exc, match=r"^qknorm_rope: rope_pairs must be"):
        K.qknorm_rope(qkv, f32(rng, hd), f32(rng, hd), f32(rng, T, hd // 2, 2, 2), qo, ko, H, KVH,
                      1e-6, rope_pairs=bad)
    assert np.all(qo == 7.0) and np.all(ko == 7.0)
