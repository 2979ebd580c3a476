"""Z-Image GGUF files as the community converters write them, and their exact read-back.

Owns writing a model's float weights into a file of one of the layouts of
``nxhpc.formats.layouts`` (the one type-rule table) with the ``gguf`` package (``GGUFWriter``;
quantization by ``gguf.quants.quantize``, bit-exact with ggml), and reading a file back with
``gguf.GGUFReader`` + ``gguf.quants.dequantize`` into the exact float64 weights a loader must
reproduce. It is test/fixture tooling and an independent decoder: its reader must not use
nxhpc's own GGUF reader or kernels, and it never infers the config (``nxhpc.dit.config`` does).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from nxhpc.dit.config import strip_prefix
from nxhpc.formats.gguf_io import LazyTensor, write_gguf
from nxhpc.formats.layouts import FileLayout, get_layout

__all__ = ["ZImageFile", "read_zimage_gguf", "write_zimage_gguf", "package_tensor_f64",
           "package_metadata"]


def write_zimage_gguf(path: str | os.PathLike, weights: Mapping[str, np.ndarray],
                      layout: str | FileLayout, *,
                      metadata: Mapping[str, Any] | None = None) -> Path:
    """Write float ``weights`` (canonical names; pad tokens ``[1, D]`` or ``[D]``) as ``layout``
    does, through the one writer (``nxhpc.formats.gguf_io.write_gguf``): values cast to
    float32 and encoded by the layout's type rules (``nxhpc.formats.layouts``). ``metadata``:
    extra key/values, typed as ``write_gguf`` takes them (str, bool, int, float, lists).
    Refuses non-finite weights. Returns the path."""
    lay = get_layout(layout)
    tensors: dict[str, LazyTensor] = {}
    for name in weights:
        canon = strip_prefix(name)
        a = np.asarray(weights[name])
        if a.dtype.kind != "f" or a.size == 0:
            raise ValueError(f"write_zimage_gguf: tensor {canon!r}: expected a non-empty float "
                             f"array, got {a.dtype} {a.shape}")
        shape = lay.stored_shape(canon, a.shape)
        a = np.ascontiguousarray(a.reshape(shape), dtype=np.float32)
        if not np.isfinite(a).all():
            raise ValueError(f"write_zimage_gguf: tensor {canon!r} contains NaN or Inf")
        tensors[canon] = LazyTensor(shape, lay.type_for(canon, shape), lambda a=a: a)
    return write_gguf(path, tensors, prefix=lay.prefix, arch=lay.arch,
                      metadata=dict(metadata or {}))


@dataclass
class ZImageFile:
    """A Z-Image GGUF read back by the ``gguf`` package.

    ``weights``: canonical name -> exact dequantized values, float64, in the stored torch shape
    (pad tokens as stored); ``tensors``: canonical name -> (torch shape, GGML type name), the
    table ``nxhpc.dit.config.infer_config`` takes; ``stored_names``: names as in the file;
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


def package_tensor_f64(t) -> tuple[tuple[int, ...], np.ndarray]:
    """(torch shape, exact float64 values) of a ``gguf.GGUFReader`` tensor, decoded by
    ``gguf.quants.dequantize`` (the independent side: never nxhpc's reader)."""
    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    deq = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    return shape, np.asarray(deq, dtype=np.float64).reshape(shape)


def package_metadata(r: gguf.GGUFReader) -> dict[str, object]:
    """Every key-value of a ``gguf.GGUFReader`` file but the ``GGUF.*`` header fields, decoded;
    a field of a type the package cannot decode is left out (not needed here)."""
    meta: dict[str, object] = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        try:
            meta[k] = f.contents()
        except Exception:
            continue
    return meta


def read_zimage_gguf(path: str | os.PathLike) -> ZImageFile:
    """Read every tensor of ``path`` with ``gguf.GGUFReader`` and decode it with
    ``gguf.quants.dequantize`` (F32/F16/BF16/Q* alike) to float64."""
    r = gguf.GGUFReader(os.fspath(path), "r")
    weights: dict[str, np.ndarray] = {}
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    stored = []
    for t in r.tensors:
        canon = strip_prefix(t.name)
        shape, weights[canon] = package_tensor_f64(t)
        tensors[canon] = (shape, t.tensor_type.name)
        stored.append(t.name)
    return ZImageFile(Path(path), weights, tensors, stored, package_metadata(r))
