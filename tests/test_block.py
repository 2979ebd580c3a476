"""The block pipeline on the C kernels, checked against independent oracles.

1. float64 numpy reference (``nxhpc.dit.reference``, no shared code with the kernels) on synthetic
   models (tiny MHA, tiny-gqa GQA + SiLU adaLN, mid hd=128; with and without mask): our float32
   error vs float64 must be within 2x of a plain numpy float32 evaluation's error
   (``testutil.np32_block``).
2. diffusers' ``ZImageTransformerBlock`` (torch CPU) with the same dequantized weights, eps set on
   all six norms: max abs error <= 1e-5 * max|reference| (6x64 and 3x128 heads, T=37).
3. Bit-identical outputs for workers in {1, 2, 3, 5, 16} and both spawn modes; fixture weights
   == GGUF weights; a chained run == layer-by-layer runs.
Negative controls show each comparison can fail. Input errors are checked before anything runs,
after narrowing to float32 (inputs and eps that float32 cannot hold are refused). A kept Block
used from several threads is serialized; nested ``with`` keeps its workers to the outer exit.
"""
import gc
import os
import threading
import time

import numpy as np
import pytest

from nxhpc.dit.block import Block, run_layers, validate_inputs
from nxhpc.dit.reference import block_forward_f64, dequantize_layer
from nxhpc.dit.config import BlockConfig
from nxhpc.models import open_model
from nxhpc.runtime.shm import live_segments
from nxhpc.runtime.workers import WorkerError
from nxhpc.dit.plan import EPS_RANGE, BlockPlan, Engine
from testutil import ArrayModel, block_inputs, errs, mask_for, np32_block, random_layer
from procutil import alive, linux_only, mapped_arenas, run_cli

PID = os.getpid()


def _open(mid, root):
    return open_model(mid, models_dir=root)


CASES = [  # model, mask: None = no mask, "model" = the model's own, int = pad that many keys
    ("tiny", None), ("tiny", 7), ("tiny-gqa", "model"), ("tiny-gqa", None), ("mid", None),
    ("mid", 11),
]


@pytest.mark.parametrize("mid, mask_kind", CASES)
def test_vs_float64_within_2x_of_numpy_float32(models_root, mid, mask_kind):
    model = _open(mid, models_root)
    cfg = model.config
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    T = x.shape[0]
    mask = (model.mask() if mask_kind == "model"
            else None if mask_kind is None else mask_for(T, mask_kind))
    if mask_kind == "model":
        assert mask is not None and not mask.all()
    blk = model.block(0)
    w64 = dequantize_layer(blk.weights)
    ref = block_forward_f64(x, w64, cfg, t_emb=t, pe=pe, mask=mask)
    out, timings = blk.forward(x, t, pe, mask=mask, workers=2)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert set(timings) >= {"us_prenorm_qkv", "us_qknorm_rope", "us_sdpa", "us_attn_tail",
                            "us_ffn", "block_us"}
    m32 = blk.adaln(t)
    np32 = np32_block(x, w64, cfg, m32, pe, mask, cfg.norm_eps)
    ours_max, ours_rms = errs(out, ref)
    np_max, np_rms = errs(np32, ref)
    assert ours_max <= 2 * np_max, (ours_max, np_max)
    assert ours_rms <= 2 * np_rms, (ours_rms, np_rms)
    # negative control: a mask that is wrong (or missing) is far outside the bound
    wrong = mask_for(T, 5) if mask is None else None
    bad, _ = blk.forward(x, t, pe, mask=wrong, workers=2)
    assert errs(bad, ref)[0] > 100 * np_max
    assert live_segments(PID) == []


def test_fixture_ref_out_matches_oracle(models_root):
    """The model's stored ref_out is the same float64 evaluation (sanity of the chain inputs)."""
    model = _open("tiny", models_root)
    out, _ = model.block(0).forward(model.blk_in(0), model.t_emb(), model.pe(), workers=2)
    ref = model.ref_out(0)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


