# Low-precision matmul family (included by _kernels.pyx): `bf16` (bfloat16 inputs, float32
# accumulation, AVX-512 BF16) and `q8` (Q8_0 activations x the stored codes of Q8_0 / Q4_0 .. Q6_K weights, int32 block dots,
# AVX-512 VNNI), plus the bfloat16 rounding helper. Owns the validation of these wrappers; weight
# types are read from the traits table (_wtype, _k_matmul.pxi), variants from the "lowp"
# dispatch family (nx_lowp.h): isa= takes ISA names like every other kernel. Must not: copy or
# write weight bytes (they may be a read-only memory map), or enter C before every shape, dtype,
# band and aliasing check has passed. Arithmetic contracts: nxhpc/csrc/nx_lowp.h.
from libc.stdint cimport uint8_t, uint16_t, uint32_t

cdef extern from "nx_lowp.h" nogil:
    void nx_bf16_round_n(nx_isa isa, const float *x, uint16_t *out, size_t n)
    int nx_matmul_bf16(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                       const float *bias, float *out, size_t T, size_t K, size_t N, size_t n0,
                       size_t n1, unsigned flags)
    int nx_matmul_q8(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                     const float *bias, float *out, size_t T, size_t K, size_t N, size_t n0,
                     size_t n1)
    int nx_matmul_bf16_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                           const uint8_t *w_up, float *out, size_t T, size_t K, size_t N,
                           size_t n0, size_t n1, unsigned flags)
    int nx_matmul_q8_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w,
                         const uint8_t *w_up, float *out, size_t T, size_t K, size_t N,
                         size_t n0, size_t n1)
    ctypedef struct nx_q8w_type:
        uint32_t elems
        int halves
        int has_min
    const nx_q8w_type *nx_q8w(uint32_t type)

#: Weight types matmul_bf16 decodes (GGML type name -> id): every type of the traits table.
BF16_WEIGHT_TYPES = {name: v[0] for name, v in _WTYPES.items()}
#: Weight types matmul_q8 takes (name -> id): the quantized types with a q8 decoding (nx_q8w).
Q8_WEIGHT_TYPES = {name: v[0] for name, v in _WTYPES.items() if nx_q8w(v[0]) != NULL}
# The natural numpy dtype of a one-value-per-block type, accepted instead of raw bytes.
_BF16_ELEM_DTYPE = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 30: np.dtype(np.uint16)}
# Slot names of the "lowp" family (nx_lowp.h NX_LOWP_SLOTS) per precision.
_LOWP_SLOT = {"bf16": "matmul_bf16", "q8": "matmul_q8"}


cdef object _lowp_x(str fn, object x):
    _f32(fn, "x", x, 2)
    return x


cdef object _lowp_bias(str fn, object bias, Py_ssize_t N):
    if bias is None:
        return None
    _f32(fn, "bias", bias, 1)
    if bias.shape[0] != N:
        raise ValueError(f"{fn}: bias must have shape ({N},), got {bias.shape}")
    return bias


def round_bf16(x, isa=None):
    """bfloat16(x) as float32 values, the rounding both low-precision matmuls apply to their
    inputs (nx_lowp.h): a subnormal becomes the zero of its sign, NaN -> quiet NaN keeping sign
    and top payload bits, otherwise round to nearest even (overflow -> inf) -- VCVTNEPS2BF16.
    x: float32 ndarray, C-contiguous. isa: None (best) or an ISA name (ISA_NAMES).
    """
    fn = "round_bf16"
    _f32(fn, "x", x, -1)
    cdef nx_isa v = _resolve_isa(fn, isa)
    h = np.empty(x.shape, dtype=np.uint16)
    cdef size_t n = <size_t>x.size
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef uint16_t *hp = <uint16_t *>cnp.PyArray_DATA(h)
    if n:
        with nogil:
            nx_bf16_round_n(v, xp, hp, n)
    return (h.astype(np.uint32) << 16).view(np.float32)


