"""Shared helpers of the block, plan, config and model tests (one copy instead of several).

Random layers whose stored bytes come from the ``gguf`` package (never from nxhpc's writers),
GGUF files written with ``gguf.GGUFWriter`` with a chosen type per tensor, a minimal in-memory
model, the plain float32 numpy block used as the error yardstick, and small comparisons.
"""
import math

import gguf
import numpy as np

from nxhpc.dit.binding import LayerWeights
from nxhpc.dit.config import BLOCK_STACKS, tensor_names
from nxhpc.formats.weights import WeightTensor

GT = gguf.GGMLQuantizationType
Q8 = GT.Q8_0




def errs(a, ref):
    """(max abs error, rms error) of ``a`` against a float64 reference."""
    d = np.asarray(a, np.float64) - ref
    return float(np.max(np.abs(d))), float(np.sqrt(np.mean(d * d)))


def t32(a):
    """A float32 torch tensor of ``a`` (torch imported lazily: a test dependency only)."""
    import torch
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def mask_for(T, pad):
    """Key mask [T] attending all but the last ``pad`` tokens."""
    m = np.ones(T, bool)
    m[T - pad:] = False
    return m


def stored(a, type_name):
    """The bytes the ``gguf`` package stores for float matrix ``a`` in ``type_name``, as the
    raw array GGUFWriter.add_tensor takes (float32/float16 for F32/F16, uint8 blocks else)."""
    a = np.ascontiguousarray(a, np.float32)
    if type_name == "F32":
        return a
    if type_name == "F16":
        return a.astype(np.float16)
    return gguf.quants.quantize(a, GT[type_name])


def weight(name, a, type_name):
    """A WeightTensor holding ``gguf``'s encoding of ``a`` in ``type_name``."""
    return WeightTensor.from_raw(name, type_name, a.shape[1], stored(a, type_name))


def draw_layer_floats(rng, cfg, modulated=True, adaln_gain=0.3, adaln_bias=0.3):
    """Float32 weights of one block under the short names (every parameter randomized)."""
    D, F, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim

    def proj(r, c):
        return (rng.standard_normal((r, c)) / math.sqrt(c)).astype(np.float32)

    def nrm(n):
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    w = {"qkv": proj(cfg.qkv_width, D), "out": proj(D, D), "w1": proj(F, D), "w3": proj(F, D),
         "w2": proj(D, F), "attention_norm1": nrm(D), "attention_norm2": nrm(D),
         "ffn_norm1": nrm(D), "ffn_norm2": nrm(D), "q_norm": nrm(hd), "k_norm": nrm(hd)}
    if modulated:
        w["adaln_w"] = (rng.standard_normal((4 * D, cfg.adaln_in)) * adaln_gain
                        / math.sqrt(cfg.adaln_in)).astype(np.float32)
        w["adaln_b"] = (adaln_bias * rng.standard_normal(4 * D)).astype(np.float32)
    return w


def random_layer(rng, cfg, *, types=None, modulated=True, prefix="layers", layer=-1):
    """A LayerWeights with random weights; matrices stored by ``gguf`` in ``types[key]``
    (default Q8_0 projections, F32 adaLN), vectors float32."""
    types = dict(types or {})
    f = draw_layer_floats(rng, cfg, modulated)
    vals = {}
    for k, a in f.items():
        if a.ndim == 2:
            t = types.get(k, "F32" if k == "adaln_w" else "Q8_0")
            vals[k] = weight(f"{prefix}.{layer}.{k}", a, t)
        else:
            vals[k] = a
    return LayerWeights(**vals, source="arrays", layer=layer, prefix=prefix)


