"""The block plan and the Engine: one arena and one pool for several plans and token counts.

1. A denoiser-shaped session -- a modulated block on image rows (T1=37), an unmodulated block
   on caption rows (T2=19), a modulated block on the joint rows (56) -- runs from ONE engine
   (one arena, one pool forked once), in place on row ranges of one buffer. Each block's output
   is graded against the float64 reference (``nxhpc.dit.reference``, ``modulation=False`` for
   the caption block) on exactly the float32 input it saw; the bound is twice the error of a
   plain float32 numpy evaluation (``testutil.np32_block``) and 1e-5 x max|ref|, as for every
   Q8_0 block test. Outputs are bit-identical for workers in {1, 2, 3, 5}, both spawn modes,
   and to a plan run alone in its own engine.
2. Negative controls: the unmodulated output misses a modulated reference with gate 0 or
   gate 1 (tanh(1) != 1), so the unit gate is really exact.
3. The plan as data: the stage table drives the timing keys and the module docs.
4. Errors: mismatched modulation, views outside the arena, token counts beyond the sizing,
   unregistered weights -- all before any work, nothing leaked.
5. Lifecycle, on the built-in tiny model: a half-built Engine / BlockRunner closes quietly, an
   interrupt during setup is the interrupt and frees all, a dropped Engine is freed without the
   cyclic GC, Engine.run from two threads is serialized, and random interrupts of block runs
   leak no worker, arena or descriptor.
"""
import gc
import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import nxhpc._kernels as K
from nxhpc.dit import plan as plan_mod
from nxhpc.dit.config import BlockConfig
from nxhpc.dit.plan import STAGES, TIMING_KEYS, UNIT_GATE, BlockPlan, Engine, stage_table
from nxhpc.dit.reference import adaln_f64, block_forward_f64, dequantize_layer
from nxhpc.runtime.shm import live_segments
from nxhpc.dit.block import BlockRunner
from testutil import block_inputs, errs, np32_block, random_layer
from kernelutil import assert_bitwise
from procutil import (ROOT, alive, children_of, kernel_populates, linux_only, mapped_arenas,
                      mapping_rss_kb, record_dispatches, with_tests_on_path)

PID = os.getpid()
CFG = BlockConfig(dim=192, n_heads=3, n_kv_heads=3, head_dim=64, ffn_dim=512, n_layers=1,
                  adaln_in=64, variant="zimage", adaln_silu=False, norm_eps=1e-5)
T1, T2 = 37, 19            # image and caption rows: neither a multiple of 32
T = T1 + T2


def random_pe(rng, n, hd):
    """Rotations [[cos, -sin], [sin, cos]] of random angles: a valid RoPE table [n, hd/2, 2, 2]."""
    a = rng.uniform(-math.pi, math.pi, (n, hd // 2))
    c, s = np.cos(a), np.sin(a)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(8)
    w = {"nr": random_layer(rng, CFG, prefix="noise_refiner", layer=0),
         "cr": random_layer(rng, CFG, modulated=False, prefix="context_refiner", layer=0),
         "l0": random_layer(rng, CFG, prefix="layers", layer=0)}
    x = rng.standard_normal((T, CFG.dim)).astype(np.float32)
    pe = random_pe(rng, T, CFG.head_dim)
    t_emb = rng.standard_normal(CFG.adaln_in).astype(np.float32)
    plans = {"img": BlockPlan(CFG, "noise_refiner"), "cap": BlockPlan(CFG, "context_refiner"),
             "joint": BlockPlan(CFG, "layers")}
    return w, x, pe, t_emb, plans


def run_session(setup, workers, spawn="pool"):
    """The denoiser-shaped sequence on one engine; returns each block's output and the m's."""
    w, x, pe, t_emb, plans = setup
    needs = [(plans["img"], T1), (plans["cap"], T2), (plans["joint"], T)]
    with Engine(needs, w, workers=workers, spawn=spawn,
                buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)}) as eng:
        u, p = eng.buffer("u"), eng.buffer("pe")
        u[:] = x
        p[:] = pe
        pids = list(eng.pool.pids)
        m_nr = eng.adaln("nr", t_emb)                  # by key ...
        m_l = eng.adaln(w["l0"], t_emb)                # ... and by the bound object
        out = {}
        t = eng.run(plans["img"], "nr", u[:T1], p[:T1], adaln_m=m_nr)
        out["img"] = u[:T1].copy()
        eng.run(plans["cap"], "cr", u[T1:], p[T1:])
        out["cap"] = u[T1:].copy()
        tj = eng.run(plans["joint"], w["l0"], u, p, adaln_m=m_l)
        out["joint"] = u.copy()
        assert tuple(t) == TIMING_KEYS and all(v >= 0 for v in t.values())
        # the last run's stages, in order: each stage's wall time covers its slowest band
        split = eng.last_split
        assert [s.name for s in split] == [s.name for s in plans["joint"].stages]
        assert all(s.wall >= s.busy_max >= s.busy_min > 0 for s in split), split
        assert sum(s.wall for s in split) <= tj["block_us"] * 1000 + 1000
        assert all(s.overhead == s.wall - s.busy_max for s in split)
        assert eng.pool.pids == pids                   # forked once, never again
        if spawn == "pool" and workers > 1:
            assert len(pids) == workers
    assert live_segments(PID) == []
    return out, m_nr, m_l