cdef object _lowp_w(str fn, object w, int wid, str tname, Py_ssize_t E, Py_ssize_t B,
                    Py_ssize_t K):
    """Weights as raw GGML bytes uint8 [N, rowbytes] (or, for F32/F16/BF16, their element dtype
    float32/float16/uint16 [N, K]): returns the uint8 [N, rowbytes] view; checks K."""
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: w must be a numpy.ndarray of raw GGML bytes (uint8), "
                        f"got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"{fn}: w must be 2-D [N, rowbytes], got shape {w.shape}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{fn}: w must be C-contiguous, got strides {w.strides}")
    if K % E != 0:
        raise ValueError(f"{fn}: x has K={K}, which is not a multiple of {E} "
                         f"({tname} block size)")
    cdef Py_ssize_t rowbytes = K // E * B
    if w.dtype != np.uint8:
        if _BF16_ELEM_DTYPE.get(wid) != w.dtype:
            allowed = "uint8" + (f" or {_BF16_ELEM_DTYPE[wid]}" if wid in _BF16_ELEM_DTYPE else "")
            raise TypeError(f"{fn}: w for wtype {tname} must be {allowed}, got dtype={w.dtype}")
        if w.shape[1] != K:
            raise ValueError(f"{fn}: w is {w.shape} ({w.dtype}) but x has K={K}")
        w = w.view(np.uint8)
    if w.shape[1] != rowbytes:
        raise ValueError(f"{fn}: w is {w.shape} but x has K={K}: {tname} rows of K={K} take "
                         f"{rowbytes} bytes (expected w of shape ({w.shape[0]}, {rowbytes}))")
    return w


def matmul_bf16(x, w, wtype, out, n0=0, n1=None, *, bias=None, isa=None, up=None):
    """out[:, n0:n1] := bf16(x) @ bf16(dequant(w))[n0:n1].T (+ bias[n0:n1]), float32 accumulation.

    x: float32 [T, K]. w: raw GGML rows uint8 [N, K/block*block_bytes] of type `wtype` (any name
    of weight_types(), or its gguf.GGMLQuantizationType / int id), or for F32/F16/BF16 the
    element array float32/float16/uint16 [N, K]; may be read-only, never copied. out: float32
    [T, N]; only columns [n0, n1) are written. bias: float32 [N] or None, added after the sum.
    Contract (nx_lowp.h): inputs rounded to bfloat16 (nearest even), one vdpbf16ps-order chain per
    output (odd element of each pair first, DAZ/FTZ): bit-identical for every band, T batching and
    isa (None = best, or an ISA name: the "lowp" table's matmul_bf16 on that ISA's chain).
    up: None, or a second weight like w (the gated form, w the gate; as ``matmul``'s up=):
    out[:, n0:n1] := silu(this matmul with w) * (this matmul with up), glu by ``swiglu`` at the
    same isa; no bias.
    """
    return _matmul_bf16("matmul_bf16", x, w, wtype, out, n0, n1, bias, isa, 0, up)


def _matmul_bf16_dequant_pack(x, w, wtype, out, n0=0, n1=None, *, bias=None, isa=None,
                              up=None):
    """Test hook: matmul_bf16 with every weight panel decoded through the type's dequantize,
    even for types that have a fused decoder (must give the same bits)."""
    return _matmul_bf16("_matmul_bf16_dequant_pack", x, w, wtype, out, n0, n1, bias, isa,
                        NX_MM_DEQUANT_PACK, up)


cdef object _matmul_bf16(str fn, object x, object w, object wtype, object out, object n0,
                         object n1, object bias, object isa, unsigned flags, object up):
    _lowp_x(fn, x)
    wid, tname, E, B = _wtype(fn, wtype)
    cdef uint32_t tid = wid
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1]
    w_given = w
    w = _lowp_w(fn, w, wid, tname, E, B, K)
    cdef Py_ssize_t N = w.shape[0]
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    bias = _lowp_bias(fn, bias, N)
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_isa v = _resolve_isa(fn, isa)
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
    cdef int rc
    with nogil:
        if up_p != NULL:
            rc = nx_matmul_bf16_glu(v, tid, xp, wp, up_p, op, <size_t>T, <size_t>K, <size_t>N,
                                    c0, c1, flags)
        else:
            rc = nx_matmul_bf16(v, tid, xp, wp, bp, op, <size_t>T, <size_t>K, <size_t>N, c0, c1,
                                flags)
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    if rc != 0:
        raise RuntimeError(f"{fn}: kernel returned {rc}")
    return out


