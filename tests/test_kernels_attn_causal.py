"""Tests of causal attention, ``K.attention(..., causal=True)`` (the Qwen3 text encoder's
attention): query row t attends keys j <= t only, the key mask still applies, grouped K/V heads.

Oracles: a float64 numpy causal softmax attention written here (sharing no code with the C), and
torch's scaled_dot_product_attention(is_causal=True). Tolerance: the bound of
tests/test_kernels_ops.py's ref_attention, re-derived below for a row's own key count. Structural
checks are bit for bit: keys after t never change row t (the property that makes right padding
harmless), head bands, the last row equal to the full attention's, and causal=False unchanged.
"""
import math

import numpy as np
import pytest

from kernelutil import (ISAS, SIMD_ISAS, assert_bitwise, assert_within, band_edges, bits,
                        ref_attention_gqa)
from nxhpc import _kernels as K

U = 2.0 ** -24           # float32 unit roundoff
TINY = 2.0 ** -149 * 4   # absolute floor: a few subnormal ulps
# T from one key to more than two tiles of every variant (generic 64 keys, AVX2 16, AVX-512 64)
# and past one query block (AVX2 64 rows, AVX-512 192): 1, tile edges, 200 and 450.
TS = [1, 2, 7, 16, 17, 63, 64, 65, 129, 200, 450]


def inputs(T, H, KVH, hd, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((H, T, hd)) * scale).astype(np.float32)
    k = (rng.standard_normal((KVH, T, hd)) * scale).astype(np.float32)
    qkv = rng.standard_normal((T, (H + 2 * KVH) * hd)).astype(np.float32)
    return q, k, qkv, rng


def ref_causal(q, k, qkv, KVH, scale, mask=None):
    """float64 causal attention with GQA; returns (out [T, H*hd], bound [T, H*hd]).

    Row t sums over n_t <= t + 1 keys: the bound of :func:`kernelutil.ref_attention_gqa` over
    n_t terms.
    """
    T = q.shape[1]
    allowed = np.tril(np.ones((T, T), bool))
    if mask is not None:
        allowed &= mask.astype(bool)[None, :]
    return ref_attention_gqa(q, k, qkv, KVH, scale, allowed,
                             allowed.sum(axis=1, keepdims=True).astype(np.float64))


def run(q, k, qkv, KVH, scale, isa, causal=True, **kw):
    out = np.full((q.shape[1], q.shape[0] * q.shape[2]), np.nan, np.float32)
    return K.attention(q, k, qkv, out, KVH, scale, isa=isa, causal=causal, **kw)


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("heads", [(8, 2), (8, 8), (1, 1)])
@pytest.mark.parametrize("mask_kind", ["none", "random", "sparse"])
def test_causal_vs_float64(T, heads, mask_kind):
    H, KVH = heads
    hd = 32 if T > 100 else 40  # 40: not a multiple of 16 (the micro-kernels' masked v tail)
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=T * 7 + H + len(mask_kind), scale=1.5)
    mask = {"none": None, "random": rng.random(T) < 0.7, "sparse": rng.random(T) < 0.1}[mask_kind]
    scale = 1.0 / math.sqrt(hd)
    ref, bound = ref_causal(q, k, qkv, KVH, scale, mask)
    outs = {}
    for isa in ISAS:
        outs[isa] = run(q, k, qkv, KVH, scale, isa, mask=mask)
        assert_within(outs[isa], ref, bound, f"causal[{isa}] T={T} {heads} {mask_kind}")
    for isa in SIMD_ISAS:  # both within `bound` of the truth -> within 2*bound of each other
        assert_within(outs[isa], outs["generic"].astype(np.float64), 2 * bound, f"{isa} vs generic")
    # negative control: the full attention is a different function (it fails this bound) once
    # some row has an attended key after it (not at T = 1, nor when only key 0 is attended)
    if T > 1 and (mask is None or mask[1:].any()):
        full = run(q, k, qkv, KVH, scale, "generic", causal=False, mask=mask)
        assert (np.abs(full - ref) > bound).any(), "the non-causal result passed the causal check"


