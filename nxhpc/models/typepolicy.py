"""Per-tensor weight-type policies for synthetic models (``python -m nxhpc.models make --types``).

Owns :data:`POLICIES` (policy name -> ordered rules over canonical tensor names, first match
wins), :func:`tensor_type` (the GGML type a tensor gets, with llama.cpp's fallback when its rows
do not fill the type's blocks), :func:`encode` (float32 -> the stored bytes of that type) and
:func:`decode` (stored bytes -> the exact float values, by ``gguf.quants.dequantize``: what a
float64 reference must be computed on). Must not: import the compiled kernels (the references
must not depend on the code they grade).

Policies, modelled on the two published converters (``DENOISER.md``, "What published files
hold"):

- ``q8_0`` (today's default, byte-identical files): every 2-D tensor Q8_0, 1-D F32.
- ``q4_k_m`` (ComfyUI-GGUF's Q4_K_M): main-layer ``attention.qkv`` Q5_K, ``feed_forward.w2``
  Q6_K, the main layers' other 2-D weights Q4_K; refiners, embedders, final layer and every
  other 2-D tensor BF16; 1-D F32. (The published file keeps w2 at Q4_K in some uploads; this
  policy takes the "M" variant's Q6_K for it, as the issue describes.)
- ``sdcpp-q4_0`` (stable-diffusion.cpp's Q4_0): the 2-D weights of the main layers and both
  refiners Q4_0, except their ``adaLN_modulation`` matrices kept Q8_0 (DENOISER.md records only
  that the file "mixes Q4_0 and Q8_0"; which tensors stay Q8_0 is an assumption here, chosen as
  the small, sensitive modulation matrices); everything else F32.
- ``<type>`` for each of f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k,
  q6_k: every 2-D tensor that type, 1-D F32.

Fallback (llama.cpp's ``llama_tensor_get_type`` rule for rows that are no multiple of 256):
Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K / Q3_K -> Q4_0 (llama.cpp now uses IQ4_NL, which
nxhpc does not run); rows no multiple of 32 -> F32.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["POLICIES", "Rule", "decode", "encode", "get_policy", "tensor_type"]

SINGLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                "Q4_K", "Q5_K", "Q6_K")
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}


@dataclass(frozen=True)
class Rule:
    """Tensors whose canonical name fully matches ``pattern`` with ``ndim`` dims (None: any)
    get ``gtype``."""
    pattern: str
    ndim: int | None
    gtype: str

    def matches(self, name: str, shape: tuple[int, ...]) -> bool:
        return (self.ndim is None or len(shape) == self.ndim) and \
            re.fullmatch(self.pattern, name) is not None


_LAYER = r"layers\.\d+\."
_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\."

POLICIES: dict[str, tuple[Rule, ...]] = {
    "q4_k_m": (Rule(_LAYER + r"attention\.qkv\.weight", 2, "Q5_K"),
               Rule(_LAYER + r"feed_forward\.w2\.weight", 2, "Q6_K"),
               Rule(_LAYER + r".+", 2, "Q4_K"),
               Rule(r".+", 1, "F32"),
               Rule(r".+", None, "BF16")),
    "sdcpp-q4_0": (Rule(_BLOCKS + r"adaLN_modulation\.\d+\.weight", 2, "Q8_0"),
                   Rule(_BLOCKS + r".+", 2, "Q4_0"),
                   Rule(r".+", None, "F32")),
    **{t.lower(): (Rule(r".+", 2, t), Rule(r".+", None, "F32")) for t in SINGLE_TYPES},
}


def get_policy(policy: str) -> tuple[Rule, ...]:
    """The rules of ``policy`` (case-insensitive); ValueError listing the known ones."""
    key = str(policy).lower()
    if key not in POLICIES:
        raise ValueError(f"unknown --types policy {policy!r} (one of {', '.join(POLICIES)})")
    return POLICIES[key]


def tensor_type(policy: str, name: str, shape: tuple[int, ...]) -> str:
    """GGML type name tensor ``name`` (canonical, torch ``shape``) is stored in under
    ``policy``, after the fallback for rows that do not fill the type's blocks."""
    for r in get_policy(policy):
        if r.matches(name, tuple(shape)):
            t = r.gtype
            while GGML_QUANT_SIZES[GGMLQuantizationType[t]][0] > 1 and \
                    int(shape[-1]) % GGML_QUANT_SIZES[GGMLQuantizationType[t]][0]:
                t = FALLBACK.get(t, "F32")
            return t
    raise ValueError(f"policy {policy!r}: no rule matches tensor {name!r}")  # pragma: no cover


def encode(a: np.ndarray, gtype: str, name: str) -> np.ndarray:
    """float32 ``[R, C]`` -> stored uint8 ``[R, rowbytes]`` of ``gtype``: F32/F16 bytes,
    BF16 and Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 by ``gguf.quants.quantize`` (Q8_0 via nxhpc's wrapper of
    it, whose bytes are gguf's), the K-quants by nxhpc.formats.quants' encoders."""
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
    from nxhpc.formats.quants import quantize
    return np.ascontiguousarray(quantize(a, gtype)).reshape(a.shape[0], -1)


def decode(raw: np.ndarray, gtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The exact values of stored bytes, float32 ``shape`` (``gguf.quants.dequantize``)."""
    if gtype == "F32":
        return np.ascontiguousarray(raw).view(np.float32).reshape(shape)
    d = gguf.quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[gtype])
    return np.asarray(d, dtype=np.float32).reshape(shape)