def matmul_q8(x, w, out, n0=0, n1=None, *, wtype="Q8_0", bias=None, isa=None, up=None):
    """out[:, n0:n1] := Q8_0(x) @ w[n0:n1].T on the stored integer codes (+ bias[n0:n1]).

    x: float32 [T, K], quantized per row to Q8_0 exactly as gguf.quants.quantize (float32 block
    scale). w: raw GGML rows uint8 [N, K/block*block_bytes] of type `wtype` (a name of
    Q8_WEIGHT_TYPES -- Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K -- or its gguf id; K a multiple
    of its block: 32, 256 for the K-quants); may be read-only, never copied. out: float32 [T, N];
    only columns [n0, n1) are written. bias: float32 [N] or None, added after the sum.
    Contract (nx_lowp.h): per 32-block (16-element halves for Q2_K/Q3_K/Q6_K) the int8 dot of
    the codes exact in int32, acc = fmaf((float)isum, dx*sw, acc) then, for types with a min,
    acc = fmaf(dx*(float)xsum, mw, acc), in block order from +0: bit-identical for every band,
    T batching and isa (None = best, or an ISA name: the "lowp" table's matmul_q8 on that ISA's
    chain -- VNNI at avx512).
    up: None, or a second weight like w (the gated form, w the gate; as ``matmul``'s up=):
    out[:, n0:n1] := silu(this matmul with w) * (this matmul with up), glu by ``swiglu`` at the
    same isa; no bias.
    """
    fn = "matmul_q8"
    _lowp_x(fn, x)
    wid, tname, E, B = _wtype(fn, wtype)
    if tname not in Q8_WEIGHT_TYPES:
        raise ValueError(f"{fn}: wtype {tname} has no q8 path (q8 takes "
                         f"{', '.join(Q8_WEIGHT_TYPES)}; other weight types: matmul_bf16)")
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: w must be a numpy.ndarray of raw {tname} bytes (uint8), "
                        f"got {type(w).__name__}")
    if w.dtype != np.uint8:
        raise TypeError(f"{fn}: w must be raw {tname} rows (uint8); matmul_q8 takes quantized "
                        f"weights only (F32/F16/BF16: matmul_bf16), got dtype={w.dtype}")
    cdef uint32_t tid = wid
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1]
    w_given = w
    w = _lowp_w(fn, w, wid, tname, E, B, K)
    cdef Py_ssize_t N = w.shape[0]
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    bias = _lowp_bias(fn, bias, N)
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_isa v = _resolve_isa(fn, isa)
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
    cdef int rc
    with nogil:
        if up_p != NULL:
            rc = nx_matmul_q8_glu(v, tid, xp, wp, up_p, op, <size_t>T, <size_t>K, <size_t>N, c0,
                                  c1)
        else:
            rc = nx_matmul_q8(v, tid, xp, wp, bp, op, <size_t>T, <size_t>K, <size_t>N, c0, c1)
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    if rc == -2:
        raise ValueError(f"{fn}: the kernel does not take weight type {tname} for q8")
    if rc != 0:
        raise RuntimeError(f"{fn}: kernel returned {rc}")
    return out


def lowp_variants(precision):
    """ISAs this CPU/OS runs whose own code fills the precision's slot ("bf16": matmul_bf16, "q8":
    matmul_q8) in the "lowp" dispatch tables, generic first (each is a valid ``isa=``); ignores
    NXHPC_DISABLE_SIMD (which only changes what isa=None picks)."""
    if precision not in _LOWP_SLOT:
        raise ValueError(f"lowp_variants: precision must be 'bf16' or 'q8', got {precision!r}")
    slot = _LOWP_SLOT[precision]
    own = []
    for isa in supported_isas():
        v = _variant(slot, isa)
        if v not in own:
            own.append(v)
    return own
