# Low-precision matmul family (included by _kernels.pyx): `bf16` (bfloat16 inputs, float32
# accumulation, AVX-512 BF16) and `q8` (Q8_0 activations x Q8_0 weights, int32 block dots,
# AVX-512 VNNI), plus the bfloat16 rounding helper. Owns the validation of these wrappers and the
# mapping of weight-type names/ids to the C decoders. Must not: copy or write weight bytes (they
# may be a read-only memory map), or enter C before every shape, dtype, band and aliasing check
# has passed. Arithmetic contracts: nxhpc/csrc/nx_lowp.h.
from libc.stdint cimport uint8_t, uint16_t

cdef extern from "nx_lowp.h" nogil:
    ctypedef enum nx_lowp_variant:
        NX_LOWP_GENERIC
        NX_LOWP_AVX512BF16
        NX_LOWP_AVX512VNNI
    ctypedef struct nx_lowp_wtype:
        int ggml_type
        const char *name
        size_t block_elems
        size_t block_bytes
    const nx_lowp_wtype *nx_lowp_wtype_of(int ggml_type)
    int nx_lowp_variant_supported(nx_lowp_variant v)
    nx_lowp_variant nx_lowp_bf16_variant(nx_isa isa)
    nx_lowp_variant nx_lowp_q8_variant(nx_isa isa)
    const char *nx_lowp_variant_name(nx_lowp_variant v)
    void nx_bf16_round_n(nx_lowp_variant v, const float *x, uint16_t *out, size_t n)
    int nx_matmul_bf16(nx_lowp_variant v, const nx_lowp_wtype *wt, const float *x,
                       const uint8_t *w, const float *bias, float *out, size_t T, size_t K,
                       size_t N, size_t n0, size_t n1)
    int nx_matmul_q8(nx_lowp_variant v, const float *x, const uint8_t *w, const float *bias,
                     float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1)

#: Weight types matmul_bf16 decodes (GGML type name -> gguf.GGMLQuantizationType value).
BF16_WEIGHT_TYPES = {"F32": 0, "F16": 1, "Q8_0": 8, "BF16": 30}
# The natural numpy dtype of a one-value-per-block type, accepted instead of raw bytes.
_BF16_ELEM_DTYPE = {0: np.dtype(np.float32), 1: np.dtype(np.float16), 30: np.dtype(np.uint16)}
_LOWP_VARIANTS = {"bf16": ("avx512bf16", NX_LOWP_AVX512BF16), "q8": ("avx512vnni", NX_LOWP_AVX512VNNI)}

_VARIANT_OF["matmul_bf16"] = lambda isa: nx_lowp_variant_name(nx_lowp_bf16_variant(<nx_isa>isa)).decode()
_VARIANT_OF["matmul_q8"] = lambda isa: nx_lowp_variant_name(nx_lowp_q8_variant(<nx_isa>isa)).decode()
_VARIANT_OF["round_bf16"] = lambda isa: nx_lowp_variant_name(nx_lowp_bf16_variant(<nx_isa>isa)).decode()


cdef nx_lowp_variant _lowp_variant(str fn, str prec, object isa) except *:
    """None -> the best variant at the default ISA level; an ISA level name -> the best variant at
    or below it; the precision's own variant name -> that variant, if this CPU runs it."""
    own_name, own = _LOWP_VARIANTS[prec]
    cdef nx_isa level
    if isinstance(isa, str) and isa == own_name:
        if not nx_lowp_variant_supported(own):
            raise ValueError(f"{fn}: isa={isa!r} is not supported on this CPU "
                             f"(features: {[k for k, v in cpu_features().items() if v is True]})")
        return own
    if isa is not None and not (isinstance(isa, str) and isa in _ISA_BY_NAME):
        raise ValueError(f"{fn}: isa must be None, one of {ISA_NAMES} or {own_name!r}, got {isa!r}")
    level = _resolve_isa(fn, isa)
    return nx_lowp_bf16_variant(level) if prec == "bf16" else nx_lowp_q8_variant(level)


