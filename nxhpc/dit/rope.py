"""Rotary position tables: (t, h, w) position ids -> the ``pe`` table, in float64.

Owns the position-id layout of a generation (caption tokens, then an image grid) and the
per-axis angle tables. Angles ``pos * theta**(-2k/d_axis)`` are formed in float64, so tables
stay accurate for positions in the tens of thousands. Nothing here runs the block.

``pe`` layout (docs/block.md): ``[T, hd/2, 2, 2]`` holding ``[[cos, -sin], [sin, cos]]`` per
(token, pair); pairs run over the t axis, then h, then w.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["VARIANT_ROPE", "default_axes_dims", "position_ids", "rope_table",
           "pe_from_complex", "pe_to_complex"]

VARIANT_ROPE: dict[str, tuple[float, tuple[int, int, int]]] = {
    "zimage": (256.0, (32, 48, 48)),       # head_dim 128
    "lumina2": (10000.0, (32, 32, 32)),    # head_dim 96
}
"""Real (theta, axes_dims) of each variant at its real head_dim."""


def default_axes_dims(head_dim: int, variant: str = "zimage") -> tuple[int, int, int]:
    """Per-axis rotary dims summing to ``head_dim`` in the variant's proportions.

    Returns the real dims at the real head_dim; otherwise splits the ``head_dim/2`` pairs in the
    same ratio (floor, remainder to the leading axes). Every axis gets at least one pair.
    """
    if head_dim < 6 or head_dim % 2:
        raise ValueError(f"default_axes_dims: head_dim must be even and >= 6, got {head_dim}")
    if variant not in VARIANT_ROPE:
        raise ValueError(f"default_axes_dims: unknown variant {variant!r}")
    real = VARIANT_ROPE[variant][1]
    if sum(real) == head_dim:
        return real
    pairs = head_dim // 2
    weights = np.asarray(real, dtype=np.float64) / sum(real)
    alloc = [max(1, int(np.floor(w * pairs))) for w in weights]
    i = 0
    while sum(alloc) < pairs:
        alloc[i % 3] += 1
        i += 1
    while sum(alloc) > pairs:
        j = int(np.argmax(alloc))
        alloc[j] -= 1
    return tuple(2 * a for a in alloc)  # type: ignore[return-value]


def position_ids(n_caption: int, grid: Sequence[int], caption_start: int = 1, *,
                 multiple: int = 1) -> np.ndarray:
    """Position ids ``int64 [Lp + Np, 3]``: the caption rows, then an image grid -- the one
    token layout of nxhpc (``docs/denoiser.md``, "Position ids").

    ``Lp`` / ``Np``: ``n_caption`` / ``F*H*W`` rounded up to a multiple of ``multiple`` (1: no
    padding; the denoiser pads both to 32). Caption row ``i`` -- its pad rows too -- is
    ``(caption_start + i, 0, 0)``; image token ``(f, h, w)`` is ``(caption_start + Lp + f, h,
    w)`` in row-major (f, h, w) order; image pad rows are ``(0, 0, 0)``. This is the layout of
    the Z-Image reference pipeline, whose caption starts at 1. A caller that runs the image
    rows first (the denoiser) takes ``ids[Lp:]`` then ``ids[:Lp]``.
    """
    if n_caption < 0 or len(grid) != 3 or any(int(g) < 1 for g in grid) or int(multiple) < 1:
        raise ValueError(f"position_ids: need n_caption >= 0, a 3-axis grid of positive "
                         f"sizes and multiple >= 1, got n_caption={n_caption}, "
                         f"grid={tuple(grid)}, multiple={multiple}")
    F, H, W = (int(g) for g in grid)
    m = int(multiple)
    Lp = -(-int(n_caption) // m) * m
    n_img = F * H * W
    Np = -(-n_img // m) * m
    ids = np.zeros((Lp + Np, 3), dtype=np.int64)
    ids[:Lp, 0] = caption_start + np.arange(Lp)
    f, h, w = np.meshgrid(np.arange(F), np.arange(H), np.arange(W), indexing="ij")
    ids[Lp:Lp + n_img] = np.stack([f.ravel() + caption_start + Lp, h.ravel(), w.ravel()],
                                  axis=1)
    return ids


def rope_table(ids: np.ndarray, axes_dims: Sequence[int], theta: float) -> np.ndarray:
    """``pe`` float64 ``[T, sum(axes_dims)/2, 2, 2]`` for position ids ``[T, len(axes_dims)]``."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[1] != len(axes_dims):
        raise ValueError(f"rope_table: ids must be [T, {len(axes_dims)}], got {ids.shape}")
    if any(int(d) <= 0 or int(d) % 2 for d in axes_dims):
        raise ValueError(f"rope_table: axes_dims must be positive and even, got {axes_dims}")
    if not theta > 0:
        raise ValueError(f"rope_table: theta must be positive, got {theta}")
    angles = []
    for a, d in enumerate(axes_dims):
        d = int(d)
        inv = float(theta) ** (-np.arange(0, d, 2, dtype=np.float64) / d)   # [d/2]
        angles.append(ids[:, a].astype(np.float64)[:, None] * inv[None, :])
    ang = np.concatenate(angles, axis=1)                                     # [T, hd/2]
    return _rotations(np.cos(ang), np.sin(ang))


def _rotations(c: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``[..., 2, 2]`` rotation matrices ``[[c, -s], [s, c]]`` from cosines and sines."""
    pe = np.empty(c.shape + (2, 2), dtype=c.dtype)
    pe[..., 0, 0] = c
    pe[..., 0, 1] = -s
    pe[..., 1, 0] = s
    pe[..., 1, 1] = c
    return pe


def pe_from_complex(freqs: np.ndarray) -> np.ndarray:
    """Complex rotations ``[T, hd/2]`` (cos + i sin) -> ``pe [T, hd/2, 2, 2]``."""
    freqs = np.asarray(freqs)
    if freqs.ndim != 2 or freqs.dtype.kind != "c":
        raise ValueError(f"pe_from_complex: expected complex [T, hd/2], got {freqs.dtype} "
                         f"{freqs.shape}")
    return _rotations(freqs.real, freqs.imag)


def pe_to_complex(pe: np.ndarray) -> np.ndarray:
    """``pe [T, hd/2, 2, 2]`` -> complex ``[T, hd/2]`` = cos + i sin."""
    pe = np.asarray(pe)
    if pe.ndim != 4 or pe.shape[2:] != (2, 2):
        raise ValueError(f"pe_to_complex: expected [T, hd/2, 2, 2], got {pe.shape}")
    return pe[..., 0, 0] + 1j * pe[..., 1, 0]
