"""The in-repo oracle for the whole Z-Image denoiser: one transformer call in plain float64 numpy.

Owns ``denoiser_forward_f64`` and the model-level pieces around the block (timestep embedder,
patchify/unpatchify, x/cap embedders with pad tokens, the final layer), written from
``docs/denoiser.md`` alone. Reuses the float64 block (``nxhpc.dit.reference``, whose
``modulation=False`` is the context refiner's block), the position ids and the float64 RoPE
tables from integer ids (``nxhpc.dit.rope``; checked against diffusers' in the tests).
Must never import ``nxhpc._kernels`` or torch: it is what the kernels are checked against.

Weights arrive dequantized, float64, under canonical (prefix-free) names
(``DenoiserConfig.tensor_shapes``). The output is the raw model output in the diffusers
convention: t = 1 - sigma (0 = pure noise), r ~ x0 - noise, not negated.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping

import numpy as np

from nxhpc.dit.config import DenoiserConfig, tensor_names
from nxhpc.dit.reference import block_forward_f64, rmsnorm_f64
from nxhpc.dit.rope import position_ids, rope_table

__all__ = [
    "MUTATIONS",
    "block_weights",
    "check_weights",
    "denoiser_forward_f64",
    "final_layer_f64",
    "pad_rows_f64",
    "patchify_f64",
    "t_embed_f64",
    "timestep_embedding_f64",
    "unpatchify_f64",
]

MUTATIONS = ("mask_pads", "patch_order", "token_order", "final_no_silu", "negate")
"""Deliberate mistakes for negative controls only (a check that cannot tell them from the
model proves nothing): ``mask_pads`` hides pad rows from attention as keys; ``patch_order``
flattens each patch as (c, ph, pw) instead of (ph, pw, c); ``token_order`` feeds the image
tokens column-major (w, h) while the position ids stay row-major (h, w); ``final_no_silu``
drops the SiLU before the final adaLN; ``negate`` returns -r (the pipeline's scheduler
input)."""


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def timestep_embedding_f64(t: float, cfg: DenoiserConfig) -> np.ndarray:
    """``[cos(a) | sin(a)]``, ``a_k = t_scale*t * exp(-ln(max_period) k / half)``,
    k = 0..half-1, half = t_freq_dim/2 -> float64 ``[t_freq_dim]``."""
    half = cfg.t_freq_dim // 2
    k = np.arange(half, dtype=np.float64)
    a = cfg.t_scale * float(t) * np.exp(-np.log(cfg.max_period) * k / half)
    return np.concatenate([np.cos(a), np.sin(a)])


def t_embed_f64(t: float, w: Mapping[str, np.ndarray], cfg: DenoiserConfig) -> np.ndarray:
    """``temb = mlp.2(silu(mlp.0(sinusoid(t))))`` -> ``[adaln_in]`` (no SiLU after)."""
    e = timestep_embedding_f64(t, cfg)
    h = w["t_embedder.mlp.0.weight"] @ e + w["t_embedder.mlp.0.bias"]
    return w["t_embedder.mlp.2.weight"] @ _silu(h) + w["t_embedder.mlp.2.bias"]


def patchify_f64(latents: np.ndarray, p: int, order: str = "hwc") -> np.ndarray:
    """``[C, H, W]`` -> ``[Ht*Wt, p*p*C]``:
    ``patches[h*Wt + w, (ph*p + pw)*C + c] = latents[c, p*h+ph, p*w+pw]``.
    ``order="chw"`` is the wrong (c, ph, pw) flattening, for negative controls only."""
    C, H, W = latents.shape
    Ht, Wt = H // p, W // p
    x = latents.reshape(C, Ht, p, Wt, p)                     # [c, h, ph, w, pw]
    if order == "hwc":
        x = x.transpose(1, 3, 2, 4, 0)                       # [h, w, ph, pw, c]
    elif order == "chw":
        x = x.transpose(1, 3, 0, 2, 4)                       # [h, w, c, ph, pw]
    else:
        raise ValueError(f"patchify_f64: order must be 'hwc' or 'chw', got {order!r}")
    return x.reshape(Ht * Wt, p * p * C)


def unpatchify_f64(Y: np.ndarray, C: int, H: int, W: int, p: int,
                   order: str = "hwc") -> np.ndarray:
    """Inverse of :func:`patchify_f64`: ``out[c, p*h+ph, p*w+pw] = Y[h*Wt + w, (ph*p+pw)*C + c]``."""
    Ht, Wt = H // p, W // p
    if order == "hwc":
        x = Y.reshape(Ht, Wt, p, p, C).transpose(4, 0, 2, 1, 3)   # [c, h, ph, w, pw]
    elif order == "chw":
        x = Y.reshape(Ht, Wt, C, p, p).transpose(2, 0, 3, 1, 4)
    else:
        raise ValueError(f"unpatchify_f64: order must be 'hwc' or 'chw', got {order!r}")
    return x.reshape(C, H, W)


def pad_rows_f64(x: np.ndarray, pad_token: np.ndarray, multiple: int) -> np.ndarray:
    """Append copies of ``pad_token`` ([D] or [1, D]) until the row count is a multiple of
    ``multiple`` (no rows added when it already is)."""
    n = x.shape[0]
    n_pad = (-n) % multiple
    pad = np.broadcast_to(np.asarray(pad_token, np.float64).reshape(1, -1), (n_pad, x.shape[1]))
    return np.concatenate([x, pad], axis=0)


def block_weights(weights: Mapping[str, np.ndarray], group: str, i: int) -> dict[str, np.ndarray]:
    """Block ``group.i``'s weights under the short names of ``nxhpc.dit.reference``."""
    return {k: np.asarray(weights[n], dtype=np.float64)
            for k, n in tensor_names(group, i).items()}


