"""The whole block at Z-Image size (built-in ``zimage-1l``: D=3840, 30x128 heads, FFN 10240,
T=256): nxhpc with 2 workers in both spawn modes and in every precision (f32, bf16, q8), next
to a PyTorch eager run of diffusers' ``ZImageTransformerBlock`` on the same input and
dequantized weights with 2 threads, in float32 and in bfloat16 (module and inputs cast with
``.to(torch.bfloat16)``: torch's own bf16 path, norms included), all in one group.

Run (benchmarks/README.md): ``OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_block.py
--benchmark-only --benchmark-timer=time.perf_counter`` (wall time: the work runs in the
worker processes / torch threads, which process_time of this process would not see; generates
the model on first use under $NXHPC_MODELS, ~1 GB). Set ``NXHPC_BENCH_MODEL=mid`` for a quick
run. Correctness is checked after timing against the model's float64 reference output: f32
within 1e-5 of max|ref|, bf16 / q8 within blockrun's default tolerance of that precision
(max_rel, nxhpc.blockrun.PRECISION_TOL); torch's errors are recorded in extra_info.
Against the machine's limit (``nxhpc.dit.roofline``, peaks measured in the same session):
nxhpc's runs carry ``frac_<stage>`` (the stage's projection / attention work at the per-core
peak of the unit it runs on, over its time), ``x_limit`` (the block over its limit on its own
units) and ``x_machine_limit`` (over its limit on the machine's fastest units; both on the
stages' time, ``block_us``, each stage's fastest round); both nxhpc's and torch's runs carry
``x_machine_limit_call``: the whole call's fastest round over that limit (the figure to
compare them by).

``test_engine_*``: a denoiser-shaped call -- a modulated block on the image rows, an
unmodulated block on the caption rows, a modulated block on the joint rows -- from ONE engine
(one arena, one pool forked once), next to the same three blocks each on its own engine (a
fork and an arena per token count), in the same group. Layer 0's weights serve all three.
"""
import dataclasses
import os
import time

import numpy as np
import pytest

from _bench_util import bench_stats, peak_of
from nxhpc.blockrun import PRECISION_TOL
from nxhpc.dit.config import block_view
from nxhpc.dit.grade import rel_errors
from nxhpc.dit.plan import BlockPlan, Engine
from nxhpc.dit.reference import dequantize_layer
from nxhpc.dit.roofline import block_limit_s, machine_kinds, report_fields
from nxhpc.models import open_model

MODEL = os.environ.get("NXHPC_BENCH_MODEL", "zimage-1l")
WORKERS = 2
# NXHPC_BENCH_T=4128: the block at that many tokens (the model's input rows and RoPE rows
# repeated; no mask); the reference is then the float64 block (nxhpc.dit.reference) on that
# input, computed once before timing (~20-40 s at T=4128 on 2 cores, ~1.5 GB of float64
# weights). NXHPC_BENCH_ROUNDS: timed rounds (default 3).
BENCH_T = int(os.environ.get("NXHPC_BENCH_T", "0"))
ROUNDS = int(os.environ.get("NXHPC_BENCH_ROUNDS", "3"))
_REF = {}