# ------------------------------------------------------------------ bit-identity
@pytest.mark.parametrize("mid", ["tiny-gqa", "mid"])
def test_bit_identical_any_workers_and_spawn(models_root, mid):
    model = _open(mid, models_root)
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    blk = model.block(0)
    base, _ = blk.forward(x, t, pe, mask=mask, workers=1)
    for spawn in ("pool", "stage"):
        for n in (1, 2, 3, 5, 16):
            out, _ = blk.forward(x, t, pe, mask=mask, workers=n, spawn=spawn)
            assert np.array_equal(out, base), (spawn, n)
    assert live_segments(PID) == []


def test_fixture_weights_equal_gguf_weights(models_root):
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    a = Block(model, 0, source="gguf")
    b = Block(model, 0, source="fixtures")
    assert a.weights.source == "gguf" and b.weights.source == "fixtures"
    oa, _ = a.forward(x, t, pe, workers=2)
    ob, _ = b.forward(x, t, pe, workers=2)
    assert np.array_equal(oa, ob)


@pytest.mark.parametrize("mid", ["mid", "tiny-gqa"])
def test_chain_equals_layer_by_layer(models_root, mid):
    model = _open(mid, models_root)
    cfg = model.config
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    seen = {}
    res = run_layers(model, range(cfg.n_layers), x, pe, t_emb=t, mask=mask, workers=2,
                     on_layer=lambda i, o, tm: seen.__setitem__(i, o.copy()))
    assert len(res.timings["per_layer"]) == cfg.n_layers
    cur = x
    for i in range(cfg.n_layers):
        cur, _ = model.block(i).forward(cur, t, pe, mask=mask, workers=3, spawn="stage")
        assert np.array_equal(cur, seen[i]), i
    assert np.array_equal(cur, res.output)
    # and the chain follows the float64 chain stored with the model
    last = model.ref_out(cfg.n_layers - 1)
    assert np.abs(res.output - last).max() <= 1e-5 * np.abs(last).max()


def test_repeat_gives_same_bits_and_min_timings(models_root):
    """repeat=3 reruns the chain on the same workers: identical output, every stage time is the
    minimum over the runs (so never above a single run's own figure), on_layer called once per
    layer; repeat < 1 is refused."""
    model = _open("mid", models_root)
    cfg = model.config
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    one = run_layers(model, range(cfg.n_layers), x, pe, t_emb=t, mask=mask, workers=2)
    calls = []
    three = run_layers(model, range(cfg.n_layers), x, pe, t_emb=t, mask=mask, workers=2,
                       repeat=3, on_layer=lambda i, o, tm: calls.append(i))
    assert np.array_equal(one.output, three.output)
    assert calls == list(range(cfg.n_layers))
    for tl in three.timings["per_layer"]:
        assert set(tl) >= {"us_ffn", "block_us"} and all(v >= 0 for v in tl.values())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="repeat"):
            run_layers(model, [0], x, pe, t_emb=t, mask=mask, workers=1, repeat=bad)


def test_adaln_fixture_path_equals_t_emb_path_closely(models_root):
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    blk = model.block(0)
    m_fix = model.adaln_m(0)
    assert np.abs(blk.adaln(t) - m_fix).max() <= 1e-5 * np.abs(m_fix).max()
    o1, _ = blk.forward(x, t, pe, workers=2)
    o2, _ = blk.forward(x, pe=pe, adaln_m=m_fix, workers=2)
    assert np.abs(o1 - o2).max() <= 1e-5 * np.abs(o1).max()


def test_context_manager_reuses_workers(models_root):
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    with model.block(0) as blk:
        o1, _ = blk.forward(x, t, pe, workers=2)
        r = blk._runner
        assert r is not None and len(r.pool.pids) == 2
        o2, _ = blk.forward(x, t, pe, workers=2)
        assert blk._runner is r
        assert np.array_equal(o1, o2)
    assert blk._runner is None and r.pool.closed
    assert live_segments(PID) == []


