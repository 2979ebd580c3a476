# _k_quants.pxi -- included by _kernels.pyx (after _k_matmul.pxi). The older wrapper of the nine
# GGML block types Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (nxhpc/csrc/nx_quants*.c):
# dequantize_blocks and quant_block_sizes, now views of the weight-type traits table and its
# dispatch (nx_wtype.c: one authority; dequantize() in _k_matmul.pxi takes every type).
# Owns: argument validation for dequantize_blocks (dtype, shape, contiguity, block-size rule,
# writeability and overlap of out, the type name restricted to the nine). Must not: write or copy
# the input bytes (they may be a read-only memory map), keep a type table of its own, or enter C
# unvalidated.

# The nine types this wrapper names (all rows of the traits table; checked at import).
_QUANT_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_QUANT_IDS = {n: _WTYPES[n][0] for n in _QUANT_NAMES}


def quant_block_sizes():
    """{name: (ggml_type, block_elems, block_bytes)} of the nine block types, from the C traits
    table (block_bytes is sizeof the C struct)."""
    return {n: _WTYPES[n] for n in _QUANT_NAMES}


cdef str _quant_name(str fn, object wtype):
    """A type name ("Q4_K", case-insensitive) or GGML type id (int / gguf enum) of the nine."""
    name = None
    if isinstance(wtype, str):
        name = wtype.upper() if wtype.upper() in _QUANT_IDS else None
    elif isinstance(wtype, (int, np.integer)) and not isinstance(wtype, (bool, np.bool_)):
        name = _WTYPE_NAME_OF_ID.get(int(wtype))
        if name not in _QUANT_IDS:
            name = None
    if name is None:
        raise ValueError(f"{fn}: wtype must be one of {sorted(_QUANT_IDS)} (a name or its GGML "
                         f"type id), got {wtype!r}"
                         + (" (Q8_0 has q8_0_dequantize; dequantize() takes every type)"
                            if str(wtype).upper() in ("Q8_0", "8")
                            or getattr(wtype, "name", None) == "Q8_0" else ""))
    return name


def dequantize_blocks(raw, wtype, out=None, *, isa=None):
    """out := decode(raw): uint8 blocks [..., nblocks*block_bytes] -> float32 [..., nblocks*elems].

    ``dequantize(raw, wtype, out, isa=isa)`` restricted to the nine block types "Q4_0", "Q4_1",
    "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K" (or their GGML type id /
    gguf.GGMLQuantizationType). Byte-identical to ``gguf.quants.dequantize(raw, wtype)`` at every
    isa (per-element float32 ops and their order: nxhpc/csrc/nx_quants.h). `raw` must be
    C-contiguous uint8 whose last dimension is a multiple of the type's block bytes; it may be
    read-only (never written). out: None or a writeable float32 C-contiguous array of the result
    shape that does not overlap raw.
    """
    fn = "dequantize_blocks"
    tname = _quant_name(fn, wtype)
    tid, E, B = _WTYPES[tname]
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{fn}: raw must be a numpy.ndarray of uint8 {tname} blocks, "
                        f"got {type(raw).__name__}")
    if raw.dtype != np.uint8:
        raise TypeError(f"{fn}: raw must be uint8 (raw {tname} block bytes), got dtype={raw.dtype}")
    if raw.ndim < 1:
        raise ValueError(f"{fn}: raw must have at least 1 dimension, got shape {raw.shape}")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{fn}: raw must be C-contiguous, got strides {raw.strides}")
    if raw.shape[raw.ndim - 1] % B != 0:
        raise ValueError(f"{fn}: raw rows must be a multiple of {B} bytes ({tname} blocks of "
                         f"{E} values), got shape {raw.shape}")
    return _dequantize(fn, raw, tname, out, isa, "raw")
