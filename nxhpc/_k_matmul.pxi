# Weight types and the matmul family (included by _kernels.pyx): weight_types, dequantize,
# embed_rows (row gather from a typed matrix), matmul (any weight type, optional bias),
# adaln_linear, the Q8_0 quantizer, and the names kept
# for older callers (q8_0_matmul, q8_0_dequantize; dequantize_blocks and quant_block_sizes for
# the nine block types Q4_0 .. Q6_K).
# Owns the validation of these wrappers: weight-type names/ids against the C traits table, raw
# GGML bytes per row, bands, aliasing. Must not: copy or write weight bytes (they may be a
# read-only memory map), or enter C before every shape, dtype, band and aliasing check passed.
import operator

from libc.stdint cimport uint8_t, uint32_t

cdef extern from "nx_wtype.h" nogil:
    enum: NX_GGML_TYPE_COUNT
    ctypedef struct nx_wtype_traits:
        const char *name
        uint32_t blck_elems
        uint32_t blck_bytes
    const nx_wtype_traits *nx_wtype(uint32_t ggml_type)
    int nx_dequantize(nx_isa isa, uint32_t type, const uint8_t *w, float *out, size_t nblocks)
    int nx_embed_rows(nx_isa isa, uint32_t type, const uint8_t *w, size_t rowbytes,
                      const void *ids, int id_bytes, float *out, size_t K, size_t r0, size_t r1)

cdef extern from "nx_matmul.h" nogil:
    enum: NX_MM_DEQUANT_PACK
    int nx_matmul_ex(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                     const float *bias, float *out, size_t T, size_t K, size_t N, size_t n0,
                     size_t n1, unsigned flags)
    int nx_matmul_packer(nx_isa isa, uint32_t type)
    int nx_matmul_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                      const uint8_t *w_up, float *out, size_t T, size_t K, size_t N, size_t n0,
                      size_t n1, unsigned flags)
    int nx_adaln_linear(nx_isa isa, uint32_t type, const float *t_emb, const uint8_t *w,
                        const float *bias, float *out, size_t K, size_t N, int silu_input)

cdef extern from "nx_q8_0.h" nogil:
    void nx_q8_0_quantize(nx_isa isa, const float *x, uint8_t *out, size_t nblocks)

# The block layout lives in pure Python (nxhpc.formats.ggml_blocks) so file tools need no build.
from nxhpc.formats.ggml_blocks import QK8_0, Q8_0_BLOCK_BYTES, Q8_0_BLOCK_DTYPE


def _read_weight_types():
    """{name: (ggml id, elements per block, bytes per block)} from the C traits table."""
    cdef const nx_wtype_traits *tr
    cdef int t
    out = {}
    for t in range(NX_GGML_TYPE_COUNT):
        tr = nx_wtype(<uint32_t>t)
        if tr != NULL:
            out[tr.name.decode()] = (t, <int>tr.blck_elems, <int>tr.blck_bytes)
    return out


_WTYPES = _read_weight_types()
_WTYPE_NAME_OF_ID = {v[0]: k for k, v in _WTYPES.items()}
# numpy dtypes that hold a type's values one per element (what gguf.GGUFReader gives for F32 /
# F16 tensors); such arrays are accepted as [N, K] besides the raw uint8 bytes [N, rowbytes].
_ELEMENT_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}


def weight_types():
    """Weight types with kernels in this build, from the C traits table (csrc/nx_wtype.c):
    ``{name: {"ggml_type": id, "block_elems": n, "block_bytes": b}}`` (GGML numbering/names)."""
    return {name: {"ggml_type": t, "block_elems": e, "block_bytes": b}
            for name, (t, e, b) in _WTYPES.items()}


