"""F32 / F16 / BF16 projection weights run as stored: bound in the file's type, zero copy, and
giving the block output of a float64 reference on the same dequantized weights.

Files are written by the ``gguf`` package (``gguf.GGUFWriter``, its own BF16 encoder), never by
nxhpc; the reference weights are decoded straight from ``gguf.GGUFReader``. Each matrix of a
block has a different type from its neighbours (types rotate over qkv, out, w1, w3, w2, adaLN),
and the blocks include an unmodulated ``context_refiner`` and a ``noise_refiner``.
Tolerance, as for Q8_0 (tests/test_block.py): max error <= 2x that of a plain float32 numpy
evaluation and <= 1e-5 x max|ref| -- these types dequantize exactly in float32, so the
kernels' float32 accumulation is the only error source.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import nxhpc._kernels as K
from nxhpc.dit.config import BlockConfig, tensor_names
from nxhpc.dit.plan import BlockPlan, Engine
from nxhpc.dit.reference import block_forward_f64
from nxhpc.models import open_model
from nxhpc.runtime.shm import live_segments
from kernelutil import assert_bitwise
from testutil import errs, gguf_weights_f64, np32_block, stack_tensors, write_gguf_typed

ROOT = Path(__file__).resolve().parents[1]
PID = os.getpid()
TYPES = ("F32", "F16", "BF16")
MATRICES = ("qkv", "out", "w1", "w3", "w2", "adaln_w")
CFG = BlockConfig(dim=192, n_heads=3, n_kv_heads=3, head_dim=64, ffn_dim=512, n_layers=2,
                  adaln_in=256, variant="zimage", adaln_silu=False, norm_eps=1e-5)
STACKS = (("layers", 2), ("noise_refiner", 1), ("context_refiner", 1))


def rotated_types(cfg, stacks):
    """Tensor name -> type: matrix j of block b gets TYPES[(b + j) % 3]."""
    out, b = {}, 0
    for prefix, n in stacks:
        for i in range(n):
            for j, k in enumerate(MATRICES):
                name = tensor_names(prefix, i, cfg.variant).get(k)
                if name:
                    out[name] = TYPES[(b + j) % 3]
            b += 1
    return out


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory):
    rng = np.random.default_rng(21)
    tensors = {}
    for prefix, n in STACKS:
        tensors.update(stack_tensors(rng, CFG, prefix, n))
    types = rotated_types(CFG, STACKS)
    p = write_gguf_typed(tmp_path_factory.mktemp("typed") / "typed.gguf", tensors, types)
    return p, types


def _reader_types(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in r.tensors}


def test_bound_in_the_files_type_zero_copy(typed_file):
    """Every matrix binds as a WeightTensor of the type the gguf reader reports, its bytes
    the file's bytes, a read-only view of the map: nothing decoded, nothing requantized."""
    path, types = typed_file
    stored = _reader_types(path)
    seen = set()
    with open_model(path) as m:
        assert m.config.block == CFG
        for prefix, n in STACKS:
            assert m.stack_size(prefix) == n
            for i in range(n):
                lw = m.layer_weights(i, prefix=prefix)
                assert lw.modulated == (prefix != "context_refiner")
                for k, w in lw.matrices().items():
                    tname, raw = stored[w.name]
                    assert w.type_name == tname == types[w.name], w.name
                    assert w.shape == CFG.shapes()[k]
                    assert np.shares_memory(w.data, m.gguf.mapping) and not w.data.flags.writeable
                    np.testing.assert_array_equal(w.data, np.ascontiguousarray(raw).view(np.uint8))
                    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[tname])
                    np.testing.assert_array_equal(w.dequantize(), np.asarray(ref).reshape(w.shape))
                    seen.add(tname)
    assert seen == set(TYPES)


