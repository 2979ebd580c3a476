"""GGML block layouts as numpy structured dtypes: the Python side of the packed layouts the C kernels read.

Owns: per-type block geometry (elements per block, bytes per block), the GGML type ids and the
structured dtypes of Q8_0 and of the nine types Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
Q6_K (field order and sizes as ggml's ggml-common.h; float16 fields little-endian).
Must not: import the compiled kernels (pure-Python tools use this); the kernels' own
``_Static_assert``s pin the same sizes in C and a test compares the two.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = [
    "BLOCK_DTYPES",
    "Q8_0_BLOCK_BYTES",
    "Q8_0_BLOCK_DTYPE",
    "QK8_0",
    "QK_K",
    "QUANT_BLOCKS",
    "QuantBlock",
    "block_of",
]

#: Values per Q8_0 block and bytes per block (float16 scale + 32 int8).
QK8_0 = 32
Q8_0_BLOCK_BYTES = 34
#: One GGUF/ggml Q8_0 block: float16 scale ``d`` then 32 int8 ``qs``; value = d*q (34 bytes, packed).
Q8_0_BLOCK_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
assert Q8_0_BLOCK_DTYPE.itemsize == Q8_0_BLOCK_BYTES

#: Elements per K-quant super-block.
QK_K = 256


class QuantBlock(NamedTuple):
    """Geometry of one GGML block type: ``elems`` values are stored in ``nbytes`` bytes."""
    name: str
    ggml_type: int
    elems: int
    nbytes: int
    dtype: np.dtype


def _block(name: str, ggml_type: int, elems: int, nbytes: int, fields: list) -> QuantBlock:
    dt = np.dtype(fields)           # packed (align=False), like the C structs of uint8/uint16
    if dt.itemsize != nbytes:
        raise AssertionError(f"{name}: structured dtype is {dt.itemsize} bytes, expected {nbytes}")
    return QuantBlock(name, ggml_type, elems, nbytes, dt)


# Field meanings (value formulas in nxhpc/csrc/nx_quants.h):
#   d, dmin, m: float16 scales; qs/ql: low bits of the codes; qh/hmask: high bits; scales: per
#   sub-block scales (Q2_K: 4-bit scale | 4-bit min << 4; Q3_K/Q4_K/Q5_K: 6-bit packed; Q6_K int8).
#   Q5_0/Q5_1 qh is one little-endian uint32 stored as 4 bytes (bit j is code j's bit 4).
QUANT_BLOCKS: dict[str, QuantBlock] = {b.name: b for b in (
    _block("Q4_0", 2, 32, 18, [("d", "<f2"), ("qs", "u1", 16)]),
    _block("Q4_1", 3, 32, 20, [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
    _block("Q5_0", 6, 32, 22, [("d", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    _block("Q5_1", 7, 32, 24, [("d", "<f2"), ("m", "<f2"), ("qh", "u1", 4), ("qs", "u1", 16)]),
    _block("Q8_0", 8, 32, 34, [("d", "<f2"), ("qs", "i1", 32)]),
    _block("Q2_K", 10, QK_K, 84, [("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"),
                                   ("dmin", "<f2")]),
    _block("Q3_K", 11, QK_K, 110, [("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12),
                                    ("d", "<f2")]),
    _block("Q4_K", 12, QK_K, 144, [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12),
                                    ("qs", "u1", 128)]),
    _block("Q5_K", 13, QK_K, 176, [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12),
                                    ("qh", "u1", 32), ("qs", "u1", 128)]),
    _block("Q6_K", 14, QK_K, 210, [("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16),
                                    ("d", "<f2")]),
)}
assert QUANT_BLOCKS["Q8_0"].dtype == Q8_0_BLOCK_DTYPE

#: name -> structured dtype of one block.
BLOCK_DTYPES: dict[str, np.dtype] = {n: b.dtype for n, b in QUANT_BLOCKS.items()}


def block_of(wtype) -> QuantBlock:
    """The block geometry of `wtype`: a name ("Q4_K", case-insensitive) or a GGML type id / enum.

    Raises ValueError for anything that is not one of the block types above.
    """
    if isinstance(wtype, str):
        b = QUANT_BLOCKS.get(wtype.upper())
    elif isinstance(wtype, (int, np.integer)) and not isinstance(wtype, bool):
        b = next((b for b in QUANT_BLOCKS.values() if b.ggml_type == int(wtype)), None)
    else:
        b = None
    if b is None:
        raise ValueError(f"unknown block type {wtype!r}: expected one of {sorted(QUANT_BLOCKS)} "
                         f"(or their GGML type ids)")
    return b