cdef tuple _wtype(str fn, object wtype):
    """A GGML type name ("Q8_0", case-insensitive) or id (int, gguf.GGMLQuantizationType) ->
    (id, name, elements per block, bytes per block)."""
    if isinstance(wtype, str):
        key = wtype.upper()
        if key in _WTYPES:
            t, e, b = _WTYPES[key]
            return t, key, e, b
        raise ValueError(f"{fn}: wtype {wtype!r} is not a supported weight type "
                         f"(supported: {', '.join(_WTYPES)})")
    if isinstance(wtype, (bool, np.bool_)):
        raise TypeError(f"{fn}: wtype must be a GGML type name or id, got {wtype!r}")
    try:
        tid = operator.index(wtype)
    except TypeError:
        raise TypeError(f"{fn}: wtype must be a GGML type name (str) or id (int), "
                        f"got {type(wtype).__name__}") from None
    if tid not in _WTYPE_NAME_OF_ID:
        raise ValueError(f"{fn}: wtype {wtype!r} (GGML type id {tid}) is not a supported weight "
                         f"type (supported: "
                         f"{', '.join(f'{n}={v[0]}' for n, v in _WTYPES.items())})")
    name = _WTYPE_NAME_OF_ID[tid]
    t, e, b = _WTYPES[name]
    return t, name, e, b


cdef object _weight_bytes(str fn, str name, object w, str tname, Py_ssize_t E, Py_ssize_t B,
                          int ndim):
    """Check a weight: uint8 raw GGML bytes [..., nb*B] (ndim dims; -1: >= 1), or for F32/F16 the
    element dtype [..., K]; C-contiguous. Returns the uint8 view (read-only arrays are fine)."""
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray of uint8 {tname} block bytes, "
                        f"got {type(w).__name__}")
    elem = _ELEMENT_DTYPES.get(tname)
    if w.dtype != np.uint8 and (elem is None or w.dtype != elem):
        also = f" or {elem} [N, K]" if elem is not None else ""
        raise TypeError(f"{fn}: {name} must be uint8 (raw {tname} block bytes){also}, "
                        f"got dtype={w.dtype}")
    if ndim >= 0 and w.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {w.shape}")
    if w.ndim < 1:
        raise ValueError(f"{fn}: {name} must have at least 1 dimension, got shape {w.shape}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous, got strides {w.strides}")
    if w.dtype != np.uint8:
        w = w.view(np.uint8)
    if w.shape[w.ndim - 1] % B != 0:
        raise ValueError(f"{fn}: {name} rows must be a multiple of {B} bytes ({tname} blocks), "
                         f"got shape {w.shape}")
    return w


cdef _no_alias(str fn, str out_name, object out, str in_name, object a):
    if a is not None and np.may_share_memory(out, a):
        raise ValueError(f"{fn}: {out_name} must not overlap {in_name}")


cdef object _index(str fn, str name, object v):
    """Band bounds must be integers (int, numpy integer) or None; 2.5 is an error, not 2."""
    if v is None:
        return None
    try:
        if isinstance(v, (bool, np.bool_)):  # True is an int to operator.index, not a bound
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an integer or None, got {v!r}") from None


cdef int _check_k(str fn, str name, Py_ssize_t K, str tname="Q8_0",
                  Py_ssize_t E=32) except -1:
    if K % E != 0:
        raise ValueError(f"{fn}: {name} has K={K}, which is not a multiple of {E} "
                         f"(the {tname} block size, wtype={tname!r})")
    return 0


cdef object _opt_bias(str fn, object bias, Py_ssize_t N):
    if bias is not None:
        _f32(fn, "bias", bias, 1)
        if bias.shape[0] != N:
            raise ValueError(f"{fn}: bias must have shape ({N},), got {bias.shape}")
    return bias


# ----------------------------------------------------------------------------- weight types

