# _k_quants.pxi -- included by _kernels.pyx. Wrappers of the dequantizers of the GGML block types
# Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (nxhpc/csrc/nx_quants*.c).
# Owns: argument validation for dequantize_blocks (dtype, shape, contiguity, block-size rule,
# writeability and overlap of out, the type name) and the C sizes/variants report. Must not:
# write or copy the input bytes (they may be a read-only memory map), or enter C unvalidated.
from libc.stdint cimport uint8_t

cdef extern from "nx_quants.h" nogil:
    ctypedef void (*nx_dequant_fn)(const uint8_t *blocks, float *out, size_t nblocks)
    ctypedef struct nx_quant_type:
        int ggml_type
        const char *name
        size_t block_elems
        size_t block_bytes
    int NX_QUANT_NTYPES
    const nx_quant_type *nx_quant_type_at(int i)
    const nx_quant_type *nx_quant_type_of(int ggml_type)
    nx_isa nx_quant_dequant_level(const nx_quant_type *t, nx_isa isa)
    void nx_quant_dequantize(const nx_quant_type *t, nx_isa isa, const uint8_t *blocks,
                             float *out, size_t nblocks)


def _quant_ids():
    """name -> GGML type id of every type the C table decodes."""
    cdef const nx_quant_type *t
    out = {}
    for i in range(NX_QUANT_NTYPES):
        t = nx_quant_type_at(i)
        out[t.name.decode()] = t.ggml_type
    return out


_QUANT_IDS = _quant_ids()


def _quant_variant(int ggml_type, int isa):
    return nx_isa_name(nx_quant_dequant_level(nx_quant_type_of(ggml_type), <nx_isa>isa)).decode()


for _qname, _qid in _QUANT_IDS.items():
    _VARIANT_OF["dequant_" + _qname.lower()] = (lambda qid: lambda isa: _quant_variant(qid, isa))(_qid)


def quant_block_sizes():
    """{name: (ggml_type, block_elems, block_bytes)} as compiled into C (sizeof of the structs)."""
    cdef const nx_quant_type *t
    out = {}
    for i in range(NX_QUANT_NTYPES):
        t = nx_quant_type_at(i)
        out[t.name.decode()] = (t.ggml_type, <Py_ssize_t>t.block_elems, <Py_ssize_t>t.block_bytes)
    return out


cdef const nx_quant_type *_quant_type(str fn, object wtype) except NULL:
    """A type name ("Q4_K", case-insensitive) or GGML type id (int / gguf enum) -> C traits."""
    cdef int tid = -1
    if isinstance(wtype, str):
        tid = _QUANT_IDS.get(wtype.upper(), -1)
    elif isinstance(wtype, (int, np.integer)) and not isinstance(wtype, (bool, np.bool_)):
        if int(wtype) in _QUANT_IDS.values():
            tid = int(wtype)
    cdef const nx_quant_type *t = nx_quant_type_of(tid) if tid >= 0 else NULL
    if t == NULL:
        raise ValueError(f"{fn}: wtype must be one of {sorted(_QUANT_IDS)} (a name or its GGML "
                         f"type id), got {wtype!r}"
                         + (" (Q8_0 has q8_0_dequantize)" if str(wtype).upper() in ("Q8_0", "8")
                            or getattr(wtype, "name", None) == "Q8_0" else ""))
    return t


def dequantize_blocks(raw, wtype, out=None, *, isa=None):
    """out := decode(raw): uint8 blocks [..., nblocks*block_bytes] -> float32 [..., nblocks*elems].

    wtype: "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K" or "Q6_K" (or the GGML
    type id / gguf.GGMLQuantizationType). Byte-identical to ``gguf.quants.dequantize(raw, wtype)``
    at every isa (per-element float32 ops and their order: nxhpc/csrc/nx_quants.h). `raw` must be
    C-contiguous uint8 whose last dimension is a multiple of the type's block bytes; it may be
    read-only (never written). out: None or a writeable float32 C-contiguous array of the result
    shape that does not overlap raw.
    """
    fn = "dequantize_blocks"
    cdef const nx_quant_type *t = _quant_type(fn, wtype)
    tname = t.name.decode()
    cdef Py_ssize_t bb = <Py_ssize_t>t.block_bytes, be = <Py_ssize_t>t.block_elems
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{fn}: raw must be a numpy.ndarray of uint8 {tname} blocks, "
                        f"got {type(raw).__name__}")
    if raw.dtype != np.uint8:
        raise TypeError(f"{fn}: raw must be uint8 (raw {tname} block bytes), got dtype={raw.dtype}")
    if raw.ndim < 1:
        raise ValueError(f"{fn}: raw must have at least 1 dimension, got shape {raw.shape}")
    if not raw.flags.c_contiguous:
        raise ValueError(f"{fn}: raw must be C-contiguous, got strides {raw.strides}")
    cdef Py_ssize_t nbytes = raw.shape[raw.ndim - 1]
    if nbytes % bb != 0:
        raise ValueError(f"{fn}: raw rows must be a multiple of {bb} bytes ({tname} blocks of "
                         f"{be} values), got shape {raw.shape}")
    oshape = tuple(raw.shape[:raw.ndim - 1]) + (nbytes // bb * be,)
    cdef nx_isa level = _resolve_isa(fn, isa)
    if out is None:
        out = np.empty(oshape, dtype=np.float32)
    else:
        _out_f32(fn, "out", out, oshape)
        if np.may_share_memory(out, raw):
            raise ValueError(f"{fn}: out must not overlap raw")
    cdef size_t nblocks = <size_t>(raw.size // bb)
    if nblocks == 0:
        return out
    cdef const uint8_t *rp = <const uint8_t *>cnp.PyArray_DATA(raw)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    with nogil:
        nx_quant_dequantize(t, level, rp, op, nblocks)
    return out
