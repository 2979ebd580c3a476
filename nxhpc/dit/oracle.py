"""diffusers as an external oracle: build its block from one layer's weights and run it.

Owns only the wiring between nxhpc's names/layouts and diffusers' modules (the qkv weight split
into to_q/to_k/to_v rows, norm names, eps on every norm, ``pe`` -> complex rotary input), so that
tests and benchmarks compare against the official implementation with one set of weights.
Must not compute anything itself: the math under test lives in ``nxhpc.dit.reference`` (float64)
and the C kernels. Needs ``torch`` and ``diffusers`` (test/benchmark dependencies).

Weights are a dict in ``nxhpc.dit.reference.dequantize_layer`` naming: ``qkv`` [(H+2*KVH)*hd, D],
``out``, ``w1``, ``w2``, ``w3``, ``q_norm``, ``k_norm``, ``attention_norm1``,
``attention_norm2``, ``ffn_norm1``, ``ffn_norm2``, ``adaln_w``, ``adaln_b``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["diffusers_block"]


def _t(a) -> Any:
    import torch
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def diffusers_block(cfg, w: dict, eps: float | None = None, layer_id: int = 0):
    """diffusers' block for ``cfg.variant`` (``ZImageTransformerBlock`` or, for ``"lumina2"``,
    ``Lumina2TransformerBlock``) holding the float weights ``w``, in eval mode, with ``eps``
    (default ``cfg.norm_eps``) set on all six norms (diffusers fixes the q/k-norm eps at 1e-5).

    The state dict is loaded with ``strict=True``: a missing or unexpected name is an error.
    """
    import torch

    eps = cfg.norm_eps if eps is None else float(eps)
    H, KVH, hd, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim
    qkv = np.asarray(w["qkv"])
    q, k, v = qkv[:H * hd], qkv[H * hd:(H + KVH) * hd], qkv[(H + KVH) * hd:]
    if cfg.variant == "lumina2":
        from diffusers.models.transformers.transformer_lumina2 import Lumina2TransformerBlock
        blk = Lumina2TransformerBlock(D, H, KVH, 256, None, eps)
        # the block sizes its FFN and adaLN input itself: give it Linears of the model's sizes
        blk.norm1.linear = torch.nn.Linear(cfg.adaln_in, 4 * D)
        blk.feed_forward.linear_1 = torch.nn.Linear(D, cfg.ffn_dim, bias=False)
        blk.feed_forward.linear_3 = torch.nn.Linear(D, cfg.ffn_dim, bias=False)
        blk.feed_forward.linear_2 = torch.nn.Linear(cfg.ffn_dim, D, bias=False)
        attn, sd = blk.attn, {
            "attn.to_q.weight": q, "attn.to_k.weight": k, "attn.to_v.weight": v,
            "attn.to_out.0.weight": w["out"], "attn.norm_q.weight": w["q_norm"],
            "attn.norm_k.weight": w["k_norm"], "feed_forward.linear_1.weight": w["w1"],
            "feed_forward.linear_2.weight": w["w2"], "feed_forward.linear_3.weight": w["w3"],
            "norm1.linear.weight": w["adaln_w"], "norm1.linear.bias": w["adaln_b"],
            "norm1.norm.weight": w["attention_norm1"], "norm2.weight": w["attention_norm2"],
            "ffn_norm1.weight": w["ffn_norm1"], "ffn_norm2.weight": w["ffn_norm2"]}
        norms = [blk.norm1.norm, blk.norm2, blk.ffn_norm1, blk.ffn_norm2]
    else:
        from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock
        blk = ZImageTransformerBlock(layer_id, D, H, KVH, eps, qk_norm=True, modulation=True)
        attn, sd = blk.attention, {
            "attention.to_q.weight": q, "attention.to_k.weight": k, "attention.to_v.weight": v,
            "attention.to_out.0.weight": w["out"], "attention.norm_q.weight": w["q_norm"],
            "attention.norm_k.weight": w["k_norm"], "feed_forward.w1.weight": w["w1"],
            "feed_forward.w2.weight": w["w2"], "feed_forward.w3.weight": w["w3"],
            "attention_norm1.weight": w["attention_norm1"],
            "attention_norm2.weight": w["attention_norm2"], "ffn_norm1.weight": w["ffn_norm1"],
            "ffn_norm2.weight": w["ffn_norm2"], "adaLN_modulation.0.weight": w["adaln_w"],
            "adaLN_modulation.0.bias": w["adaln_b"]}
        norms = [blk.attention_norm1, blk.attention_norm2, blk.ffn_norm1, blk.ffn_norm2]
    blk.load_state_dict({name: _t(a) for name, a in sd.items()}, strict=True)
    attn.norm_q.eps = eps
    attn.norm_k.eps = eps
    for n in norms:
        if getattr(n, "eps", eps) != eps:
            raise RuntimeError(f"diffusers norm {n} has eps {n.eps}, expected {eps}")
    return blk.eval()


# ----------------------------------------------------------------------------- the whole model
# diffusers' ZImageTransformer2DModel <-> the original / ComfyUI tensor names
# (``nxhpc.dit.config``). Only renames and the qkv row split live here.

__all__ += ["diffusers_zimage", "random_zimage_model", "run_diffusers_zimage",
            "zimage_from_canonical", "zimage_to_canonical"]

_PREFIX_RENAMES = (("all_x_embedder.{p}-1.", "x_embedder."),      # diffusers -> canonical,
                   ("all_final_layer.{p}-1.", "final_layer."))    # at the start of a name
_INNER_RENAMES = ((".attention.to_out.0.", ".attention.out."),     # anywhere in a name
                  (".attention.norm_q.", ".attention.q_norm."),
                  (".attention.norm_k.", ".attention.k_norm."))


def _to_numpy64(v) -> np.ndarray:
    if hasattr(v, "detach"):
        v = v.detach().cpu().double().numpy()
    return np.array(v, dtype=np.float64)


def _rename(name: str, patch: int, to_canonical: bool) -> str:
    for d, c in _PREFIX_RENAMES:
        d = d.format(p=patch)
        a, b = (d, c) if to_canonical else (c, d)
        if name.startswith(a):
            name = b + name[len(a):]
    for d, c in _INNER_RENAMES:
        a, b = (d, c) if to_canonical else (c, d)
        name = name.replace(a, b)
    return name


def zimage_to_canonical(state_dict, patch: int = 2) -> dict[str, np.ndarray]:
    """diffusers ``ZImageTransformer2DModel`` state dict -> ``{canonical name: float64}``:
    ``to_q/to_k/to_v`` stacked by rows into ``attention.qkv.weight``; ``to_out.0`` -> ``out``;
    ``norm_q/norm_k`` -> ``q_norm/k_norm``; ``all_x_embedder.{p}-1`` -> ``x_embedder``;
    ``all_final_layer.{p}-1`` -> ``final_layer``; everything else keeps its name."""
    sd = {k: _to_numpy64(v) for k, v in state_dict.items()}
    out: dict[str, np.ndarray] = {}
    for k in [k for k in sd if k.endswith(".attention.to_q.weight")]:
        base = k[:-len("to_q.weight")]
        out[base + "qkv.weight"] = np.concatenate(
            [sd.pop(base + "to_q.weight"), sd.pop(base + "to_k.weight"),
             sd.pop(base + "to_v.weight")], axis=0)
    for k, v in sd.items():
        if k.endswith((".attention.to_k.weight", ".attention.to_v.weight")):
            raise ValueError(f"zimage_to_canonical: {k} without its to_q")
        out[_rename(k, patch, True)] = v
    return out


def zimage_from_canonical(weights, cfg, dtype=None) -> dict:
    """``{canonical name: array}`` -> diffusers state dict (torch tensors, ``dtype`` default
    float64); the fused qkv split by rows ``[q (H*hd); k (KVH*hd); v (KVH*hd)]``; pad tokens
    given as ``[D]`` become ``[1, D]``; ``norm_final.weight`` is dropped (diffusers has none)."""
    import torch
    dtype = torch.float64 if dtype is None else dtype
    H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    sd = {}
    for n, v in weights.items():
        if n == "norm_final.weight":
            continue
        a = np.asarray(v, dtype=np.float64)
        if n.endswith("pad_token"):
            a = a.reshape(1, -1)
        if n.endswith(".attention.qkv.weight"):
            base = n[:-len("qkv.weight")]
            for part, rows in (("to_q", a[:H * hd]), ("to_k", a[H * hd:(H + KVH) * hd]),
                               ("to_v", a[(H + KVH) * hd:])):
                sd[base + part + ".weight"] = torch.from_numpy(np.ascontiguousarray(rows))
            continue
        sd[_rename(n, cfg.patch, False)] = torch.from_numpy(np.ascontiguousarray(a))
    return {k: v.to(dtype) for k, v in sd.items()}


def _timestep_embedding_f64(t, dim: int, max_period: float = 10000.0):
    """diffusers' ``TimestepEmbedder.timestep_embedding`` with the angles in float64."""
    import math

    import torch
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def diffusers_zimage(cfg, weights=None, dtype=None, float64_sinusoid: bool = False):
    """diffusers' ``ZImageTransformer2DModel`` for ``cfg`` (eval mode, ``dtype`` default
    float64), holding ``weights`` (canonical names, e.g. the dequantized weights of a file;
    loaded ``strict=True``) when given.

    diffusers forms the timestep sinusoid in float32 even in a float64 model (angles up to
    1000 rad, so ~5e-5 absolute error in cos/sin, which is most of its 1e-6..6e-6-relative
    distance to a float64 forward); ``float64_sinusoid=True`` replaces that one static function
    on this instance by the same formula in float64 (what remains is its float32 RoPE table,
    ~5e-8 relative). The model is otherwise untouched."""
    import torch
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    dtype = torch.float64 if dtype is None else dtype
    model = ZImageTransformer2DModel(**cfg.diffusers_kwargs()).to(dtype)
    if weights is not None:
        model.load_state_dict(zimage_from_canonical(weights, cfg, dtype), strict=True)
    for m in model.modules():                          # one eps everywhere (q/k norms fixed)
        if type(m).__name__ == "RMSNorm" and m.eps != cfg.norm_eps:
            m.eps = cfg.norm_eps
    if float64_sinusoid:
        model.t_embedder.timestep_embedding = _timestep_embedding_f64
    return model.eval()


