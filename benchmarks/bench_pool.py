"""What one stage's dispatch costs the worker pool: a no-op stage's round trip (the parent writes
each worker its command, each answers) with the workers blocking on their command pipes between
stages (``spin_s=0``) and polling them first (the default, ``POOL_SPIN_S``), in one group; then
the same two pools running the real 10-stage block at T=256 (the ``zimage-1l-q4km`` block in
bf16, as ``bench_block`` runs it), where the dispatch is about a fiftieth of the block.

    python -m pytest benchmarks/bench_pool.py --benchmark-only --benchmark-timer=time.perf_counter

``extra_info``: ``us_per_stage`` (median, the no-op stage) or ``ms_per_block`` (median). The
block needs the ``zimage-1l-q4km`` model (``benchmarks/goals.py`` makes it); without it those two
benchmarks skip. Results: benchmarks/README.md.
"""
from __future__ import annotations

import numpy as np
import pytest

from _bench_util import bench_stats
from nxhpc.runtime import workers
from nxhpc.runtime.workers import POOL_SPIN_S, WorkerPool

WORKERS = 2
SPINS = {"blocking": 0.0, "polling": POOL_SPIN_S}


def _noop(lo, hi, arg):
    pass


@pytest.mark.parametrize("how", list(SPINS))
def test_stage_round_trip(benchmark, how):
    benchmark.group = f"pool: a no-op stage, {WORKERS} workers"
    with WorkerPool(WORKERS, {"noop": _noop}, spin_s=SPINS[how]) as p:
        for _ in range(50):
            p.run("noop", WORKERS)
        benchmark.pedantic(p.run, args=("noop", WORKERS), rounds=2000, warmup_rounds=50)
    benchmark.extra_info["us_per_stage"] = bench_stats(benchmark).median * 1e6


@pytest.mark.parametrize("how", list(SPINS))
def test_block_t256(benchmark, how, monkeypatch):
    from nxhpc.models import open_model
    from nxhpc.models.registry import models_dir
    if not (models_dir() / "zimage-1l-q4km" / "model.gguf").exists():
        pytest.skip("no zimage-1l-q4km model (python benchmarks/goals.py --only block256 "
                    "makes it)")
    monkeypatch.setattr(workers, "POOL_SPIN_S", SPINS[how])   # the engine's pools' default
    benchmark.group = f"pool: the zimage-1l-q4km block, T=256, bf16, {WORKERS} workers"
    model = open_model("zimage-1l-q4km")
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    dst = np.empty(x.shape, dtype=np.float32)
    try:
        with model.block(0) as blk:
            def run():
                blk.forward(x, t, pe, mask=mask, workers=WORKERS, spawn="pool",
                            precision="bf16", out=dst)
            benchmark.pedantic(run, rounds=24, warmup_rounds=2)
    finally:
        model.close()
    benchmark.extra_info["ms_per_block"] = bench_stats(benchmark).median * 1e3
