"""Benchmarks of the typed-weight x float32 matmul (Q8_0, F16, BF16) against numpy/OpenBLAS
float32 on the same weights.

Run (numpy baseline without the old-OpenBLAS safety settings, one thread each):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \
        python -m pytest benchmarks/bench_matmul.py --benchmark-only \
        --benchmark-timer=time.process_time

(``time.process_time``: CPU time of this single-threaded process, so other jobs time-slicing the
two cores do not count; every contender runs one thread, which the numpy benchmark asserts.)

Each shape is one ``benchmark.group``: ``nxhpc`` (q8_0_matmul, best isa, one process; at
T=256, K=N=3840 also ``matmul`` with F16 and BF16 weights, written by numpy / the gguf package and
converted panel by panel) and ``numpy`` (``x @ w_f32.T`` on the pre-dequantized weights, limited
to 1 thread with threadpoolctl).
GFLOP/s = 2*T*K*N / time is in ``extra_info`` together with its fraction of this CPU's float32
FMA peak, measured once per session (``_bench_util.peak_fields``: ``peak_kind`` fma_zmm for
AVX-512 code, fma_ymm for AVX2 code, the fastest of the two for generic code and numpy; an ISA
asked for is resolved to the code that runs there, ``nxhpc.runtime.peak.variant_at``).
Correctness is checked after timing against a float64 evaluation with the derived error bound.
"""
import gguf
import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import nxhpc
from nxhpc import _kernels as K
from nxhpc.runtime.peak import variant_at
from _bench_util import bench_stats, peak_fields

SHAPES = [(256, 3840, 3840), (256, 3840, 10240), (256, 3840, 11520), (256, 10240, 3840)]


def _case(T, Kd, N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, Kd), dtype=np.float32)
    w = K.q8_0_quantize((rng.standard_normal((N, Kd), dtype=np.float32) * 0.02))
    w_f32 = K.q8_0_dequantize(w)
    return x, w, w_f32


def _info(benchmark, T, Kd, N, isa, slot=None):
    """GFLOP/s against the peak of the code that ran: ``isa``'s, or with ``slot`` the code that
    runs kernel ``slot`` when ``isa`` is asked for (``peak_fields``)."""
    sec = bench_stats(benchmark).min
    gflops = 2.0 * T * Kd * N / sec / 1e9
    benchmark.extra_info.update({
        "T": T, "K": Kd, "N": N, "isa": isa, "gflops_best": round(gflops, 1),
        "gflops_mean": round(2.0 * T * Kd * N / bench_stats(benchmark).mean / 1e9, 1),
        **peak_fields(gflops, "f32", isa, slot=slot),
    })


def _check(out, x, w_f32, rows=32, any_order=False):
    """Error bound on a sample of rows, in float64 (derived in tests/test_kernels_q8.py::
    matmul_bound): q8_0_matmul's two-level sum rounds each product at most
    n = min(K, 128) + ceil(K/128) - 1 times; a float32 sum in any order (OpenBLAS, any_order=True)
    at most n = K times. Plus the float64 reference's own gamma_K(2^-53)."""
    x64 = x[:rows].astype(np.float64)
    w64 = w_f32.astype(np.float64)
    ref = x64 @ w64.T
    mag = np.abs(x64) @ np.abs(w64).T
    Kd = x.shape[1]
    n = Kd if any_order else min(Kd, 128) + -(-Kd // 128) - 1
    bound = (n * 2.0 ** -24 / (1 - n * 2.0 ** -24) + 2 * Kd * 2.0 ** -53) * mag
    assert (np.abs(out[:rows] - ref) <= bound).all()


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=lambda v: str(v))
def test_bench_q8_0_matmul(benchmark, T, Kd, N):
    x, w, w_f32 = _case(T, Kd, N)
    out = np.empty((T, N), np.float32)
    isa = nxhpc.kernel_variants()["q8_0_matmul"]
    benchmark.group = f"matmul T={T} K={Kd} N={N}"
    benchmark.name = f"nxhpc q8_0_matmul ({isa})"
    benchmark.pedantic(K.q8_0_matmul, args=(x, w, out), rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, isa)
    _check(out, x, w_f32)


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=lambda v: str(v))
def test_bench_numpy_f32(benchmark, T, Kd, N):
    x, w, w_f32 = _case(T, Kd, N)
    benchmark.group = f"matmul T={T} K={Kd} N={N}"
    benchmark.name = "numpy x @ w_f32.T (1 thread)"
    with threadpool_limits(1):
        info = [d for d in __import__("threadpoolctl").threadpool_info()
                if d.get("user_api") == "blas"]
        assert all(d["num_threads"] == 1 for d in info), info
        out = benchmark.pedantic(lambda: x @ w_f32.T, rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, "openblas")
    benchmark.extra_info["blas"] = [f"{d.get('internal_api')} {d.get('version')} "
                                    f"{d.get('architecture')}" for d in info]
    _check(out, x, w_f32, any_order=True)


