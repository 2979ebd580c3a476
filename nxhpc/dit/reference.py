"""The in-repo oracle: a plain float64 numpy evaluation of one block (docs/block.md).

Owns ``block_forward_f64`` and its pieces (adaLN, RMSNorm, RoPE, attention). Written from the
formulas alone: it shares no code with the kernels and must never import ``nxhpc._kernels``.
Weights arrive dequantized (float64, short names ``qkv, out, w1, w2, w3, attention_norm1,
attention_norm2, ffn_norm1, ffn_norm2, q_norm, k_norm`` and, for a modulated block, ``adaln_w,
adaln_b``); :func:`dequantize_layer` decodes bound weights of any GGML type with the ``gguf``
package (never nxhpc's decoders).
"""
from __future__ import annotations

from typing import Any, MutableMapping

import numpy as np

__all__ = ["WEIGHT_KEYS", "MODULATION_KEYS", "rmsnorm_f64", "adaln_f64", "rope_f64", "attention_f64",
           "block_forward_f64", "dequantize_layer"]

WEIGHT_KEYS = ("qkv", "out", "w1", "w2", "w3", "attention_norm1", "attention_norm2",
               "ffn_norm1", "ffn_norm2", "q_norm", "k_norm", "adaln_w", "adaln_b")
#: The adaLN pair: only a modulated block has (and needs) them.
MODULATION_KEYS = ("adaln_w", "adaln_b")


