# Q8_0 kernel family (included by _kernels.pyx): quantize, dequantize, Q8_0 x float32 matmul,
# adaLN linear. Owns the validation of these wrappers and the Q8_0 block layout on the Python side
# (Q8_0_BLOCK_DTYPE). Must not: copy or write weight bytes (they may be a read-only memory map),
# or enter C before every shape, dtype, band and aliasing check has passed.
import operator

from libc.stdint cimport uint8_t

cdef extern from "nx_q8_0.h" nogil:
    void nx_q8_0_quantize(nx_isa isa, const float *x, uint8_t *out, size_t nblocks)
    void nx_q8_0_dequantize(nx_isa isa, const uint8_t *w, float *out, size_t nblocks)
    nx_isa nx_q8_0_convert_level(nx_isa isa)
    nx_isa nx_q8_0_matmul_level(nx_isa isa)
    int nx_q8_0_matmul(nx_isa isa, const float *x, const uint8_t *w, float *out,
                       size_t T, size_t K, size_t N, size_t n0, size_t n1)
    int nx_adaln_linear_f32(const float *t_emb, const float *w, const float *bias, float *out,
                            size_t K, size_t N, int silu_input)
    int nx_adaln_linear_q8_0(nx_isa isa, const float *t_emb, const uint8_t *w, const float *bias,
                             float *out, size_t K, size_t N, int silu_input)

# The block layout lives in pure Python (nxhpc.formats.ggml_blocks) so file tools need no build.
from nxhpc.formats.ggml_blocks import QK8_0, Q8_0_BLOCK_BYTES, Q8_0_BLOCK_DTYPE

_VARIANT_OF["q8_0_quantize"] = lambda isa: nx_isa_name(nx_q8_0_convert_level(<nx_isa>isa)).decode()
_VARIANT_OF["q8_0_dequantize"] = lambda isa: nx_isa_name(nx_q8_0_convert_level(<nx_isa>isa)).decode()
_VARIANT_OF["q8_0_matmul"] = lambda isa: nx_isa_name(nx_q8_0_matmul_level(<nx_isa>isa)).decode()
# Q8_0 weights run the q8_0_matmul variant reported here; float32 weights always the scalar loop.
_VARIANT_OF["adaln_linear"] = lambda isa: nx_isa_name(nx_q8_0_matmul_level(<nx_isa>isa)).decode()


cdef object _q8_rows(str fn, str name, object w, int ndim):
    """Check raw Q8_0 bytes: uint8 ndarray, C-contiguous, `ndim` dims (-1: >= 1), last dim % 34 == 0.

    Read-only arrays (memory maps) are accepted: weights are never written.
    """
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray of uint8 Q8_0 blocks, "
                        f"got {type(w).__name__}")
    if w.dtype != np.uint8:
        raise TypeError(f"{fn}: {name} must be uint8 (raw Q8_0 block bytes), got dtype={w.dtype}")
    if ndim >= 0 and w.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {w.shape}")
    if w.ndim < 1:
        raise ValueError(f"{fn}: {name} must have at least 1 dimension, got shape {w.shape}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous, got strides {w.strides}")
    if w.shape[w.ndim - 1] % Q8_0_BLOCK_BYTES != 0:
        raise ValueError(f"{fn}: {name} rows must be a multiple of {Q8_0_BLOCK_BYTES} bytes "
                         f"(Q8_0 blocks), got shape {w.shape}")
    return w


cdef _no_alias(str fn, str out_name, object out, str in_name, object a):
    if a is not None and np.may_share_memory(out, a):
        raise ValueError(f"{fn}: {out_name} must not overlap {in_name}")


cdef object _index(str fn, str name, object v):
    """Band bounds must be integers (int, numpy integer) or None; 2.5 is an error, not 2."""
    if v is None:
        return None
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an integer or None, got {v!r}") from None