cdef object _dequantize(str fn, object w, object wtype, object out, object isa, str wname="w"):
    tid, tname, E, B = _wtype(fn, wtype)
    w = _weight_bytes(fn, wname, w, tname, E, B, -1)
    cdef Py_ssize_t nbytes = w.shape[w.ndim - 1]
    oshape = tuple(w.shape[:w.ndim - 1]) + (nbytes // B * E,)
    cdef nx_isa level = _resolve_isa(fn, isa)
    if out is None:
        out = np.empty(oshape, dtype=np.float32)
    else:
        _out_f32(fn, "out", out, oshape)
        _no_alias(fn, "out", out, wname, w)
    cdef size_t nblocks = <size_t>(w.size // B)
    if nblocks == 0:
        return out
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef uint32_t t = tid
    with nogil:
        nx_dequantize(level, t, wp, op, nblocks)
    return out


def dequantize(w, wtype, out=None, *, isa=None):
    """out := the float32 values of GGML weight bytes: uint8 [..., nb*block_bytes] -> [..., K].

    wtype: a GGML type name or id of ``weight_types()``. Byte-identical to
    ``gguf.quants.dequantize`` for every type here (F32/F16/BF16/Q8_0 are exact in float32;
    F16 keeps NaN payloads as numpy does), at every isa. `w` may be read-only; F32/F16 weights
    may also be given as float32/float16 arrays. Returns out.
    """
    return _dequantize("dequantize", w, wtype, out, isa)


_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def embed_rows(w, wtype, ids, out, r0=0, r1=None, *, isa=None):
    """out[i, :] := dequantize(w[ids[i]]) for rows i in [r0, r1): an embedding lookup.

    w: an [N, K] matrix of any type of ``weight_types()`` in the form ``matmul`` takes (uint8
    raw GGML rows [N, K//block_elems*block_bytes], or float32/float16 [N, K] for F32/F16; a
    read-only memory map is fine, never copied or written). ids: int32 or int64 [n],
    C-contiguous; every id must lie in [0, N) (checked over all of ids before any row is
    written). out: float32 [n, K], writeable; only rows [r0, r1) are written. Each row is
    decoded on its own with the type's dequantize (no decode of the whole matrix; memory O(rows
    asked)), so a row is byte-identical to ``gguf.quants.dequantize`` of that row, at every isa
    and for any band split. Returns out.
    """
    fn = "embed_rows"
    tid, tname, E, B = _wtype(fn, wtype)
    w = _weight_bytes(fn, "w", w, tname, E, B, 2)
    cdef Py_ssize_t N = w.shape[0], rowbytes = w.shape[1]
    cdef Py_ssize_t K = rowbytes // B * E
    if not isinstance(ids, np.ndarray):
        raise TypeError(f"{fn}: ids must be a numpy.ndarray of int32 or int64, "
                        f"got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{fn}: ids must be int32 or int64, got dtype={ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{fn}: ids must be 1-D, got shape {ids.shape}")
    if not ids.flags.c_contiguous:
        raise ValueError(f"{fn}: ids must be C-contiguous, got strides {ids.strides}")
    cdef Py_ssize_t n = ids.shape[0]
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({n}, {K}), got None")
    _out_f32(fn, "out", out, (n, K))
    lo, hi = _band(fn, "rows of out", _index(fn, "r0", r0), _index(fn, "r1", r1), n)
    cdef nx_isa level = _resolve_isa(fn, isa)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "ids", ids)
    if n:
        bad = np.flatnonzero((ids < 0) | (ids >= N))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{fn}: ids[{i}] = {int(ids[i])} is out of range for w with N={N} "
                             f"rows (every id must be in [0, {N}); {bad.size} bad id"
                             f"{'s' if bad.size > 1 else ''})")
    if lo == hi or K == 0:
        return out
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const void *ip = <const void *>cnp.PyArray_DATA(ids)
    cdef int id_bytes = ids.dtype.itemsize
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef uint32_t t = tid
    cdef size_t a = lo, b = hi, rb = rowbytes, k = K
    cdef int rc
    with nogil:
        rc = nx_embed_rows(level, t, wp, rb, ip, id_bytes, op, k, a, b)
    if rc != 0:
        raise ValueError(f"{fn}: wtype {tname} has no dequantize in this build")
    return out


