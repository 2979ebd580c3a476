"""The one seam between the block and the matmul kernels: a typed weight in, float32 out.

Owns :func:`matmul` (a band of output columns of ``x @ W^T``) and :func:`adaln_linear`
(``W @ t + b``), both taking a :class:`~nxhpc.formats.weights.WeightTensor` and passing its raw
bytes and GGML type to the kernels as stored (no decode, no requantize).
Must not: compute anything itself, or copy a weight matrix (the TEMP adaLN fallback below
decodes F16/BF16 adaLN weights, ``4D x adaln_in``, until the typed kernels land).

Kernel API (``nxhpc._kernels``, typed): ``matmul(x, w, wtype, out, n0, n1)``,
``adaln_linear(t_emb, w, wtype, bias, out, silu_input=...)``, ``weight_types()``. A kernels
module without ``weight_types`` is the Q8_0-only API; the fallback serves it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nxhpc.formats.weights import WeightTensor

__all__ = ["matmul", "adaln_linear", "typed_kernels", "check_runnable"]


def typed_kernels(kernels: Any) -> bool:
    """Whether ``kernels`` has the typed matmul API (``weight_types`` present)."""
    return hasattr(kernels, "weight_types")


def check_runnable(kernels: Any, weight: WeightTensor, *, adaln: bool = False) -> None:
    """NotImplementedError naming the tensor unless ``kernels`` can run ``weight`` as stored
    (called before the fork, so a missing type fails in the parent, before any work)."""
    if typed_kernels(kernels):
        have = kernels.weight_types()
        if weight.type_name not in have:
            raise NotImplementedError(f"weight {weight.name!r} is {weight.type_name}; the "
                                      f"kernels run {', '.join(have)}")
        return
    # TEMP until cseam merge: the Q8_0-only kernels (adaLN also takes float32 and, decoded
    # here, F16/BF16)
    ok = ("Q8_0", "F32", "F16", "BF16") if adaln else ("Q8_0",)
    if weight.type_name not in ok:
        raise NotImplementedError(
            f"weight {weight.name!r} is {weight.type_name}; these kernels run "
            f"{' and '.join(ok)} {'adaLN' if adaln else 'projection'} weights only (the typed "
            f"matmul for F32/F16/BF16 is not built into {kernels.__name__})")


def matmul(kernels: Any, x: np.ndarray, weight: WeightTensor, out: np.ndarray, lo: int,
           hi: int) -> None:
    """out[:, lo:hi] := x @ dequant(weight)[lo:hi]^T   (x float32 [T, K], out float32 [T, N])."""
    if typed_kernels(kernels):
        kernels.matmul(x, weight.data, weight.type_name, out, lo, hi)
        return
    # TEMP until cseam merge: the Q8_0-only kernels
    if weight.type_name == "Q8_0":
        kernels.q8_0_matmul(x, weight.data, out, n0=lo, n1=hi)
        return
    raise NotImplementedError(
        f"matmul: weight {weight.name!r} is {weight.type_name}; these kernels run Q8_0 only "
        f"(the typed matmul for F32/F16/BF16 is not built into {kernels.__name__})")


def adaln_linear(kernels: Any, t_emb: np.ndarray, weight: WeightTensor, bias: np.ndarray,
                 out: np.ndarray, *, silu_input: bool) -> None:
    """out := dequant(weight) @ (silu(t_emb) if silu_input else t_emb) + bias."""
    if typed_kernels(kernels):
        kernels.adaln_linear(t_emb, weight.data, weight.type_name, bias, out,
                             silu_input=silu_input)
        return
    # TEMP until cseam merge: the old kernel takes Q8_0 bytes or a float32 matrix
    if weight.type_name == "Q8_0":
        w = weight.data
    elif weight.type_name == "F32":
        w = weight.data.view(np.float32)
    elif weight.type_name in ("F16", "BF16"):
        w = weight.dequantize()        # small (4D x adaln_in); gone with the typed kernel
    else:
        raise NotImplementedError(f"adaln_linear: weight {weight.name!r} is "
                                  f"{weight.type_name}; these kernels run Q8_0 and F32 only")
    kernels.adaln_linear(t_emb, w, bias, out, silu_input=silu_input)
