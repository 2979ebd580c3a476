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

__all__ = ["diffusers_block", "run_diffusers_block"]


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


def run_diffusers_block(blk, x: np.ndarray, t_emb: np.ndarray, pe: np.ndarray,
                        mask: np.ndarray | None = None) -> np.ndarray:
    """One forward of a diffusers block on x [T, D] (batch 1), ``pe`` [T, hd/2, 2, 2] passed as
    its complex rotary input, ``mask`` [T] (True = attend) or None; float64 copy of the output."""
    import torch
    freqs = torch.complex(_t(pe[..., 0, 0]), _t(pe[..., 1, 0]))
    m = None if mask is None else torch.from_numpy(np.asarray(mask).astype(bool))[None]
    with torch.no_grad():
        out = blk(_t(x)[None], m, freqs[None], _t(t_emb)[None])[0]
    return out.double().numpy()