def test_causal_head_dim_128_vs_torch_sdpa():
    torch = pytest.importorskip("torch")
    T, H, KVH, hd = 150, 8, 2, 128
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=5, scale=2.0)
    v = qkv[:, (H + KVH) * hd:].reshape(T, KVH, hd).transpose(1, 0, 2)
    rep = H // KVH
    tq = torch.from_numpy(q)[None]
    tk = torch.from_numpy(np.repeat(k, rep, axis=0))[None]
    tv = torch.from_numpy(np.ascontiguousarray(np.repeat(v, rep, axis=0)))[None]
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                           scale=hd ** -0.5)
    ref = ref[0].permute(1, 0, 2).reshape(T, H * hd).numpy().astype(np.float64)
    _, bound = ref_causal(q, k, qkv, KVH, hd ** -0.5)
    for isa in ISAS:  # torch is itself a float32 evaluation: our bound plus torch's -> 2x
        assert_within(run(q, k, qkv, KVH, hd ** -0.5, isa), ref, 2 * bound, f"{isa} vs torch")


@pytest.mark.parametrize("isa", ISAS)
def test_later_keys_never_change_a_row(isa):
    """Row t is a function of keys <= t alone, bit for bit: rewriting every later q, k and v, or
    cutting the sequence after t (right padding removed), leaves rows <= t unchanged."""
    T, H, KVH, hd = 203, 4, 2, 24
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=11)
    mask = rng.random(T) < 0.8
    sc = hd ** -0.5
    base = run(q, k, qkv, KVH, sc, isa, mask=mask)
    for t in (0, 15, 16, 63, 64, 100, 191, 192, 201):
        q2, k2, qkv2 = q.copy(), k.copy(), qkv.copy()
        q2[:, t + 1:] = rng.standard_normal(q2[:, t + 1:].shape) * 3
        k2[:, t + 1:] = rng.standard_normal(k2[:, t + 1:].shape) * 3
        qkv2[t + 1:] = 1e3
        got = run(q2, k2, qkv2, KVH, sc, isa, mask=mask)
        assert_bitwise(got[:t + 1], base[:t + 1], f"{isa}: later keys changed rows <= {t}")
        if t + 1 < T:  # negative control: the rewritten rows themselves do change
            assert not np.array_equal(got[t + 1:], base[t + 1:])
        n = t + 1  # the unpadded sequence of the first n tokens
        cut = run(np.ascontiguousarray(q[:, :n]), np.ascontiguousarray(k[:, :n]),
                  np.ascontiguousarray(qkv[:n]), KVH, sc, isa, mask=mask[:n])
        assert_bitwise(cut, base[:n], f"{isa}: prefix of {n} tokens")
    # negative control: without causality the first row does see the later keys
    full = run(q, k, qkv, KVH, sc, isa, causal=False, mask=mask)
    qkv3 = qkv.copy()
    qkv3[1:] = 1e3
    assert not np.array_equal(run(q, k, qkv3, KVH, sc, isa, causal=False, mask=mask)[0], full[0])


@pytest.mark.parametrize("isa", ISAS)
def test_rows_before_a_poisoned_tail_never_read_it(isa):
    """What is never read (docs/kernels.md, causal attention): v rows after a micro-block's last
    row, and k and v of key tiles after it. A tail of inf / NaN there (garbage past the end of
    a padded buffer) leaves every earlier row's bits as they are; the test above rewrites later
    rows only with finite values, where a read key's weight 0 hides the read (0 * v = 0).
    Rows within 8 of the tail are not checked: their micro-block (at most 8 rows) may reach it."""
    T, H, KVH, hd = 203, 4, 2, 24
    q, k, qkv, _ = inputs(T, H, KVH, hd, seed=12)
    sc = hd ** -0.5
    base = run(q, k, qkv, KVH, sc, isa)
    vcols = slice((H + KVH) * hd, (H + 2 * KVH) * hd)
    for p, what in ((100, "v"), (131, "v"), (64, "kv"), (192, "kv")):
        for bad in (np.inf, np.nan):
            k2, qkv2 = k.copy(), qkv.copy()
            qkv2[p:, vcols] = bad
            if what == "kv":              # p on a key tile's edge (16 or 64 keys): k too
                k2[:, p:] = bad
            got = run(q, k2, qkv2, KVH, sc, isa)
            assert_bitwise(got[:p - 8], base[:p - 8], f"{isa}: {what} from {p} = {bad}")
            # negative control: the rows that do attend the tail read it
            assert not np.isfinite(got[p:]).any(), (isa, p, what, bad)