@pytest.fixture(scope="module")
def setup():
    model = open_model(MODEL)
    cfg = model.config
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    if BENCH_T and BENCH_T != x.shape[0]:
        reps = -(-BENCH_T // x.shape[0])
        x = np.ascontiguousarray(np.tile(x, (reps, 1))[:BENCH_T])
        pe = np.ascontiguousarray(np.tile(pe, (reps, 1, 1, 1))[:BENCH_T])
        mask = None
        from nxhpc.dit.reference import adaln_f64, block_forward_f64
        w64 = dequantize_layer(model.layer_weights(0))
        m = adaln_f64(t.astype(np.float64), w64["adaln_w"], w64["adaln_b"], silu=cfg.adaln_silu)
        _REF["ref"] = block_forward_f64(x, w64, cfg, adaln_m=m, pe=pe)
        del w64
    else:
        _REF["ref"] = model.ref_out(0)
    T = x.shape[0]
    flops = 2 * T * cfg.dim * (cfg.qkv_width + cfg.dim + 3 * cfg.ffn_dim) + 4 * T * T * cfg.dim
    yield model, x, pe, t, mask, flops
    model.close()


def _check(out, model, precision="f32"):
    """Errors vs the float64 reference: the largest over max|ref|, ``max_rel`` (blockrun's worst
    element, what the goals judge) and ``rel_rms_err`` (the error's RMS over the reference's: a
    whole-output figure beside that tail one). Asserted for nxhpc's precisions (None: recorded
    only)."""
    ref = _REF["ref"]
    d = out.astype(np.float64) - ref
    err = float(np.abs(d).max() / np.abs(ref).max())
    max_rel = float(rel_errors(out, ref).max())
    if precision == "f32":
        assert err <= 1e-5, err
    elif precision is not None:
        assert max_rel <= PRECISION_TOL[precision], (precision, max_rel)
    return dict(max_err_rel_to_max_ref=err, max_rel=max_rel,
                rel_rms_err=float(np.sqrt(np.mean(d * d) / np.mean(ref * ref))))


def split_costs(split, wall_us: float, block_us: float) -> dict[str, float]:
    """One forward's time outside the bands' own work, microseconds: ``pool_us`` (per stage,
    wall less the slowest band: commands, wake-ups, results; a row group's once, on its first
    stage), ``unequal_bands_us`` (the slowest band less the fastest; inside a row group, where
    bands do not wait for each other between stages, an upper bound), ``parent_us`` (the call
    less its stages: input checks, adaLN, copies in and out)."""
    return {"pool_us": sum(s.overhead for s in split) / 1e3,
            "unequal_bands_us": sum(s.busy_max - s.busy_min for s in split) / 1e3,
            "parent_us": wall_us - block_us}


def _x_call(benchmark, cfg, T: int) -> float | None:
    """The whole call's fastest round over the block's limit on the machine's fastest units:
    the one figure nxhpc's and torch's runs both carry on the same scope and statistic
    (nxhpc's ``x_machine_limit`` is its stages' time, ``block_us``, without the parent's
    input checks, adaLN and copies)."""
    lim = block_limit_s(block_view(cfg), T, machine_kinds(peak_of), peak_of, WORKERS)
    return bench_stats(benchmark).min / lim if lim else None


@pytest.mark.parametrize("spawn,precision", [("pool", "f32"), ("stage", "f32"), ("pool", "bf16"),
                                             ("pool", "q8")])
def test_block_nxhpc(benchmark, setup, spawn, precision):
    model, x, pe, t, mask, flops = setup
    cfg = model.config
    benchmark.group = f"block {MODEL} T={x.shape[0]} workers/threads={WORKERS}"
    # pool: workers forked once, reused across rounds; the output into one array (out=), as a
    # caller running the block repeatedly would: a fresh [T, D] array a call costs page faults
    # (at T=4128 up to 0.7 s on the AMX Xeon), which measures the allocator, not the block
    dst = np.empty(x.shape, dtype=np.float32)
    rounds, costs = [], []

    def run():
        t0 = time.perf_counter_ns()
        o, tm = blk.forward(x, t, pe, mask=mask, workers=WORKERS, spawn=spawn,
                            precision=precision, out=dst)
        wall_us = (time.perf_counter_ns() - t0) / 1e3
        rounds.append(tm)
        costs.append(split_costs(blk.last_split, wall_us, tm["block_us"]))
        return o

    with model.block(0) as blk:
        out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    # each stage's fastest round (as blockrun --repeat), then against its limit on this machine
    timings = {k: min(r[k] for r in rounds[1:] or rounds) for k in rounds[-1]}
    s = bench_stats(benchmark).median
    benchmark.extra_info.update(gflops=flops / s / 1e9, precision=precision,
                                **{k: v for k, v in timings.items()})
    benchmark.extra_info.update(report_fields(timings, block_view(cfg), x.shape[0],
                                              precision, WORKERS, rate=peak_of))
    benchmark.extra_info["x_machine_limit_call"] = _x_call(benchmark, cfg, x.shape[0])
    # beside the kernels' time: the pool's, the unequal bands' and the parent's (medians)
    timed = costs[1:] or costs
    benchmark.extra_info.update({k: float(np.median([c[k] for c in timed])) for k in timed[0]})
    benchmark.extra_info.update(_check(out, model, precision))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_block_torch_eager(benchmark, setup, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from nxhpc.dit.oracle import diffusers_block
    model, x, pe, t, mask, flops = setup
    cfg = model.config
    torch.set_num_threads(WORKERS)
    dt = getattr(torch, dtype)
    blk = diffusers_block(cfg, dequantize_layer(model.layer_weights(0))).to(dt)
    freqs = torch.complex(torch.from_numpy(pe[..., 0, 0].copy()),
                          torch.from_numpy(pe[..., 1, 0].copy()))
    xm = torch.from_numpy(x)[None].to(dt)
    mm = torch.from_numpy(mask)[None] if mask is not None else None
    tt = torch.from_numpy(t)[None].to(dt)

    def run():
        with torch.no_grad():
            return blk(xm, mm, freqs[None], tt)[0].float().numpy()

    benchmark.group = f"block {MODEL} T={x.shape[0]} workers/threads={WORKERS}"
    out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["gflops"] = flops / bench_stats(benchmark).median / 1e9
    benchmark.extra_info["x_machine_limit_call"] = _x_call(benchmark, cfg, x.shape[0])
    benchmark.extra_info.update(dtype=dtype, **_check(out, model, "f32" if dtype == "float32"
                                                      else None))


def _session_inputs(setup):
    model, x, pe, t, _, _ = setup
    cfg = model.config
    T = x.shape[0]
    T2 = max(1, T // 8)                  # caption rows; the rest are image rows
    w = model.layer_weights(0)
    weights = {"img": w, "cap": dataclasses.replace(w, adaln_w=None, adaln_b=None,
                                                    prefix="context_refiner"), "joint": w}
    plans = {"img": BlockPlan(cfg, "noise_refiner"), "cap": BlockPlan(cfg, "context_refiner"),
             "joint": BlockPlan(cfg, "layers")}
    rows = {"img": slice(0, T - T2), "cap": slice(T - T2, T), "joint": slice(0, T)}
    flops = sum(2 * n * cfg.dim * (cfg.qkv_width + cfg.dim + 3 * cfg.ffn_dim)
                + 4 * n * n * cfg.dim for n in (T - T2, T2, T))
    return cfg, weights, plans, rows, flops


def _run_plans(eng, names, plans, rows, m, x, pe):
    u, p = eng.buffer("u"), eng.buffer("pe")
    for name in names:
        r = rows[name]
        u[:r.stop - r.start] = x[r]
        p[:r.stop - r.start] = pe[r]
        n = r.stop - r.start
        eng.run(plans[name], name, u[:n], p[:n], adaln_m=None if name == "cap" else m)
    return u[:n].copy()


def test_engine_one_pool_three_plans(benchmark, setup):
    model, x, pe, t, _, _ = setup
    cfg, weights, plans, rows, flops = _session_inputs(setup)
    T = x.shape[0]
    needs = [(plans[n], rows[n].stop - rows[n].start) for n in plans]
    benchmark.group = f"engine {MODEL} T={T} workers={WORKERS}"

    def run():
        with Engine(needs, weights, workers=WORKERS,
                    buffers={"u": (T, cfg.dim), "pe": (T, cfg.head_dim // 2, 2, 2)}) as eng:
            m = eng.adaln("img", t)
            return _run_plans(eng, list(plans), plans, rows, m, x, pe)

    out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["gflops"] = flops / bench_stats(benchmark).median / 1e9
    assert np.isfinite(out).all()


def test_engine_one_engine_per_plan(benchmark, setup):
    model, x, pe, t, _, _ = setup
    cfg, weights, plans, rows, flops = _session_inputs(setup)
    T = x.shape[0]
    benchmark.group = f"engine {MODEL} T={T} workers={WORKERS}"

    def run():
        out = None
        for name in plans:
            n = rows[name].stop - rows[name].start
            with Engine([(plans[name], n)], {name: weights[name]}, workers=WORKERS,
                        buffers={"u": (n, cfg.dim), "pe": (n, cfg.head_dim // 2, 2, 2)}) as eng:
                m = None if name == "cap" else eng.adaln(name, t)
                out = _run_plans(eng, [name], plans, rows, m, x, pe)
        return out

    out = benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["gflops"] = flops / bench_stats(benchmark).median / 1e9
    assert np.isfinite(out).all()
