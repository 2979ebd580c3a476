"""Benchmarks of the block's non-matmul kernels: flash attention (vs torch SDPA and numpy), and the
memory-bound rmsnorm / qknorm_rope / swiglu / gated_residual at Z-Image width (vs numpy).

Run (every baseline limited to one thread):

    OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_attention.py --benchmark-only \
        --benchmark-columns=min,mean,rounds

Attention: T=1024, hd=128, H heads in one process; GFLOP/s = 4*T^2*hd*H / time (QK^T and PV) in
``extra_info`` with its fraction of this CPU's float32 FMA peak, measured once per session
(``_bench_util.peak_fields``: fma_zmm for the avx512 variant, fma_ymm for avx2, the fastest for
the baselines; an ISA asked for is first resolved to the code that runs there,
``nxhpc.runtime.peak.variant_at``: avxvnni's attention is avx2's). The other kernels report GB/s
of compulsory traffic. Correctness is checked after timing (float64 reference with the error
bound from tests/test_kernels_ops.py for attention).

bf16 vs f32 at the DiT's lengths (T = 1024, 2048, 4128; hd = 128; NXHPC_BENCH_HEADS heads, default
2 of Z-Image's 30): nxhpc's float32 and bf16 attention (csrc/nx_attn_bf16.h; every ISA with its
own bf16 kernel -- the AVX-512 BF16 one with each of its dots, ``avx512bf16:fma`` and
``avx512bf16:vdpbf16ps`` (``K.attention_bf16_dot``; ``auto_dot`` in ``extra_info`` is the one this
process runs by default) -- and the scalar generic spec at T <= 2048, one round) beside torch
SDPA in float32 and bfloat16, each output checked against float64 with its precision's bound,
GFLOP/s against the peak of the unit each runs on (``peak_kind``: fma_zmm for the FMA dot,
bf16_zmm for vdpbf16ps, amx_bf16 for AMX) and the machine's fastest bf16 unit. On a
shared machine add ``--benchmark-timer=time.process_time`` (wall clock counts other jobs' time).

bf16 where the softmax weights underflow: T=1152 with q and k scaled by 6 ("sharp") or 1, and the
text encoder's causal shape, per bf16 kernel beside torch's bfloat16 SDPA on the same inputs
(checked against float64 on the bfloat16-rounded inputs where the sharp scores make the bound of
the unrounded ones vacuous).
"""

import os

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from nxhpc import _kernels as K
from _bench_util import bench_stats, peak_fields, qknorm_rope_inputs, torch_threads

T_ATT, HD = 1024, 128
U = 2.0 ** -24
SIMD = [i for i in K.supported_isas() if i != "generic"]


def _peak(g, precision, isa=None):
    """``peak_fields`` of ``g`` GFLOP/s for the attention of ``precision`` ("f32", "bf16") asked
    for at ``isa`` (an ISA or an "isa:dot" label), against the unit of the code that runs there;
    None: a baseline, against this CPU's fastest unit of the precision."""
    return peak_fields(g, precision, isa, slot="attention" if precision == "f32" else "attention_bf16")


