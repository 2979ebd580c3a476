"""Per-core peaks of this CPU: the register-only loops of ``nxhpc._kernels.peak`` (csrc/nx_peak.h),
one benchmark per kind this CPU runs, in one ``benchmark.group``.

Owns: the peak table every other benchmark's ``frac_of_peak`` refers to (those take the figure
from ``_bench_util.peak_of``, measured once per session by ``nxhpc.runtime.peak.measure``; this
file times the same loops with pytest-benchmark's statistics). Must not: assert speed.

Run (process time, so that other jobs time-slicing the cores do not count):

    python -m pytest benchmarks/bench_peak.py --benchmark-only --benchmark-timer=time.process_time

``extra_info``: ``kind``, ``isa`` (the target its loop is compiled for), ``ops_per_iter``,
``iters`` per round, ``gops_best`` / ``gops_mean`` (10^9 operations per second, 2 per
multiply-add: GFLOP/s for the float kinds, GOP/s for the int8 ones) and ``session_peak_gops``
(``peak_of``, the figure the other benchmarks divide by). After timing, the accumulators are
checked against the closed form of the default operands (nx_peak.h; the fma chains converge to
their fixed point 2, the integer dot products add a known amount per iteration).
"""
import numpy as np
import pytest

from nxhpc import _kernels as K
from _bench_util import bench_stats, peak_of

INFO = K.peak_kinds()
KINDS = [pytest.param(k, marks=pytest.mark.skipif(not INFO[k]["supported"],
                                                  reason=f"{k}: not supported here"))
         for k in K.PEAK_KINDS]
ROUND_S = 0.05  # seconds per round


def _iters(kind):
    """Iterations for about ROUND_S seconds at the session's measured peak."""
    return max(1, int(ROUND_S * peak_of(kind) / INFO[kind]["ops_per_iter"]))


def _check(kind, iters, acc):
    if kind.startswith("fma"):     # a = 0.5, b = 1 from 0: 2 - 2^(1-n), exactly 2 after 25 steps
        expect = 2.0 - 2.0 ** (1 - iters) if iters < 25 else 2.0
        assert (acc == np.float32(expect)).all()
    elif kind == "i8_ymm":         # + 2 (two products 1 * 1) per iteration, wrapping mod 2^16
        assert (acc.astype(np.int64) == (2 * iters + 2 ** 15) % 2 ** 16 - 2 ** 15).all()
    elif kind == "vnni_zmm":       # + 4 (four products 1 * 1) per iteration, wrapping
        assert (acc.astype(np.int64) == (4 * iters + 2 ** 31) % 2 ** 32 - 2 ** 31).all()
    elif kind == "amx_int8":       # + 64 per iteration, wrapping
        assert (acc.astype(np.int64) == (64 * iters + 2 ** 31) % 2 ** 32 - 2 ** 31).all()
    else:                          # float32 sums of 1.0 products: finite, positive, all equal
        assert np.isfinite(acc).all() and (acc > 0).all() and (acc == acc.flat[0]).all()


@pytest.mark.parametrize("kind", KINDS)
def test_bench_peak(benchmark, kind):
    iters = _iters(kind)
    benchmark.group = "peak per core"
    benchmark.name = f"peak {kind} ({INFO[kind]['isa']})"
    ops, acc = benchmark.pedantic(K.peak, args=(kind, iters), rounds=5, warmup_rounds=1)
    st = bench_stats(benchmark)
    benchmark.extra_info.update({
        "kind": kind, "isa": INFO[kind]["isa"], "ops_per_iter": INFO[kind]["ops_per_iter"],
        "iters": iters, "gops_best": round(ops / st.min / 1e9, 1),
        "gops_mean": round(ops / st.mean / 1e9, 1),
        "session_peak_gops": round(peak_of(kind) / 1e9, 1)})
    _check(kind, iters, acc)
