"""Z-Image GGUF files as the community converters write them, and their exact read-back.

Owns writing a model's float weights into a file of one of the layouts of
``nxhpc.formats.layouts`` (the one type-rule table) with the ``gguf`` package (``GGUFWriter``;
quantization by ``gguf.quants.quantize``, bit-exact with ggml), and reading a file back with
``gguf.GGUFReader`` + ``gguf.quants.dequantize`` into the exact float64 weights a loader must
reproduce. It is test/fixture tooling and an independent decoder: it must not use nxhpc's own
GGUF reader or kernels, and it never infers the config (``nxhpc.dit.config`` does).
Types the ``gguf`` package cannot quantize (the K-quants) take a quantizer through
``quantizers=``.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType

from nxhpc.dit.config import strip_prefix
from nxhpc.formats.layouts import FileLayout, get_layout

__all__ = ["ZImageFile", "read_zimage_gguf", "write_zimage_gguf"]

Quantizer = Callable[[np.ndarray, GGMLQuantizationType], np.ndarray]


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