def test_arena_unmapped_after_each_forward(models_root):
    """The arena's memory is returned when forward() returns, not at some later GC cycle
    (at Z-Image size and T=4096 one arena is ~1 GB); inside ``with`` it stays mapped."""
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    blk = model.block(0)
    gc.disable()
    try:
        assert mapped_arenas() == []
        for spawn in ("pool", "stage"):
            blk.forward(x, t, pe, workers=2, spawn=spawn)
            assert mapped_arenas() == [], spawn
        run_layers(model, [0, 1], x, pe, t_emb=t, workers=2)
        assert mapped_arenas() == []
        with model.block(0) as kept:
            kept.forward(x, t, pe, workers=2)
            assert len(mapped_arenas()) == 1           # negative control: the check sees it
        assert mapped_arenas() == []
    finally:
        gc.enable()


def test_hung_worker_stage_timeout(models_root, monkeypatch):
    """A worker stuck inside a kernel is killed at ``stage_timeout``; the error names the stage."""
    import nxhpc._kernels as K
    real = K.norm_residual                # the residual tails' kernel

    def stuck(*a, r0=0, **k):
        if r0 > 0:
            time.sleep(60)
        return real(*a, r0=r0, **k)

    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    blk = model.block(0)
    ok, _ = blk.forward(x, t, pe, workers=2, stage_timeout=30)    # a generous limit is inert
    base, _ = blk.forward(x, t, pe, workers=2)
    assert np.array_equal(ok, base)
    monkeypatch.setattr(K, "norm_residual", stuck)
    t0 = time.monotonic()
    with pytest.raises(WorkerError,
                       match=r"stage 'attn_tail': worker 1 of 2.*stage timeout of 0.5 s"):
        blk.forward(x, t, pe, workers=2, stage_timeout=0.5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="stage_timeout"):
        blk.forward(x, t, pe, workers=2, stage_timeout=-1)
    assert live_segments(PID) == [] and mapped_arenas() == []


def test_forward_into_out(models_root):
    """``out=``: the output lands in the caller's array (the same bits as a fresh one), also
    when it is x itself; a bad out is refused before anything runs and nothing is written."""
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    with model.block(0) as blk:
        want, _ = blk.forward(x, t, pe, workers=2)
        buf = np.full_like(want, np.nan)
        got = blk.forward(x, t, pe, workers=2, out=buf)
        assert got.output is buf and np.array_equal(buf.view(np.uint32), want.view(np.uint32))
        xc = x.astype(np.float32).copy()
        blk.forward(xc, t, pe, workers=2, out=xc)                 # in place
        assert np.array_equal(xc.view(np.uint32), want.view(np.uint32))
        keep = np.full_like(want, 7.0)
        for bad, err, msg in ((keep.astype(np.float64), TypeError, "out must be float32"),
                              (keep[:-1], ValueError, r"out must have x's shape"),
                              (np.asfortranarray(keep), ValueError, "C-contiguous"),
                              (keep.tolist(), TypeError, "numpy.ndarray")):
            with pytest.raises(err, match=msg):
                blk.forward(x, t, pe, workers=2, out=bad)
        ro = keep.copy()
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writeable"):
            blk.forward(x, t, pe, workers=2, out=ro)
        assert (ro == 7.0).all() and (keep == 7.0).all()
    assert live_segments(PID) == []


