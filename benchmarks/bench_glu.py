"""The gated projection of a SwiGLU feed-forward (``matmul_bf16`` / ``matmul_q8`` with ``up=``)
against what the block ran before it: the two projections into two buffers, then ``swiglu``.

One worker's band at Z-Image's FFN shape (K = 3840, N = 10240, columns [0, 5120): half of the
columns, as one of 2 workers computes), Q4_K weights (the Q4_K_M files' w1 / w3) with random
codes and sub-scales, outputs in shared memory like the workers' arena. Each ``benchmark.group``
("gated w13 <precision> T=..") holds both ways; GFLOP/s = 2 projections x 2 T K (n1 - n0) /
time in ``extra_info``. After timing the two outputs are compared bit for bit (the promise of
csrc/nx_matmul.h); speed is not asserted.

    OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_glu.py --benchmark-only \\
        --benchmark-timer=time.perf_counter
"""
from multiprocessing import shared_memory

import numpy as np
import pytest
from _bench_util import bench_stats, peak_fields

from nxhpc import _kernels as K
from nxhpc.formats.ggml_blocks import BLOCK_DTYPES, QUANT_BLOCKS

KD, N, N0, N1 = 3840, 10240, 0, 5120
TYPE = "Q4_K"


def _q4k(rng):
    """Random Q4_K rows [N, KD/256*144]: random codes and 6-bit sub-scales, f16 d / dmin of
    modest size (so the outputs stay finite and silu meets both signs)."""
    dt = BLOCK_DTYPES[TYPE]
    w = rng.integers(0, 256, (N, KD // QUANT_BLOCKS[TYPE].elems * dt.itemsize), dtype=np.uint8)
    b = w.reshape(-1, dt.itemsize).view(dt)[:, 0]
    b["d"] = (rng.uniform(0.5, 1.0, b.size) * 2.0 ** -10).astype("<f2")
    b["dmin"] = (rng.uniform(0.5, 1.0, b.size) * 2.0 ** -10).astype("<f2")
    return w


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(7)
    return _q4k(rng), _q4k(rng)


@pytest.fixture()
def shm():
    """float32 arrays in shared memory (the workers' arena's pages); unlinked after the test."""
    segs = []

    def make(shape):
        s = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
        segs.append(s)
        a = np.ndarray(shape, np.float32, buffer=s.buf)
        a[:] = 0
        return a
    yield make
    for s in segs:
        s.close()
        s.unlink()


def _run(precision, x, w, out, up=None):
    if precision == "q8":
        K.matmul_q8(x, w, out, N0, N1, wtype=TYPE, up=up)
    else:
        K.matmul_bf16(x, w, TYPE, out, N0, N1, up=up)


@pytest.mark.parametrize("precision", ["bf16", "q8"])
@pytest.mark.parametrize("T", [256, 1024])
@pytest.mark.parametrize("way", ["two calls + swiglu", "gated"])
def test_bench_glu(benchmark, weights, shm, precision, T, way):
    w1, w3 = weights
    x = shm((T, KD))
    x[:] = np.random.default_rng(T).standard_normal((T, KD), dtype=np.float32)
    f1, f3 = shm((T, N)), shm((T, N))

    def two():
        _run(precision, x, w1, f1)
        _run(precision, x, w3, f3)
        K.swiglu(f1, f3, f1, 0, T * N // 2)   # one of 2 workers' share of the swiglu stage

    def gated():
        _run(precision, x, w1, f1, up=w3)

    benchmark.group = f"gated w13 {precision} {TYPE} T={T} K={KD} cols={N1 - N0}"
    benchmark.pedantic(gated if way == "gated" else two, rounds=5 if T > 256 else 15,
                       warmup_rounds=1)
    g = 2 * 2.0 * T * KD * (N1 - N0) / bench_stats(benchmark).min / 1e9
    benchmark.extra_info.update(way=way, precision=precision, T=T, gflops_best=round(g, 1),
                                **peak_fields(g, precision, K.kernel_variants()[
                                    "matmul_bf16" if precision == "bf16" else "matmul_q8"]))
    # the two ways give the same bits on the band
    ref = shm((T, N))
    _run(precision, x, w1, ref)
    tmp = shm((T, N))
    _run(precision, x, w3, tmp)
    K.swiglu(ref, tmp, ref)
    got = shm((T, N))
    _run(precision, x, w1, got, up=w3)
    assert np.array_equal(got[:, N0:N1].view(np.uint32), ref[:, N0:N1].view(np.uint32))