def final_layer_f64(Y: np.ndarray, w: Mapping[str, np.ndarray], temb: np.ndarray,
                    cfg: DenoiserConfig, silu: bool = True) -> np.ndarray:
    """``layernorm(Y, final_eps, no affine) * (1 + adaLN.1(silu(temb)))`` then
    ``final_layer.linear`` -> ``[n, p*p*C]``."""
    mu = Y.mean(axis=1, keepdims=True)
    var = ((Y - mu) ** 2).mean(axis=1, keepdims=True)
    n = (Y - mu) / np.sqrt(var + cfg.final_eps)
    c = _silu(temb) if silu else temb
    scale = 1.0 + w["final_layer.adaLN_modulation.1.weight"] @ c \
        + w["final_layer.adaLN_modulation.1.bias"]
    return (n * scale) @ w["final_layer.linear.weight"].T + w["final_layer.linear.bias"]


def check_weights(weights: Mapping[str, np.ndarray], cfg: DenoiserConfig) -> None:
    """Raise ValueError unless every tensor of ``cfg`` is present with its shape (pad tokens
    ``[1, D]`` or ``[D]``)."""
    for name, shape in cfg.tensor_shapes().items():
        if name not in weights:
            raise ValueError(f"denoiser weights: tensor {name!r} is missing")
        got = tuple(np.shape(weights[name]))
        if got != shape and not (name.endswith("pad_token") and got == (cfg.dim,)):
            raise ValueError(f"denoiser weights: tensor {name!r} has shape {list(got)}, "
                             f"expected {list(shape)}")