@pytest.fixture(scope="module")
def session(setup):
    return run_session(setup, 2)


def _grade(out, x_in, w64, pe, m, modulation=True):
    ref = block_forward_f64(x_in, w64, CFG, adaln_m=m, pe=pe, modulation=modulation)
    np32 = np32_block(x_in, w64, CFG, m, pe, None, CFG.norm_eps, modulation=modulation)
    ours_max, ours_rms = errs(out, ref)
    np_max, np_rms = errs(np32, ref)
    assert ours_max <= 2 * np_max and ours_rms <= 2 * np_rms, (ours_max, np_max, ours_rms, np_rms)
    assert ours_max <= 1e-5 * np.abs(ref).max(), (ours_max, np.abs(ref).max())
    assert np.abs(ref - x_in).max() > 0.1 * np.abs(x_in).max()      # the block did something
    return ref


def test_three_plans_one_engine_vs_float64(setup, session):
    w, x, pe, t_emb, _ = setup
    out, m_nr, m_l = session
    w64 = {k: dequantize_layer(v) for k, v in w.items()}
    assert "adaln_w" not in w64["cr"]
    for m, k in ((m_nr, "nr"), (m_l, "l0")):           # the kernel adaLN vs float64
        ref_m = adaln_f64(t_emb, w64[k]["adaln_w"], w64[k]["adaln_b"])
        assert np.abs(m - ref_m).max() <= 1e-5 * np.abs(ref_m).max()
    _grade(out["img"], x[:T1], w64["nr"], pe[:T1], m_nr)
    ref_cap = _grade(out["cap"], x[T1:], w64["cr"], pe[T1:], None, modulation=False)
    joint_in = np.concatenate([out["img"], out["cap"]])
    _grade(out["joint"], joint_in, w64["l0"], pe, m_l)
    # negative controls: the caption block is not a modulated block with gate 0 or gate 1
    bound = 1e-5 * np.abs(ref_cap).max()
    for gate in (0.0, 1.0):
        m = np.zeros(4 * CFG.dim)
        m[CFG.dim:2 * CFG.dim] = m[3 * CFG.dim:] = gate
        wm = dict(w64["cr"], adaln_w=np.zeros((4 * CFG.dim, CFG.adaln_in)),
                  adaln_b=np.zeros(4 * CFG.dim))
        wrong = block_forward_f64(x[T1:], wm, CFG, adaln_m=m, pe=pe[T1:])
        assert np.abs(out["cap"] - wrong).max() > 100 * bound, gate


@pytest.mark.parametrize("workers, spawn", [(1, "pool"), (3, "pool"), (5, "pool"),
                                            (2, "stage")])
def test_session_bit_identical_any_workers(setup, session, workers, spawn):
    base = session[0]
    out = run_session(setup, workers, spawn)[0]
    for k in base:
        assert_bitwise(out[k], base[k], f"{k} workers={workers} {spawn}")


def _joint(setup, workers, precision):
    """The joint block at T rows on its own engine: its output and each stage's extent."""
    w, x, pe, t_emb, plans = setup
    with Engine([(plans["joint"], T)], {"l0": w["l0"]}, workers=workers,
                buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)}) as eng:
        u = eng.buffer("u")
        u[:] = x
        eng.buffer("pe")[:] = pe
        eng.run(plans["joint"], "l0", u, eng.buffer("pe"), adaln_m=eng.adaln("l0", t_emb),
                precision=precision)
        return u.copy(), {s.name: s.extent for s in eng.last_split}


PROJECTIONS = {"qkv": CFG.qkv_width, "out_proj": CFG.dim, "w13": CFG.ffn_dim, "w2": CFG.dim}


