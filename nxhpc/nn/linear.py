"""The one seam between a model's blocks and the matmul kernels: a typed weight in, float32 out.

Owns :func:`matmul` (a band of output columns of ``x @ W^T``) and :func:`adaln_linear`
(``W @ t + b``), both taking a :class:`~nxhpc.formats.weights.WeightTensor` and passing its raw
bytes and GGML type to the kernels as stored (no decode, no requantize), and the precision
switch :data:`PRECISIONS` (which kernel a block's projection runs; docs/kernels.md has each
precision's arithmetic contract):

* ``"f32"`` (default): ``matmul`` -- exact dequantized weights, float32 FMA (unchanged bits).
* ``"bf16"``: ``matmul_bf16`` -- x and the decoded weights rounded to bfloat16, float32
  accumulation; every weight type of the traits table.
* ``"q8"``: ``matmul_q8`` for the quantized weight types of :data:`Q8_WEIGHT_TYPES` (x
  quantized per row to Q8_0, int32 dots on the weights' stored codes, per-block float32
  scales/mins). An F32/F16/BF16 weight runs ``bf16`` instead: :func:`effective_precision` says
  which, per tensor.

adaLN (:func:`adaln_linear`, O(D) work) stays float32 in every precision. Attention follows the
switch too (:func:`attention_precision`): ``"f32"`` runs the float32 attention, ``"bf16"`` and
``"q8"`` the bf16 attention (Q K^T and P V on the bfloat16 dot, softmax statistics in float32:
csrc/nx_attn_bf16.h).
Must not: compute anything itself, or copy a weight matrix.

Kernel API (``nxhpc._kernels``): ``matmul(x, w, wtype, out, n0, n1)``, ``matmul_bf16(x, w, wtype,
out, n0, n1)``, ``matmul_q8(x, w, out, n0, n1, wtype=...)``, ``adaln_linear(t_emb, w, wtype, bias, out,
silu_input=...)``, ``weight_types()``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from nxhpc.formats.weights import WeightTensor

__all__ = ["matmul", "adaln_linear", "check_runnable", "check_precision", "effective_precision",
           "attention_precision", "PRECISIONS", "DEFAULT_PRECISION", "Q8_WEIGHT_TYPES"]

#: The matmul precisions of a block (see the module docstring).
PRECISIONS = ("f32", "bf16", "q8")
DEFAULT_PRECISION = "f32"
#: Weight types ``q8`` runs on their integer codes (the kernels' ``Q8_WEIGHT_TYPES``; a test
#: keeps the two equal). Any other type runs ``bf16`` under ``q8``.
Q8_WEIGHT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def check_precision(precision: Any, where: str = "precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError naming ``where``."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, PRECISIONS))}, got "
                         f"{precision!r}")
    return precision


def effective_precision(weight: WeightTensor, precision: str) -> str:
    """The precision ``weight``'s matmul runs under the switch ``precision``: ``"q8"`` only for
    the types of :data:`Q8_WEIGHT_TYPES` (F32/F16/BF16 run ``"bf16"``), else ``precision``."""
    if precision == "q8" and weight.type_name not in Q8_WEIGHT_TYPES:
        return "bf16"
    return precision


def attention_precision(precision: str) -> str:
    """The ``precision=`` of the attention kernel under the switch ``precision``: ``"f32"`` for
    ``"f32"`` (float32 bits unchanged), ``"bf16"`` for ``"bf16"`` and ``"q8"``."""
    return "f32" if check_precision(precision) == "f32" else "bf16"


def check_runnable(kernels: Any, weight: WeightTensor, *, adaln: bool = False) -> None:
    """NotImplementedError naming the tensor unless ``kernels`` can run ``weight`` as stored
    (called before the fork, so a missing type fails in the parent, before any work)."""
    have = kernels.weight_types()
    if weight.type_name not in have:
        raise NotImplementedError(f"weight {weight.name!r} is {weight.type_name}; the "
                                  f"kernels run {', '.join(have)}")


def matmul(kernels: Any, x: np.ndarray, weight: WeightTensor, out: np.ndarray, lo: int,
           hi: int, precision: str = DEFAULT_PRECISION) -> None:
    """out[:, lo:hi] := x @ dequant(weight)[lo:hi]^T   (x float32 [T, K], out float32 [T, N]),
    in ``precision`` ("f32" | "bf16" | "q8"; q8 on an F32/F16/BF16 weight runs bf16)."""
    if precision == "f32":
        kernels.matmul(x, weight.data, weight.type_name, out, lo, hi)
    elif precision == "q8" and weight.type_name in Q8_WEIGHT_TYPES:
        kernels.matmul_q8(x, weight.data, out, lo, hi, wtype=weight.type_name)
    elif precision in ("bf16", "q8"):
        kernels.matmul_bf16(x, weight.data, weight.type_name, out, lo, hi)
    else:
        check_precision(precision)


def adaln_linear(kernels: Any, t_emb: np.ndarray, weight: WeightTensor, bias: np.ndarray,
                 out: np.ndarray, *, silu_input: bool) -> None:
    """out := dequant(weight) @ (silu(t_emb) if silu_input else t_emb) + bias."""
    kernels.adaln_linear(t_emb, weight.data, weight.type_name, bias, out, silu_input=silu_input)
