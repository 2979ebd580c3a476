"""Helpers shared by the kernel tests (tests/test_kernels_*.py): bit comparisons, the float32
error bound of the matmul's documented summation order, and GGUF weights of each type made by
the `gguf` package (never by nxhpc).

Owns nothing the kernels use; must not import anything from nxhpc but the compiled kernels.
"""
import gguf
import numpy as np
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nxhpc import _kernels as K
from nxhpc.formats.ggml_blocks import BLOCK_DTYPES, QUANT_BLOCKS

ISAS = K.supported_isas()
SIMD_ISAS = [i for i in ISAS if i != "generic"]
EPS32 = 2.0 ** -24          # unit roundoff of float32 (round to nearest)
EPS64 = 2.0 ** -53
CHAIN = 128                 # k-steps per fma chain of the matmul's two-level sum (nx_matmul.h)
GGML = gguf.GGMLQuantizationType


def isa_chain(isa):
    """isa, its parent, ..., "generic": where a kernel missing at `isa` comes from."""
    isas = K.cpu_features()["isas"]
    out = [isa]
    while out[-1] != "generic":
        out.append(isas[out[-1]]["parent"])
    return out


def expected_variant(have, isa):
    """The variant a kernel with SIMD variants at the ISAs in `have` runs when `isa` is requested:
    the first of them on isa's chain, else generic (stays right when an ISA is added above)."""
    return next((a for a in isa_chain(isa) if a in have), "generic")