@pytest.mark.parametrize("precision", ["f32", "bf16", "q8"])
def test_projections_by_rows_have_the_bits_of_columns(setup, monkeypatch, precision):
    """Once every worker gets PROJ_ROWS_PER_WORKER token rows, the four projections split over
    rows instead of output columns, with the same bits (the threshold is moved here so that
    T = 56 runs both ways at every worker count). Negative control: a row band that leaves out
    its last row changes the output, so the comparison sees the row split."""
    from nxhpc.nn import stages
    assert stages.proj_by_rows(512, 2) and not stages.proj_by_rows(511, 2)
    assert stages.proj_by_rows(256, 1) and stages.proj_by_rows(256, 0)
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 10 ** 9)
    base, ext = _joint(setup, 2, precision)
    assert {k: ext[k] for k in PROJECTIONS} == PROJECTIONS
    assert ext["norm1"] == T and ext["sdpa"] == CFG.n_heads
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 1)
    for workers in (1, 2, 3):
        out, ext = _joint(setup, workers, precision)
        assert {k: ext[k] for k in PROJECTIONS} == dict.fromkeys(PROJECTIONS, T)
        assert ext["sdpa"] == CFG.n_heads
        assert_bitwise(out, base, f"rows, {workers} workers, {precision}")
    real = stages.matmul

    def short(k, x, wt, o, lo, hi, prec):          # a row band's last row left out
        if o.shape[0] < T:
            x, o = x[:-1], o[:-1]
        real(k, x, wt, o, lo, hi, prec)

    monkeypatch.setattr(stages, "matmul", short)
    assert np.any(_joint(setup, 2, precision)[0] != base)
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 10 ** 9)
    assert_bitwise(_joint(setup, 2, precision)[0], base, "the mutant by columns")


@pytest.mark.parametrize("precision", ["f32", "bf16", "q8"])
def test_row_groups_have_the_bits_of_separate_stages(setup, monkeypatch, precision):
    """With the projections by rows, the row-local stages run as two dispatches (norm1 + qkv;
    out_proj to ffn_tail) with no wait between a worker's stages, and give the bits of every
    stage dispatched alone, at 1, 2 and 3 workers and both spawn modes; by columns nothing is
    grouped. Each grouped stage keeps its own StageSplit (its group named). Negative control:
    a group run in reverse order changes the output, so the comparison sees the groups."""
    from nxhpc.nn import engine as eng_mod, stages
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 1)
    monkeypatch.setattr(eng_mod, "ROW_GROUPS", False)
    base, _ = _joint(setup, 2, precision)
    calls = record_dispatches(monkeypatch)
    _joint(setup, 2, precision)
    assert calls == [s.name for s in STAGES]
    monkeypatch.setattr(eng_mod, "ROW_GROUPS", True)
    groups = {"norm1": "norm1", "qkv": "norm1", "qknorm_rope": "", "sdpa": "",
              **dict.fromkeys(["out_proj", "attn_tail", "w13", "w2", "ffn_tail"], "out_proj")}
    for workers, spawn in ((1, "pool"), (2, "pool"), (3, "pool"), (2, "stage")):
        w, x, pe, t_emb, plans = setup
        calls.clear()
        with Engine([(plans["joint"], T)], {"l0": w["l0"]}, workers=workers, spawn=spawn,
                    buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)}) as eng:
            u = eng.buffer("u")
            u[:] = x
            eng.buffer("pe")[:] = pe
            t = eng.run(plans["joint"], "l0", u, eng.buffer("pe"),
                        adaln_m=eng.adaln("l0", t_emb), precision=precision)
            assert_bitwise(u, base, f"groups, {workers} workers, {spawn}, {precision}")
            split = eng.last_split
        assert calls == ["norm1+qkv", "qknorm_rope", "sdpa",
                         "out_proj+attn_tail+w13+w2+ffn_tail"]
        assert [s.name for s in split] == [s.name for s in STAGES]
        assert {s.name: s.group for s in split} == groups
        assert all(s.extent == T for s in split if s.group)
        # a group's pool cost is its first stage's overhead; the others' shares fit their bands
        assert all(s.overhead == 0 for s in split if s.group and s.name != s.group)
        assert all(0 <= s.busy_min <= s.busy_max and s.wall >= 0 for s in split)
        assert sum(s.wall for s in split) <= t["block_us"] * 1000 + 1000
    calls.clear()
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 10 ** 9)   # by columns: no group
    assert_bitwise(_joint(setup, 2, precision)[0], base, "columns")
    assert calls == [s.name for s in STAGES]
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 1)
    real_group = eng_mod.Engine._group_task

    def reversed_group(self, fns):
        task = real_group(self, fns)
        return lambda lo, hi, arg: task(lo, hi, (arg[0], arg[1][::-1]))
    monkeypatch.setattr(eng_mod.Engine, "_group_task", reversed_group)
    assert np.any(_joint(setup, 2, precision)[0] != base)


