"""Benchmarks of the backward kernels (nxhpc._kernels.*_backward) against torch.autograd (float32,
one thread, backward pass only: the forward graph is built outside the timer and
``torch.autograd.grad(..., retain_graph=True)`` is timed).

Run:

    OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_backward.py --benchmark-only \
        --benchmark-columns=min,mean,rounds

Attention: T=1024, hd=128, H heads (MHA); GFLOP/s in ``extra_info`` counts 10*T^2*hd per head
(S = QK^T and dP = dO V^T recomputed, dQ, dK, dV), with its fraction of this CPU's float32 FMA
peak, measured once per session (``_bench_util.peak_fields``: fma_zmm for the avx512 variant,
fma_ymm for avx2, the fastest for generic code and torch; the ISA asked for resolved to the
variant that runs there, ``nxhpc.runtime.peak.variant_at``). The memory-bound kernels run at Z-Image width
(D=3840, FFN 10240, 30 heads of 128) and report GB/s of compulsory traffic. Correctness is
checked after timing against float64 references (tolerances of tests/test_kernels_bwd.py's kind:
relative to the magnitude of the terms).
"""
import numpy as np
import pytest

from nxhpc import _kernels as K
from _bench_util import bench_stats, peak_fields, qknorm_rope_inputs, rope_pe, torch_threads

torch = pytest.importorskip("torch")

T_ATT, HD = 1024, 128
T_MB, D, NH, FFN = 256, 3840, 30, 10240
SIMD = [i for i in K.supported_isas() if i != "generic"]
#: The memory-bound kernels' contenders: the AVX-512 variant (where the CPU has it), the
#: generic spec and torch autograd.
IMPLS = [pytest.param("avx512", marks=pytest.mark.skipif("avx512" not in SIMD,
                                                         reason="no AVX-512")),
         "generic", "torch"]


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def _gbs(benchmark, nbytes, name):
    benchmark.extra_info.update({"impl": name,
                                 "GB/s_best": round(nbytes / bench_stats(benchmark).min / 1e9, 2)})


def _torch_bwd(fn, inputs, upstream):
    """A callable running only the backward of fn(*inputs) (float32 torch, graph kept)."""
    ts = [torch.from_numpy(a.copy()).requires_grad_(True) for a in inputs]
    out = fn(*ts)
    g = torch.from_numpy(upstream)
    return lambda: torch.autograd.grad(out, ts, grad_outputs=g, retain_graph=True)


# ------------------------------------------------------------------ attention backward

def _attn_case(H, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((H, T_ATT, HD), dtype=np.float32) for _ in range(4)]


def _attn_info(benchmark, H, name, isa=None):
    """GFLOP/s against the peak of the code that runs at ``isa`` (``variant_at``: an ISA with no
    attention_backward of its own runs its ancestor's); None (torch): the fastest float32 unit."""
    flop = 10.0 * T_ATT * T_ATT * HD * H
    g = flop / bench_stats(benchmark).min / 1e9
    benchmark.extra_info.update({"impl": name, "T": T_ATT, "hd": HD, "H": H, "gflops_best": round(g, 1),
                                 **peak_fields(g, "f32", isa, slot="attention_backward")})


def _attn_check(grads, q, k, v, dout, rows=32):
    """float64 dq rows of head 0 and dv of head 0 (P^T dO over all query rows)."""
    sc = HD ** -0.5
    q64, k64, v64, d64 = (a[0].astype(np.float64) for a in (q, k, v, dout))
    s = q64 @ k64.T * np.float32(sc)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dp = d64 @ v64.T
    ds = p * (dp - (p * dp).sum(1, keepdims=True))
    dq_ref = np.float32(sc) * ds[:rows] @ k64
    dv_ref = p.T @ d64
    # error ~ u * (T + hd) * magnitude of the terms: bound with 8x margin
    pdp = np.abs(p * dp).sum(1, keepdims=True)[:rows]
    mag_q = np.float32(sc) * (np.abs(p[:rows]) * (np.abs(dp[:rows]) + pdp)) @ np.abs(k64)
    assert (np.abs(grads[0][0, :rows] - dq_ref) <= 8 * 2.0 ** -24 * (T_ATT + HD) * mag_q + 1e-30).all()
    mag_v = np.abs(p).T @ np.abs(d64)
    assert (np.abs(grads[2][0] - dv_ref) <= 8 * 2.0 ** -24 * (T_ATT + HD) * mag_v + 1e-30).all()