def _attn_case(H, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((H, T_ATT, HD), dtype=np.float32)
    k = rng.standard_normal((H, T_ATT, HD), dtype=np.float32)
    qkv = rng.standard_normal((T_ATT, 3 * H * HD), dtype=np.float32)
    return q, k, qkv


def _attn_info(benchmark, H, name, isa=None):
    flop = 4.0 * T_ATT * T_ATT * HD * H
    g = flop / bench_stats(benchmark).min / 1e9
    benchmark.extra_info.update({
        "impl": name, "T": T_ATT, "hd": HD, "H": H, "gflops_best": round(g, 1),
        "gflops_mean": round(flop / bench_stats(benchmark).mean / 1e9, 1),
        **_peak(g, "f32", isa)})


def _attn_check(out, q, k, qkv, H, heads=(0,), rows=64):
    """float64 reference + the worst-case bound of tests/test_kernels_ops.py on sampled rows."""
    scale = HD ** -0.5
    for h in heads:
        q64, k64 = q[h, :rows].astype(np.float64), k[h].astype(np.float64)
        v = qkv[:, 2 * H * HD + h * HD:2 * H * HD + (h + 1) * HD].astype(np.float64)
        s = q64 @ k64.T * scale
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ref = p @ v
        ds = (HD * U * scale * (np.abs(q64) @ np.abs(k64).T) + U * np.abs(s)).max(1, keepdims=True)
        bound = 2 * (2 * ds + 2 * (T_ATT + 16) * U + 4 * U) * (p @ np.abs(v))
        assert (np.abs(out[:rows, h * HD:(h + 1) * HD] - ref) <= bound).all()


@pytest.mark.parametrize("H", [2, 4])
@pytest.mark.parametrize("isa", SIMD)
def test_bench_attention_nxhpc(benchmark, H, isa):
    benchmark.group = f"attention T={T_ATT} hd={HD} H={H}"
    q, k, qkv = _attn_case(H)
    out = np.empty((T_ATT, H * HD), np.float32)
    benchmark.pedantic(K.attention, args=(q, k, qkv, out, H, HD ** -0.5), kwargs={"isa": isa},
                       rounds=7, warmup_rounds=1)
    _attn_info(benchmark, H, f"nxhpc[{isa}]", isa)
    _attn_check(out, q, k, qkv, H, heads=range(H))


@pytest.mark.parametrize("H", [2, 4])
def test_bench_attention_torch_sdpa(benchmark, H):
    benchmark.group = f"attention T={T_ATT} hd={HD} H={H}"
    q, k, qkv = _attn_case(H)
    v = qkv[:, 2 * H * HD:].reshape(T_ATT, H, HD).transpose(1, 0, 2)
    out = _torch_sdpa(benchmark, q, k, v, "float32", 7)
    _attn_info(benchmark, H, "torch.sdpa (1 thread)")
    _attn_check(out, q, k, qkv, H)


@pytest.mark.parametrize("H", [2, 4])
def test_bench_attention_numpy(benchmark, H):
    benchmark.group = f"attention T={T_ATT} hd={HD} H={H}"
    q, k, qkv = _attn_case(H)
    scale = np.float32(HD ** -0.5)
    out = np.empty((T_ATT, H * HD), np.float32)

    def run():
        for h in range(H):
            s = (q[h] @ k[h].T) * scale
            s -= s.max(axis=1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=1, keepdims=True)
            out[:, h * HD:(h + 1) * HD] = s @ qkv[:, 2 * H * HD + h * HD:2 * H * HD + (h + 1) * HD]
        return out

    with threadpool_limits(1):      # entered once, outside the timed calls
        benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    _attn_info(benchmark, H, "numpy float32 (1 thread)")
    _attn_check(out, q, k, qkv, H)


# ------------------------------------------------------------------ bf16 vs f32 at the DiT's lengths

# Z-Image at 1024x1024 images: T ~ 4128 tokens, D = 3840 = 30 heads x 128. All heads cost the same
# and nothing is shared between heads (1 thread), so the grid times NXHPC_BENCH_HEADS heads (default
# 2; 30 = the whole layer) and GFLOP/s = 4*T^2*hd*H / time counts QK^T and PV.
T_DIT = (1024, 2048, 4128)
H_DIT = int(os.environ.get("NXHPC_BENCH_HEADS", "2"))
_BF16_ISAS = [i for i in K.supported_isas() if K._variant("attention_bf16", i) == i]


def _dit_case(T, H, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((H, T, HD), dtype=np.float32)
    k = rng.standard_normal((H, T, HD), dtype=np.float32)
    qkv = rng.standard_normal((T, 3 * H * HD), dtype=np.float32)
    return q, k, qkv


def _dit_info(benchmark, T, H, name):
    flop = 4.0 * T * T * HD * H
    benchmark.extra_info.update({
        "impl": name, "T": T, "hd": HD, "H": H,
        "gflops_best": round(flop / bench_stats(benchmark).min / 1e9, 1),
        "gflops_mean": round(flop / bench_stats(benchmark).mean / 1e9, 1)})


def _torch_sdpa(benchmark, q, k, v, dtype, rounds, causal=False):
    """torch's SDPA on one thread, timed by ``benchmark``: q, k, v [H, T, hd] (a GQA's k and v
    already repeated per query head) cast to ``dtype``; returns the output, float32 [T, H*hd]."""
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a))[None].to(dt) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        with torch.no_grad():
            return sdpa(tq, tk, tv, is_causal=causal, scale=HD ** -0.5)

    with torch_threads(1):
        res = benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    H, T = q.shape[0], q.shape[1]
    return res[0].float().permute(1, 0, 2).reshape(T, H * HD).numpy()


