"""Helpers shared by the benchmarks."""
import math
import types

# With --benchmark-disable each benchmark runs once as a smoke test (its correctness check
# included) and pytest-benchmark keeps no statistics: report NaN rates instead of failing.
_NO_STATS = types.SimpleNamespace(min=math.nan, max=math.nan, mean=math.nan, median=math.nan,
                                  stddev=math.nan)


def bench_stats(benchmark):
    """The timing statistics of a finished benchmark (``.min``, ``.mean``, ``.median`` in s)."""
    return _NO_STATS if benchmark.stats is None else benchmark.stats.stats
