"""Z-Image GGUF files as the community converters write them, and their exact read-back.

Owns the per-tensor type policies of published Z-Image GGUF layouts (a small table of rules,
first match wins), writing a model's float weights into such a file with the ``gguf``
package (``GGUFWriter``; quantization by ``gguf.quants.quantize``, bit-exact with ggml), and
reading a file back with ``gguf.GGUFReader`` + ``gguf.quants.dequantize`` into the exact
float64 weights a loader must reproduce. It is test/fixture tooling and an independent
decoder: it must not use nxhpc's own GGUF reader or kernels, and it never infers the config
(``nxhpc.dit.config`` does).

Layouts (``DENOISER.md``, "What published files hold"):

- ``comfyui-q8_0`` (ComfyUI-GGUF / city96 converter, e.g. jayn7/Z-Image-Turbo-GGUF): arch
  ``lumina2``, no prefix; the main layers' 2-D weights Q8_0; refiners, embedders, final layer
  and pad tokens (``[1, D]``) BF16; 1-D tensors F32.
- ``sdcpp-q8_0`` (stable-diffusion.cpp converter, e.g. leejet/Z-Image-Turbo-GGUF): prefix
  ``model.diffusion_model.``, no ``general.architecture``; 2-D weights of the layers and both
  refiners Q8_0; everything else F32 (pad tokens written ``[D]``, so both pad shapes a loader
  must accept are exercised).

A new policy (Q4_K_M, Q4_0 mixing Q8_0, ...) is one more :class:`FileLayout` in
:data:`LAYOUTS`; types the ``gguf`` package cannot quantize (the K-quants) take a quantizer
through ``quantizers=``.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from nxhpc.dit.config import PREFIX, strip_prefix

__all__ = [
    "COMFYUI_Q8_0",
    "LAYOUTS",
    "SDCPP_Q8_0",
    "FileLayout",
    "TypeRule",
    "ZImageFile",
    "get_layout",
    "read_zimage_gguf",
    "write_zimage_gguf",
]

Quantizer = Callable[[np.ndarray, GGMLQuantizationType], np.ndarray]


@dataclass(frozen=True)
class TypeRule:
    """Tensors whose canonical name fully matches ``pattern`` (a regex) and whose stored torch
    shape has ``ndim`` dims (None: any) get GGML type ``gtype``; when the row length is not a
    multiple of that type's block size they get ``fallback`` (None: error)."""
    pattern: str
    ndim: int | None
    gtype: str
    fallback: str | None = None

    def matches(self, name: str, shape: tuple[int, ...]) -> bool:
        return (self.ndim is None or len(shape) == self.ndim) and \
            re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class FileLayout:
    """How one converter writes a Z-Image file: name prefix, ``general.architecture`` (None:
    not written), stored pad-token shape (``"1xD"`` or ``"D"``) and the type rules (first
    match wins). The optional ``norm_final.weight`` is written when the weights hold it."""
    name: str
    prefix: str
    arch: str | None
    pad_shape: str
    rules: tuple[TypeRule, ...]

    def stored_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Torch shape a tensor is stored with (pad tokens per :attr:`pad_shape`)."""
        if name in ("x_pad_token", "cap_pad_token"):
            n = int(np.prod(shape))
            return (1, n) if self.pad_shape == "1xD" else (n,)
        return tuple(shape)

    def type_for(self, name: str, shape: tuple[int, ...]) -> str:
        """GGML type name of canonical tensor ``name`` stored with torch ``shape``."""
        for r in self.rules:
            if r.matches(name, shape):
                block = GGML_QUANT_SIZES[GGMLQuantizationType[r.gtype]][0]
                if shape[-1] % block == 0:
                    return r.gtype
                if r.fallback is None:
                    raise ValueError(f"layout {self.name}: tensor {name!r} {list(shape)} has "
                                     f"rows of {shape[-1]}, not a multiple of {r.gtype}'s "
                                     f"block {block}")
                return r.fallback
        raise ValueError(f"layout {self.name}: no type rule matches tensor {name!r}")


_BLOCKS = r"(layers|noise_refiner|context_refiner)\.\d+\..+"

COMFYUI_Q8_0 = FileLayout(
    name="comfyui-q8_0", prefix="", arch="lumina2", pad_shape="1xD",
    rules=(TypeRule(r"layers\.\d+\..+", 2, "Q8_0"),
           TypeRule(r".+", 1, "F32"),
           TypeRule(r".+", None, "BF16")))

SDCPP_Q8_0 = FileLayout(
    name="sdcpp-q8_0", prefix=PREFIX, arch=None, pad_shape="D",
    rules=(TypeRule(_BLOCKS, 2, "Q8_0"),
           TypeRule(r".+", None, "F32")))

LAYOUTS: dict[str, FileLayout] = {lay.name: lay for lay in (COMFYUI_Q8_0, SDCPP_Q8_0)}


def get_layout(layout: str | FileLayout) -> FileLayout:
    if isinstance(layout, FileLayout):
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown Z-Image file layout {layout!r} (one of {sorted(LAYOUTS)})")
    return LAYOUTS[layout]


def _encode(a: np.ndarray, gtype: str, name: str,
            quantizers: Mapping[str, Quantizer]) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """float32 array -> (data for ``GGUFWriter.add_tensor``, raw_dtype or None)."""
    q = GGMLQuantizationType[gtype]
    if gtype == "F32":
        return a, None
    if gtype == "F16":
        return a.astype(np.float16), None
    fn = quantizers.get(gtype, gguf.quants.quantize)
    try:
        data = fn(a, q)
    except NotImplementedError:
        raise ValueError(f"write_zimage_gguf: the gguf package cannot quantize to {gtype} "
                         f"(tensor {name!r}); pass quantizers={{{gtype!r}: fn}}") from None
    return np.ascontiguousarray(data), q


def write_zimage_gguf(path: str | os.PathLike, weights: Mapping[str, np.ndarray],
                      layout: str | FileLayout, *, metadata: Mapping[str, str] | None = None,
                      quantizers: Mapping[str, Quantizer] | None = None) -> Path:
    """Write float ``weights`` (canonical names; pad tokens ``[1, D]`` or ``[D]``) as ``layout``
    does. Values are cast to float32 and encoded by the layout's type rules. ``metadata``:
    extra string key/values. Refuses non-finite weights. Returns the path."""
    lay = get_layout(layout)
    quantizers = dict(quantizers or {})
    w = gguf.GGUFWriter(os.fspath(path), lay.arch or "unused")
    if lay.arch is None:                    # this converter writes no architecture key
        w.kv_data[0].pop("general.architecture", None)
    for k, v in (metadata or {}).items():
        w.add_string(k, str(v))
    for name in weights:
        canon = strip_prefix(name)
        a = np.asarray(weights[name])
        if a.dtype.kind != "f" or a.size == 0:
            raise ValueError(f"write_zimage_gguf: tensor {canon!r}: expected a non-empty float "
                             f"array, got {a.dtype} {a.shape}")
        a = np.ascontiguousarray(a.reshape(lay.stored_shape(canon, a.shape)), dtype=np.float32)
        if not np.isfinite(a).all():
            raise ValueError(f"write_zimage_gguf: tensor {canon!r} contains NaN or Inf")
        data, raw = _encode(a, lay.type_for(canon, a.shape), canon, quantizers)
        w.add_tensor(lay.prefix + canon, data, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return Path(path)


@dataclass
class ZImageFile:
    """A Z-Image GGUF read back by the ``gguf`` package.

    ``weights``: canonical name -> exact dequantized values, float64, in the stored torch shape
    (pad tokens as stored); ``tensors``: canonical name -> (torch shape, GGML type name), the
    table ``infer_denoiser_config`` takes; ``stored_names``: names as in the file;
    ``metadata``: the scalar/string key-values."""
    path: Path
    weights: dict[str, np.ndarray]
    tensors: dict[str, tuple[tuple[int, ...], str]]
    stored_names: list[str]
    metadata: dict[str, object]

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, t in self.tensors.values():
            out[t] = out.get(t, 0) + 1
        return out


def read_zimage_gguf(path: str | os.PathLike) -> ZImageFile:
    """Read every tensor of ``path`` with ``gguf.GGUFReader`` and decode it with
    ``gguf.quants.dequantize`` (F32/F16/BF16/Q* alike) to float64."""
    r = gguf.GGUFReader(os.fspath(path), "r")
    weights: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    stored = []
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        canon = strip_prefix(t.name)
        weights[canon] = np.asarray(deq, dtype=np.float64).reshape(shape)
        tensors[canon] = (shape, t.tensor_type.name)
        stored.append(t.name)
    meta: dict[str, object] = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            meta[k] = f.contents()
        except Exception:  # arrays of odd types: not needed here
            continue
    return ZImageFile(Path(path), weights, tensors, stored, meta)
