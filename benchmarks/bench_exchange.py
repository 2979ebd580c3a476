"""What splitting one denoiser call across MPI ranks costs: bytes per layer and step, measured
exchange time with 2-3 ranks on this machine, and a model of the step time on R machines.

Bytes come from the DiT's own :meth:`nxhpc.dit.plan.BlockPlan.split` (the regions the engine
gathers after each split stage) at Z-Image's dims (D=3840, 30 heads x 128, F=10240, 30 layers,
2 + 2 refiner blocks). The measured exchange runs ``mpirun -n R`` of a probe that gathers
exactly those regions with :class:`nxhpc.runtime.ranks.Ranks` (the engine's code path) on
numpy buffers of the real sizes -- no model is needed. A step is a sampler's call after its
first, as bench_denoise times it: the caption's context refiner ran in the first call and its rows
are reused (``Denoiser.reuse_caption``), so it neither computes nor gathers (``caption=True``
counts it). Results: ``benchmarks/README.md``.

    python -m pytest benchmarks/bench_exchange.py --benchmark-only -s
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from nxhpc.dit.config import DenoiserConfig
from nxhpc.dit.plan import BlockPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: image tokens (latents / 2x2 patches) and padded caption rows at each size
SIZES = {512: (32 * 32, 128), 1024: (64 * 64, 128)}
FLOAT = 4


def layer_regions(T: int, cfg=None) -> list[tuple[str, str, tuple[int, int]]]:
    """(stage, buffer, shape) of every region one block gathers at ``T`` tokens."""
    cfg = cfg or DenoiserConfig.zimage()
    plan = BlockPlan(cfg, "layers")
    out = []
    for s in plan.stages:
        for g in plan.split(s, T) or ():
            out.append((s.name, g.name, g.shape))
    return out


def layer_bytes(T: int, cfg=None) -> int:
    """Bytes one block gathers at ``T`` tokens (every rank's bands together)."""
    return sum(a * b * FLOAT for _, _, (a, b) in layer_regions(T, cfg))


def step_bytes(px: int, cfg=None, caption: bool = False) -> int:
    """Bytes one sampler step's denoiser call gathers: 2 noise-refiner blocks on the image rows
    and 30 layers on the joint rows; with ``caption`` (a sampler's first call) also 2
    context-refiner blocks on the caption rows, which later calls with the same caption copy
    back instead of running (``Denoiser.reuse_caption``, docs/denoiser.md; bench_denoise's step
    counts such a call)."""
    cfg = cfg or DenoiserConfig.zimage()
    n_img, lp = SIZES[px]
    return (cfg.n_noise_refiner * layer_bytes(n_img, cfg)
            + (cfg.n_context_refiner * layer_bytes(lp, cfg) if caption else 0)
            + cfg.n_layers * layer_bytes(n_img + lp, cfg))


def layer_flops(T: int, cfg=None) -> float:
    """Multiply-adds x 2 of one block's projections and attention at ``T`` tokens."""
    cfg = cfg or DenoiserConfig.zimage()
    D, F = cfg.dim, cfg.ffn_dim
    return 2.0 * T * D * (cfg.qkv_width + D + 3 * F) + 4.0 * T * T * cfg.n_heads * cfg.head_dim


def step_time(R: int, cores: int, gbit: float, px: int, gflops_per_core: float = 40.0,
              latency_s: float = 30e-6, caption: bool = False) -> float:
    """Modelled seconds of one sampler step's call on ``R`` machines of ``cores`` cores joined
    at ``gbit`` Gbit/s: the split work over ``R * cores`` cores plus a ring allgather per region
    (each rank receives ``(R-1)/R`` of it, ``R-1`` hops of ``latency_s``). The context refiner
    counts only with ``caption`` (a sampler's first call: :func:`step_bytes`). Element-wise
    work (repeated on every rank) and the embedders are left out: a few per cent of a step."""
    cfg = DenoiserConfig.zimage()
    n_img, lp = SIZES[px]
    n_ctx = cfg.n_context_refiner if caption else 0
    flops = (cfg.n_noise_refiner * layer_flops(n_img, cfg) + n_ctx * layer_flops(lp, cfg)
             + cfg.n_layers * layer_flops(n_img + lp, cfg))
    compute = flops / (R * cores * gflops_per_core * 1e9)
    if R == 1:
        return compute
    n_regions = len(layer_regions(8, cfg)) * (cfg.n_layers + cfg.n_noise_refiner + n_ctx)
    exchange = step_bytes(px, cfg, caption) * (R - 1) / R / (gbit * 1e9 / 8) \
        + n_regions * (R - 1) * latency_s
    return compute + exchange


_PROBE = r"""
import json, sys, time
import numpy as np
from nxhpc.runtime.ranks import init_world
w = init_world()
regions = json.loads(sys.argv[1]); reps = int(sys.argv[2])
bufs = [(np.ones(shape, dtype=np.float32), axis) for _, _, shape, axis in regions]
times = []
for it in range(reps + 1):                  # the first pass warms up (pages, datatypes)
    w.comm.Barrier()
    t0 = time.perf_counter()
    for a, axis in bufs:
        n = a.shape[axis]
        if axis == 0:
            w.gather_rows(a, w.bounds(n), "probe")
        else:
            w.gather_cols(a, w.bounds(n), "probe")
    if it:
        times.append(time.perf_counter() - t0)
if w.rank == 0:
    print(json.dumps({"s_per_layer": sorted(times)[len(times) // 2], "all": times}))
"""


def _probe(R: int, T: int, reps: int = 3) -> dict:
    plan = BlockPlan(DenoiserConfig.zimage(), "layers")
    regions = [(s.name, g.name, list(g.shape), g.axis) for s in plan.stages
               for g in plan.split(s, T) or ()]
    env = dict(os.environ, PYTHONPATH=ROOT, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(["mpirun", "--oversubscribe", "-n", str(R), sys.executable, "-c", _PROBE,
                        json.dumps(regions), str(reps)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_exchange_model(benchmark):
    """The bytes and the modelled step times (no MPI): recorded in extra_info."""
    rows = benchmark(lambda: {px: step_bytes(px) for px in SIZES})
    cfg = DenoiserConfig.zimage()
    for px, (n_img, lp) in SIZES.items():
        T = n_img + lp
        # correctness: the plan's regions are qkv, attn, atto, f1 (after the gated w13's
        # SwiGLU) and f2 of [T, width]
        want = T * (cfg.qkv_width + cfg.n_heads * cfg.head_dim + 2 * cfg.dim
                    + cfg.ffn_dim) * FLOAT
        assert layer_bytes(T) == want
        benchmark.extra_info[f"layer_MB_{px}"] = want / 1e6
        benchmark.extra_info[f"step_GB_{px}"] = rows[px] / 1e9
        benchmark.extra_info[f"first_call_GB_{px}"] = step_bytes(px, caption=True) / 1e9
        for gbit in (10, 100):
            for cores in (2, 16, 64):
                benchmark.extra_info[f"step_s_{px}_{gbit}G_{cores}c"] = [
                    round(step_time(R, cores, gbit, px), 3) for R in (1, 2, 4, 8, 16, 32, 64)]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("px", [512, 1024])
@pytest.mark.parametrize("R", [2, 3])
def test_exchange_measured(benchmark, R, px):
    """One block's gathers at Z-Image's dims, R ranks on this machine (shared memory)."""
    n_img, lp = SIZES[px]
    T = n_img + lp
    res = benchmark.pedantic(lambda: _probe(R, T), rounds=1, iterations=1)
    benchmark.extra_info.update(R=R, T=T, layer_MB=layer_bytes(T) / 1e6,
                                s_per_layer=res["s_per_layer"],
                                GB_per_s=layer_bytes(T) * (R - 1) / R / res["s_per_layer"] / 1e9)
    assert res["s_per_layer"] > 0