def denoiser_forward_f64(latents: np.ndarray, t: float, cap_feats: np.ndarray,
                         weights: Mapping[str, np.ndarray], cfg: DenoiserConfig, *,
                         trace: MutableMapping[str, np.ndarray] | None = None,
                         mutation: str | None = None) -> np.ndarray:
    """One transformer call in float64: ``latents [C, H, W]``, ``t`` in [0, 1] (t = 1 - sigma),
    ``cap_feats [L, cap_dim]`` -> raw output ``[C, H, W]`` (diffusers convention, not negated).

    ``weights``: canonical name -> float64 array. ``trace`` (a dict) receives the
    intermediates ``temb, x_emb, cap_emb, img_ids, cap_ids, x_refined, cap_refined, unified,
    final``. ``mutation`` (one of :data:`MUTATIONS`) is for negative controls only.
    """
    if mutation is not None and mutation not in MUTATIONS:
        raise ValueError(f"denoiser_forward_f64: unknown mutation {mutation!r} "
                         f"(one of {MUTATIONS})")
    lat = np.asarray(latents, dtype=np.float64)
    cap = np.asarray(cap_feats, dtype=np.float64)
    p, C = cfg.patch, cfg.in_channels
    if lat.ndim != 3 or lat.shape[0] != C or lat.shape[1] % p or lat.shape[2] % p \
            or min(lat.shape[1:]) < p:
        raise ValueError(f"denoiser_forward_f64: latents are {lat.shape}, expected [{C}, H, W] "
                         f"with H, W positive multiples of {p}")
    if cap.ndim != 2 or cap.shape[1] != cfg.cap_dim or cap.shape[0] < 1:
        raise ValueError(f"denoiser_forward_f64: cap_feats are {cap.shape}, expected "
                         f"[L >= 1, {cfg.cap_dim}]")
    if not (np.isfinite(lat).all() and np.isfinite(cap).all()):
        raise ValueError("denoiser_forward_f64: latents or cap_feats contain NaN/Inf")
    if not (np.isfinite(t) and 0.0 <= float(t) <= 1.0):
        raise ValueError(f"denoiser_forward_f64: t must be in [0, 1], got {t}")
    check_weights(weights, cfg)
    w = {n: np.asarray(a, dtype=np.float64) for n, a in weights.items()}
    _, H, W = lat.shape
    Ht, Wt = H // p, W // p
    n_img, L, M = Ht * Wt, cap.shape[0], cfg.seq_multiple
    order = "chw" if mutation == "patch_order" else "hwc"

    temb = t_embed_f64(t, w, cfg)
    X = patchify_f64(lat, p, order) @ w["x_embedder.weight"].T + w["x_embedder.bias"]
    perm = np.arange(n_img)
    if mutation == "token_order":          # token j is grid cell perm[j] (column-major)
        perm = np.arange(n_img).reshape(Ht, Wt).T.ravel()
        X = X[perm]
    X = pad_rows_f64(X, w["x_pad_token"], M)
    Cp = rmsnorm_f64(cap, w["cap_embedder.0.weight"], cfg.norm_eps) @ \
        w["cap_embedder.1.weight"].T + w["cap_embedder.1.bias"]
    Cp = pad_rows_f64(Cp, w["cap_pad_token"], M)
    ids = position_ids(L, (1, Ht, Wt), multiple=M)
    Lp = -(-L // M) * M
    cap_ids, img_ids = ids[:Lp], ids[Lp:]
    pe_img = rope_table(img_ids, cfg.axes_dims, cfg.rope_theta)
    pe_cap = rope_table(cap_ids, cfg.axes_dims, cfg.rope_theta)
    img_keep = cap_keep = None
    if mutation == "mask_pads":
        img_keep = np.arange(X.shape[0]) < n_img
        cap_keep = np.arange(Cp.shape[0]) < L
    if trace is not None:
        trace.update(temb=temb, x_emb=X.copy(), cap_emb=Cp.copy(), img_ids=img_ids,
                     cap_ids=cap_ids)

    for i in range(cfg.n_noise_refiner):
        X = block_forward_f64(X, block_weights(w, "noise_refiner", i), cfg, t_emb=temb,
                              pe=pe_img, mask=img_keep)
    for i in range(cfg.n_context_refiner):
        Cp = block_forward_f64(Cp, block_weights(w, "context_refiner", i), cfg, pe=pe_cap,
                               mask=cap_keep, modulation=False)
    U = np.concatenate([X, Cp], axis=0)
    pe_u = np.concatenate([pe_img, pe_cap], axis=0)
    u_keep = None if img_keep is None else np.concatenate([img_keep, cap_keep])
    if trace is not None:
        trace.update(x_refined=X, cap_refined=Cp)
    for i in range(cfg.n_layers):
        U = block_forward_f64(U, block_weights(w, "layers", i), cfg, t_emb=temb, pe=pe_u,
                              mask=u_keep)
    Y = final_layer_f64(U[:n_img], w, temb, cfg, silu=mutation != "final_no_silu")
    Y = Y[np.argsort(perm)]                # back to row-major cells for unpatchify
    if trace is not None:
        trace.update(unified=U, final=Y)
    out = unpatchify_f64(Y, C, H, W, p, order)
    return -out if mutation == "negate" else out