@pytest.mark.parametrize("isa", ISAS)
def test_last_row_is_the_full_attention(isa):
    """The last query sees every key: its causal row equals the non-causal one bit for bit."""
    for T in (1, 5, 64, 97):
        q, k, qkv, rng = inputs(T, 6, 3, 16, seed=T)
        mask = rng.random(T) < 0.6
        for m in (None, mask):
            c = run(q, k, qkv, 3, 0.25, isa, mask=m)
            f = run(q, k, qkv, 3, 0.25, isa, causal=False, mask=m)
            assert_bitwise(c[T - 1], f[T - 1], f"T={T}")
            if T > 1:
                assert not np.array_equal(c[:T - 1], f[:T - 1])  # the others differ


@pytest.mark.parametrize("isa", ISAS)
def test_causal_with_mask_edges(isa):
    T, H, KVH, hd = 70, 2, 1, 8
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=3)
    # key 0 masked: row 0 has no key left -> zeros (the documented rule); rows 1.. are normal
    mask = np.ones(T, bool)
    mask[0] = False
    out = run(q, k, qkv, KVH, 0.3, isa, mask=mask)
    assert np.all(bits(out[0]) == 0)
    ref, bound = ref_causal(q, k, qkv, KVH, 0.3, mask)
    assert_within(out, ref, bound, isa)
    # a mask masking nothing == no mask, bit for bit
    assert_bitwise(run(q, k, qkv, KVH, 0.3, isa, mask=np.ones(T, np.uint8) * 5),
                   run(q, k, qkv, KVH, 0.3, isa), "all-attend mask")
    # every key masked: every row zeros
    assert np.all(bits(run(q, k, qkv, KVH, 0.3, isa, mask=np.zeros(T, bool))) == 0)


@pytest.mark.parametrize("isa", ISAS)
def test_causal_band_invariance_and_untouched(isa):
    T, H, KVH, hd = 140, 8, 2, 24
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=8)
    mask = rng.random(T) < 0.8
    full = run(q, k, qkv, KVH, 0.2, isa, mask=mask)
    for _ in range(5):
        edges = band_edges(rng, H, 5)
        out = np.full_like(full, 7.0)
        for a, b in zip(edges[:-1], edges[1:]):
            K.attention(q, k, qkv, out, KVH, 0.2, mask=mask, h0=a, h1=b, isa=isa, causal=True)
        assert_bitwise(out, full, f"bands {edges}")
    out = np.full_like(full, 7.0)
    K.attention(q, k, qkv, out, KVH, 0.2, mask=mask, h0=3, h1=6, isa=isa, causal=True)
    assert np.all(out[:, :3 * hd] == 7.0) and np.all(out[:, 6 * hd:] == 7.0)
    assert_bitwise(out[:, 3 * hd:6 * hd], full[:, 3 * hd:6 * hd])


@pytest.mark.parametrize("isa", ISAS)
def test_causal_false_is_the_default(isa):
    T, H, KVH, hd = 50, 4, 2, 16
    q, k, qkv, rng = inputs(T, H, KVH, hd, seed=1)
    a = np.empty((T, H * hd), np.float32)
    K.attention(q, k, qkv, a, KVH, 0.3, isa=isa)
    assert_bitwise(run(q, k, qkv, KVH, 0.3, isa, causal=False), a, "causal=False")
    assert_bitwise(run(q, k, qkv, KVH, 0.3, isa, causal=np.bool_(False)), a, "numpy bool")


@pytest.mark.parametrize("bad", [1, 0, None, "yes", 1.0, np.array([True])])
def test_causal_must_be_a_bool(bad):
    q, k, qkv, _ = inputs(4, 2, 1, 8, seed=0)
    out = np.full((4, 16), 7.0, np.float32)
    with pytest.raises(TypeError, match=r"^attention: causal must be a bool"):
        K.attention(q, k, qkv, out, 1, 0.3, causal=bad)
    assert np.all(out == 7.0)
    with pytest.raises(TypeError):
        K.attention(q, k, qkv, out, 1, 0.3, None, 0, None, None, True)  # keyword-only