def _bf16_round(a):
    """float32 -> the nearest bfloat16 value (ties to even), as float32 (finite inputs)."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def _bf16_check(out, q, k, qkv, T, H, extra=0.0, rows=32, causal=False, KVH=None,
                rounded=False):
    """float64 attention on sampled rows of head 0 vs the error bound of csrc/nx_attn_bf16.h
    (+ extra * sum w|v|, for an implementation that also rounds its output); ``causal``: the
    rows spread over [0, T), each against its keys j <= t (``KVH`` kv heads, default H).
    ``rounded``: the reference takes q, k, v rounded to bfloat16 as the kernels do, and the
    bound drops its input-rounding term (2u + u^2): for scores so large that this term alone
    exceeds 1 (sharp attention), where the bound of the unrounded inputs says nothing."""
    u, e = 2.0 ** -8, 2.0 ** -24
    if rounded:
        q, k, qkv = _bf16_round(q), _bf16_round(k), _bf16_round(qkv)
    sc = float(np.float32(HD ** -0.5))
    KVH = H if KVH is None else KVH
    idx = np.linspace(0, T - 1, rows).astype(int) if causal else np.arange(rows)
    q64, k64 = q[0, idx].astype(np.float64), k[0].astype(np.float64)
    v = qkv[:, (H + KVH) * HD:(H + KVH) * HD + HD].astype(np.float64)
    allowed = (np.arange(T)[None, :] <= idx[:, None]) if causal else np.ones((rows, T), bool)
    s = np.where(allowed, sc * (q64 @ k64.T), -np.inf)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    gam = lambda n: n * e / (1 - n * e)  # noqa: E731
    a = ((0.0 if rounded else 2 * u + u * u) + gam(HD) * (1 + u) ** 2) * sc * (
        np.abs(q64) @ np.abs(k64).T)
    a = np.where(allowed, a, 0.0)
    delta = (a + gam(2) * (np.where(allowed, np.abs(s), 0.0) + a)).max(1)  # c's rounding, s * c
    nt = -(-T // 64)
    R = s.max(1) - np.where(allowed, s, np.inf).min(1) + 2 * delta
    rho = (1 + u) * (1 + 2.0 ** -18) ** (nt + 1) * (1 + e) ** (2 * nt) * np.exp(2 * e * R) - 1
    eta = np.exp(delta) * (1 + rho) * (1 + gam(66 * nt + 8)) - 1
    coef = (2 * eta + u * (1 + eta)) / (1 - eta) + 2.0 ** -21 + extra
    bound = coef[:, None] * (p @ np.abs(v)) + 64 * nt * 2.0 ** -124 * (1 + np.abs(v).max())
    assert (np.abs(out[idx, :HD] - p @ v) <= bound).all()


# f32 at the best ISA; bf16 at every ISA with a bf16 attention of its own (AVX2, AVX-512 BF16 with
# each of its two dots, "avx512bf16:fma" / ":vdpbf16ps", K.attention_bf16_dot; AMX), and the
# scalar generic spec as the bf16 baseline (one round, T <= 2048: ~0.2 GFLOP/s)
_BF16_LABELS = [lab for i in _BF16_ISAS if i != "generic"
                for lab in ([f"{i}:fma", f"{i}:vdpbf16ps"] if i == "avx512bf16" else [i])]
_DIT_IMPLS = ([("f32", i) for i in SIMD[-1:]] + [("bf16", lab) for lab in _BF16_LABELS]
              + [("bf16", "generic")])


def _run_labelled(benchmark, label, args, kwargs, rounds, warmup_rounds=1):
    """K.attention timed at a variant label ("avx512bf16:vdpbf16ps": that ISA with that dot,
    the process's choice restored after); returns the process's own dot."""
    base, _, dot = label.partition(":")
    before = K.attention_bf16_dot()
    if dot:
        K.attention_bf16_dot(dot)
    try:
        benchmark.pedantic(K.attention, args=args, kwargs={"isa": base, **kwargs},
                           rounds=rounds, warmup_rounds=warmup_rounds)
    finally:
        K.attention_bf16_dot(before)
    return before


@pytest.mark.parametrize("T", T_DIT)
@pytest.mark.parametrize("impl,isa", _DIT_IMPLS or [("f32", None)], ids=str)
def test_bench_attention_dit_nxhpc(benchmark, T, impl, isa):
    isas = [isa] if isa else []
    if not isas:
        pytest.skip(f"no SIMD variant of the {impl} attention on this CPU")
    slow = isa == "generic"
    if slow and T > 2048:
        pytest.skip("the scalar bf16 spec takes minutes at this length")
    benchmark.group = f"attention T={T} hd={HD} H={H_DIT} (DiT, 1 thread)"
    q, k, qkv = _dit_case(T, H_DIT)
    out = np.empty((T, H_DIT * HD), np.float32)
    dot = isas[0].partition(":")[2]
    before = _run_labelled(benchmark, isas[0], (q, k, qkv, out, H_DIT, HD ** -0.5),
                           {"precision": impl}, 1 if slow else 3, 0 if slow else 1)
    _dit_info(benchmark, T, H_DIT, f"nxhpc {impl} [{isas[0]}]")
    g = benchmark.extra_info["gflops_best"]
    if dot:
        benchmark.extra_info.update({"dot": dot, "auto_dot": before})
    # against its unit's peak (the AVX-512 BF16 kernel's by its dot: fma_zmm or bf16_zmm) and
    # the machine's fastest unit of the precision
    benchmark.extra_info.update(_peak(g, impl, isas[0]))
    if impl == "f32":
        _attn_check_T(out, q, k, qkv, T, H_DIT)
    else:
        _bf16_check(out, q, k, qkv, T, H_DIT)


def _attn_check_T(out, q, k, qkv, T, H, rows=32):
    """The float32 attention's bound (tests/test_kernels_ops.py) on sampled rows of head 0."""
    scale = HD ** -0.5
    q64, k64 = q[0, :rows].astype(np.float64), k[0].astype(np.float64)
    v = qkv[:, 2 * H * HD:2 * H * HD + HD].astype(np.float64)
    s = q64 @ k64.T * scale
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ds = (HD * U * scale * (np.abs(q64) @ np.abs(k64).T) + U * np.abs(s)).max(1, keepdims=True)
    bound = 2 * (2 * ds + 2 * (T + 16) * U + 4 * U) * (p @ np.abs(v))
    assert (np.abs(out[:rows, :HD] - p @ v) <= bound).all()


@pytest.mark.parametrize("T", T_DIT)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_attention_dit_torch_sdpa(benchmark, T, dtype):
    benchmark.group = f"attention T={T} hd={HD} H={H_DIT} (DiT, 1 thread)"
    q, k, qkv = _dit_case(T, H_DIT)
    H = H_DIT
    v = qkv[:, 2 * H * HD:].reshape(T, H, HD).transpose(1, 0, 2)
    out = _torch_sdpa(benchmark, q, k, v, dtype, 3)
    _dit_info(benchmark, T, H, f"torch.sdpa {dtype} (1 thread)")
    benchmark.extra_info.update(_peak(benchmark.extra_info["gflops_best"],
                                      "f32" if dtype == "float32" else "bf16"))
    if dtype == "float32":
        _attn_check_T(out, q, k, qkv, T, H)
    else:  # bfloat16 inputs, bfloat16 output (one more rounding)
        _bf16_check(out, q, k, qkv, T, H, extra=2.0 ** -7)


# ------------------------------------------------------------------ causal attention (text encoder)

# Qwen3-4B's attention at the caption length cap: T=512, hd=128, query heads 4 per kv head (8 of
# its 32 query heads here). GFLOP/s counts the causal half only: 2*T*(T+1)*hd*H.
T_C, H_C, KVH_C = 512, 8, 2


def _causal_case(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((H_C, T_C, HD), dtype=np.float32)
    k = rng.standard_normal((KVH_C, T_C, HD), dtype=np.float32)
    qkv = rng.standard_normal((T_C, (H_C + 2 * KVH_C) * HD), dtype=np.float32)
    return q, k, qkv


def _causal_info(benchmark, name, precision, isa=None):
    """The causal row's GFLOP/s, against the peak of ``precision``'s unit (``_peak``)."""
    flop = 2.0 * T_C * (T_C + 1) * HD * H_C
    g = flop / bench_stats(benchmark).min / 1e9
    benchmark.extra_info.update({"impl": name, "T": T_C, "hd": HD, "H": H_C, "KVH": KVH_C,
                                 "gflops_best": round(g, 1), **_peak(g, precision, isa)})


def _causal_check(out, q, k, qkv, rows=(0, 1, 63, 64, 200, 511)):
    """float64 causal reference on sampled rows of head 0 and the last head, the bound of
    tests/test_kernels_attn_causal.py."""
    scale = HD ** -0.5
    for h in (0, H_C - 1):
        g = h // (H_C // KVH_C)
        v = qkv[:, (H_C + KVH_C) * HD + g * HD:(H_C + KVH_C) * HD + (g + 1) * HD]
        for t in rows:
            q64, k64, v64 = (a.astype(np.float64) for a in (q[h, t], k[g, :t + 1], v[:t + 1]))
            s = k64 @ q64 * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            ds = (HD * U * scale * (np.abs(k64) @ np.abs(q64)) + U * np.abs(s)).max()
            bound = 2 * (2 * ds + 2 * (t + 17) * U + 4 * U) * (p @ np.abs(v64))
            assert (np.abs(out[t, h * HD:(h + 1) * HD] - p @ v64) <= bound + 1e-30).all()


@pytest.mark.parametrize("isa", SIMD)
def test_bench_attention_causal_nxhpc(benchmark, isa):
    benchmark.group = f"causal attention T={T_C} hd={HD} H={H_C} KVH={KVH_C}"
    q, k, qkv = _causal_case()
    out = np.empty((T_C, H_C * HD), np.float32)
    benchmark.pedantic(K.attention, args=(q, k, qkv, out, KVH_C, HD ** -0.5),
                       kwargs={"isa": isa, "causal": True}, rounds=7, warmup_rounds=1)
    _causal_info(benchmark, f"nxhpc[{isa}]", "f32", isa)
    _causal_check(out, q, k, qkv)


# ------------------------------------------------------------------ bf16 weights that underflow

# Where most softmax weights E(x - m) underflow: sharp scores (q and k x SHARP: a row's scores
# spread over hundreds of units of log2, as in heads that attend to a few keys) at a 512x512
# call's length, and the text encoder's causal diagonal (every tile on it has keys a row must
# not see). Such a weight is below 2^-126 before bf() flushes it; without FTZ each vector
# holding one costs a microcode assist on Intel cores (csrc/nx_attn_bf16_amx.c). Each bf16
# kernel beside its own diffuse case (x 1) and torch's bfloat16 SDPA on the same inputs.
T_SH, H_SH, SHARP = 1152, 2, 6.0


def _sharp_case(scale, seed=0):
    q, k, qkv = _dit_case(T_SH, H_SH, seed)
    return q * np.float32(scale), k * np.float32(scale), qkv


@pytest.mark.parametrize("qk_scale", [1.0, SHARP], ids=["diffuse", "sharp"])
@pytest.mark.parametrize("isa", _BF16_LABELS or [None])
def test_bench_attention_bf16_sharp_nxhpc(benchmark, isa, qk_scale):
    if isa is None:
        pytest.skip("no SIMD bf16 attention on this CPU")
    benchmark.group = f"bf16 attention, sharp scores: T={T_SH} hd={HD} H={H_SH} q, k x {SHARP}"
    q, k, qkv = _sharp_case(qk_scale)
    out = np.empty((T_SH, H_SH * HD), np.float32)
    _run_labelled(benchmark, isa, (q, k, qkv, out, H_SH, HD ** -0.5), {"precision": "bf16"}, 5)
    _dit_info(benchmark, T_SH, H_SH, f"nxhpc bf16 [{isa}] q, k x {qk_scale}")
    benchmark.extra_info.update(_peak(benchmark.extra_info["gflops_best"], "bf16", isa))
    _bf16_check(out, q, k, qkv, T_SH, H_SH, rounded=True)


def test_bench_attention_bf16_sharp_torch_sdpa(benchmark):
    benchmark.group = f"bf16 attention, sharp scores: T={T_SH} hd={HD} H={H_SH} q, k x {SHARP}"
    q, k, qkv = _sharp_case(SHARP)
    v = qkv[:, 2 * H_SH * HD:].reshape(T_SH, H_SH, HD).transpose(1, 0, 2)
    out = _torch_sdpa(benchmark, q, k, v, "bfloat16", 5)
    _dit_info(benchmark, T_SH, H_SH, f"torch.sdpa bfloat16 q, k x {SHARP} (1 thread)")
    benchmark.extra_info.update(_peak(benchmark.extra_info["gflops_best"], "bf16"))
    _bf16_check(out, q, k, qkv, T_SH, H_SH, extra=2.0 ** -7, rounded=True)


@pytest.mark.parametrize("isa", _BF16_LABELS or [None])
def test_bench_attention_causal_bf16_nxhpc(benchmark, isa):
    if isa is None:
        pytest.skip("no SIMD bf16 attention on this CPU")
    benchmark.group = f"causal bf16 attention T={T_C} hd={HD} H={H_C} KVH={KVH_C}"
    q, k, qkv = _causal_case()
    out = np.empty((T_C, H_C * HD), np.float32)
    _run_labelled(benchmark, isa, (q, k, qkv, out, KVH_C, HD ** -0.5),
                  {"precision": "bf16", "causal": True}, 7)
    _causal_info(benchmark, f"nxhpc bf16 [{isa}]", "bf16", isa)
    _bf16_check(out, q, k, qkv, T_C, H_C, causal=True, KVH=KVH_C)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_attention_causal_torch_sdpa(benchmark, dtype):
    bf = dtype == "bfloat16"
    benchmark.group = f"causal {'bf16 ' if bf else ''}attention T={T_C} hd={HD} H={H_C} KVH={KVH_C}"
    q, k, qkv = _causal_case()
    rep = H_C // KVH_C
    v = qkv[:, (H_C + KVH_C) * HD:].reshape(T_C, KVH_C, HD).transpose(1, 0, 2)
    out = _torch_sdpa(benchmark, q, np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0),
                      dtype, 7, causal=True)
    # against the fastest unit of its precision (the baselines' rule): bf16 for bfloat16
    _causal_info(benchmark, f"torch.sdpa {dtype} is_causal (1 thread)", "bf16" if bf else "f32")
    if bf:  # bfloat16 inputs and output
        _bf16_check(out, q, k, qkv, T_C, H_C, extra=2.0 ** -7, causal=True, KVH=KVH_C)
    else:
        _causal_check(out, q, k, qkv)


# ------------------------------------------------------------------ memory-bound kernels, T=256, D=3840

T_MB, D, NH, FFN = 256, 3840, 30, 10240


def _gbs(benchmark, nbytes, name):
    benchmark.extra_info.update({"impl": name, "GB/s_best": round(nbytes / bench_stats(benchmark).min / 1e9, 2)})


@pytest.mark.parametrize("impl", ["nxhpc", "numpy"])
def test_bench_rmsnorm(benchmark, impl):
    benchmark.group = f"rmsnorm+mod T={T_MB} D={D}"
    rng = np.random.default_rng(1)
    x = rng.standard_normal((T_MB, D), dtype=np.float32)
    w, mod = rng.standard_normal(D, dtype=np.float32), rng.standard_normal(D, dtype=np.float32)
    out = np.empty_like(x)
    if impl == "nxhpc":
        benchmark(K.rmsnorm, x, w, out, 1e-6, mod)
    else:
        def run():
            np.multiply(x, (1.0 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + np.float32(1e-6))), out=out)
            out[...] *= w * mod
        benchmark(run)
    _gbs(benchmark, 2 * x.nbytes, impl)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(1, keepdims=True) + 1e-6) * w * mod
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["nxhpc", "numpy"])
def test_bench_qknorm_rope(benchmark, impl):
    benchmark.group = f"qknorm_rope T={T_MB} H={NH} hd={HD}"
    rng = np.random.default_rng(2)
    qkv, qw, kw, pe = qknorm_rope_inputs(rng, T_MB, NH, HD)
    qo, ko = np.empty((NH, T_MB, HD), np.float32), np.empty((NH, T_MB, HD), np.float32)
    if impl == "nxhpc":
        benchmark(K.qknorm_rope, qkv, qw, kw, pe, qo, ko, NH, NH, 1e-6)
    else:
        def run():
            for j, (w, dst) in enumerate([(qw, qo), (kw, ko)]):
                x = qkv[:, j * D:(j + 1) * D].reshape(T_MB, NH, HD)
                y = x / np.sqrt(np.mean(x * x, axis=2, keepdims=True) + np.float32(1e-6)) * w
                y0, y1 = y[..., 0::2], y[..., 1::2]
                o = np.empty_like(y)
                o[..., 0::2] = pe[:, None, :, 0, 0] * y0 + pe[:, None, :, 0, 1] * y1
                o[..., 1::2] = pe[:, None, :, 1, 0] * y0 + pe[:, None, :, 1, 1] * y1
                dst[...] = o.transpose(1, 0, 2)
        benchmark(run)
    _gbs(benchmark, 4 * T_MB * D * 4 + pe.nbytes, impl)
    x = qkv[:, :D].reshape(T_MB, NH, HD).astype(np.float64)
    y = x / np.sqrt((x * x).mean(2, keepdims=True) + 1e-6) * qw
    ref0 = pe[:, None, :, 0, 0] * y[..., 0::2] + pe[:, None, :, 0, 1] * y[..., 1::2]
    assert np.allclose(qo.transpose(1, 0, 2)[..., 0::2], ref0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["nxhpc", "numpy"])