def random_zimage_model(cfg, seed: int = 0, dtype=None, float64_sinusoid: bool = False):
    """A diffusers ``ZImageTransformer2DModel`` for ``cfg`` with EVERY parameter drawn at
    random (diffusers zero-inits the pad tokens and one-inits the norms: left alone, mistakes
    in either would hide), and its weights under canonical names as float64 numpy.

    Scales keep activations O(1) through the random model: Linear weights
    N(0, 1/fan_in) (adaLN ones N(0, 0.25/fan_in), so scales 1+m stay positive-ish and gates
    moderate), biases N(0, 0.1^2), norm weights 1 + N(0, 0.2^2), pad tokens N(0, 1).
    ``float64_sinusoid``: see :func:`diffusers_zimage`. Returns ``(model, weights)``."""
    import torch
    dtype = torch.float64 if dtype is None else dtype
    model = diffusers_zimage(cfg, None, torch.float64, float64_sinusoid)
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, prm in sorted(model.named_parameters()):
            z = torch.randn(prm.shape, generator=g, dtype=torch.float64)
            if name.endswith("pad_token"):
                v = z
            elif prm.ndim == 1 and name.endswith(".bias"):
                v = 0.1 * z
            elif prm.ndim == 1:
                v = 1.0 + 0.2 * z
            else:
                s = 0.5 if "adaLN_modulation" in name else 1.0
                v = z * (s / np.sqrt(prm.shape[1]))
            prm.copy_(v)
    w = zimage_to_canonical(model.state_dict(), cfg.patch)
    weights = {n: w.pop(n) for n in cfg.tensor_shapes()}      # the model's order
    if w:
        raise RuntimeError(f"random_zimage_model: unmapped diffusers tensors {sorted(w)}")
    return model.to(dtype).eval(), weights


def run_diffusers_zimage(model, latents: np.ndarray, t: float, cap_feats: np.ndarray,
                         dtype=None) -> np.ndarray:
    """One call ``model([lat[:, None]], tensor([t]), [cap], return_dict=False)[0][0][:, 0]``
    at batch 1 in ``dtype`` (default: the model's; another dtype runs a converted copy):
    latents ``[C, H, W]``, t = 1 - sigma,
    cap_feats ``[L, cap_dim]`` -> raw output float64 ``[C, H, W]`` (not negated)."""
    import copy

    import torch
    dtype = next(model.parameters()).dtype if dtype is None else dtype
    if next(model.parameters()).dtype != dtype:        # a converted copy: the caller's stays
        model = copy.deepcopy(model).to(dtype)
    lat = torch.from_numpy(np.ascontiguousarray(latents, dtype=np.float64)).to(dtype)
    cap = torch.from_numpy(np.ascontiguousarray(cap_feats, dtype=np.float64)).to(dtype)
    with torch.no_grad():
        out = model([lat[:, None]], torch.tensor([float(t)], dtype=dtype), [cap],
                    return_dict=False)[0][0][:, 0]
    return out.double().numpy()