def write_gguf_typed(path, tensors, types, *, prefix="", arch="lumina2"):
    """Write ``{name: float32 array}`` with ``gguf.GGUFWriter``: 2-D tensors in
    ``types.get(name, "F32")`` (encoded by the gguf package), 1-D tensors F32."""
    w = gguf.GGUFWriter(str(path), arch)
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, np.float32)
        t = types.get(name, "F32") if a.ndim == 2 else "F32"
        raw = stored(a, t)
        if t in ("F32", "F16"):
            w.add_tensor(prefix + name, raw)
        else:
            w.add_tensor(prefix + name, raw, raw_dtype=GT[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def stack_tensors(rng, cfg, prefix, count):
    """Random float32 tensors of blocks ``prefix.0 .. prefix.count-1`` under their names."""
    out = {}
    mod = BLOCK_STACKS[prefix]
    for i in range(count):
        f = draw_layer_floats(rng, cfg, mod)
        for k, name in tensor_names(prefix, i, cfg.variant).items():
            out[name] = f[k]
    return out


def gguf_weights_f64(path, names):
    """Short name -> float64 weights decoded straight from ``gguf.GGUFReader`` (not nxhpc)."""
    r = gguf.GGUFReader(str(path))
    by = {t.name.removeprefix("model.diffusion_model."): t for t in r.tensors}
    out = {}
    for k, name in names.items():
        t = by[name]
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[k] = np.asarray(a, dtype=np.float64).reshape(tuple(reversed(t.shape.tolist())))
    return out


class ArrayModel:
    """Minimal model: config + in-memory LayerWeights (what Block needs). ``cfg``: a
    BlockConfig, held as the block model's DenoiserConfig (``config.block`` is ``cfg``)."""

    def __init__(self, cfg, layers):
        from nxhpc.dit.config import DenoiserConfig
        self.config = DenoiserConfig(
            dim=cfg.dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
            ffn_dim=cfg.ffn_dim, n_layers=cfg.n_layers, adaln_in=cfg.adaln_in,
            norm_eps=cfg.norm_eps, variant=cfg.variant)
        assert self.config.as_block_config(validate=False) == cfg
        self._layers = layers

    def layer_weights(self, i, source="auto"):
        return self._layers[i]

    def block(self, i):
        from nxhpc.dit.block import Block
        return Block(self, i)


def np32_block(x, w, cfg, m, pe, mask, eps, modulation=True):
    """docs/block.md in float32 numpy (BLAS sgemm), same dequantized weights; the error
    yardstick: a careful float32 evaluation's own error against float64. ``modulation=False``:
    the unmodulated block (scale 0, gate multiplier 1, no tanh)."""
    f = np.float32
    x = x.astype(f)
    w = {k: v.astype(f) for k, v in w.items()}
    D, H, KVH, hd = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    eps = f(eps)
    T = x.shape[0]

    def rms(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    def rope(v):                       # v [T, h, hd]
        v2 = v.reshape(T, v.shape[1], hd // 2, 1, 2)
        p = pe.astype(f)[:, None]      # [T, 1, hd/2, 2, 2]
        return (p[..., 0] * v2[..., 0] + p[..., 1] * v2[..., 1]).reshape(v.shape)

    if modulation:
        m = m.astype(f)
        mod_msa, tg_msa = f(1) + m[:D], np.tanh(m[D:2 * D])
        mod_mlp, tg_mlp = f(1) + m[2 * D:3 * D], np.tanh(m[3 * D:])
    else:
        mod_msa = tg_msa = mod_mlp = tg_mlp = f(1)
    h = rms(x, w["attention_norm1"]) * mod_msa
    qkv = h @ w["qkv"].T
    q = rope(rms(qkv[:, :H * hd].reshape(T, H, hd), w["q_norm"]))
    k = rope(rms(qkv[:, H * hd:(H + KVH) * hd].reshape(T, KVH, hd), w["k_norm"]))
    v = qkv[:, (H + KVH) * hd:].reshape(T, KVH, hd)
    o = np.empty((T, H, hd), f)
    for hh in range(H):
        g = hh // (H // KVH)
        s = (q[:, hh] @ k[:, g].T) / f(math.sqrt(hd))
        if mask is not None:
            s = np.where(np.asarray(mask, bool)[None, :], s, f(-np.inf))
        s = np.exp(s - s.max(axis=1, keepdims=True))
        o[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, g]
    mid = x + tg_msa * rms(o.reshape(T, D) @ w["out"].T, w["attention_norm2"])
    h2 = rms(mid, w["ffn_norm1"]) * mod_mlp
    a = h2 @ w["w1"].T
    ff = a / (f(1) + np.exp(-a)) * (h2 @ w["w3"].T)
    return mid + tg_mlp * rms(ff @ w["w2"].T, w["ffn_norm2"])


def rel_err(a, ref) -> float:
    """``max |a - ref| / max |ref|`` in float64: an error relative to the reference's scale."""
    ref = np.asarray(ref, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / np.abs(ref).max())


def open_and_decode_all(path) -> str:
    """Open a model file and decode every layer's weights: ``"ok"``, or ``"error"`` when it
    raises a ModelFileError (which must name the file); anything else propagates."""
    from nxhpc.dit.reference import dequantize_layer
    from nxhpc.formats.gguf_io import ModelFileError
    from nxhpc.models import open_model
    try:
        with open_model(path) as m:
            for i in range(m.config.n_layers):
                w = dequantize_layer(m.layer_weights(i))
                assert all(np.isfinite(v).all() for v in w.values())
    except ModelFileError as e:
        assert str(path) in str(e), f"message does not name the file: {e}"
        return "error"
    return "ok"


def block_inputs(m):
    """A block model's stored inputs of layer 0: ``(x, t_emb, pe)``."""
    return m.blk_in(0), m.t_emb(), m.pe()


def shared_by_threads(call, jobs, *, threads: int, rounds: int) -> None:
    """Call ``call(*jobs[k])`` from ``threads`` threads at once (each walks every job
    ``rounds`` times, starting at its own offset) and assert that every result is bit-equal to
    the same job run alone first: an object shared by request threads must give each caller
    its own result (a serialized call), never another call's or a corrupt one."""
    import threading
    want = [call(*j) for j in jobs]
    got: list[tuple[int, np.ndarray]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def caller(n: int) -> None:
        try:
            start.wait()
            for r in range(rounds * len(jobs)):
                k = (n + r) % len(jobs)
                got.append((k, call(*jobs[k])))
        except BaseException as e:          # noqa: BLE001 - reported below
            errors.append(e)

    pool = [threading.Thread(target=caller, args=(n,)) for n in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=600)
    assert not errors, errors
    assert len(got) == threads * rounds * len(jobs)
    wrong = [k for k, out in got if out.shape != want[k].shape
             or not np.array_equal(out.view(np.uint8), want[k].view(np.uint8))]
    assert not wrong, f"{len(wrong)} of {len(got)} results are another call's or corrupt"
