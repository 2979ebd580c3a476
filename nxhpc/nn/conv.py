"""Convolutions on the matmul kernels, over channels-last rows ``x[H*W, C]``.

Owns :func:`conv3x3_band` (a band of output pixels of a 3x3 convolution, padding 1, optionally
reading through a nearest x2 upsampling: one ``conv3x3`` / ``conv3x3_bf16`` kernel call, the
matmul of the band's im2col rows with the weight as stored, ``[C_out, C_in*9]``, whose packer
makes those rows as it goes), :func:`conv1x1_band` (the matmul of rows), and
:func:`linear_band` (the precision switch: ``"f32"`` -> ``matmul``, ``"bf16"`` ->
``matmul_bf16``, bias added once after the sum). Every output pixel's arithmetic is the
matmul's fixed sum over its own im2col row, so any band split gives the same bits. Must not:
make an im2col matrix, copy a weight, or import a model family.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nxhpc.formats.weights import WeightTensor

__all__ = ["conv3x3_band", "conv1x1_band", "linear_band", "CONV_PRECISIONS",
           "decoder_precision"]

#: The precisions a convolution runs in (the matmul's; no Q8_0 weights come in these files).
CONV_PRECISIONS = ("f32", "bf16")


def _bf16_dot() -> str:
    """Which bfloat16 dot this CPU runs faster, "vdpbf16ps" or "fma" (the attention's choice:
    ``nxhpc._kernels.attention_bf16_dot``, the two peak loops timed once)."""
    import nxhpc
    return nxhpc.kernels().attention_bf16_dot()


def decoder_precision(precision: str, variants: Any = None) -> str:
    """The autoencoder's precision in a run whose transformer and text encoder run
    ``precision``: ``f32`` and ``bf16`` as given; under ``q8`` (there is no int8 convolution)
    ``bf16`` where its matmul is faster than float32's -- on the AMX tiles, or on AVX-512 BF16
    where ``vdpbf16ps`` outruns the float32 FMA (AMD Zen 4: twice its rate; an Intel Xeon's
    runs at half, benchmarks/README.md "Peaks") --, else ``f32``: on AVX2 the bf16 convolution
    is float32 FMAs on rounded values, at the f32 one's speed (benchmarks/README.md, "the 3x3
    convolutions on AVX2") with bf16's error. ``variants``: ``nxhpc.kernel_variants()``
    (default: this process's)."""
    if precision != "q8":
        return precision
    if variants is None:
        from nxhpc import kernel_variants
        variants = kernel_variants()
    v = variants.get("matmul_bf16")
    if v == "amx" or (v == "avx512bf16" and _bf16_dot() == "vdpbf16ps"):
        return "bf16"
    return "f32"


def conv3x3_band(kern: Any, x: np.ndarray, H: int, W: int, w: WeightTensor,
                 bias: np.ndarray | None, out: np.ndarray, lo: int, hi: int, *, upsample: bool,
                 precision: str) -> None:
    """out[lo:hi] := conv3x3(up(x))[lo:hi]: output pixels [lo, hi) of the (2H x 2W if
    ``upsample`` else H x W) grid; x [H*W, C_in], w [C_out, C_in*9], out [pixels, C_out]. One
    kernel call: no im2col panel is made (the kernels' docs: the bits of every panel split)."""
    if precision == "f32":
        kern.conv3x3(x, H, W, w.data, w.type_name, out, lo, hi, bias=bias, upsample=upsample)
    elif precision == "bf16":
        kern.conv3x3_bf16(x, H, W, w.data, w.type_name, out, lo, hi, bias=bias,
                          upsample=upsample)
    else:
        raise ValueError(f"precision must be one of {CONV_PRECISIONS}, got {precision!r}")


def conv1x1_band(kern: Any, x: np.ndarray, w: WeightTensor, bias: np.ndarray | None,
                 out: np.ndarray, lo: int, hi: int, precision: str) -> None:
    """out[lo:hi] := x[lo:hi] @ w^T + bias (a 1x1 convolution of rows [lo, hi))."""
    if hi > lo:
        linear_band(kern, x[lo:hi], w, bias, out[lo:hi], precision)


def linear_band(kern: Any, x: np.ndarray, w: WeightTensor, bias: np.ndarray | None,
                out: np.ndarray, precision: str) -> None:
    """out := x @ dequant(w)^T + bias (x float32 [T, K], out float32 [T, N]) in ``precision``."""
    if precision == "f32":
        kern.matmul(x, w.data, w.type_name, out, bias=bias)
    elif precision == "bf16":
        kern.matmul_bf16(x, w.data, w.type_name, out, bias=bias)
    else:
        raise ValueError(f"precision must be one of {CONV_PRECISIONS}, got {precision!r}")