def rmsnorm_f64(v: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """``v / sqrt(mean(v^2) + eps) * w`` over the last axis."""
    v = np.asarray(v, dtype=np.float64)
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def adaln_f64(t_emb: np.ndarray, w: np.ndarray, b: np.ndarray, silu: bool = False) -> np.ndarray:
    """``m = w @ (silu(t_emb) if silu else t_emb) + b`` -> float64 ``[4D]``."""
    t = np.asarray(t_emb, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if t.ndim != 1 or w.ndim != 2 or w.shape[1] != t.shape[0]:
        raise ValueError(f"adaln_f64: t_emb {t.shape} does not fit weight {w.shape}")
    if silu:
        t = t / (1.0 + np.exp(-t))
    return w @ t + np.asarray(b, dtype=np.float64)


def rope_f64(x: np.ndarray, pe: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs: ``out[2j+r] = pe[t,j,r,0]*x[2j] + pe[t,j,r,1]*x[2j+1]``.

    x ``[T, n_heads, hd]``, pe ``[T, hd/2, 2, 2]``.
    """
    T, n, hd = x.shape
    xp = x.reshape(T, n, hd // 2, 2)
    p = np.asarray(pe, dtype=np.float64)[:, None]           # [T, 1, hd/2, 2, 2]
    out = np.empty_like(xp)
    for r in range(2):
        out[..., r] = p[..., r, 0] * xp[..., 0] + p[..., r, 1] * xp[..., 1]
    return out.reshape(T, n, hd)


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """Per query head h: ``softmax(q_h k_g^T / sqrt(hd) [masked]) v_g``, g = h // (H/KVH).

    q ``[T, H, hd]``, k and v ``[T, KVH, hd]``, mask ``[T]`` over keys (True = attend).
    A query whose keys are all masked gets zeros. Returns ``[T, H*hd]``.
    """
    T, H, hd = q.shape
    KVH = k.shape[1]
    group = H // KVH
    keep = None if mask is None else np.asarray(mask).astype(bool)
    out = np.zeros((T, H, hd), dtype=np.float64)
    if keep is not None and not keep.any():
        return out.reshape(T, H * hd)
    for h in range(H):
        g = h // group
        s = (q[:, h, :] @ k[:, g, :].T) / np.sqrt(hd)        # [T, T]
        if keep is not None:
            s = np.where(keep[None, :], s, -np.inf)
        s = s - s.max(axis=1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(axis=1, keepdims=True)
        out[:, h, :] = p @ v[:, g, :]
    return out.reshape(T, H * hd)


def block_forward_f64(x: np.ndarray, weights: dict, config: Any, t_emb: np.ndarray | None = None,
                      adaln_m: np.ndarray | None = None, pe: np.ndarray | None = None,
                      mask: np.ndarray | None = None, eps: float | None = None,
                      trace: MutableMapping[str, np.ndarray] | None = None,
                      modulation: bool = True) -> np.ndarray:
    """One block in float64: ``x [T, D]`` -> ``out [T, D]`` (docs/block.md, "Forward pass").

    Give either ``t_emb`` (adaLN computed here, with SiLU when ``config.adaln_silu``) or the
    modulation vector ``adaln_m [4D]``. ``pe [T, hd/2, 2, 2]`` is required; ``mask [T]`` is
    optional (True/1 = attend); ``eps`` defaults to ``config.norm_eps``. When ``trace`` is a
    dict, the intermediates (``m, h, qkv, q, k, v, attn, mid, h2, f, out``) are stored in it.

    ``modulation=False`` is the unmodulated block of docs/denoiser.md (the context refiner): no
    adaLN, no tanh, ``x += rmsnorm(attn(rmsnorm(x, n1)), n2); x += rmsnorm(ffn(rmsnorm(x, f1)),
    f2)``; give neither ``t_emb`` nor ``adaln_m``, and the weights need no adaLN pair.
    """
    D, H, KVH, hd = config.dim, config.n_heads, config.n_kv_heads, config.head_dim
    eps = float(config.norm_eps if eps is None else eps)
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != D:
        raise ValueError(f"block_forward_f64: x is {x.shape}, expected [T, {D}]")
    T = x.shape[0]
    keys = WEIGHT_KEYS if modulation else tuple(k for k in WEIGHT_KEYS
                                                if k not in MODULATION_KEYS)
    missing = [k for k in keys if k not in weights]
    if missing:
        raise ValueError(f"block_forward_f64: weights lack {missing}")
    w = {k: np.asarray(weights[k], dtype=np.float64) for k in keys}
    if pe is None:
        raise ValueError("block_forward_f64: pe is required")
    pe = np.asarray(pe, dtype=np.float64)
    if pe.shape != (T, hd // 2, 2, 2):
        raise ValueError(f"block_forward_f64: pe is {pe.shape}, expected {(T, hd // 2, 2, 2)}")
    if mask is not None and np.shape(mask) != (T,):
        raise ValueError(f"block_forward_f64: mask is {np.shape(mask)}, expected ({T},)")
    if not modulation:
        if t_emb is not None or adaln_m is not None:
            raise ValueError("block_forward_f64: an unmodulated block takes no t_emb/adaln_m")
        m = None
        mod_msa = mod_mlp = tg_msa = tg_mlp = 1.0
    else:
        if adaln_m is None:
            if t_emb is None:
                raise ValueError("block_forward_f64: give t_emb or adaln_m")
            m = adaln_f64(t_emb, w["adaln_w"], w["adaln_b"], silu=config.adaln_silu)
        else:
            m = np.asarray(adaln_m, dtype=np.float64)
        if m.shape != (4 * D,):
            raise ValueError(f"block_forward_f64: adaLN output is {m.shape}, expected "
                             f"({4 * D},)")
        scale_msa, gate_msa, scale_mlp, gate_mlp = m[:D], m[D:2 * D], m[2 * D:3 * D], m[3 * D:]
        mod_msa, mod_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
        tg_msa, tg_mlp = np.tanh(gate_msa), np.tanh(gate_mlp)

    h = rmsnorm_f64(x, w["attention_norm1"], eps) * mod_msa
    qkv = h @ w["qkv"].T                                      # [T, (H + 2 KVH) hd]
    q = qkv[:, :H * hd].reshape(T, H, hd)
    k = qkv[:, H * hd:(H + KVH) * hd].reshape(T, KVH, hd)
    v = qkv[:, (H + KVH) * hd:].reshape(T, KVH, hd)
    q = rope_f64(rmsnorm_f64(q, w["q_norm"], eps), pe)
    k = rope_f64(rmsnorm_f64(k, w["k_norm"], eps), pe)
    attn = attention_f64(q, k, v, mask)
    mid = x + tg_msa * rmsnorm_f64(attn @ w["out"].T, w["attention_norm2"], eps)

    h2 = rmsnorm_f64(mid, w["ffn_norm1"], eps) * mod_mlp
    a = h2 @ w["w1"].T
    f = a / (1.0 + np.exp(-a)) * (h2 @ w["w3"].T)
    out = mid + tg_mlp * rmsnorm_f64(f @ w["w2"].T, w["ffn_norm2"], eps)
    if trace is not None:
        trace.update(m=m, h=h, qkv=qkv, q=q, k=k, v=v, attn=attn, mid=mid, h2=h2, f=f, out=out)
    return out


def dequantize_layer(lw: Any) -> dict[str, np.ndarray]:
    """Bound weights (a ``LayerWeights``) -> float64 weights under the short names.

    Every matrix is decoded by its stored GGML type with ``gguf.quants.dequantize`` (a bare
    uint8 array is Q8_0 rows); float arrays are widened. Absent (None) adaLN tensors of an
    unmodulated block are left out.
    """
    import gguf
    out: dict[str, np.ndarray] = {}
    for key in WEIGHT_KEYS:
        a = getattr(lw, key, None)
        if a is None and key in MODULATION_KEYS:
            continue
        if hasattr(a, "ggml_type") and hasattr(a, "data"):       # a WeightTensor
            d = gguf.quants.dequantize(np.ascontiguousarray(a.data),
                                       gguf.GGMLQuantizationType(a.ggml_type))
            out[key] = np.asarray(d, dtype=np.float64).reshape(a.shape)
            continue
        a = np.asarray(a)
        if a.dtype == np.uint8:
            a = gguf.quants.dequantize(np.ascontiguousarray(a), gguf.GGMLQuantizationType.Q8_0)
        out[key] = a.astype(np.float64)
    return out