# For the record: every compiled variant at one smaller shape (the generic one is a scalar
# fmaf chain: the spec, not a fast path).
@pytest.mark.parametrize("isa", nxhpc.supported_isas())
def test_bench_q8_0_matmul_variants(benchmark, isa):
    T, Kd, N = 64, 3840, 1024
    x, w, w_f32 = _case(T, Kd, N, seed=1)
    out = np.empty((T, N), np.float32)
    benchmark.group = f"matmul variants T={T} K={Kd} N={N}"
    benchmark.name = f"q8_0_matmul isa={isa}"
    benchmark.pedantic(K.q8_0_matmul, args=(x, w, out), kwargs={"isa": isa},
                       rounds=1 if isa == "generic" else 5, warmup_rounds=0 if isa == "generic" else 1)
    # against the unit of the code that runs at the ISA asked for (avxvnni's q8_0_matmul is avx2's)
    _info(benchmark, T, Kd, N, isa, slot="q8_0_matmul")
    benchmark.extra_info["variant"] = variant_at("q8_0_matmul", isa)
    _check(out, x, w_f32)


def test_bench_numpy_f32_variants_shape(benchmark):
    T, Kd, N = 64, 3840, 1024
    x, w, w_f32 = _case(T, Kd, N, seed=1)
    benchmark.group = f"matmul variants T={T} K={Kd} N={N}"
    benchmark.name = "numpy x @ w_f32.T (1 thread)"
    with threadpool_limits(1):
        out = benchmark.pedantic(lambda: x @ w_f32.T, rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, "openblas")
    _check(out, x, w_f32, any_order=True)


TYPED_SHAPE = (256, 3840, 3840)


def _typed_case(wtype, T, Kd, N, seed=0):
    """The benchmark's weight (same values as _case before quantization) stored as `wtype` by
    numpy (F16) or the gguf package (BF16), and its float32 values per gguf's dequantize."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, Kd), dtype=np.float32)
    w32 = rng.standard_normal((N, Kd), dtype=np.float32) * 0.02
    if wtype == "F16":
        raw = w32.astype(np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(w32, gguf.GGMLQuantizationType[wtype])
    w_f32 = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[wtype]).astype(np.float32)
    return x, np.ascontiguousarray(raw.reshape(N, -1)), w_f32


@pytest.mark.parametrize("wtype", ["F16", "BF16"])
def test_bench_typed_matmul(benchmark, wtype):
    T, Kd, N = TYPED_SHAPE
    x, w, w_f32 = _typed_case(wtype, T, Kd, N)
    out = np.empty((T, N), np.float32)
    isa = nxhpc.kernel_variants()["matmul"]
    benchmark.group = f"matmul T={T} K={Kd} N={N}"
    benchmark.name = f"nxhpc matmul {wtype} ({isa}, {K._matmul_packer(wtype)} packer)"
    benchmark.pedantic(K.matmul, args=(x, w, wtype, out), rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, isa)
    benchmark.extra_info["wtype"] = wtype
    _check(out, x, w_f32)