def test_a_failing_stage_in_a_row_group_is_named(setup, monkeypatch):
    """An error inside a row group names the group's stages, and the worker's traceback the
    stage that raised; nothing leaks."""
    from nxhpc.nn import stages
    from nxhpc.runtime.workers import WorkerError
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 1)
    real = K.norm_residual

    def failing(*a, r0=0, **k):
        if r0 > 0:
            raise FloatingPointError("injected")
        return real(*a, r0=r0, **k)
    monkeypatch.setattr(K, "norm_residual", failing)
    with pytest.raises(WorkerError, match=r"stage 'out_proj\+attn_tail\+w13\+w2\+ffn_tail': "
                                          r"worker 1 of 2") as ei:
        _joint(setup, 2, "f32")
    msg, detail = str(ei.value), ei.value.detail
    del ei                                # its traceback holds the run's views of the arena
    gc.collect()
    assert "injected" in msg
    assert "in stage 'attn_tail' of the row group out_proj+attn_tail+w13+w2+ffn_tail" in detail
    assert live_segments(PID) == [] and mapped_arenas() == []


def test_a_hung_stage_in_a_row_group_gets_the_groups_budget(setup, monkeypatch):
    """A row group of k stages may run k stage timeouts (each stage gets ``stage_timeout``),
    then it is a worker failure naming the group and the budget; nothing leaks."""
    from nxhpc.nn import stages
    from nxhpc.runtime.workers import WorkerError
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", 1)
    real = K.norm_residual

    def slow(*a, r0=0, **k):              # 0.6 s in each tail: over 0.5 s, under 5 x 0.5 s
        if r0 > 0:
            time.sleep(0.6)
        return real(*a, r0=r0, **k)
    monkeypatch.setattr(K, "norm_residual", slow)
    w, x, pe, t_emb, plans = setup

    def run(timeout):
        with Engine([(plans["joint"], T)], {"l0": w["l0"]}, workers=2, stage_timeout=timeout,
                    buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)}) as eng:
            u = eng.buffer("u")
            u[:] = x
            eng.buffer("pe")[:] = pe
            eng.run(plans["joint"], "l0", u, eng.buffer("pe"), adaln_m=eng.adaln("l0", t_emb))
            return u.copy()
    run(0.5)                              # 1.2 s of tails in a group of 5 stages: within 2.5 s
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as ei:
        run(0.2)                          # 1.2 s > 5 x 0.2 s
    msg = str(ei.value)
    del ei
    gc.collect()
    assert "stage 'out_proj+attn_tail+w13+w2+ffn_tail': worker 1 of 2" in msg, msg
    assert "stage timeout of 0.2 s for each of its 5 stages (1 s)" in msg, msg
    assert time.monotonic() - t0 < 10
    assert live_segments(PID) == [] and mapped_arenas() == []