def _inputs(seed, T):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, CFG.dim)).astype(np.float32)
    a = rng.uniform(-np.pi, np.pi, (T, CFG.head_dim // 2))
    c, s = np.cos(a), np.sin(a)
    pe = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)
    t_emb = rng.standard_normal(CFG.adaln_in).astype(np.float32)
    return x, pe, t_emb


def _check(out, ref, np32):
    ours_max, ours_rms = errs(out, ref)
    np_max, np_rms = errs(np32, ref)
    assert ours_max <= 2 * np_max and ours_rms <= 2 * np_rms, (ours_max, np_max)
    assert ours_max <= 1e-5 * np.abs(ref).max()


def test_typed_layers_match_float64(typed_file):
    path, _ = typed_file
    x, pe, t_emb = _inputs(5, 45)
    with open_model(path) as m:
        for i in range(CFG.n_layers):
            w64 = gguf_weights_f64(path, tensor_names("layers", i, CFG.variant))
            blk = m.block(i)
            out, _ = blk.forward(x, t_emb, pe, workers=2)
            ref = block_forward_f64(x, w64, CFG, t_emb=t_emb, pe=pe)
            np32 = np32_block(x, w64, CFG, blk.adaln(t_emb), pe, None, CFG.norm_eps)
            _check(out, ref, np32)
            for n in (1, 3):
                assert_bitwise(blk.forward(x, t_emb, pe, workers=n)[0], out, f"workers={n}")
            # negative control: the same weights read as another layer's are far off
            other = gguf_weights_f64(path, tensor_names("layers", 1 - i, CFG.variant))
            bad = block_forward_f64(x, other, CFG, t_emb=t_emb, pe=pe)
            assert errs(out, bad)[0] > 1e3 * errs(out, ref)[0]
    assert live_segments(PID) == []


def test_typed_refiners_match_float64(typed_file):
    """noise_refiner (modulated) and context_refiner (unmodulated) blocks from one engine."""
    path, _ = typed_file
    T1, T2 = 33, 13
    x, pe, t_emb = _inputs(6, T1 + T2)
    img, cap = BlockPlan(CFG, "noise_refiner"), BlockPlan(CFG, "context_refiner")
    with open_model(path) as m:
        w = {"nr": m.layer_weights(0, prefix="noise_refiner"),
             "cr": m.layer_weights(0, prefix="context_refiner")}
        outs = []
        for n in (1, 2, 3):
            with Engine([(img, T1), (cap, T2)], w, workers=n,
                        buffers={"u": (T1 + T2, CFG.dim),
                                 "pe": (T1 + T2, CFG.head_dim // 2, 2, 2)}) as eng:
                u, p = eng.buffer("u"), eng.buffer("pe")
                u[:], p[:] = x, pe
                m_nr = eng.adaln("nr", t_emb)
                eng.run(img, "nr", u[:T1], p[:T1], adaln_m=m_nr)
                eng.run(cap, "cr", u[T1:], p[T1:])
                outs.append((u.copy(), m_nr))
        for o, _ in outs[1:]:
            assert_bitwise(o, outs[0][0], "refiners, workers")
        out, m_nr = outs[0]
        w64 = gguf_weights_f64(path, tensor_names("noise_refiner", 0, CFG.variant))
        ref = block_forward_f64(x[:T1], w64, CFG, t_emb=t_emb, pe=pe[:T1])
        _check(out[:T1], ref, np32_block(x[:T1], w64, CFG, m_nr, pe[:T1], None, CFG.norm_eps))
        w64 = gguf_weights_f64(path, tensor_names("context_refiner", 0, CFG.variant))
        ref = block_forward_f64(x[T1:], w64, CFG, pe=pe[T1:], modulation=False)
        _check(out[T1:], ref, np32_block(x[T1:], w64, CFG, None, pe[T1:], None, CFG.norm_eps,
                                         modulation=False))


def test_kernel_weight_types_agree_with_gguf_geometry():
    """The kernels' type table (typed kernels only) and the gguf package's block geometry."""
    from gguf.constants import GGML_QUANT_SIZES
    table = K.weight_types()
    assert set(TYPES) | {"Q8_0"} <= set(table)
    for name, t in table.items():
        qt = gguf.GGMLQuantizationType[name]
        assert t["ggml_type"] == int(qt)
        assert (t["block_elems"], t["block_bytes"]) == GGML_QUANT_SIZES[qt], name


# ------------------------------------------------------------------ memory: no float32 copy
RSS_CFG = BlockConfig(dim=768, n_heads=6, n_kv_heads=6, head_dim=128, ffn_dim=2048, n_layers=2,
                      adaln_in=256, variant="zimage", adaln_silu=False)
_RSS_SCRIPT = r"""
import json, sys
import numpy as np

def anon():
    with open("/proc/self/status") as f:
        for ln in f:
            if ln.startswith("RssAnon:"):
                return int(ln.split()[1]) * 1024

from nxhpc.models import open_model
import nxhpc.dit.block  # noqa: F401 - imports done before measuring
res = {}
with open_model(sys.argv[1]) as m:
    c = m.config
    a0 = anon()
    lws = [m.layer_weights(i) for i in range(c.n_layers)]
    res["bind"] = anon() - a0
    res["types"] = sorted({w.type_name for lw in lws for w in lw.matrices().values()})
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, c.dim)).astype(np.float32)
    a = rng.uniform(-3, 3, (64, c.head_dim // 2))
    pe = np.stack([np.stack([np.cos(a), -np.sin(a)], -1),
                   np.stack([np.sin(a), np.cos(a)], -1)], -2).astype(np.float32)
    t = rng.standard_normal(c.adaln_in).astype(np.float32)
    a1 = anon()
    try:
        from nxhpc.dit.block import run_layers
        run_layers(m, range(c.n_layers), x, pe, t_emb=t, workers=1, weights=dict(enumerate(lws)))
        res["run"] = anon() - a1
    except NotImplementedError as e:
        res["run"] = "NotImplementedError: " + str(e)
    # negative control: a float32 copy of layer 0's matrices shows up in the same measure
    a2 = anon()
    keep = [w.dequantize() for w in lws[0].matrices().values()]
    res["copy"] = anon() - a2
    res["copy_bytes"] = sum(k.nbytes for k in keep)
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def rss_report(tmp_path_factory):
    rng = np.random.default_rng(2)
    tensors = stack_tensors(rng, RSS_CFG, "layers", RSS_CFG.n_layers)
    types = {n: "BF16" for n, a in tensors.items() if a.ndim == 2}
    d = tmp_path_factory.mktemp("rss")
    path = write_gguf_typed(d / "bf16.gguf", tensors, types)
    f32_bytes = sum(a.nbytes for a in tensors.values() if a.ndim == 2)
    del tensors
    script = d / "rss.py"
    script.write_text(_RSS_SCRIPT)
    # a script file puts its own folder on sys.path, not the cwd: the checkout goes on
    # PYTHONPATH, so the test needs no installed nxhpc
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), f32_bytes


def test_bf16_binding_makes_no_float32_copy(rss_report):
    """Binding two BF16 layers (a float32 copy would be 63 MB) grows private memory (RssAnon:
    file pages of the map are RssFile, the arena is RssShmem) by well under a float32 copy --
    the bound, a quarter of it, leaves room for the allocator keeping freed 1 MB scan chunks --
    while the negative control (decoding layer 0) grows it by at least that layer's float32
    size."""
    res, f32_bytes = rss_report
    assert res["types"] == ["BF16"]
    assert res["bind"] < 0.25 * f32_bytes, (res["bind"], f32_bytes)
    assert res["copy"] >= 0.9 * res["copy_bytes"], res


def test_bf16_run_makes_no_float32_copy(rss_report):
    """Running both layers in process (workers=1) converts BF16 panel by panel: private
    memory grows by well under a float32 copy of the matrices."""
    res, f32_bytes = rss_report
    if isinstance(res["run"], str):
        raise NotImplementedError(res["run"])
    assert res["run"] < 0.25 * f32_bytes, (res["run"], f32_bytes)