# The older wrapper of the nine block types (Q4_0 .. Q6_K): dequantize() restricted to them.
_QUANT_NAMES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def quant_block_sizes():
    """{name: (ggml_type, block_elems, block_bytes)} of the nine block types Q4_0 .. Q6_K, from
    the C traits table (``weight_types()`` restricted to them)."""
    return {n: _WTYPES[n] for n in _QUANT_NAMES}


def dequantize_blocks(raw, wtype, out=None, *, isa=None):
    """out := decode(raw): ``dequantize(raw, wtype, out, isa=isa)`` restricted to the nine block
    types "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K" (a name, GGML
    type id or gguf.GGMLQuantizationType); the same checks, the argument named `raw`."""
    fn = "dequantize_blocks"
    name = None
    if isinstance(wtype, str):
        name = wtype.upper()
    elif isinstance(wtype, (int, np.integer)) and not isinstance(wtype, (bool, np.bool_)):
        name = _WTYPE_NAME_OF_ID.get(int(wtype))
    if name not in _QUANT_NAMES:
        raise ValueError(f"{fn}: wtype must be one of {sorted(_QUANT_NAMES)} (a name or its GGML "
                         f"type id), got {wtype!r}"
                         + (" (Q8_0 has q8_0_dequantize; dequantize() takes every type)"
                            if str(wtype).upper() in ("Q8_0", "8")
                            or getattr(wtype, "name", None) == "Q8_0" else ""))
    return _dequantize(fn, raw, name, out, isa, "raw")


def q8_0_dequantize(w, out=None, isa=None):
    """out := d * q: uint8 Q8_0 bytes [..., K//32*34] -> float32 [..., K] (``dequantize(w, "Q8_0")``).

    Byte-identical to ``gguf.quants.dequantize(w, GGMLQuantizationType.Q8_0)`` (exact: d*q is
    representable in float32). `w` may be read-only.
    """
    return _dequantize("q8_0_dequantize", w, "Q8_0", out, isa)