@pytest.mark.parametrize("H", [2])
@pytest.mark.parametrize("isa", K.supported_isas())
def test_bench_attention_backward_nxhpc(benchmark, H, isa):
    benchmark.group = f"attention_backward T={T_ATT} hd={HD} H={H}"
    q, k, v, dout = _attn_case(H)
    outs = [np.empty_like(q) for _ in range(3)]
    benchmark.pedantic(K.attention_backward, args=(q, k, v, dout, *outs, HD ** -0.5),
                       kwargs={"isa": isa}, rounds=5, warmup_rounds=1)
    _attn_info(benchmark, H, f"nxhpc[{isa}]", isa)
    _attn_check(outs, q, k, v, dout)


@pytest.mark.parametrize("H", [2])
def test_bench_attention_backward_torch(benchmark, H):
    benchmark.group = f"attention_backward T={T_ATT} hd={HD} H={H}"
    q, k, v, dout = _attn_case(H)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    run = _torch_bwd(lambda a, b, c: sdpa(a, b, c, scale=HD ** -0.5), [q, k, v], dout)
    grads = benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    _attn_info(benchmark, H, "torch autograd sdpa (1 thread)")
    _attn_check([g.numpy() for g in grads], q, k, v, dout)


# ------------------------------------------------------------------ memory-bound backward kernels

@pytest.mark.parametrize("impl", IMPLS)
def test_bench_rmsnorm_backward(benchmark, impl):
    benchmark.group = f"rmsnorm_backward+mod T={T_MB} D={D}"
    rng = np.random.default_rng(1)
    x, dy = (rng.standard_normal((T_MB, D), dtype=np.float32) for _ in range(2))
    w, mod = rng.standard_normal(D, dtype=np.float32), rng.standard_normal(D, dtype=np.float32)
    if impl == "torch":
        run = _torch_bwd(lambda a: a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6)
                         * torch.from_numpy(w) * torch.from_numpy(mod), [x], dy)
        dx = benchmark(run)[0].numpy()
    else:
        dx, dw = np.empty_like(x), np.empty(D, np.float32)
        benchmark(K.rmsnorm_backward, x, w, dy, dx, 1e-6, mod=mod, dw=dw, isa=impl)
    _gbs(benchmark, 3 * x.nbytes, impl)
    x64 = x.astype(np.float64)
    inv = 1 / np.sqrt((x64 * x64).mean(1, keepdims=True) + np.float32(1e-6))
    g = dy * w.astype(np.float64) * mod
    ref = inv * (g - x64 * inv ** 2 * (g * x64).mean(1, keepdims=True))
    mag = inv * (np.abs(g) + np.abs(x64) * inv ** 2 * np.abs(g * x64).mean(1, keepdims=True))
    assert (np.abs(dx - ref) <= 2.0 ** -24 * (D + 8) * mag).all()


