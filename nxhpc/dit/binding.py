"""Binding one block's weights: :class:`LayerWeights` from a GGUF map or from fixtures.

Owns: the :class:`LayerWeights` record, binding a block of any stack (``layers``,
``noise_refiner``, ``context_refiner``) from a :class:`~nxhpc.formats.gguf_io.GGUFFile` --
matrices as :class:`~nxhpc.formats.weights.WeightTensor` in their stored GGML type, zero-copy
read-only views of the map, never decoded or requantized; 1-D tensors decoded to float32 -- and
from a fixture store (float32 weights holding Q8_0 values, re-quantized to the identical Q8_0
bytes), and the untrusted-file checks on the way (NaN/Inf anywhere, checked on the stored bits
in bounded chunks so no float32 copy of a matrix is ever made).
Must not: run kernels, infer the config (``nxhpc.dit.config`` does), or keep a decoded matrix.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from nxhpc.dit.config import _ROLE, BlockConfig, block_label, tensor_names
from nxhpc.formats.gguf_io import ModelFileError, dequantize_q8_0, quantize_q8_0
from nxhpc.formats.weights import WeightTensor, as_weight_tensor, check_finite_weight

__all__ = ["LayerWeights", "bind_gguf_layer", "bind_fixture_layer", "check_finite_weight"]



@dataclass
class LayerWeights:
    """One block's weights, bound once.

    Matrices (``qkv``, ``out``, ``w1``, ``w3``, ``w2``, ``adaln_w``) are
    :class:`~nxhpc.formats.weights.WeightTensor` (a bare uint8 Q8_0 / float32 array is accepted
    and read as such); norms and ``adaln_b`` are float32 1-D. An unmodulated block
    (``context_refiner``) has ``adaln_w = adaln_b = None``.
    """
    qkv: Any
    out: Any
    w1: Any
    w3: Any
    w2: Any
    attention_norm1: np.ndarray
    attention_norm2: np.ndarray
    ffn_norm1: np.ndarray
    ffn_norm2: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    adaln_w: Any = None      # WeightTensor [4D, adaln_in], or None (unmodulated)
    adaln_b: np.ndarray | None = None
    source: str = "arrays"   # "gguf" | "fixtures" | "arrays"
    layer: int = -1
    prefix: str = "layers"

    @property
    def modulated(self) -> bool:
        """Whether the block has adaLN tensors."""
        return self.adaln_w is not None

    @property
    def label(self) -> str:
        return block_label(self.prefix, self.layer)

    def typed(self) -> "LayerWeights":
        """A copy whose matrices are all :class:`WeightTensor` (bare arrays wrapped, no copy)."""
        vals = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if _ROLE.get(f.name) == "matrix" and v is not None:
                v = as_weight_tensor(v, f.name)
            vals[f.name] = v
        return replace(self, **vals)

    #: The projections a block's matmul precision applies to (adaLN stays float32); under
    #: ``q8`` their float ones may carry Q8_0 copies (``nxhpc.nn.linear.Q8Blocks``).
    PROJECTIONS = ("qkv", "out", "w1", "w3", "w2")

    def matrices(self) -> dict[str, WeightTensor]:
        """Short name -> the bound matrices as :class:`WeightTensor` (adaLN only if present)."""
        t = self.typed()
        return {k: getattr(t, k) for k, r in _ROLE.items()
                if r == "matrix" and getattr(t, k) is not None}


def _finite_vector(a: np.ndarray, path: Any, name: str) -> np.ndarray:
    if not np.isfinite(a).all():
        raise ModelFileError(f"{path}: tensor {name!r} has NaN/Inf values")
    return a


def bind_gguf_layer(g: Any, cfg: BlockConfig, index: int, prefix: str = "layers", *,
                    check_values: bool = True) -> LayerWeights:
    """Block ``prefix.index`` from an open GGUFFile: matrices as stored (zero copy), vectors
    float32. ``check_values`` scans every value once for NaN/Inf (ModelFileError naming it)."""
    names = tensor_names(prefix, index, cfg.variant)
    vals: dict[str, Any] = {}
    for key, name in names.items():
        if _ROLE[key] == "matrix":
            w = WeightTensor.from_gguf(g, name)
            if check_values:
                check_finite_weight(w, f"{g.path}: tensor {name!r}")
            vals[key] = w
        else:
            vals[key] = _finite_vector(np.array(g.load_f32(name), np.float32), g.path, name)
    lw = LayerWeights(**vals, source="gguf", layer=int(index), prefix=prefix)
    _check(cfg, lw, f"{g.path}: {block_label(prefix, index)}")
    return lw


def bind_fixture_layer(fx: Any, cfg: BlockConfig, index: int,
                       prefix: str = "layers") -> LayerWeights:
    """Block ``prefix.index`` from a fixture store's float32 weights: projections quantized to
    Q8_0 when that is exact (the stored values are Q8_0 values, so this gives back the GGUF's
    exact bytes; otherwise, for a model of other types, the float32 values as F32), the
    adaLN matrix kept F32 (``adaln_linear`` gives the same bits for a Q8_0 weight and its
    float32 dequantization)."""
    names = tensor_names(prefix, index, cfg.variant)
    exp = cfg.shapes(modulated="adaln_w" in names)
    vals: dict[str, Any] = {}
    for key, name in names.items():
        a = fx.load(name, exp[key])
        if key == "adaln_w":
            a = WeightTensor.from_array(name, a)
        elif _ROLE[key] == "matrix":
            q = quantize_q8_0(a, name)
            # a model of another type (Q4_K, BF16 ...): its values are not all Q8_0 values, so
            # they stay F32 (the matmul gives the same bits as over the stored type's bytes)
            a = WeightTensor.from_raw(name, "Q8_0", exp[key][1], q) \
                if np.array_equal(dequantize_q8_0(q), a) else WeightTensor.from_array(name, a)
        vals[key] = a
    lw = LayerWeights(**vals, source="fixtures", layer=int(index), prefix=prefix)
    _check(cfg, lw, f"{fx.path}: {block_label(prefix, index)}")
    return lw


def _check(cfg: BlockConfig, lw: LayerWeights, where: str) -> None:
    try:
        cfg.check_layer(lw, where)
    except ValueError as e:
        raise ModelFileError(str(e)) from None
