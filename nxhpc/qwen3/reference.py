"""The Qwen3 text encoder in float64 numpy, written plainly from the design facts: the oracle.

Owns :func:`encode_f64` (token ids -> ``hidden_states[-2]``, the residual stream after block
``n_layers - 1`` without the final norm) and its pieces (:func:`rmsnorm_f64`,
:func:`rope_half_f64`, :func:`attention_f64`, :func:`block_f64`). Its switches change one
fact each (no q/k norm, interleaved RoPE pairs, no causal mask, the final norm applied, a
different block count); the tests use them as negative controls that the engine must miss.
Must not: import engine code (``nxhpc._kernels``, ``nxhpc.nn``, ``nxhpc.runtime``, the qwen3
plan or model): it is what they are checked against. It takes float64 weights by llama.cpp
tensor name (e.g. from ``nxhpc.models.qwen3_files.read_qwen3_gguf``) and the config.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nxhpc.qwen3.config import Qwen3Config, layer_names

__all__ = ["encode_f64", "block_f64", "rmsnorm_f64", "rope_half_f64", "rope_interleaved_f64",
           "attention_f64"]


def rmsnorm_f64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2 over the last axis) + eps) * w."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _angles(T: int, hd: int, theta: float) -> np.ndarray:
    """[T, hd/2]: position t times inv_freq_i = theta^(-2i/hd)."""
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    return np.arange(T, dtype=np.float64)[:, None] * inv[None, :]


def rope_half_f64(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on ``x`` [heads, T, hd]: pair (i, i + hd/2) turned by angle t*inv_i."""
    hd = x.shape[-1]
    a = _angles(x.shape[-2], hd, theta)
    c, s = np.cos(a), np.sin(a)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope_interleaved_f64(x: np.ndarray, theta: float) -> np.ndarray:
    """The other RoPE layout (a negative control): pair (2i, 2i+1) turned by angle t*inv_i."""
    hd = x.shape[-1]
    a = _angles(x.shape[-2], hd, theta)
    c, s = np.cos(a), np.sin(a)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def attention_f64(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True
                  ) -> np.ndarray:
    """softmax(q k^T / sqrt(hd) + mask) v per query head; q [H, T, hd], k/v [KVH, T, hd];
    query head h reads kv head h // (H/KVH); causal: query t sees keys j <= t. -> [H, T, hd]."""
    H, T, hd = q.shape
    group = H // k.shape[0]
    kk = np.repeat(k, group, axis=0)
    vv = np.repeat(v, group, axis=0)
    s = q @ kk.transpose(0, 2, 1) / np.sqrt(hd)
    if causal:
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p @ vv


def block_f64(x: np.ndarray, w: Mapping[str, np.ndarray], cfg: Qwen3Config, *,
              qk_norm: bool = True, rope: str = "half", causal: bool = True) -> np.ndarray:
    """One Qwen3 block on the residual stream ``x`` [T, D]; ``w`` by short key
    (:data:`~nxhpc.qwen3.config.LAYER_TENSORS`)."""
    T = x.shape[0]
    H, KVH, hd, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.eps
    n1 = rmsnorm_f64(x, w["attn_norm"], eps)
    q = (n1 @ w["wq"].T).reshape(T, H, hd).transpose(1, 0, 2)
    k = (n1 @ w["wk"].T).reshape(T, KVH, hd).transpose(1, 0, 2)
    v = (n1 @ w["wv"].T).reshape(T, KVH, hd).transpose(1, 0, 2)
    if qk_norm:
        q = rmsnorm_f64(q, w["q_norm"], eps)
        k = rmsnorm_f64(k, w["k_norm"], eps)
    turn = rope_half_f64 if rope == "half" else rope_interleaved_f64
    q, k = turn(q, cfg.rope_theta), turn(k, cfg.rope_theta)
    a = attention_f64(q, k, v, causal).transpose(1, 0, 2).reshape(T, H * hd)
    h = x + a @ w["wo"].T
    n2 = rmsnorm_f64(h, w["ffn_norm"], eps)
    g = n2 @ w["w_gate"].T
    u = n2 @ w["w_up"].T
    return h + (g / (1.0 + np.exp(-g)) * u) @ w["w_down"].T


def encode_f64(ids: Sequence[int], weights: Mapping[str, np.ndarray], cfg: Qwen3Config, *,
               n_blocks: int | None = None, qk_norm: bool = True, rope: str = "half",
               causal: bool = True, final_norm: bool = False) -> np.ndarray:
    """hidden_states[-2] of ``ids``: embedding rows, then ``n_blocks`` (default
    ``cfg.layers_needed``) blocks, no final norm (``final_norm=True``: ``output_norm``
    applied, a negative control). ``weights``: float64 arrays by llama.cpp tensor name."""
    ids = np.asarray(ids, dtype=np.int64)
    x = np.asarray(weights["token_embd.weight"], dtype=np.float64)[ids]
    for i in range(cfg.layers_needed if n_blocks is None else n_blocks):
        w = {k: np.asarray(weights[n], dtype=np.float64) for k, n in layer_names(i).items()}
        x = block_f64(x, w, cfg, qk_norm=qk_norm, rope=rope, causal=causal)
    if final_norm:
        x = rmsnorm_f64(x, np.asarray(weights["output_norm.weight"], np.float64), cfg.eps)
    return x