def test_bench_swiglu(benchmark, impl):
    benchmark.group = f"swiglu T={T_MB} F={FFN}"
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((T_MB, FFN), dtype=np.float32), rng.standard_normal((T_MB, FFN), dtype=np.float32)
    out = np.empty_like(a)
    if impl == "nxhpc":
        benchmark(K.swiglu, a, b, out)
    else:
        benchmark(lambda: np.multiply(a / (np.float32(1) + np.exp(-a)), b, out=out))
    _gbs(benchmark, 3 * a.nbytes, impl)
    a64 = a.astype(np.float64)
    assert np.allclose(out, a64 / (1 + np.exp(-a64)) * b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["nxhpc", "numpy"])
def test_bench_gated_residual(benchmark, impl):
    benchmark.group = f"gated_residual T={T_MB} D={D}"
    rng = np.random.default_rng(4)
    r, y = rng.standard_normal((T_MB, D), dtype=np.float32), rng.standard_normal((T_MB, D), dtype=np.float32)
    g = rng.standard_normal(D, dtype=np.float32)
    out = np.empty_like(r)
    if impl == "nxhpc":
        benchmark(K.gated_residual, r, y, g, out)
    else:
        benchmark(lambda: np.add(r, np.tanh(g) * y, out=out))
    _gbs(benchmark, 3 * r.nbytes, impl)
    assert np.allclose(out, r + np.tanh(g.astype(np.float64)) * y, rtol=1e-5, atol=1e-6)