def bits(a):
    """Bit pattern of a float32 array (compares NaNs and signed zeros exactly)."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def assert_bitwise(a, b, what=""):
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    diff = np.flatnonzero(bits(a) != bits(b))
    assert diff.size == 0, f"{what}: {diff.size} elements differ, first at flat {diff[:5]}"


def matmul_bound(K, mag):
    """Error bound of the matmul's two-level sum vs the exact sum, times sum_k |x_k w_k| = mag.

    The contract: K cut into C = ceil(K/128) chunks; inside a chunk one float32 fma chain from +0
    (each fma rounds once, relative error <= u = 2^-24); the chunk sums added in order (C - 1
    float32 additions). Each product therefore passes through at most n = min(K, 128) + C - 1
    roundings, so |fl - exact| <= gamma_n * sum |x||w| with gamma_n = n u / (1 - n u) (Higham,
    Accuracy and Stability, sec. 3.1 / 3.5). The float64 reference (BLAS dgemm, any order) adds
    at most gamma_K(2^-53) * sum |x||w|. Both are strict bounds, not fudge factors. (A single
    K-long chain would need n = K: at K = 4128 that is 26x looser.)
    """
    n = min(K, CHAIN) + max(-(-K // CHAIN) - 1, 0)
    gamma32 = n * EPS32 / (1.0 - n * EPS32)
    gamma64 = 2 * K * EPS64 / (1.0 - 2 * K * EPS64)
    return (gamma32 + gamma64) * mag + 1e-300


# ----------------------------------------------------------------------------- GGUF weights

#: Every weight type the kernels run -- the tests' own list, not read from the kernels: the
#: tests of each type are parametrized over it, and test_kernels_wtype.py's guard fails when the
#: C traits table holds a type missing here.
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K")


def gguf_bytes(w32, wtype):
    """The raw GGUF bytes (uint8 [N, rowbytes]) of float32 [N, K] values stored as `wtype`,
    written by the gguf package: quants.quantize for BF16, Q8_0 and Q4_0 .. Q5_1 (for BF16
    ggml's round-to-nearest-even with NaN quieted), numpy's astype for F16, the bytes themselves
    for F32. (gguf has no K-quant encoder: NotImplementedError.)"""
    w32 = np.ascontiguousarray(w32, dtype=np.float32)
    if wtype == "F32":
        raw = w32.view(np.uint8)
    elif wtype == "F16":
        raw = w32.astype(np.float16).view(np.uint8)
    else:
        raw = gguf_quantize(w32, GGML[wtype])
    return np.ascontiguousarray(raw.reshape(w32.shape[0], -1))


def gguf_values(raw, wtype):
    """float32 [N, K] values of GGUF bytes per gguf.quants.dequantize (the independent decoder)."""
    return np.asarray(gguf_dequantize(raw, GGML[wtype]), dtype=np.float32)


def finite_scale_blocks(rng, wtype, N, Kd, specials=False):
    """Raw blocks of `wtype` with every code and sub-scale byte random (so every code value and
    every packing of the 6-bit scales occurs) and finite f16 scales (the layouts' d / m / dmin
    fields, nxhpc.formats.ggml_blocks) spread over 2^-14 .. 2^2; with `specials`, some scale
    fields are inf or NaN."""
    dt = BLOCK_DTYPES[wtype]
    w = rng.integers(0, 256, (N, Kd // QUANT_BLOCKS[wtype].elems * dt.itemsize), dtype=np.uint8)
    blocks = w.reshape(-1, dt.itemsize).view(dt)[:, 0]
    for f in ("d", "m", "dmin"):
        if f in dt.names:
            d = (rng.choice([-1, 1], blocks.size) * 2.0 ** rng.uniform(-14, 2, blocks.size))
            d = d.astype("<f2")
            if specials:
                d[rng.choice(d.size, 3, replace=False)] = [np.inf, -np.inf, np.nan]
            blocks[f] = d
    return w


def random_weight(rng, n, k, wtype, scale=1.0):
    """gguf-written bytes of a random [n, k] weight, and their float64 values."""
    raw = gguf_bytes((rng.standard_normal((n, k)) * scale).astype(np.float32), wtype)
    return raw, gguf_values(raw, wtype).astype(np.float64)


def ref_attention_gqa(q, k, qkv, KVH, scale, allowed, terms):
    """float64 attention with GQA (query head h reads kv group h // (H/KVH), values from the
    joint ``qkv`` row), each query row t over the keys ``allowed[t]`` ([T, T] bool); returns
    (out [T, H*hd], bound [T, H*hd]). A row with no allowed key is 0.

    Bound: logits s_j = scale * q.k_j are float32 FMA chains over hd, so
    |ds_j| <= hd*u*|scale|*sum_d |q_d k_jd| + u|s_j| =: D_j; the softmax weights then carry a
    relative error <= 2 max_j D_j + (exp polynomial, 2 ulp) + (running sum and per-tile
    rescaling over ``terms`` keys, <= (terms + 16) u); the output, a float32 sum of p_j v_j,
    adds (terms + 16) u sum_j p_j|v_j|. Total: (2 max D + 2 (terms + 16) u + 4u) *
    sum_j p_j |v_j|, doubled for safety, plus a floor of a few subnormal ulps.
    """
    H, T, hd = q.shape
    out = np.zeros((T, H * hd))
    bound = np.zeros((T, H * hd))
    for h in range(H):
        g = h // (H // KVH)
        q64, k64 = q[h].astype(np.float64), k[g].astype(np.float64)
        v = qkv[:, (H + KVH) * hd + g * hd:(H + KVH) * hd + (g + 1) * hd].astype(np.float64)
        s = q64 @ k64.T * scale
        ds = hd * EPS32 * abs(scale) * (np.abs(q64) @ np.abs(k64).T) + EPS32 * np.abs(s)
        s[~allowed] = -np.inf
        ds[~allowed] = 0.0
        m = s.max(axis=1, keepdims=True) if T else 0.0
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)
        out[:, h * hd:(h + 1) * hd] = p @ v
        dmax = ds.max(axis=1, keepdims=True) if T else 0
        bound[:, h * hd:(h + 1) * hd] = 2 * (2 * dmax + 2 * (terms + 16) * EPS32 + 4 * EPS32) \
            * (p @ np.abs(v))
    return out, bound + 2.0 ** -149 * 4


def assert_within(got, ref, bound, what=""):
    """|got - ref| <= bound element-wise (float64); equal values (infinities included) count as
    exact, and NaN where ``ref`` is NaN too."""
    got = np.asarray(got).astype(np.float64)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(got - ref))
    bad = ~(err <= bound)
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} outside the bound; worst ratio "
                           f"{np.nanmax(err / np.maximum(bound, 1e-300)):.3g}")


def band_edges(rng, m, max_cuts):
    """A random split of ``[0, m)`` into bands, as edges ``[0, c_1, ..., c_k, m]`` with
    ``1 <= k < max_cuts`` sorted cuts drawn from ``[0, m]`` (empty bands included)."""
    cuts = np.sort(rng.integers(0, m + 1, size=rng.integers(1, max_cuts)))
    return [0, *cuts.tolist(), m]


def assert_error_names(case, functions):
    """``case`` = (name, call, exception type, ...): ``call()`` raises that type with a message
    naming one of ``functions``; returns the message."""
    import pytest
    name, call, exc = case[:3]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert any(fn in msg for fn in functions), f"{name}: error does not name the function: {msg}"
    return msg
