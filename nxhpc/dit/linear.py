"""The one seam between the block and the matmul kernels: a typed weight in, float32 out.

Owns :func:`matmul` (a band of output columns of ``x @ W^T``) and :func:`adaln_linear`
(``W @ t + b``), both taking a :class:`~nxhpc.formats.weights.WeightTensor` and passing its raw
bytes and GGML type to the kernels as stored (no decode, no requantize).
Must not: compute anything itself, or copy a weight matrix.

Kernel API (``nxhpc._kernels``): ``matmul(x, w, wtype, out, n0, n1)``,
``adaln_linear(t_emb, w, wtype, bias, out, silu_input=...)``, ``weight_types()``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nxhpc.formats.weights import WeightTensor

__all__ = ["matmul", "adaln_linear", "check_runnable"]


def check_runnable(kernels: Any, weight: WeightTensor, *, adaln: bool = False) -> None:
    """NotImplementedError naming the tensor unless ``kernels`` can run ``weight`` as stored
    (called before the fork, so a missing type fails in the parent, before any work)."""
    have = kernels.weight_types()
    if weight.type_name not in have:
        raise NotImplementedError(f"weight {weight.name!r} is {weight.type_name}; the "
                                  f"kernels run {', '.join(have)}")


def matmul(kernels: Any, x: np.ndarray, weight: WeightTensor, out: np.ndarray, lo: int,
           hi: int) -> None:
    """out[:, lo:hi] := x @ dequant(weight)[lo:hi]^T   (x float32 [T, K], out float32 [T, N])."""
    kernels.matmul(x, weight.data, weight.type_name, out, lo, hi)


def adaln_linear(kernels: Any, t_emb: np.ndarray, weight: WeightTensor, bias: np.ndarray,
                 out: np.ndarray, *, silu_input: bool) -> None:
    """out := dequant(weight) @ (silu(t_emb) if silu_input else t_emb) + bias."""
    kernels.adaln_linear(t_emb, weight.data, weight.type_name, bias, out, silu_input=silu_input)
