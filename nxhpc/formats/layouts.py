"""The one table of file layouts and weight-type rules: which GGML type each tensor is stored in.

Owns :class:`Rule` (a regex over canonical tensor names + a dimension count -> a GGML type),
:class:`FileLayout` (a converter's name prefix, ``general.architecture``, stored pad-token shape
and ordered rules, first match wins; what happens when a tensor's rows do not fill the type's
blocks), :data:`LAYOUTS` (every layout and ``--types`` policy by name, in one table),
:func:`get_layout`, and the float32 <-> stored-bytes codec of those types (:func:`encode`,
:func:`decode`: ``gguf.quants`` and nxhpc's pure-numpy K-quant encoders). Must not: import the
compiled kernels (references are computed on what :func:`decode` returns, so it must not depend
on the code they grade), infer configs, or read files.

The entries (``docs/denoiser.md``, "What published files hold"):

- ``comfyui-q8_0`` (ComfyUI-GGUF / city96's converter, e.g. jayn7/Z-Image-Turbo-GGUF): arch
  ``lumina2``, no prefix; the main layers' 2-D weights Q8_0; refiners, embedders, final layer
  and pad tokens (``[1, D]``) BF16; 1-D tensors F32.
- ``sdcpp-q8_0`` (stable-diffusion.cpp's converter, e.g. leejet/Z-Image-Turbo-GGUF): prefix
  ``model.diffusion_model.``, no ``general.architecture``; 2-D weights of the layers and both
  refiners Q8_0; everything else F32 (pad tokens written ``[D]``).
- ``q4_k_m`` (ComfyUI-GGUF's Q4_K_M): main-layer ``attention.qkv`` Q5_K, ``feed_forward.w2``
  Q6_K, the main layers' other 2-D weights Q4_K; every other 2-D tensor BF16; 1-D F32. (Some
  uploads keep w2 at Q4_K; this takes the "M" variant's Q6_K.)
- ``sdcpp-q4_0`` (stable-diffusion.cpp's Q4_0): the 2-D weights of the main layers and both
  refiners Q4_0, their ``adaLN_modulation`` matrices Q8_0 (which tensors that file keeps at
  Q8_0 is not recorded anywhere; the small, sensitive modulation matrices are an assumption);
  everything else F32.
- one per type (``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0`` .. ``q5_1``, ``q2_k`` ..
  ``q6_k``): every 2-D tensor that type, 1-D F32.

Rows that do not fill a type's blocks: a rule's own ``fallback`` when it names one; else, in a
layout with ``llama_fallback`` (the ``--types`` policies), llama.cpp's chain
(``llama_tensor_get_type``): Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0
(llama.cpp now uses IQ4_NL, which nxhpc does not run), rows no multiple of 32 -> F32; else a
ValueError naming the tensor (the converters' layouts: their Z-Image rows always fill).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from nxhpc.formats.gguf_io import PREFIX

__all__ = ["Rule", "FileLayout", "LAYOUTS", "POLICY_NAMES", "SINGLE_TYPES", "FALLBACK",
           "get_layout", "encode", "decode"]

SINGLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}


def _block(gtype: str) -> int:
    return GGML_QUANT_SIZES[GGMLQuantizationType[gtype]][0]


@dataclass(frozen=True)
class Rule:
    """Tensors whose canonical name fully matches ``pattern`` and whose stored torch shape has
    ``ndim`` dims (None: any) get GGML type ``gtype``; ``fallback`` (optional) is the type
    when the rows do not fill ``gtype``'s blocks."""
    pattern: str
    ndim: int | None
    gtype: str
    fallback: str | None = None

    def matches(self, name: str, shape: tuple[int, ...]) -> bool:
        return (self.ndim is None or len(shape) == self.ndim) and \
            re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class FileLayout:
    """How one converter (or one ``--types`` policy) stores a model: name prefix,
    ``general.architecture`` (None: not written), stored pad-token shape (``"1xD"`` or
    ``"D"``), the type rules (first match wins) and whether llama.cpp's fallback chain applies
    to rows that do not fill a type's blocks (see the module docstring)."""
    name: str
    prefix: str
    arch: str | None
    pad_shape: str
    rules: tuple[Rule, ...]
    llama_fallback: bool = False

    def stored_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Torch shape a tensor is stored with (pad tokens per :attr:`pad_shape`)."""
        if name in ("x_pad_token", "cap_pad_token"):
            n = int(np.prod(shape))
            return (1, n) if self.pad_shape == "1xD" else (n,)
        return tuple(shape)

    def type_for(self, name: str, shape: tuple[int, ...]) -> str:
        """GGML type name of canonical tensor ``name`` stored with torch ``shape``."""
        shape = tuple(int(d) for d in shape)
        for r in self.rules:
            if not r.matches(name, shape):
                continue
            t = r.gtype
            if shape[-1] % _block(t) == 0:
                return t
            if r.fallback is not None:
                return r.fallback
            if not self.llama_fallback:
                raise ValueError(f"layout {self.name}: tensor {name!r} {list(shape)} has rows "
                                 f"of {shape[-1]}, not a multiple of {t}'s block {_block(t)}")
            while _block(t) > 1 and shape[-1] % _block(t):
                t = FALLBACK.get(t, "F32")
            return t
        raise ValueError(f"layout {self.name}: no type rule matches tensor {name!r}")


_LAYER = r"layers\.\d+\."
_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\."


def _policy(name: str, *rules: Rule) -> FileLayout:
    return FileLayout(name=name, prefix="", arch=None, pad_shape="1xD", rules=rules,
                      llama_fallback=True)


LAYOUTS: dict[str, FileLayout] = {lay.name: lay for lay in (
    FileLayout(name="comfyui-q8_0", prefix="", arch="lumina2", pad_shape="1xD",
               rules=(Rule(_LAYER + r".+", 2, "Q8_0"),
                      Rule(r".+", 1, "F32"),
                      Rule(r".+", None, "BF16"))),
    FileLayout(name="sdcpp-q8_0", prefix=PREFIX, arch=None, pad_shape="D",
               rules=(Rule(_BLOCKS + r".+", 2, "Q8_0"),
                      Rule(r".+", None, "F32"))),
    _policy("q4_k_m", Rule(_LAYER + r"attention\.qkv\.weight", 2, "Q5_K"),
            Rule(_LAYER + r"feed_forward\.w2\.weight", 2, "Q6_K"),
            Rule(_LAYER + r".+", 2, "Q4_K"),
            Rule(r".+", 1, "F32"),
            Rule(r".+", None, "BF16")),
    _policy("sdcpp-q4_0", Rule(_BLOCKS + r"adaLN_modulation\.\d+\.weight", 2, "Q8_0"),
            Rule(_BLOCKS + r".+", 2, "Q4_0"),
            Rule(r".+", None, "F32")),
    *(_policy(t.lower(), Rule(r".+", 2, t), Rule(r".+", None, "F32")) for t in SINGLE_TYPES),
)}
#: The names ``python -m nxhpc.models make --types`` takes (every entry with llama's fallback).
POLICY_NAMES = tuple(n for n, lay in LAYOUTS.items() if lay.llama_fallback)


def get_layout(layout: str | FileLayout, *, policy: bool = False) -> FileLayout:
    """The entry ``layout`` of :data:`LAYOUTS` (case-insensitive; a :class:`FileLayout` passes
    through). ``policy``: only the ``--types`` policies. ValueError listing the known names."""
    if isinstance(layout, FileLayout):
        return layout
    key = str(layout).lower()
    names = POLICY_NAMES if policy else tuple(LAYOUTS)
    if key not in names:
        what = "--types policy" if policy else "file layout"
        raise ValueError(f"unknown {what} {layout!r} (one of {', '.join(names)})")
    return LAYOUTS[key]


def encode(a: np.ndarray, gtype: str, name: str) -> np.ndarray:
    """float32 ``[R, C]`` -> stored uint8 ``[R, rowbytes]`` of ``gtype``: F32/F16 bytes, BF16
    and Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 by ``gguf.quants.quantize`` (Q8_0 through nxhpc's checked
    wrapper of it, whose bytes are gguf's), the K-quants Q2_K..Q6_K by
    ``nxhpc.formats.quants``, any other type the ``gguf`` package can quantize (TQ2_0, ...) by
    it; ValueError naming the tensor for a type none can."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if gtype == "F32":
        return a.view(np.uint8)
    if gtype == "F16":
        return a.astype(np.float16).view(np.uint8)
    if gtype == "Q8_0":
        from nxhpc.formats.gguf_io import quantize_q8_0
        return quantize_q8_0(a, name)
    if gtype == "BF16":
        return np.ascontiguousarray(gguf.quants.quantize(a, GGMLQuantizationType.BF16)
                                    ).view(np.uint8).reshape(a.shape[0], -1)
    from nxhpc.formats.quants import QUANTIZABLE, quantize
    if gtype in QUANTIZABLE:
        return np.ascontiguousarray(quantize(a, gtype)).reshape(a.shape[0], -1)
    try:
        q = gguf.quants.quantize(a, GGMLQuantizationType[gtype])
    except (NotImplementedError, KeyError):
        raise ValueError(f"encode: neither nxhpc nor the gguf package can quantize to {gtype} "
                         f"(tensor {name!r})") from None
    return np.ascontiguousarray(q).view(np.uint8).reshape(a.shape[0], -1)


def decode(raw: np.ndarray, gtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The exact values of stored bytes, float32 ``shape`` (``gguf.quants.dequantize``)."""
    if gtype == "F32":
        return np.ascontiguousarray(raw).view(np.float32).reshape(shape)
    d = gguf.quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[gtype])
    return np.asarray(d, dtype=np.float32).reshape(shape)
