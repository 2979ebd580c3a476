"""GGML block layouts as numpy structured dtypes: the Python side of the packed layouts the C kernels read.

Owns: per-type block geometry (elements per block, bytes per block) and the structured dtypes.
Must not: import the compiled kernels (pure-Python tools use this); the kernels' own
``_Static_assert``s pin the same sizes in C and a test compares the two.
"""
from __future__ import annotations

import numpy as np

__all__ = ["QK8_0", "Q8_0_BLOCK_BYTES", "Q8_0_BLOCK_DTYPE"]

#: Values per Q8_0 block and bytes per block (float16 scale + 32 int8).
QK8_0 = 32
Q8_0_BLOCK_BYTES = 34
#: One GGUF/ggml Q8_0 block: float16 scale ``d`` then 32 int8 ``qs``; value = d*q (34 bytes, packed).
Q8_0_BLOCK_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
assert Q8_0_BLOCK_DTYPE.itemsize == Q8_0_BLOCK_BYTES