def test_plan_alone_equals_plan_in_shared_engine(setup, session):
    """Sharing the arena and pool with other plans does not change a plan's bits."""
    w, x, pe, _, plans = setup
    out, m_nr, _ = session
    with Engine([(plans["cap"], T2)], {"cr": w["cr"]}, workers=2,
                buffers={"x": (T2, CFG.dim), "y": (T2, CFG.dim),
                         "pe": (T2, CFG.head_dim // 2, 2, 2)}) as eng:
        eng.buffer("x")[:] = x[T1:]
        eng.buffer("pe")[:] = pe[T1:]
        eng.run(plans["cap"], "cr", eng.buffer("x"), eng.buffer("pe"), out=eng.buffer("y"))
        assert_bitwise(eng.buffer("y"), out["cap"], "cap alone, out-of-place")
        assert_bitwise(eng.buffer("x"), x[T1:], "input untouched when out is given")


@linux_only
@pytest.mark.parametrize("populating", [True, False])
def test_workers_start_with_the_arena_mapped(setup, monkeypatch, populating):
    """Each resident worker maps the whole arena in one call before its first stage (a forked
    process otherwise maps each shared page at its first touch, one fault per page). Negative
    control: with populating disabled a worker holds (almost) none of the arena's pages."""
    import nxhpc.runtime.shm as shm
    if not populating:
        monkeypatch.setattr(shm, "populate", lambda mm: False)
    w, _, _, _, plans = setup

    def rss(eng, lo, hi, arg):
        out = eng.buffer("rss")
        kb = mapping_rss_kb(out.ctypes.data)
        for i in range(lo, hi):
            out[i] = kb

    with Engine([(plans["cap"], T2)], {"cr": w["cr"]}, workers=2, tasks={"rss": rss},
                buffers={"rss": ((2,), np.int64), "pad": (1 << 20,)}) as eng:
        eng.run_task("rss", 2)
        got = eng.buffer("rss") * 1024
        assert eng.pool.pids and os.getpid() not in eng.pool.pids
        if populating and kernel_populates():
            assert (got >= eng.arena.nbytes).all(), (got, eng.arena.nbytes)
        else:
            assert (got < eng.arena.nbytes // 4).all(), (got, eng.arena.nbytes)


def test_unit_gate_is_exactly_one_in_every_variant():
    """gated_residual(resid, y, UNIT_GATE) == resid + y bit for bit, at every ISA (and so for
    norm_residual with y normalized): tanh of the unit gate rounds to 1.0f. Negative control: a
    gate of 8 (tanh = 1 - 2.3e-7) is visible."""
    rng = np.random.default_rng(3)
    r = (rng.standard_normal((5, 333)) * 100).astype(np.float32)
    y = (rng.standard_normal((5, 333)) * 1e3).astype(np.float32)
    for isa in K.supported_isas():
        o = np.empty_like(r)
        K.gated_residual(r, y, np.full(333, UNIT_GATE, np.float32), o, isa=isa)
        assert_bitwise(o, r + y, isa)
        K.gated_residual(r, y, np.full(333, 8.0, np.float32), o, isa=isa)
        assert not np.array_equal(o, r + y), isa
        # the residual tails' kernel (norm first, with a unit weight): resid + rmsnorm(y)
        n = np.empty_like(r)
        K.rmsnorm(y, np.ones(333, np.float32), n, 1e-6, isa=isa)
        K.norm_residual(y, np.ones(333, np.float32), r, np.full(333, UNIT_GATE, np.float32), o,
                        1e-6, isa=isa)
        assert_bitwise(o, r + n, isa)


def test_stage_table_drives_keys_and_docs():
    assert TIMING_KEYS == ("us_prenorm_qkv", "us_qknorm_rope", "us_sdpa", "us_attn_tail",
                           "us_ffn", "block_us")
    doc = plan_mod.__doc__
    for line in stage_table().splitlines():
        assert "    " + line in doc, line
    assert [s.name for s in STAGES] == ["norm1", "qkv", "qknorm_rope", "sdpa", "out_proj",
                                        "attn_tail", "w13", "w2", "ffn_tail"]
    p = BlockPlan(CFG)
    assert p.modulated and not BlockPlan(CFG, "context_refiner").modulated
    assert BlockPlan(CFG, "noise_refiner").modulated
    ext = {s.name: p.extent(s, 10) for s in STAGES}
    assert ext == {"norm1": 10, "qkv": CFG.qkv_width, "qknorm_rope": 6, "sdpa": 3,
                   "out_proj": 192, "attn_tail": 10, "w13": 512,
                   "w2": 192, "ffn_tail": 10}
    assert p.tensor_names(1)["adaln_w"] == "layers.1.adaLN_modulation.0.weight"
    assert "adaln_w" not in BlockPlan(CFG, "context_refiner").tensor_names(0)
    with pytest.raises(ValueError, match="unknown stack prefix"):
        BlockPlan(CFG, "final_layer")
    assert not BlockPlan(CFG, "final_layer", modulated=False).modulated


def test_engine_errors_before_any_work(setup):
    w, x, pe, t_emb, plans = setup
    img, cap = plans["img"], plans["cap"]
    with Engine([(img, T1), (cap, T2)], w, workers=2,
                buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)}) as eng:
        u, p = eng.buffer("u"), eng.buffer("pe")
        m = eng.adaln("nr", t_emb)
        with pytest.raises(ValueError, match="unmodulated context_refiner plan takes no"):
            eng.run(cap, "cr", u[:T2], p[:T2], adaln_m=m)
        with pytest.raises(ValueError, match="needs adaln_m"):
            eng.run(img, "nr", u[:T1], p[:T1])
        with pytest.raises(ValueError, match="cannot run layer 0, which has adaLN"):
            eng.run(cap, "l0", u[:T2], p[:T2])
        with pytest.raises(ValueError, match="cannot run context_refiner.0, which has no"):
            eng.run(img, "cr", u[:T1], p[:T1], adaln_m=m)
        with pytest.raises(ValueError, match="row range of one of the engine's buffers"):
            eng.run(img, "nr", np.zeros((T1, CFG.dim), np.float32), p[:T1], adaln_m=m)
        with pytest.raises(ValueError, match=r"pe must be float32 \(37, 32, 2, 2\)"):
            eng.run(img, "nr", u[:T1], p[:T2], adaln_m=m)
        with pytest.raises(ValueError, match="needs more scratch"):
            eng.run(img, "nr", u, p, adaln_m=m)          # T1+T2 rows: never declared
        with pytest.raises(ValueError, match="non-finite"):
            eng.run(img, "nr", u[:T1], p[:T1], adaln_m=np.full(4 * CFG.dim, np.nan))
        with pytest.raises(KeyError, match="not given to the engine"):
            eng.run(img, random_layer(np.random.default_rng(0), CFG), u[:T1], p[:T1],
                    adaln_m=m)
        with pytest.raises(KeyError, match="no buffer 'x'"):
            eng.buffer("x")
        with pytest.raises(ValueError, match="unmodulated"):
            eng.adaln("cr", t_emb)
        # the engine still works after the refused calls
        eng.run(cap, "cr", u[:T2], p[:T2])
    with pytest.raises(ValueError, match="share one BlockConfig"):
        other = BlockConfig(**{**CFG.__dict__, "ffn_dim": 256})
        Engine([(img, T1), (BlockPlan(other), T1)], {}, workers=1)
    with pytest.raises(ValueError, match="reserved"):
        Engine([(img, T1)], {}, buffers={"qkv": (3,)})
    bad = random_layer(np.random.default_rng(1), CFG)
    bad.w2 = bad.w2.data[:, :-34]
    with pytest.raises(ValueError, match="weight 'w2' must be Q8_0 uint8"):
        Engine([(img, T1)], {"bad": bad})
    assert live_segments(PID) == []


# ----------------------------------------------------------------------------- lifecycle
# (on the built-in tiny model: the Engine and BlockRunner as Block and run_layers use them)

def test_half_built_engine_and_runner_close_is_a_noop():
    """close() of an Engine / BlockRunner whose __init__ never ran (an interrupt before its
    first statement) touches no attribute that does not exist yet. Before: AttributeError
    ('pool', 'engine') -- the error that replaced the KeyboardInterrupt."""
    for cls in (Engine, BlockRunner):
        obj = object.__new__(cls)
        obj.close()
        obj.close()
    assert object.__new__(Engine).closed


@linux_only
@pytest.mark.parametrize("where", ["in SharedArena()", "in WorkerPool()", "after Engine()"])
def test_interrupt_in_setup_is_the_interrupt_and_frees_all(tiny, monkeypatch, where):
    """A KeyboardInterrupt during setup -- inside Engine.__init__ (at the arena, at the fork),
    or right after Engine() returned, before BlockRunner stored it -- comes out of Engine(),
    BlockRunner() and Block.forward() as itself, with nothing mapped or forked, without any
    garbage collection. Before: the last case left the engine's workers and arena alive (a
    reference cycle) until the cyclic GC ran; the first two are regression checks."""
    import nxhpc.dit.block as block
    import nxhpc.nn.engine as plan
    mod, name = (block, "Engine") if where == "after Engine()" else (plan, where[3:-2])
    real = getattr(mod, name)
    calls = []

    def interrupted(*a, **k):
        calls.append(where)
        if where == "after Engine()":
            real(*a, **k)                  # built, then dropped unstored
        elif where == "in WorkerPool()":   # after the arena exists: it must be released
            assert len(mapped_arenas()) == 1
        raise KeyboardInterrupt
    x, t, pe = block_inputs(tiny)
    w = {0: tiny.layer_weights(0)}
    kids = set(children_of(PID))
    gc.disable()
    try:
        monkeypatch.setattr(mod, name, interrupted)
        if mod is plan:
            with pytest.raises(KeyboardInterrupt):
                Engine([(BlockPlan(tiny.config), x.shape[0])], w, workers=2)
        with pytest.raises(KeyboardInterrupt):
            BlockRunner(tiny.config, w, x.shape[0], workers=2)
        with tiny.block(0) as blk:
            with pytest.raises(KeyboardInterrupt):
                blk.forward(x, t, pe, workers=2)
            assert blk._runner is None
        assert calls == [where] * (3 if mod is plan else 2)    # the patched step really ran
        assert mapped_arenas() == [] and set(children_of(PID)) == kids
        monkeypatch.setattr(mod, name, real)
        with tiny.block(0) as blk:                      # negative control: the check sees one
            blk.forward(x, t, pe, workers=2)
            assert len(mapped_arenas()) == 1 and len(set(children_of(PID)) - kids) == 2
    finally:
        gc.enable()
    assert live_segments(PID) == []


@linux_only
@pytest.mark.parametrize("spawn", ["pool", "stage"])
def test_dropped_engine_frees_workers_and_arena_without_gc(tiny, spawn):
    """An Engine dropped without close() -- e.g. an interrupt between Engine() returning and
    the caller's store -- is released when its last reference goes. Before: the pool's tasks
    held the engine (engine -> pool -> task -> engine), so its workers and arena lived until
    the cyclic garbage collector happened to run."""
    x, t, pe = block_inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    kids = set(children_of(PID))                # (e.g. multiprocessing's resource tracker)
    gc.disable()
    try:
        e = Engine([(plan, T)], {0: tiny.layer_weights(0)}, workers=2, spawn=spawn,
                   buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)})
        np.copyto(e.buffer("x"), x)
        np.copyto(e.buffer("pe"), pe)
        e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t))
        pids = list(e.pool.pids)
        assert len(mapped_arenas()) == 1 and (spawn == "stage" or all(map(alive, pids)))
        del e
        assert mapped_arenas() == []
        assert not any(map(alive, pids)) and set(children_of(PID)) == kids
    finally:
        gc.enable()