def q8_0_quantize(x, out=None, isa=None):
    """out := Q8_0(x): float32 [..., K] (K % 32 == 0) -> uint8 [..., K//32*34].

    Byte-identical to ``gguf.quants.quantize(x, GGMLQuantizationType.Q8_0)``: per block of 32,
    d = max|x|/127, q = round-half-away(x/d), d stored as float16 (round to nearest even).
    """
    fn = "q8_0_quantize"
    _f32(fn, "x", x, -1)
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have at least 1 dimension, got shape {x.shape}")
    cdef Py_ssize_t K = x.shape[x.ndim - 1]
    _check_k(fn, "x", K, "Q8_0", QK8_0)
    oshape = tuple(x.shape[:x.ndim - 1]) + (K // QK8_0 * Q8_0_BLOCK_BYTES,)
    cdef nx_isa level = _resolve_isa(fn, isa)
    if out is None:
        out = np.empty(oshape, dtype=np.uint8)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8:
            raise TypeError(f"{fn}: out must be a uint8 numpy.ndarray, got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        if tuple(out.shape) != oshape:
            raise ValueError(f"{fn}: out must have shape {oshape}, got {out.shape}")
        if not out.flags.c_contiguous:
            raise ValueError(f"{fn}: out must be C-contiguous, got strides {out.strides}")
        if not out.flags.writeable:
            raise ValueError(f"{fn}: out is read-only")
        _no_alias(fn, "out", out, "x", x)
    cdef size_t nblocks = <size_t>(x.size // QK8_0)
    if nblocks == 0:
        return out
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef uint8_t *op = <uint8_t *>cnp.PyArray_DATA(out)
    with nogil:
        nx_q8_0_quantize(level, xp, op, nblocks)
    return out


# ----------------------------------------------------------------------------- matmul

cdef object _glu_up(str fn, object up, object w, object w_given, object bias, object out):
    """The gated calls' second weight: ``up`` checked like ``w`` was (``w_given``: w as passed,
    ``w``: its uint8 row view) and of its dtype and shape; no bias; not overlapping out. Returns
    up's uint8 row view."""
    if not isinstance(up, np.ndarray):
        raise TypeError(f"{fn}: up must be a numpy.ndarray like w, got {type(up).__name__}")
    if up.dtype != w_given.dtype or up.shape != w_given.shape:
        raise ValueError(f"{fn}: up must have w's dtype and shape {w_given.shape} "
                         f"{w_given.dtype}, got {up.shape} {up.dtype}")
    if not up.flags.c_contiguous:
        raise ValueError(f"{fn}: up must be C-contiguous, got strides {up.strides}")
    if bias is not None:
        raise ValueError(f"{fn}: the gated call (up=) takes no bias")
    up = up.view(np.uint8).reshape(w.shape)
    _no_alias(fn, "out", out, "up", up)
    return up


cdef object _matmul(str fn, object x, object w, object wtype, object out, object n0, object n1,
                    object bias, object isa, unsigned flags, object up=None):
    _f32(fn, "x", x, 2)
    tid, tname, E, B = _wtype(fn, wtype)
    given = f"{w.shape} {w.dtype}" if isinstance(w, np.ndarray) else ""
    w_given = w
    w = _weight_bytes(fn, "w", w, tname, E, B, 2)
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1], N = w.shape[0]
    _check_k(fn, "x", K, tname, E)
    cdef Py_ssize_t rowbytes = K // E * B
    if w.shape[1] != rowbytes:
        raise ValueError(f"{fn}: w is {given} ({w.shape[1] // B * E} values per row as "
                         f"{tname}), but x is {x.shape} (K={K}: expected w of shape "
                         f"({N}, {rowbytes}) uint8)")
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    _opt_bias(fn, bias, N)
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_isa level = _resolve_isa(fn, isa)
    _no_alias(fn, "out", out, "x", x)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "bias", bias)
    if up is not None:
        up = _glu_up(fn, up, w, w_given, bias, out)
    if T == 0 or lo == hi:
        return out
    cdef size_t c0 = lo, c1 = hi
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const uint8_t *up_p = NULL
    if up is not None:
        up_p = <const uint8_t *>cnp.PyArray_DATA(up)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef uint32_t t = tid
    cdef int rc
    with nogil:
        if up_p != NULL:
            rc = nx_matmul_glu(level, t, xp, wp, up_p, op, <size_t>T, <size_t>K, <size_t>N, c0,
                               c1, flags)
        else:
            rc = nx_matmul_ex(level, t, xp, wp, bp, op, <size_t>T, <size_t>K, <size_t>N, c0,
                              c1, flags)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    return out


def matmul(x, w, wtype, out, n0=0, n1=None, *, bias=None, isa=None, up=None):
    """out[:, n0:n1] := x @ dequant(w)[n0:n1].T (+ bias[n0:n1]), for a weight of any GGML type.

    x: float32 [T, K], C-contiguous. w: uint8 [N, K//block_elems*block_bytes], the raw GGML rows
    (a read-only memory map is fine; never copied or written, converted panel by panel), or for
    F32/F16 a float32/float16 [N, K] array. wtype: a name or id of ``weight_types()``; K must be
    a multiple of its block. out: float32 [T, N], writeable; only columns [n0, n1) are written.
    bias: None or float32 [N], added once after the sum. Each out[t, n] is a fixed two-level
    float32 sum over k (128-step fma chains from +0 at k = 0, 128, ..., added in order;
    csrc/nx_matmul.h), so the result is bit-identical for every band split, T batching and isa,
    and -- the values of F32/F16/BF16/Q8_0 being exact in float32 -- to the same matmul over
    ``dequantize(w, wtype)`` as an F32 weight.

    up: None, or a second weight of w's dtype and shape (the gated form of a SwiGLU
    feed-forward, w its gate): out[:, n0:n1] := silu(x @ dequant(w).T) * (x @ dequant(up).T) on
    the band, the bits of this matmul for w and for up and then ``swiglu`` (same ``isa``) on the
    two; no bias.
    """
    return _matmul("matmul", x, w, wtype, out, n0, n1, bias, isa, 0, up)


def _matmul_dequant_pack(x, w, wtype, out, n0=0, n1=None, *, bias=None, isa=None):
    """Test hook: matmul with every panel packed by the ISA's generic dequantize-and-transpose
    packer, even for types that have a fused one (must give the same bits)."""
    return _matmul("_matmul_dequant_pack", x, w, wtype, out, n0, n1, bias, isa,
                   NX_MM_DEQUANT_PACK)


def _matmul_packer(wtype, isa=None):
    """How the matmul packs `wtype`'s panels at `isa`: "spec" (generic: whole rows dequantized,
    no panels), "fused" (a type-specific packer) or "dequantize" (the generic packer)."""
    fn = "_matmul_packer"
    tid, tname, E, B = _wtype(fn, wtype)
    cdef nx_isa level = _resolve_isa(fn, isa)
    return {0: "spec", 1: "fused", 2: "dequantize"}[nx_matmul_packer(level, <uint32_t>tid)]


def q8_0_matmul(x, w, out, n0=0, n1=None, isa=None):
    """out[:, n0:n1] := x @ dequant(w)[n0:n1].T for Q8_0 bytes: ``matmul(x, w, "Q8_0", out, ...)``.

    x: float32 [T, K], K % 32 == 0. w: uint8 [N, K//32*34], raw GGUF Q8_0 rows (may be a read-only
    memory map; never copied or written). out: float32 [T, N], writeable. Only columns [n0, n1) of
    out are written. Bit-identical for every band split, every T batching and every isa.
    """
    return _matmul("q8_0_matmul", x, w, "Q8_0", out, n0, n1, None, isa, 0)


# ----------------------------------------------------------------------------- adaLN linear

def adaln_linear(t_emb, w, wtype, bias=None, out=None, silu_input=False, *, isa=None):
    """out := w @ (silu(t_emb) if silu_input else t_emb) + bias.

    t_emb: float32 [K]; w: raw GGML bytes of `wtype` [N, rowbytes] (or float32/float16 [N, K]
    for F32/F16); bias: float32 [N] or None; out: float32 [N], writeable. It is ``matmul`` with
    T = 1 plus the bias, so a weight in any type and its float32 dequantization give
    bit-identical output at every isa.
    """
    fn = "adaln_linear"
    _f32(fn, "t_emb", t_emb, 1)
    cdef Py_ssize_t K = t_emb.shape[0], N
    tid, tname, E, B = _wtype(fn, wtype)
    given = f"{w.shape} {w.dtype}" if isinstance(w, np.ndarray) else ""
    w_given = w
    w = _weight_bytes(fn, "w", w, tname, E, B, 2)
    _check_k(fn, "t_emb", K, tname, E)
    if w.shape[1] != K // E * B:
        raise ValueError(f"{fn}: {tname} w is {given} but t_emb has K={K} "
                         f"(expected {K // E * B} bytes per row as uint8)")
    N = w.shape[0]
    _opt_bias(fn, bias, N)
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({N},), got None")
    _out_f32(fn, "out", out, (N,))
    if not isinstance(silu_input, (bool, np.bool_)):
        raise TypeError(f"{fn}: silu_input must be a bool, got {silu_input!r}")
    cdef nx_isa level = _resolve_isa(fn, isa)
    _no_alias(fn, "out", out, "t_emb", t_emb)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "bias", bias)
    if N == 0:
        return out
    cdef const float *tp = <const float *>cnp.PyArray_DATA(t_emb)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int silu = 1 if silu_input else 0
    cdef uint32_t t = tid
    cdef int rc
    with nogil:
        rc = nx_adaln_linear(level, t, tp, wp, bp, op, <size_t>K, <size_t>N, silu)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch (K={K}, N={N})")
    return out