cdef int _check_k(str fn, str name, Py_ssize_t K) except -1:
    if K % QK8_0 != 0:
        raise ValueError(f"{fn}: {name} has K={K}, which is not a multiple of {QK8_0} (Q8_0 block size)")
    return 0


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
    _check_k(fn, "x", K)
    oshape = tuple(x.shape[:x.ndim - 1]) + (K // QK8_0 * Q8_0_BLOCK_BYTES,)
    cdef nx_isa level = _resolve_isa(fn, isa)
    if out is None:
        out = np.empty(oshape, dtype=np.uint8)
    else:
        _q8_rows(fn, "out", out, len(oshape))
        if tuple(out.shape) != oshape:
            raise ValueError(f"{fn}: out must have shape {oshape}, got {out.shape}")
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


def q8_0_dequantize(w, out=None, isa=None):
    """out := d * q: uint8 Q8_0 bytes [..., K//32*34] -> float32 [..., K].

    Byte-identical to ``gguf.quants.dequantize(w, GGMLQuantizationType.Q8_0)`` (exact: d*q is
    representable in float32). `w` may be read-only.
    """
    fn = "q8_0_dequantize"
    _q8_rows(fn, "w", w, -1)
    cdef Py_ssize_t nbytes = w.shape[w.ndim - 1]
    oshape = tuple(w.shape[:w.ndim - 1]) + (nbytes // Q8_0_BLOCK_BYTES * QK8_0,)
    cdef nx_isa level = _resolve_isa(fn, isa)
    if out is None:
        out = np.empty(oshape, dtype=np.float32)
    else:
        _out_f32(fn, "out", out, oshape)
        _no_alias(fn, "out", out, "w", w)
    cdef size_t nblocks = <size_t>(w.size // Q8_0_BLOCK_BYTES)
    if nblocks == 0:
        return out
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    with nogil:
        nx_q8_0_dequantize(level, wp, op, nblocks)
    return out


def q8_0_matmul(x, w, out, n0=0, n1=None, isa=None):
    """out[:, n0:n1] := x @ dequant(w)[n0:n1].T  (float32 activations, exact Q8_0 weights).

    x: float32 [T, K], K % 32 == 0. w: uint8 [N, K//32*34], raw GGUF Q8_0 rows (may be a read-only
    memory map; never copied or written). out: float32 [T, N], writeable. Only columns [n0, n1) of
    out are written. Each out[t, n] is a fixed two-level float32 sum over k (128-step fma chains
    from +0 at k = 0, 128, ..., their sums added in order; see nx_q8_0.h), so the result is
    bit-identical for every band split, every T batching and every isa.
    """
    fn = "q8_0_matmul"
    _f32(fn, "x", x, 2)
    _q8_rows(fn, "w", w, 2)
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1], N = w.shape[0]
    _check_k(fn, "x", K)
    if w.shape[1] != K // QK8_0 * Q8_0_BLOCK_BYTES:
        raise ValueError(f"{fn}: w is {w.shape} ({w.shape[1] // Q8_0_BLOCK_BYTES * QK8_0} values "
                         f"per row), but x is {x.shape} (K={K}: expected w of shape "
                         f"({N}, {K // QK8_0 * Q8_0_BLOCK_BYTES}))")
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({T}, {N}), got None")
    _out_f32(fn, "out", out, (T, N))
    lo, hi = _band(fn, "columns of out", _index(fn, "n0", n0), _index(fn, "n1", n1), N)
    cdef nx_isa level = _resolve_isa(fn, isa)
    _no_alias(fn, "out", out, "x", x)
    _no_alias(fn, "out", out, "w", w)
    if T == 0 or lo == hi:
        return out
    cdef size_t c0 = lo, c1 = hi
    cdef const float *xp = <const float *>cnp.PyArray_DATA(x)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int rc
    with nogil:
        rc = nx_q8_0_matmul(level, xp, wp, op, <size_t>T, <size_t>K, <size_t>N, c0, c1)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (T={T}, K={K}, N={N})")
    return out


def adaln_linear(t_emb, w, bias, out, silu_input=False, isa=None):
    """out := w @ (silu(t_emb) if silu_input else t_emb) + bias.

    t_emb: float32 [K]. w: float32 [N, K] or Q8_0 uint8 [N, K//32*34] (K % 32 == 0). bias: float32
    [N] or None. out: float32 [N], writeable. Both storages run q8_0_matmul's two-level float32
    sum over k, then add the bias: a Q8_0 weight and its float32 dequantization give bit-identical
    output, at every isa (float32 weights always run the scalar loop).
    """
    fn = "adaln_linear"
    _f32(fn, "t_emb", t_emb, 1)
    cdef Py_ssize_t K = t_emb.shape[0], N
    cdef bint q8
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{fn}: w must be a numpy.ndarray (float32 [N, K] or uint8 Q8_0 "
                        f"[N, K//32*34]), got {type(w).__name__}")
    if w.dtype == np.uint8:
        q8 = True
        _q8_rows(fn, "w", w, 2)
        _check_k(fn, "t_emb", K)
        if w.shape[1] != K // QK8_0 * Q8_0_BLOCK_BYTES:
            raise ValueError(f"{fn}: Q8_0 w is {w.shape} but t_emb has K={K} "
                             f"(expected {K // QK8_0 * Q8_0_BLOCK_BYTES} bytes per row)")
    elif w.dtype == np.float32:
        q8 = False
        _f32(fn, "w", w, 2)
        if w.shape[1] != K:
            raise ValueError(f"{fn}: w is {w.shape} but t_emb has K={K}")
    else:
        raise TypeError(f"{fn}: w must be float32 or uint8 (Q8_0), got dtype={w.dtype}")
    N = w.shape[0]
    if bias is not None:
        _f32(fn, "bias", bias, 1)
        if bias.shape[0] != N:
            raise ValueError(f"{fn}: bias must have shape ({N},), got {bias.shape}")
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
    cdef const void *wp = <const void *>cnp.PyArray_DATA(w)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = <float *>cnp.PyArray_DATA(out)
    cdef int silu = 1 if silu_input else 0
    cdef int rc
    with nogil:
        if q8:
            rc = nx_adaln_linear_q8_0(level, tp, <const uint8_t *>wp, bp, op, <size_t>K,
                                      <size_t>N, silu)
        else:
            rc = nx_adaln_linear_f32(tp, <const float *>wp, bp, op, <size_t>K, <size_t>N, silu)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch (K={K})")
    return out
