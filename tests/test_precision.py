"""Tests of the precision switch through the block (nxhpc.nn.linear PRECISIONS: f32, bf16, q8).

Owns: that the switch reaches every projection (the block's output in bf16 / q8 is the output of
the kernels those precisions name, not f32's), that block outputs stay bit-identical for every
worker count in every precision, the measured accuracy of one block per precision against the
float64 oracle (nxhpc.dit.reference: no code shared with the kernels), and that
``blockrun --precision P`` passes with its default tolerance (with a negative control that the
tolerance is not vacuous). Must not: produce expected values with the code under test.

The kernels' arithmetic per precision is proved against independent numpy models in
tests/test_kernels_lowp.py; here the block composes them.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testutil import ArrayModel, random_layer

import nxhpc
from nxhpc.blockrun import PRECISION_TOL
from nxhpc.nn import linear
from nxhpc.dit.block import run_layers
from nxhpc.dit.grade import rel_errors
from nxhpc.dit.reference import block_forward_f64, dequantize_layer
from nxhpc.formats.weights import WeightTensor
from nxhpc.dit.config import BlockConfig
from nxhpc.models import open_model
from nxhpc.runtime.shm import live_segments

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()
K = nxhpc.kernels()


def _cfg(**kw):
    base = dict(variant="zimage", dim=128, n_heads=2, n_kv_heads=2, head_dim=64, ffn_dim=256,
                norm_eps=1e-5, adaln_in=64, adaln_silu=False, n_layers=1)
    base.update(kw)
    return BlockConfig(**base)


# ------------------------------------------------------------------ the seam


@pytest.mark.parametrize("wtype", ["Q8_0", "F16", "F32", "BF16"])
def test_linear_matmul_dispatches_on_precision(wtype):
    """f32 -> matmul, bf16 -> matmul_bf16, q8 -> matmul_q8 for Q8_0 and matmul_bf16 for the
    float types (the other quantized types: tests/test_kernels_q8_types.py);
    the band [lo, hi) only. The three kernels give different bits on these inputs (control)."""
    rng = np.random.default_rng(3)
    cfg = _cfg()
    lw = random_layer(rng, cfg, types={"w1": wtype})
    w = lw.typed().w1
    assert isinstance(w, WeightTensor) and w.type_name == wtype
    N, Kd = w.shape
    x = rng.standard_normal((9, Kd)).astype(np.float32)
    ref = {"f32": lambda o: K.matmul(x, w.data, wtype, o, 5, 40),
           "bf16": lambda o: K.matmul_bf16(x, w.data, wtype, o, 5, 40),
           "q8": (lambda o: K.matmul_q8(x, w.data, o, 5, 40)) if wtype == "Q8_0"
           else (lambda o: K.matmul_bf16(x, w.data, wtype, o, 5, 40))}
    outs = {}
    for p in linear.PRECISIONS:
        got = np.full((9, N), -3.0, np.float32)
        linear.matmul(K, x, w, got, 5, 40, p)
        want = np.full((9, N), -3.0, np.float32)
        ref[p](want)
        assert np.array_equal(got, want), p
        assert (got[:, :5] == -3).all() and (got[:, 40:] == -3).all()
        outs[p] = got
        assert linear.effective_precision(w, p) == ("bf16" if p == "q8" and wtype != "Q8_0" else p)
    assert not np.array_equal(outs["f32"], outs["bf16"])
    if wtype == "Q8_0":
        assert not np.array_equal(outs["q8"], outs["bf16"])
    else:
        assert np.array_equal(outs["q8"], outs["bf16"])
    # default precision is f32
    got = np.full((9, N), -3.0, np.float32)
    linear.matmul(K, x, w, got, 5, 40)
    assert np.array_equal(got, outs["f32"])


class _AttentionRecorder:
    """Stands in for the kernels: records the precision= each attention call names."""

    def __init__(self):
        self.calls = []

    def attention(self, *args, precision="f32", **kw):
        self.calls.append(precision)


def test_attention_follows_the_switch():
    """f32 -> the float32 attention, bf16 and q8 -> the bf16 attention, in the DiT block, the
    Qwen3 encoder (causal) and the VAE mid block: each model's attention step is called with a
    recorder for kernels; the kernels' own arithmetic is tests/test_kernels_attn_bf16.py's."""
    from types import SimpleNamespace

    from nxhpc.dit import plan as dit_plan
    from nxhpc.qwen3 import model as qwen3_model
    from nxhpc.vae import model as vae_model

    want = {"f32": "f32", "bf16": "bf16", "q8": "bf16"}
    for p in linear.PRECISIONS:
        assert linear.attention_precision(p) == want[p]
        for sdpa in (dit_plan._sdpa, qwen3_model._sdpa):
            rec = _AttentionRecorder()
            c = SimpleNamespace(kernels=rec, buf={"q": 0, "k": 0, "qkv": 0, "attn": 0},
                                cfg=SimpleNamespace(n_kv_heads=1), scale=1.0, mask=None,
                                precision=p)
            sdpa(c, 0, 1)
            assert rec.calls == [want[p]], (sdpa.__module__, p)
    for p in vae_model.CONV_PRECISIONS:
        ex = vae_model._Executor({}, p, 32, 1e-6, 64)
        ex.kern = rec = _AttentionRecorder()
        ex.bufs = {n: np.zeros(3 * 4 * 8, np.float32) for n in ("q", "k", "qkv", "t")}
        ex.run("attention", 0, 1, ("t", 4, 8))
        assert rec.calls == [want[p]], ("vae", p)
    with pytest.raises(ValueError, match="precision"):
        linear.attention_precision("fp16")


@pytest.mark.parametrize("bad", ["F32", "fp32", "int8", "", None, 8])
def test_bad_precision_is_a_clear_error(bad, models_root):
    with pytest.raises(ValueError, match="precision"):
        linear.check_precision(bad)
    model = open_model("tiny", models_dir=models_root)
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    with pytest.raises(ValueError, match="Block.forward: precision"):
        model.block(0).forward(x, t, pe, workers=1, precision=bad)
    with pytest.raises(ValueError, match="run_layers: precision"):
        run_layers(model, [0], x, pe, t_emb=t, workers=1, precision=bad)
    assert live_segments(PID) == []


# ------------------------------------------------------------------ the block


def _errors(out, ref):
    """(max_rel, rms_rel) as blockrun grades: rel_i = |out-ref| / max(|ref_i|, rms(ref)), and
    rms(out - ref) / rms(ref)."""
    r = rel_errors(out, ref)
    d = np.asarray(out, np.float64) - ref
    return float(r.max()), float(np.sqrt(np.mean(d * d)) / np.sqrt(np.mean(ref * ref)))


@pytest.mark.parametrize("name", ["tiny", "mid"])
def test_block_accuracy_per_precision_vs_float64(models_root, name):
    """Measured, not assumed: one block per precision vs the float64 oracle. Each precision's
    max_rel is within its blockrun default tolerance; bf16 and q8 are measurably less accurate
    than f32 (so the switch did reach the matmuls) and q8 less than bf16 (its activations keep
    ~7 bits per block against bfloat16's 8 per element, plus the weights' own rounding)."""
    model = open_model(name, models_dir=models_root)
    cfg = model.config
    x, pe, t = model.blk_in(0), model.pe(), model.t_emb()
    blk = model.block(0)
    ref = block_forward_f64(x, dequantize_layer(blk.weights), cfg, t_emb=t, pe=pe)
    got = {}
    for p in linear.PRECISIONS:
        out, _ = blk.forward(x, t, pe, workers=2, precision=p)
        got[p] = _errors(out, ref)
        print(f"{name} {p}: max_rel {got[p][0]:.3e} rms_rel {got[p][1]:.3e}")
        assert got[p][0] <= PRECISION_TOL[p], (p, got[p])
    assert got["f32"][1] < 1e-5
    assert got["bf16"][1] > 30 * got["f32"][1] and got["q8"][1] > got["bf16"][1]
    # bfloat16 inputs (u = 2^-8) through ~3 chained matmuls: RMS 0.1%-1% of the output's
    assert 1e-4 < got["bf16"][1] < 1e-2 and 1e-4 < got["q8"][1] < 2e-2
    # and within about twice what every ISA measured (AMX to the scalar path: bf16 max_rel
    # 1.3e-2-1.5e-2, RMS 2.1e-3-2.4e-3; q8 3.4e-2-4.0e-2, 5.4e-3-6.0e-3), so that a regression
    # inside blockrun's looser tolerances still fails here
    assert got["bf16"][0] <= 3e-2 and got["bf16"][1] <= 5e-3
    assert got["q8"][0] <= 8e-2 and got["q8"][1] <= 1.2e-2
    assert live_segments(PID) == []


@pytest.mark.parametrize("precision", ["bf16", "q8"])
def test_block_bit_identical_for_any_worker_count(models_root, precision):
    """Every lowp kernel is band-invariant, so the block output is the same bits for 1, 2, 3
    workers and both spawn modes; and it differs from f32 (control: the switch took effect)."""
    model = open_model("tiny-gqa", models_dir=models_root)
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    blk = model.block(0)
    base, _ = blk.forward(x, t, pe, mask=mask, workers=1, precision=precision)
    for spawn in ("pool", "stage"):
        for n in (1, 2, 3):
            out, _ = blk.forward(x, t, pe, mask=mask, workers=n, spawn=spawn, precision=precision)
            assert np.array_equal(out, base), (precision, spawn, n)
    f32, _ = blk.forward(x, t, pe, mask=mask, workers=2)
    assert not np.array_equal(f32, base)
    assert live_segments(PID) == []


def test_chain_precision_and_q8_on_other_weight_types():
    """run_layers carries the precision to every layer of a chain. q8 runs on quantized
    weights; a float tensor runs bf16 (linear.effective_precision): with every
    projection F16, q8 gives exactly bf16's bits; with one F16 tensor among Q8_0 ones it
    differs from both bf16 and f32, and stays worker-count invariant."""
    rng = np.random.default_rng(8)
    cfg = _cfg(n_layers=2)
    T = 24
    x = rng.standard_normal((T, cfg.dim)).astype(np.float32)
    pe = np.zeros((T, cfg.head_dim // 2, 2, 2), np.float32)
    pe[..., 0, 0] = pe[..., 1, 1] = 1.0
    m = {i: (rng.standard_normal(4 * cfg.dim) * 0.1).astype(np.float32) for i in (0, 1)}
    f16 = {k: "F16" for k in ("qkv", "out", "w1", "w2", "w3")}
    all_f16 = ArrayModel(cfg, {i: random_layer(rng, cfg, types=f16, layer=i) for i in (0, 1)})
    mixed = ArrayModel(cfg, {0: random_layer(rng, cfg, types={"w2": "F16"}, layer=0),
                             1: random_layer(rng, cfg, layer=1)})

    def run(model, p, w=2):
        return run_layers(model, [0, 1], x, pe, adaln_ms=m, workers=w, precision=p).output

    assert np.array_equal(run(all_f16, "q8"), run(all_f16, "bf16"))
    assert not np.array_equal(run(all_f16, "f32"), run(all_f16, "bf16"))
    outs = {p: run(mixed, p) for p in linear.PRECISIONS}
    assert len({o.tobytes() for o in outs.values()}) == 3
    for w in (1, 3):
        assert np.array_equal(run(mixed, "q8", w), outs["q8"])
    assert live_segments(PID) == []


# ------------------------------------------------------------------ blockrun


def _cli(args, root, timeout=300):
    env = dict(os.environ, NXHPC_MODELS=str(root))
    return subprocess.run([sys.executable, "-m", "nxhpc.blockrun", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("name", ["tiny", "mid"])
@pytest.mark.parametrize("precision", ["bf16", "q8"])
def test_blockrun_precision_passes_default_tolerance(models_root, name, precision):
    r = _cli([name, "2", "--precision", precision], models_root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"precision={precision}" in r.stdout
    assert f"<= tol {PRECISION_TOL[precision]:g}" in r.stdout


def test_blockrun_tolerance_is_not_vacuous(models_root):
    """Negative controls: bf16 and q8 graded at a quarter of their measured max_rel on tiny
    (bf16 1.3e-2-1.5e-2, q8 3.4e-2: far from any variant's spread) fail; f32 passes 1e-5."""
    r = _cli(["tiny", "2", "--precision", "bf16", "--tol", "3e-3"], models_root)
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr
    r = _cli(["tiny", "2", "--precision", "q8", "--tol", "8e-3"], models_root)
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr
    r = _cli(["tiny", "2", "--tol", "1e-5"], models_root)
    assert r.returncode == 0 and "precision=f32" in r.stdout, r.stdout + r.stderr
    r = _cli(["tiny", "2", "--precision", "fp8"], models_root)
    assert r.returncode == 2 and "precision" in r.stderr


# ------------------------------------------------------------------ --precision auto


@pytest.mark.parametrize("variants,want", [
    ({"matmul_bf16": "amx", "matmul_q8": "amx"}, "bf16"),
    ({"matmul_bf16": "avx512bf16", "matmul_q8": "avx512"}, "q8"),
    ({"matmul_bf16": "avx2", "matmul_q8": "avx2"}, "q8"),
    ({"matmul_bf16": "generic", "matmul_q8": "generic"}, "f32"),
])
def test_fastest_precision_follows_the_kernel_variants(variants, want):
    """The table of README "Which precision is fastest": bf16 on the AMX tiles, q8 wherever
    matmul_q8 has a SIMD kernel, f32 on the generic C code."""
    assert linear.fastest_precision(variants) == want


def test_precision_auto_resolves_within_the_allowed_choices(monkeypatch):
    """``auto`` becomes the fastest precision where the command takes it; decode (f32 / bf16
    only, no int8 convolution) takes bf16 where q8 is fastest and the bf16 matmul is faster
    (AVX-512 BF16 without AMX, where vdpbf16ps is the faster dot), else f32 -- the rule
    ``generate --precision q8`` decodes by (it was f32 there: the two disagreed); a bad value is
    an argparse error naming every choice and auto."""
    import argparse

    import nxhpc
    from nxhpc.cli import args as types
    from nxhpc.nn import conv
    monkeypatch.setattr(conv, "_bf16_dot", lambda: "vdpbf16ps")   # a Zen 4's faster dot
    for fast in ("bf16", "q8", "f32"):
        for bf16_variant, want in (("avx512bf16", "bf16"), ("avx2", "f32"), ("avx512", "f32")):
            monkeypatch.setattr(linear, "fastest_precision", lambda fast=fast: fast)
            monkeypatch.setattr(nxhpc, "kernel_variants", lambda v=bf16_variant:
                                {"matmul_bf16": v}, raising=False)
            assert types.precision("auto") == fast
            assert types.precision("auto", ("f32", "bf16")) == \
                (fast if fast != "q8" else want), (fast, bf16_variant)
    assert types.precision("q8") == "q8"
    with pytest.raises(argparse.ArgumentTypeError, match="f32, bf16, auto"):
        types.precision("q8", ("f32", "bf16"))
    with pytest.raises(argparse.ArgumentTypeError, match="auto"):
        types.precision("fp16")


def test_blockrun_precision_auto_runs_the_fastest_and_grades_it(models_root, tmp_path):
    """``--precision auto`` runs (and reports, and grades at the tolerance of) this machine's
    fastest precision -- its block output the same bits as naming that precision -- and f32
    with the SIMD kernels off (the generic code: control that the choice follows the kernels)."""
    want = linear.fastest_precision(nxhpc.kernel_variants())
    outs = {}
    for p in ("auto", want):
        path = tmp_path / f"{p}.npy"
        r = _cli(["tiny", "2", "--precision", p, "--save-output", str(path)], models_root)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"precision={want}" in r.stdout
        assert f"<= tol {PRECISION_TOL[want]:g}" in r.stdout
        outs[p] = np.load(path)
    assert np.array_equal(outs["auto"], outs[want])
    env_cli = subprocess.run(
        [sys.executable, "-m", "nxhpc.blockrun", "tiny", "1", "--precision", "auto"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, NXHPC_MODELS=str(models_root), NXHPC_DISABLE_SIMD="1"))
    assert env_cli.returncode == 0 and "precision=f32" in env_cli.stdout, env_cli.stderr
