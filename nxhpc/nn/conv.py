"""Convolutions on the matmul kernels, over channels-last rows ``x[H*W, C]``.

Owns :func:`conv3x3_band` (a band of output pixels of a 3x3 convolution, padding 1, optionally
reading through a nearest x2 upsampling: im2col panels of at most :data:`PANEL_FLOATS` floats,
each multiplied by the weight as stored, ``[C_out, C_in*9]``), :func:`conv1x1_band` (the matmul
of rows), and :func:`linear_band` (the precision switch: ``"f32"`` -> ``matmul``, ``"bf16"`` ->
``matmul_bf16``, bias added once after the sum). Every output pixel's arithmetic is the
matmul's fixed two-level sum over its own panel row, so any band split and any panel size give
the same bits. Must not: make a whole im2col matrix, copy a weight, or import a model family.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nxhpc.formats.weights import WeightTensor

__all__ = ["conv3x3_band", "conv1x1_band", "linear_band", "panel_rows", "PANEL_FLOATS",
           "CONV_PRECISIONS", "Panel"]

#: The largest im2col panel, in floats (4 MiB): a few hundred output pixels at C_in = 512, the
#: matmul's own row block (264 at AVX2) at least once.
PANEL_FLOATS = 1 << 20
#: The precisions a convolution runs in (the matmul's; no Q8_0 weights come in these files).
CONV_PRECISIONS = ("f32", "bf16")


def panel_rows(K: int) -> int:
    """Output pixels per im2col panel of row length ``K`` (at least 16)."""
    return max(16, PANEL_FLOATS // max(K, 1))


class Panel:
    """One process's im2col scratch, grown on demand and reused (never shared between
    processes: each worker has its own)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.float32)

    def get(self, rows: int, K: int) -> np.ndarray:
        """A float32 [rows, K] view of the scratch."""
        n = rows * K
        if self._buf.size < n:
            self._buf = np.empty(n, dtype=np.float32)
        return self._buf[:n].reshape(rows, K)


def linear_band(kern: Any, x: np.ndarray, w: WeightTensor, bias: np.ndarray | None,
                out: np.ndarray, precision: str) -> None:
    """out := x @ dequant(w)^T + bias (x float32 [T, K], out float32 [T, N]) in ``precision``."""
    if precision == "f32":
        kern.matmul(x, w.data, w.type_name, out, bias=bias)
    elif precision == "bf16":
        kern.matmul_bf16(x, w.data, w.type_name, out, bias=bias)
    else:
        raise ValueError(f"precision must be one of {CONV_PRECISIONS}, got {precision!r}")


def conv3x3_band(kern: Any, x: np.ndarray, H: int, W: int, w: WeightTensor,
                 bias: np.ndarray | None, out: np.ndarray, lo: int, hi: int, *, upsample: bool,
                 precision: str, panel: Panel) -> None:
    """out[lo:hi] := conv3x3(up(x))[lo:hi]: output pixels [lo, hi) of the (2H x 2W if
    ``upsample`` else H x W) grid; x [H*W, C_in], w [C_out, C_in*9], out [pixels, C_out].
    ``bf16``: one ``conv3x3_bf16`` call (no panel; the bits of every panel split); ``f32``: im2col
    panels of :data:`PANEL_FLOATS` from ``panel``, each through ``matmul``."""
    if precision == "bf16":          # one call: the im2col rows made as the matmul packs them
        kern.conv3x3_bf16(x, H, W, w.data, w.type_name, out, lo, hi, bias=bias, upsample=upsample)
        return
    K = w.shape[1]
    step = panel_rows(K)
    for p0 in range(lo, hi, step):
        p1 = min(p0 + step, hi)
        pan = panel.get(p1 - p0, K)
        kern.im2col3x3(x, H, W, pan, p0, p1, upsample=upsample)
        linear_band(kern, pan, w, bias, out[p0:p1], precision)


def conv1x1_band(kern: Any, x: np.ndarray, w: WeightTensor, bias: np.ndarray | None,
                 out: np.ndarray, lo: int, hi: int, precision: str) -> None:
    """out[lo:hi] := x[lo:hi] @ w^T + bias (a 1x1 convolution of rows [lo, hi))."""
    if hi > lo:
        linear_band(kern, x[lo:hi], w, bias, out[lo:hi], precision)