# ------------------------------------------------------------------ bad inputs
def test_bad_inputs_clear_errors(models_root):
    model = _open("tiny", models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    blk = model.block(0)
    xn = x.copy()
    xn[3, 5] = np.nan
    with pytest.raises(ValueError, match=r"x has 1 non-finite.*\(3, 5\)"):
        blk.forward(xn, t, pe, workers=2)
    with pytest.raises(ValueError, match=r"x must have shape \(45, 384\)"):
        blk.forward(x[:, :100], t, pe)
    with pytest.raises(ValueError, match="pe must have shape"):
        blk.forward(x, t, pe[:10])
    with pytest.raises(ValueError, match="t_emb must have shape"):
        blk.forward(x, t[:10], pe)
    with pytest.raises(ValueError, match="exactly one of t_emb"):
        blk.forward(x, None, pe)
    with pytest.raises(ValueError, match="mask must have shape"):
        blk.forward(x, t, pe, mask=np.ones(3, bool))
    with pytest.raises(ValueError, match="0/1"):
        blk.forward(x, t, pe, mask=np.full(x.shape[0], 2.0))
    with pytest.raises(TypeError, match="floating-point"):
        blk.forward(x.astype(np.int32), t, pe)
    for w in (0, -1, "2", 1.5):
        with pytest.raises(ValueError, match="workers"):
            blk.forward(x, t, pe, workers=w)
    with pytest.raises(ValueError, match="spawn"):
        blk.forward(x, t, pe, spawn="threads")
    with pytest.raises(ValueError, match="eps"):
        blk.forward(x, t, pe, eps=-1.0)
    with pytest.raises(ValueError, match="layer index"):
        model.block(99)
    assert live_segments(PID) == []


def test_inputs_checked_after_narrowing_to_float32(tiny):
    """A float64 input of 1e300 is finite but inf in float32: refused, naming the input and the
    index. Before: accepted, and the block returned all-NaN silently."""
    x, t, pe = block_inputs(tiny)
    blk = tiny.block(0)
    big = x.astype(np.float64)
    big[3, 7] = 1e300
    with pytest.raises(ValueError, match=r"x has 1 non-finite.*float32.*\(3, 7\)"):
        blk.forward(big, t, pe, workers=1)
    t64 = t.astype(np.float64)
    t64[0] = -1e40
    with pytest.raises(ValueError, match=r"t_emb .*float32"):
        blk.forward(x, t64, pe, workers=1)
    with pytest.raises(ValueError, match=r"t_emb .*float32"):
        blk.adaln(t64)
    m64 = blk.adaln(t).astype(np.float64)
    m64[5] = 1e39
    with pytest.raises(ValueError, match=r"adaln_m .*float32"):
        blk.forward(x, pe=pe, adaln_m=m64, workers=1)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    plan = BlockPlan(tiny.config)
    with Engine([(plan, T)], {0: blk.weights}, workers=1,
                buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
        with pytest.raises(ValueError, match=r"adaln_m .*float32"):
            e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=m64)
        with pytest.raises(ValueError, match=r"t_emb .*float32"):
            e.adaln(0, t64)
    # negative controls: float64 inputs within float32's range run, bit-identical to float32;
    # the largest float32 value itself passes the check
    ref, _ = blk.forward(x, t, pe, workers=1)
    out, _ = blk.forward(x.astype(np.float64), t.astype(np.float64), pe.astype(np.float64),
                         workers=1)
    assert np.array_equal(out, ref)
    edge = x.astype(np.float64)
    edge[0, 0] = float(np.finfo(np.float32).max)
    validate_inputs(tiny.config, edge, pe, t_emb=t)


@pytest.mark.parametrize("eps", [1e-50, 1e-39, 3.5e38, 1e39, 2 ** 1024])
def test_eps_outside_float32_is_refused(tiny, eps):
    """eps is narrowed to float32 in the kernels: 1e-50 -> 0 (a zero row, i.e. padding, turns
    NaN), 1e-39 -> subnormal, >= 3.5e38 -> inf. Refused in Block.forward, run_layers,
    Engine.run and blockrun --eps (exit 2). Before: accepted everywhere (Engine.run did not
    check eps at all)."""
    x, t, pe = block_inputs(tiny)
    T, D, hd = x.shape[0], tiny.config.dim, tiny.config.head_dim
    with pytest.raises(ValueError, match="eps .*float32"):
        tiny.block(0).forward(x, t, pe, workers=1, eps=eps)
    with pytest.raises(ValueError, match="eps .*float32"):
        run_layers(tiny, [0], x, pe, t_emb=t, workers=1, eps=eps)
    plan = BlockPlan(tiny.config)
    with Engine([(plan, T)], {0: tiny.layer_weights(0)}, workers=1,
                buffers={"x": (T, D), "pe": (T, hd // 2, 2, 2)}) as e:
        for bad in (eps, 0.0, -1.0):
            with pytest.raises(ValueError, match="eps"):
                e.run(plan, 0, e.buffer("x"), e.buffer("pe"), adaln_m=e.adaln(0, t), eps=bad)


def test_narrow_finite_keeps_the_shape_and_names_a_0d_value():
    """narrow_finite on a 0-d value: returned 0-d (it came back as shape (1,)), and a NaN or a
    float64 beyond float32's range is a ValueError naming it (a NaN was an IndexError)."""
    from nxhpc.nn.checks import narrow_finite
    r = narrow_finite("v", np.float64(2.5))
    assert r.shape == () and r.dtype == np.float32 and r == 2.5
    assert narrow_finite("v", np.ones((2, 3))).shape == (2, 3)
    with pytest.raises(ValueError, match=r"v has 1 non-finite values \(NaN/inf\)"):
        narrow_finite("v", np.array(np.nan))
    with pytest.raises(ValueError, match="v has 1 non-finite values .*beyond float32's range"):
        narrow_finite("v", np.array(1e300))


def test_eps_bounds_run_finite_on_a_zero_row(tiny, models_root):
    """Positive control of the eps bound: at both ends of EPS_RANGE a block whose input has an
    all-zero row (padding) gives a finite output; blockrun --eps 1e-50 is a usage error."""
    x, t, pe = block_inputs(tiny)
    x = x.copy()
    x[2] = 0.0
    for eps in EPS_RANGE:
        out, _ = tiny.block(0).forward(x, t, pe, workers=2, eps=eps)
        assert np.isfinite(out).all(), eps
    r = run_cli("nxhpc.blockrun", ["tiny", "1", "--eps", "1e-50"], models_root)
    assert r.returncode == 2 and "float32" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_kept_block_from_threads_is_serialized(tiny):
    """One kept Block used from 4 threads (3 calls each): calls are serialized by the Block's
    lock -- every output is the single-thread result bit for bit, no error, the workers are
    the same ones throughout. Before: spurious worker errors, EBADF and 1 s stalls."""
    x, t, pe = block_inputs(tiny)
    ref, _ = tiny.block(0).forward(x, t, pe, workers=2)
    outcomes, pids = [], set()
    with tiny.block(0) as blk:
        blk.forward(x, t, pe, workers=2)
        pids0 = tuple(blk._runner.pool.pids)

        def call():
            for _ in range(3):
                try:
                    out, _ = blk.forward(x, t, pe, workers=2)
                    outcomes.append("same" if np.array_equal(out, ref) else "DIFFERENT")
                    pids.add(tuple(blk._runner.pool.pids))
                except BaseException as e:  # noqa: BLE001
                    outcomes.append(f"{type(e).__name__}: {e}")
        ts = [threading.Thread(target=call) for _ in range(4)]
        for th in ts:
            th.start()
        for th in ts:
            th.join(120)
    assert outcomes == ["same"] * 12, outcomes
    assert pids == {pids0}
    assert live_segments(PID) == []


@linux_only
def test_nested_with_keeps_workers_until_the_outermost_exit(tiny):
    """``with blk:`` inside ``with blk:``: leaving the inner block keeps the workers (same
    pids on the next call); leaving the outer one releases them. Before: the inner exit
    silently stopped keeping them."""
    x, t, pe = block_inputs(tiny)
    with tiny.block(0) as blk:
        with blk:
            out1, _ = blk.forward(x, t, pe, workers=2)
            pids = list(blk._runner.pool.pids)
        assert blk._runner is not None and all(map(alive, pids))
        out2, _ = blk.forward(x, t, pe, workers=2)
        assert list(blk._runner.pool.pids) == pids and np.array_equal(out1, out2)
    assert blk._runner is None and not any(map(alive, pids))
    with blk:                                                   # reusable afterwards
        blk.forward(x, t, pe, workers=2)
        assert blk._runner is not None
        blk.close()                                             # close() inside: released
        assert blk._runner is None
    assert live_segments(PID) == []


def test_bad_weights_named():
    cfg = BlockConfig(dim=64, n_heads=2, n_kv_heads=2, head_dim=32, ffn_dim=128, n_layers=1,
                      adaln_in=64, variant="zimage", adaln_silu=False)
    lw = random_layer(np.random.default_rng(0), cfg)
    lw.w2 = lw.w2.data[:, :-34]          # a bare uint8 array is read as Q8_0 rows
    with pytest.raises(ValueError, match="layer 0: weight 'w2' must be Q8_0 uint8"):
        Block(ArrayModel(cfg, [lw]), 0)


# ------------------------------------------------------------------ diffusers oracle
def _diffusers_block(cfg, lw, eps):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from nxhpc.dit.oracle import diffusers_block
    return diffusers_block(cfg, dequantize_layer(lw), eps)


def _diffusers_pe(hd, n_caption, grid):
    """RoPE from diffusers' own RopeEmbedder over (t, h, w) ids -> pe [T, hd/2, 2, 2] + freqs."""
    torch = pytest.importorskip("torch")
    zi = pytest.importorskip("diffusers.models.transformers.transformer_z_image")
    axes = (hd // 4, 3 * hd // 8, 3 * hd // 8)
    ids = [(1 + i, 0, 0) for i in range(n_caption)]
    ids += [(n_caption + 1, h, w) for h in range(grid[0]) for w in range(grid[1])]
    emb = zi.RopeEmbedder(theta=256.0, axes_dims=list(axes), axes_lens=[256, 64, 64])
    freqs = emb(torch.tensor(ids, dtype=torch.int64))            # complex64 [T, hd/2]
    c, s = freqs.real.numpy(), freqs.imag.numpy()
    pe = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)
    return pe, freqs


@pytest.mark.parametrize("heads", [6, 3])           # 6 x 64 and 3 x 128 at D=384
@pytest.mark.parametrize("use_mask", [False, True])
def test_vs_diffusers_zimage_block(heads, use_mask):
    torch = pytest.importorskip("torch")
    D, eps = 384, 1e-6                  # eps != diffusers' internal 1e-5: proves it was set
    cfg = BlockConfig(dim=D, n_heads=heads, n_kv_heads=heads, head_dim=D // heads,
                      ffn_dim=int(D / 3 * 8), n_layers=1, adaln_in=256, variant="zimage",
                      adaln_silu=False, norm_eps=eps)
    rng = np.random.default_rng(100 + heads)
    lw = random_layer(rng, cfg)
    pe, freqs = _diffusers_pe(cfg.head_dim, 5, (4, 8))         # T = 37
    T = pe.shape[0]
    x = rng.standard_normal((T, D)).astype(np.float32)
    t_emb = rng.standard_normal(256).astype(np.float32)
    mask = mask_for(T, 6) if use_mask else None
    dblk = _diffusers_block(cfg, lw, eps)
    with torch.no_grad():
        ref = dblk(torch.from_numpy(x)[None],
                   torch.from_numpy(mask)[None] if use_mask else None,
                   freqs[None], torch.from_numpy(t_emb)[None])[0].numpy().astype(np.float64)
    model = ArrayModel(cfg, [lw])
    out, _ = model.block(0).forward(x, t_emb, pe, mask=mask, workers=2)
    scale = np.abs(ref).max()
    err = np.abs(out - ref).max()
    assert err <= 1e-5 * scale, f"max abs err {err:.3e} vs bound {1e-5 * scale:.3e}"
    # negative control: flipping the mask decision (or dropping it) is caught by the same bound
    wrong = None if use_mask else mask_for(T, 6)
    bad, _ = model.block(0).forward(x, t_emb, pe, mask=wrong, workers=2)
    assert np.abs(bad - ref).max() > 1e-5 * scale
    # and a one-block perturbation of one weight is caught too
    lw2 = random_layer(np.random.default_rng(100 + heads), cfg)
    lw2.w2 = lw2.w2.data.copy()
    lw2.w2[0, 2:34] = 0                   # zero one Q8_0 block of w2 row 0
    bad2, _ = ArrayModel(cfg, [lw2]).block(0).forward(x, t_emb, pe, mask=mask, workers=2)
    assert np.abs(bad2 - ref).max() > 1e-5 * scale