def test_engine_from_threads_is_serialized(tiny):
    """One Engine, two threads each running the block on its own row range of a joint buffer
    (10 runs each): Engine.run is serialized, every result is the single-run one."""
    x, t, pe = block_inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    w = {0: tiny.layer_weights(0)}
    ref, _ = tiny.block(0).forward(x, t, pe, workers=2)
    errors = []
    with Engine([(plan, T)], w, workers=2, buffers={"u": (2 * T, D), "o": (2 * T, D),
                                                    "pe": (2 * T, hd // 2, 2, 2)}) as e:
        u, o, p = e.buffer("u"), e.buffer("o"), e.buffer("pe")
        for k in (0, 1):
            u[k * T:(k + 1) * T] = x
            p[k * T:(k + 1) * T] = pe
        m = e.adaln(0, t)

        def call(k):
            for _ in range(10):
                try:
                    sl = slice(k * T, (k + 1) * T)
                    e.run(plan, 0, u[sl], p[sl], adaln_m=m, out=o[sl])
                    if not np.array_equal(o[sl], ref):
                        errors.append(f"thread {k}: different output")
                except BaseException as ex:  # noqa: BLE001
                    errors.append(f"thread {k}: {type(ex).__name__}: {ex}")
        ts = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(120)
    assert errors == [], errors[:5]


_LOOP = textwrap.dedent(r"""
    import collections, gc, json, os, random, signal, sys, time, traceback
    import numpy as np
    from procutil import children_of                  # tests/, on this child's PYTHONPATH
    from nxhpc.models import open_model
    from nxhpc.dit.block import run_layers
    from nxhpc.dit.plan import BlockPlan, Engine
    from nxhpc.runtime.shm import live_segments

    N, seed, models = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rng = random.Random(seed)
    DIT = os.path.dirname(sys.modules["nxhpc.dit.block"].__file__)
    RUNTIME = os.path.dirname(sys.modules["nxhpc.runtime.shm"].__file__)
    m = open_model("tiny", models_dir=models)
    cfg = m.config
    x, t, pe = m.blk_in(0), m.t_emb(), m.pe()
    T, D, hd = x.shape[0], cfg.dim, cfg.head_dim
    w01 = {0: m.layer_weights(0), 1: m.layer_weights(1)}
    plan = BlockPlan(cfg, "layers")

    def on_alarm(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, on_alarm)

    def kept(mode):                 # Block kept between calls
        with m.block(0) as blk:
            blk.forward(x, t, pe, workers=2, spawn=mode)
            blk.forward(x, t, pe, workers=2, spawn=mode)

    def single(mode):               # Block, one call: forks and releases inside forward
        m.block(0).forward(x, t, pe, workers=2, spawn=mode)

    def chain(mode):                # run_layers: one BlockRunner for two layers
        run_layers(m, [0, 1], x, pe, t_emb=t, workers=2, spawn=mode, weights=w01)

    def engine(mode):               # the Engine itself
        with Engine([(plan, T)], w01, workers=2, spawn=mode,
                    buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
            np.copyto(e.buffer("x"), x)
            np.copyto(e.buffer("pe"), pe)
            e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t))

    CYCLES = (kept, single, chain, engine)

    def children():
        return children_of(os.getpid())

    def mapped():
        with open("/proc/self/maps") as fh:
            return sorted({ln.split()[5] for ln in fh if "/dev/shm/nxhpc_" in ln})

    def fds():
        return {f: os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{f}")}

    for c in CYCLES:                               # warm up: imports, lifeline, caches
        for mode in ("pool", "stage"):
            c(mode)
    times = collections.defaultdict(list)
    for _ in range(3):                             # each cycle's length: its timer's range
        for c in CYCLES:
            for mode in ("pool", "stage"):
                t0 = time.perf_counter()
                c(mode)
                times[(c, mode)].append(time.perf_counter() - t0)
    per = {k: sorted(v)[1] for k, v in times.items()}
    gc.collect()
    fds0, kids0 = fds(), set(children())
    errors, where = collections.Counter(), collections.Counter()
    interrupted = 0
    gc.disable()          # what is left must be released by refcounting, not a lucky GC run
    for i in range(N):
        c = rng.choice(CYCLES)
        mode = rng.choice(("pool", "stage"))
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.2 * per[(c, mode)]))
                c(mode)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except KeyboardInterrupt as e:
            interrupted += 1
            inner = [fr for fr in traceback.extract_tb(e.__traceback__)
                     if fr.filename.startswith((DIT, RUNTIME))]
            if inner:
                where[f"{os.path.basename(inner[-1].filename)}:{inner[-1].name}"] += 1
        except BaseException as e:  # noqa: BLE001
            errors[f"{type(e).__name__}: {str(e)[:80]}"] += 1
    time.sleep(0.2)
    before_gc = {"children": sorted(set(children()) - kids0), "mapped": mapped(),
                 "new_fds": {k: v for k, v in fds().items() if k not in fds0}}
    gc.enable()
    gc.collect()
    time.sleep(0.2)
    print(json.dumps({
        "cycles": N, "interrupted": interrupted, "errors": dict(errors), "where": dict(where),
        "before_gc": before_gc, "segments": live_segments(os.getpid()),
        "children": sorted(set(children()) - kids0), "mapped": mapped(),
        "new_fds": {k: v for k, v in fds().items() if k not in fds0},
    }))
""")


@linux_only
@pytest.mark.parametrize("seed", [1, 2])
def test_random_interrupts_in_block_runs_leak_nothing(models_root, tiny, seed):
    """The random-interrupt loop of test_workers.py (the runtime alone) on block runs (a kept Block, a one-call
    Block, run_layers, the Engine), both spawn modes: every interrupt surfaces as itself; no
    worker, mapped arena or descriptor survives -- already before any garbage collection.
    Before: 2 live workers and 3 mapped arenas after 300 interrupts (freed only by gc)."""
    r = subprocess.run([sys.executable, "-c", _LOOP, "300", str(seed), str(models_root)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env=with_tests_on_path())
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    # negative controls: the interrupts happened, at many places, in the block code too
    assert rep["interrupted"] >= rep["cycles"] // 2, rep
    assert len(rep["where"]) >= 5, rep["where"]
    assert any(not k.startswith(("proc.py", "shm.py", "workers.py")) for k in rep["where"]), \
        rep["where"]                             # ... also in the block code, not only runtime
    assert rep["errors"] == {}, rep["errors"]
    assert "Exception ignored" not in r.stderr, r.stderr[-3000:]
    assert rep["before_gc"] == {"children": [], "mapped": [], "new_fds": {}}, rep["before_gc"]
    assert rep["segments"] == [] and rep["children"] == [] and rep["mapped"] == [], rep
    assert rep["new_fds"] == {}, rep


def test_closed_engine_says_so(setup):
    """An engine's buffer asked for after close() is a RuntimeError saying the engine is
    closed (it was a bare KeyError naming the buffer, as a misspelt name is -- control)."""
    w, x, pe, t_emb, plans = setup
    eng = Engine([(plans["joint"], T)], {"l0": w["l0"]}, workers=1,
                 buffers={"u": (T, CFG.dim), "pe": (T, CFG.head_dim // 2, 2, 2)})
    try:
        with pytest.raises(KeyError, match="no buffer 'uu'"):
            eng.buffer("uu")
        assert eng.buffer("u").shape == (T, CFG.dim)
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        eng.buffer("u")
