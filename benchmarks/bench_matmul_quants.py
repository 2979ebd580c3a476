"""Benchmarks of the matmul over every weight type of issue 10 (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K) beside the Q8_0 matmul and numpy float32 on the dequantized weights.

Run (numpy baseline without the old-OpenBLAS safety settings, one thread each):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \
        python -m pytest benchmarks/bench_matmul_quants.py --benchmark-only \
        --benchmark-timer=time.process_time

One ``benchmark.group`` per shape (T=256; K=3840, N in {3840, 10240}; K=10240, N=3840): ``matmul``
of each type at the best isa (one process; Q8_0 is the baseline: the goal is every type within
10% of it) and ``numpy x @ w_f32.T`` (1 thread). Weights: 256 rows of Gaussian * 0.02 values
encoded by nxhpc.formats.quants (the K-quant encoders are numpy and slow), tiled to N rows -- the
kernels' speed does not depend on the values, and every row is still read from memory.
``extra_info``: GFLOP/s and its share of this CPU's float32 FMA peak (``peak_kind``,
``frac_of_peak``: ``_bench_util.peak_fields``), the ratio to the Q8_0 matmul of the same run, and
the packer's share:
``decode_ms`` (K.dequantize of the whole weight: the decode work the packer does, once per weight
since T <= MC = 264) and ``packer_share`` = decode time / matmul time, both this process's CPU
time (``time.process_time``, best of 3, whatever ``--benchmark-timer`` is; an upper bound of the
packer's cost: the packer decodes into an L2-resident scratch, faster than this 60-160 MB
stream). Correctness is checked after timing on a sample of rows vs float64 with the bound of
the documented summation order.
"""
import time

import numpy as np
import pytest
from _bench_util import bench_stats, peak_fields
from threadpoolctl import threadpool_info, threadpool_limits

import nxhpc
from nxhpc import _kernels as K
from nxhpc.formats.quants import quantize

SHAPES = [(256, 3840, 3840), (256, 3840, 10240), (256, 10240, 3840)]
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_W, _X, _Q8_SEC = {}, {}, {}


def _x(T, Kd):
    if (T, Kd) not in _X:
        _X[T, Kd] = np.random.default_rng(1).standard_normal((T, Kd), dtype=np.float32)
    return _X[T, Kd]


def _weight(name, Kd, N):
    if (name, Kd, N) not in _W:
        w = np.random.default_rng(0).standard_normal((256, Kd), dtype=np.float32) * 0.02
        raw = K.q8_0_quantize(w) if name == "Q8_0" else quantize(w, name)
        _W[name, Kd, N] = np.ascontiguousarray(np.tile(raw, (N // 256, 1)))
    return _W[name, Kd, N]


def _check(out, x, w_f32, any_order=False, rows=16):
    x64, w64 = x[:rows].astype(np.float64), w_f32[:64].astype(np.float64)
    ref, mag = x64 @ w64.T, np.abs(x64) @ np.abs(w64).T
    Kd = x.shape[1]
    n = Kd if any_order else min(Kd, 128) + -(-Kd // 128) - 1
    bound = (n * 2.0 ** -24 / (1 - n * 2.0 ** -24) + 2 * Kd * 2.0 ** -53) * mag
    assert (np.abs(out[:rows, :64] - ref) <= bound).all()


def _cpu_best(fn, runs=3):
    """The least CPU time of this process (``time.process_time``) over ``runs`` calls of ``fn``."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _gflops(benchmark, T, Kd, N):
    return 2.0 * T * Kd * N / bench_stats(benchmark).min / 1e9


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=lambda v: str(v))
def test_bench_matmul_type(benchmark, T, Kd, N, name):
    x, w = _x(T, Kd), _weight(name, Kd, N)
    out = np.empty((T, N), np.float32)
    isa = nxhpc.kernel_variants()["matmul"]
    benchmark.group = f"matmul types T={T} K={Kd} N={N}"
    benchmark.name = f"nxhpc matmul {name} ({isa})"
    benchmark.pedantic(K.matmul, args=(x, w, name, out), rounds=5, warmup_rounds=1)
    sec = bench_stats(benchmark).min
    if name == "Q8_0":
        _Q8_SEC[T, Kd, N] = sec
    # the packer's share on one clock (this process's CPU time), whatever --benchmark-timer is:
    # best of 3 of the decode and of the matmul
    dec = _cpu_best(lambda: K.dequantize(w, name))
    mm = _cpu_best(lambda: K.matmul(x, w, name, out))
    w_f32 = K.dequantize(w, name)
    benchmark.extra_info.update({
        "T": T, "K": Kd, "N": N, "isa": isa, "wtype": name,
        "gflops_best": round(_gflops(benchmark, T, Kd, N), 1),
        **peak_fields(_gflops(benchmark, T, Kd, N), "f32", isa),
        "vs_q8_0_time": round(sec / _Q8_SEC[T, Kd, N], 3) if (T, Kd, N) in _Q8_SEC else None,
        "decode_ms": round(dec * 1e3, 2),
        "packer_share": round(dec / mm, 3),
        "weight_mb": round(w.nbytes / 1e6, 1),
    })
    _check(out, x, w_f32)


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=lambda v: str(v))
def test_bench_numpy_f32(benchmark, T, Kd, N):
    x = _x(T, Kd)
    w_f32 = K.dequantize(_weight("Q8_0", Kd, N), "Q8_0")
    benchmark.group = f"matmul types T={T} K={Kd} N={N}"
    benchmark.name = "numpy x @ w_f32.T (1 thread)"
    with threadpool_limits(1):
        info = [d for d in threadpool_info() if d.get("user_api") == "blas"]
        assert all(d["num_threads"] == 1 for d in info), info
        out = benchmark.pedantic(lambda: x @ w_f32.T, rounds=5, warmup_rounds=1)
    benchmark.extra_info.update({"T": T, "K": Kd, "N": N,
                                 "gflops_best": round(_gflops(benchmark, T, Kd, N), 1),
                                 **peak_fields(_gflops(benchmark, T, Kd, N), "f32")})
    _check(out, x, w_f32, any_order=True)