cdef int _wtype_id(str fn, object wtype) except -1:
    """A GGML type given as name ('Q8_0'), int or gguf.GGMLQuantizationType -> its id, if decodable."""
    if isinstance(wtype, str):
        if wtype.upper() not in BF16_WEIGHT_TYPES:
            raise ValueError(f"{fn}: wtype {wtype!r} is not a weight type the bf16 path decodes "
                             f"(supported: {sorted(BF16_WEIGHT_TYPES)})")
        return BF16_WEIGHT_TYPES[wtype.upper()]
    try:
        v = operator.index(wtype)
    except TypeError:
        raise TypeError(f"{fn}: wtype must be a GGML type name, int or gguf.GGMLQuantizationType, "
                        f"got {wtype!r}") from None
    if v not in BF16_WEIGHT_TYPES.values() or nx_lowp_wtype_of(<int>v) == NULL:
        raise ValueError(f"{fn}: wtype {wtype!r} (GGML type {v}) is not a weight type the bf16 path "
                         f"decodes (supported: {sorted(BF16_WEIGHT_TYPES)})")
    return v


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
    x: float32 ndarray, C-contiguous. isa: None, an ISA level name, or "avx512bf16".
    """
    fn = "round_bf16"
    _f32(fn, "x", x, -1)
    cdef nx_lowp_variant v = _lowp_variant(fn, "bf16", isa)
    h = np.empty(x.shape, dtype=np.uint16)
    cdef size_t n = <size_t>x.size
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef uint16_t *hp = <uint16_t *>cnp.PyArray_DATA(h)
    if n:
        with nogil:
            nx_bf16_round_n(v, xp, hp, n)
    return (h.astype(np.uint32) << 16).view(np.float32)


cdef object _lowp_w(str fn, object w, int wid, const nx_lowp_wtype *wt, Py_ssize_t K):
    """Weights as raw GGML bytes uint8 [N, rowbytes] (or, for F32/F16/BF16, their element dtype
    float32/float16/uint16 [N, K]): returns the uint8 [N, rowbytes] view; checks K."""
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: w must be a numpy.ndarray of raw GGML bytes (uint8), "
                        f"got {type(w).__name__}")
    cdef str tname = wt.name.decode()
    if w.ndim != 2:
        raise ValueError(f"{fn}: w must be 2-D [N, rowbytes], got shape {w.shape}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{fn}: w must be C-contiguous, got strides {w.strides}")
    if K % <Py_ssize_t>wt.block_elems != 0:
        raise ValueError(f"{fn}: x has K={K}, which is not a multiple of {wt.block_elems} "
                         f"({tname} block size)")
    cdef Py_ssize_t rowbytes = K // <Py_ssize_t>wt.block_elems * <Py_ssize_t>wt.block_bytes
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


def matmul_bf16(x, w, wtype, out, n0=0, n1=None, *, bias=None, isa=None):
    """out[:, n0:n1] := bf16(x) @ bf16(dequant(w))[n0:n1].T (+ bias[n0:n1]), float32 accumulation.

    x: float32 [T, K]. w: raw GGML rows uint8 [N, K/block*block_bytes] of type `wtype` ("F32",
    "F16", "BF16", "Q8_0", or the gguf.GGMLQuantizationType / int), or for F32/F16/BF16 the
    element array float32/float16/uint16 [N, K]; may be read-only, never copied. out: float32
    [T, N]; only columns [n0, n1) are written. bias: float32 [N] or None, added after the sum.
    Contract (nx_lowp.h): inputs rounded to bfloat16 (nearest even), one vdpbf16ps-order chain per
    output (odd element of each pair first, DAZ/FTZ): bit-identical for every band, T batching and
    isa ("generic" / "avx512bf16"; None = best).
    """
    fn = "matmul_bf16"
    _lowp_x(fn, x)
    cdef int wid = _wtype_id(fn, wtype)
    cdef const nx_lowp_wtype *wt = nx_lowp_wtype_of(wid)
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1]
    w = _lowp_w(fn, w, wid, wt, K)
    cdef Py_ssize_t N = w.shape[0]
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    bias = _lowp_bias(fn, bias, N)
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_lowp_variant v = _lowp_variant(fn, "bf16", isa)
    _no_alias(fn, "out", out, "x", x)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "bias", bias)
    if T == 0 or lo == hi:
        return out
    cdef size_t c0 = lo, c1 = hi
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int rc
    with nogil:
        rc = nx_matmul_bf16(v, wt, xp, wp, bp, op, <size_t>T, <size_t>K, <size_t>N, c0, c1)
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    if rc != 0:
        raise RuntimeError(f"{fn}: kernel returned {rc}")
    return out


def matmul_q8(x, w, out, n0=0, n1=None, *, bias=None, isa=None):
    """out[:, n0:n1] := ggml's Q8_0 x Q8_0 product of Q8_0(x) and w (+ bias[n0:n1]).

    x: float32 [T, K], K % 32 == 0, quantized per row to Q8_0 exactly as gguf.quants.quantize.
    w: Q8_0 weights only, raw rows uint8 [N, K/32*34] (other weight types: use matmul_bf16); may be
    read-only, never copied. out: float32 [T, N]; only columns [n0, n1) are written. bias: float32
    [N] or None, added after the sum. Contract (nx_lowp.h): per 32-block the int8 dot exact in
    int32, acc = fmaf((float)isum, dx*dw, acc) in block order from +0: bit-identical for every
    band, T batching and isa ("generic" / "avx512vnni"; None = best).
    """
    fn = "matmul_q8"
    _lowp_x(fn, x)
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: w must be a numpy.ndarray of raw Q8_0 bytes (uint8), "
                        f"got {type(w).__name__}")
    if w.dtype != np.uint8:
        raise TypeError(f"{fn}: w must be raw Q8_0 rows (uint8); matmul_q8 takes Q8_0 weights only "
                        f"(other weight types: matmul_bf16), got dtype={w.dtype}")
    _q8_rows(fn, "w", w, 2)
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1], N = w.shape[0]
    _check_k(fn, "x", K)
    if w.shape[1] != K // QK8_0 * Q8_0_BLOCK_BYTES:
        raise ValueError(f"{fn}: w is {w.shape} ({w.shape[1] // Q8_0_BLOCK_BYTES * QK8_0} values "
                         f"per row), but x is {x.shape} (K={K}: expected Q8_0 w of shape "
                         f"({N}, {K // QK8_0 * Q8_0_BLOCK_BYTES}))")
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    bias = _lowp_bias(fn, bias, N)
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_lowp_variant v = _lowp_variant(fn, "q8", isa)
    _no_alias(fn, "out", out, "x", x)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "bias", bias)
    if T == 0 or lo == hi:
        return out
    cdef size_t c0 = lo, c1 = hi
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int rc
    with nogil:
        rc = nx_matmul_q8(v, xp, wp, bp, op, <size_t>T, <size_t>K, <size_t>N, c0, c1)
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    if rc != 0:
        raise RuntimeError(f"{fn}: kernel returned {rc}")
    return out


def lowp_variants(precision):
    """Variant names this CPU/OS runs for `precision` ("bf16" or "q8"), generic first; ignores
    NXHPC_DISABLE_SIMD (which only changes what isa=None picks)."""
    if precision not in _LOWP_VARIANTS:
        raise ValueError(f"lowp_variants: precision must be 'bf16' or 'q8', got {precision!r}")
    name, v = _LOWP_VARIANTS[precision]
    return ["generic"] + ([name] if nx_lowp_variant_supported(v) else [])
