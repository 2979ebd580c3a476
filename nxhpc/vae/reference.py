"""The float64 reference of the FLUX autoencoder's decoder, in plain numpy (NCHW).

Owns :func:`decode_ref`: the decoder written from its formulas over float64 copies of the
weights (``weights[name]`` by diffusers name, diffusers shapes), with the knobs the negative
controls turn (``eps``, ``shift``, ``upsample_first``). It is what the kernels are checked
against beside diffusers, so it shares none of their code.
Must not: import compiled code, ``nxhpc.nn``, the runtime, or the engine.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from nxhpc.vae.config import VaeConfig

__all__ = ["decode_ref"]


def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """x [C, H, W] (*) w [O, C, k, k] + b, stride 1, padding k // 2."""
    k = w.shape[-1]
    if k == 1:
        return np.einsum("oc,chw->ohw", w[:, :, 0, 0], x) + b[:, None, None]
    p = k // 2
    pad = np.pad(x, ((0, 0), (p, p), (p, p)))
    win = sliding_window_view(pad, (k, k), axis=(1, 2))        # [C, H, W, k, k]
    return np.einsum("ocij,chwij->ohw", w, win, optimize=True) + b[:, None, None]


def _group_norm(x: np.ndarray, groups: int, gamma: np.ndarray, beta: np.ndarray,
                eps: float) -> np.ndarray:
    C, H, W = x.shape
    g = x.reshape(groups, -1)
    mean = g.mean(axis=1, keepdims=True)
    var = ((g - mean) ** 2).mean(axis=1, keepdims=True)
    y = ((g - mean) / np.sqrt(var + eps)).reshape(C, H, W)
    return y * gamma[:, None, None] + beta[:, None, None]


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def decode_ref(weights: Mapping[str, np.ndarray], cfg: VaeConfig, latents: np.ndarray, *,
               eps: float | None = None, shift: float | None = None,
               upsample_first: bool = True) -> np.ndarray:
    """float64 pixels [out_channels, H, W] of latents [C_z, h, w] (sampler space)."""
    eps = cfg.eps if eps is None else eps
    shift = cfg.shift_factor if shift is None else shift
    G = cfg.norm_num_groups
    W_ = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}

    def conv(name: str, x: np.ndarray) -> np.ndarray:
        w = W_[name + ".weight"]
        if w.ndim == 2:
            w = w[:, :, None, None]
        return _conv(x, w, W_[name + ".bias"])

    def norm(name: str, x: np.ndarray) -> np.ndarray:
        return _group_norm(x, G, W_[name + ".weight"], W_[name + ".bias"], eps)

    def resnet(p: str, x: np.ndarray) -> np.ndarray:
        y = conv(f"{p}.conv1", _silu(norm(f"{p}.norm1", x)))
        y = conv(f"{p}.conv2", _silu(norm(f"{p}.norm2", y)))
        sc = conv(f"{p}.conv_shortcut", x) if f"{p}.conv_shortcut.weight" in W_ else x
        return sc + y

    def attention(p: str, x: np.ndarray) -> np.ndarray:
        C, H, Wd = x.shape
        h = norm(f"{p}.group_norm", x).reshape(C, H * Wd).T          # [P, C]

        def lin(n: str, v: np.ndarray) -> np.ndarray:
            return v @ W_[f"{p}.{n}.weight"].reshape(C, C).T + W_[f"{p}.{n}.bias"]
        q, k, v = lin("to_q", h), lin("to_k", h), lin("to_v", h)
        s = q @ k.T / np.sqrt(C)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        o = (s / s.sum(axis=1, keepdims=True)) @ v
        return x + lin("to_out.0", o).T.reshape(C, H, Wd)

    x = np.asarray(latents, dtype=np.float64) / cfg.scaling_factor + shift
    x = conv("decoder.conv_in", x)
    x = resnet("decoder.mid_block.resnets.0", x)
    if cfg.mid_attention:
        x = attention("decoder.mid_block.attentions.0", x)
    x = resnet("decoder.mid_block.resnets.1", x)
    for i in range(cfg.levels):
        for j in range(cfg.layers_per_block + 1):
            x = resnet(f"decoder.up_blocks.{i}.resnets.{j}", x)
        if i < cfg.levels - 1:
            up = f"decoder.up_blocks.{i}.upsamplers.0.conv"
            if upsample_first:
                x = conv(up, x.repeat(2, axis=1).repeat(2, axis=2))
            else:
                x = conv(up, x).repeat(2, axis=1).repeat(2, axis=2)
    x = _silu(norm("decoder.conv_norm_out", x))
    return conv("decoder.conv_out", x)