@pytest.mark.parametrize("impl", ["avx512", "avx2", "generic", "torch"])
def test_bench_swiglu_backward(benchmark, impl):
    if impl in ("avx512", "avx2") and impl not in SIMD:
        pytest.skip(f"no {impl}")
    benchmark.group = f"swiglu_backward T={T_MB} F={FFN}"
    rng = np.random.default_rng(3)
    a, b, g = (rng.standard_normal((T_MB, FFN), dtype=np.float32) for _ in range(3))
    if impl == "torch":
        run = _torch_bwd(lambda x, y: torch.nn.functional.silu(x) * y, [a, b], g)
        da, db = (t.numpy() for t in benchmark(run))
    else:
        da, db = np.empty_like(a), np.empty_like(a)
        benchmark(K.swiglu_backward, a, b, g, da, db, isa=impl)
    _gbs(benchmark, 5 * a.nbytes, impl)
    a64 = a.astype(np.float64)
    s = 1 / (1 + np.exp(-a64))
    assert (np.abs(db - g * a64 * s) <= 64 * 2.0 ** -24 * np.abs(g * a64 * s) + 1e-30).all()
    assert (np.abs(da - g * b * s * (1 + a64 * (1 - s)))
            <= 64 * 2.0 ** -24 * np.abs(g * b) * s * (1 + np.abs(a64) * (1 - s)) + 1e-30).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_bench_gated_residual_backward(benchmark, impl):
    benchmark.group = f"gated_residual_backward T={T_MB} D={D}"
    rng = np.random.default_rng(4)
    y, g = (rng.standard_normal((T_MB, D), dtype=np.float32) for _ in range(2))
    gate = rng.standard_normal(D, dtype=np.float32)
    if impl == "torch":
        run = _torch_bwd(lambda yy, gg: torch.tanh(gg) * yy, [y, gate], g)
        dy, dgate = (t.numpy() for t in benchmark(run))
    else:
        dy, dgate = np.empty_like(y), np.empty(D, np.float32)
        benchmark(K.gated_residual_backward, y, gate, g, None, dy, dgate=dgate, isa=impl)
    _gbs(benchmark, 3 * y.nbytes, impl)
    t = np.tanh(gate.astype(np.float64))
    assert (np.abs(dy - g * t) <= 2 * 2.0 ** -24 * np.abs(g * t)).all()
    s = (g.astype(np.float64) * y).sum(0) / np.cosh(gate.astype(np.float64)) ** 2
    assert (np.abs(dgate - s) <= 2.0 ** -24 * (T_MB + 8) * np.abs(g * y.astype(np.float64)).sum(0)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_bench_rope_backward(benchmark, impl):
    benchmark.group = f"rope_backward H={NH} T={T_MB} hd={HD}"
    rng = np.random.default_rng(5)
    x, dy = (rng.standard_normal((NH, T_MB, HD), dtype=np.float32) for _ in range(2))
    pe = rope_pe(rng, T_MB, HD)
    if impl == "torch":
        pt = torch.from_numpy(pe)

        def fwd(a):
            o0 = pt[:, :, 0, 0] * a[..., 0::2] + pt[:, :, 0, 1] * a[..., 1::2]
            o1 = pt[:, :, 1, 0] * a[..., 0::2] + pt[:, :, 1, 1] * a[..., 1::2]
            return torch.stack([o0, o1], -1).reshape(a.shape)
        dx = benchmark(_torch_bwd(fwd, [x], dy))[0].numpy()
    else:
        dx = np.empty_like(dy)
        benchmark(K.rope_backward, dy, pe, dx, isa=impl)
    _gbs(benchmark, 2 * dy.nbytes + pe.nbytes, impl)
    d64 = dy.astype(np.float64)
    ref0 = pe[:, :, 0, 0] * d64[..., 0::2] + pe[:, :, 1, 0] * d64[..., 1::2]
    mag0 = np.abs(pe[:, :, 0, 0] * d64[..., 0::2]) + np.abs(pe[:, :, 1, 0] * d64[..., 1::2])
    assert (np.abs(dx[..., 0::2] - ref0) <= 2 * 2.0 ** -24 * mag0 + 1e-30).all()


@pytest.mark.parametrize("impl", ["generic", "torch"])
def test_bench_qknorm_rope_backward(benchmark, impl):
    benchmark.group = f"qknorm_rope_backward T={T_MB} H={NH} hd={HD}"
    rng = np.random.default_rng(6)
    qkv, qw, kw, pe = qknorm_rope_inputs(rng, T_MB, NH, HD)
    dq, dk = (rng.standard_normal((NH, T_MB, HD), dtype=np.float32) for _ in range(2))
    if impl == "torch":
        pt = torch.from_numpy(pe)

        def fwd(x):  # q heads only (the k half is the same work)
            y = x[:, :D].reshape(T_MB, NH, HD).transpose(0, 1)
            y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + 1e-6) * torch.from_numpy(qw)
            o0 = pt[:, :, 0, 0] * y[..., 0::2] + pt[:, :, 0, 1] * y[..., 1::2]
            o1 = pt[:, :, 1, 0] * y[..., 0::2] + pt[:, :, 1, 1] * y[..., 1::2]
            return torch.stack([o0, o1], -1).reshape(y.shape)
        benchmark(_torch_bwd(fwd, [qkv], dq))
        _gbs(benchmark, 3 * T_MB * D * 4 + pe.nbytes, impl)
    else:
        out = np.zeros_like(qkv)
        benchmark(K.qknorm_rope_backward, qkv, qw, kw, pe, dq, dk, out, NH, NH, 1e-6,
                  h1=NH, isa=impl)  # q heads only, as the torch baseline
        _gbs(benchmark, 3 * T_MB * D * 4 + pe.nbytes, impl)
        x = qkv[:, :HD].astype(np.float64)
        inv = 1 / np.sqrt((x * x).mean(1, keepdims=True) + np.float32(1e-6))
        d = dq[0].astype(np.float64)
        gr = np.empty_like(d)
        gr[:, 0::2] = pe[:, :, 0, 0] * d[:, 0::2] + pe[:, :, 1, 0] * d[:, 1::2]
        gr[:, 1::2] = pe[:, :, 0, 1] * d[:, 0::2] + pe[:, :, 1, 1] * d[:, 1::2]
        g = gr * qw
        ref = inv * (g - x * inv ** 2 * (g * x).mean(1, keepdims=True))
        mag = inv * (np.abs(g) + np.abs(x) * inv ** 2 * np.abs(g * x).mean(1, keepdims=True))
        assert (np.abs(out[:, :HD] - ref) <= 2.0 ** -24 * (HD + 8) * mag).all()
