# _k_ops.pxi -- included by _kernels.pyx. Wrappers of the block's non-matmul forward kernels
# (rmsnorm, layernorm_mod, qknorm_rope, attention, swiglu, gated_residual, norm_residual) over
# nxhpc/csrc/nx_ops*.c.
# Owns: argument validation for these families (dtype, shape, contiguity, writeability, bands,
# overlap of outputs with inputs) and their nogil calls. Must not: compute anything itself.
import math as _math

from libc.stdint cimport uint8_t, int64_t

cdef extern from "nx_ops.h" nogil:
    void nx_rmsnorm_f32(nx_isa isa, const float *x, const float *w, const float *mod, float *out,
                        int64_t D, float eps, int64_t r0, int64_t r1)
    void nx_qknorm_rope_f32(nx_isa isa, const float *qkv, const float *q_w, const float *k_w,
                            const float *pe, float *q_out, float *k_out, int64_t T, int64_t H,
                            int64_t KVH, int64_t hd, float eps, int64_t h0, int64_t h1,
                            int half)
    int nx_attention_f32(nx_isa isa, const float *q, const float *k, const float *qkv,
                         const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH,
                         int64_t hd, float scale, int64_t h0, int64_t h1, int64_t t0,
                         int64_t t1, int causal)
    void nx_swiglu_f32(nx_isa isa, const float *a, const float *b, float *out,
                       int64_t i0, int64_t i1)
    int nx_gated_residual_f32(nx_isa isa, const float *resid, const float *y, const float *gate,
                              float *out, int64_t D, int64_t r0, int64_t r1)
    int nx_norm_residual_f32(nx_isa isa, const float *y, const float *w, const float *resid,
                             const float *gate, float *out, const float *w2, const float *mod2,
                             float *h, int64_t D, float eps, int64_t r0, int64_t r1)
    void nx_vmath_f32(nx_isa isa, int which, const float *x, float *out, int64_t n)
    void nx_layernorm_mod_f32(nx_isa isa, const float *x, const float *mod, float *out,
                              int64_t D, float eps, int64_t r0, int64_t r1)

cdef extern from "nx_attn_bf16.h" nogil:
    int nx_attention_bf16(nx_isa isa, const float *q, const float *k, const float *qkv,
                          const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH,
                          int64_t hd, float scale, int64_t h0, int64_t h1, int64_t t0,
                          int64_t t1, int causal)
    int nx_attn_bf16_dot()
    int nx_attn_bf16_set_dot(int mode)

#: The precisions of attention(): "f32" (float32 throughout, nx_ops.h) and "bf16" (Q K^T and P V
#: on the bfloat16 dot, softmax statistics in float32: nx_attn_bf16.h).
ATTENTION_PRECISIONS = ("f32", "bf16")


cdef inline const float *_cptr(object a):
    return <const float *> cnp.PyArray_DATA(<cnp.ndarray> a)


cdef inline float *_wptr(object a):
    return <float *> cnp.PyArray_DATA(<cnp.ndarray> a)


#: float32's largest finite value: a scalar above it would be inf in the kernels.
cdef double _F32_MAX = 3.4028234663852886e38
#: The largest count a kernel argument may be: products of two counts (H * W, rows * heads)
#: stay within Py_ssize_t.
cdef Py_ssize_t _COUNT_MAX = 2147483647


cdef float _real(str fn, str name, object v, bint nonneg) except? -1:
    """A finite real scalar (python or numpy number, not bool) as float32."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{fn}: {name} must be a real number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond a double's range
        raise ValueError(f"{fn}: {name} must be a finite number within float32's range, got an "
                         f"integer of {int(v).bit_length()} bits") from None
    # finite as float32, the kernels' type: a double above float32's largest value is inf there
    if not _math.isfinite(f) or abs(f) > _F32_MAX or (nonneg and f < 0):
        raise ValueError(f"{fn}: {name} must be a finite{' non-negative' if nonneg else ''} "
                         f"number within float32's range (|v| <= {_F32_MAX:.6g}), got {v!r}")
    return <float> f


cdef Py_ssize_t _count(str fn, str name, object v) except -1:
    """A positive integer count (python or numpy integer, not bool)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{fn}: {name} must be an integer, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{fn}: {name} must be >= 1, got {v}")
    if v > _COUNT_MAX:
        raise ValueError(f"{fn}: {name} = {v} is too large (at most {_COUNT_MAX})")
    return <Py_ssize_t> v


cdef _no_overlap(str fn, str out_name, object out, str in_name, object a, bint allow_same):
    """Outputs must not partially overlap inputs (allow_same: exactly the same buffer is fine)."""
    if a is None or not np.may_share_memory(out, a):
        return
    if (allow_same and out.shape == a.shape
            and out.__array_interface__["data"][0] == a.__array_interface__["data"][0]):
        return
    raise ValueError(f"{fn}: {out_name} overlaps {in_name} in memory"
                     + (" (only exactly the same array is allowed)" if allow_same else ""))


def rmsnorm(x, w, out, eps, mod=None, r0=0, r1=None, isa=None):
    """out[r] := x[r] / sqrt(mean(x[r]^2) + eps) * w [* mod], rows [r0, r1) of x [T, D].

    w, mod: float32 [D] (mod may be None). out: float32 [T, D], may be x itself (in place); rows
    outside the band are untouched. The sum of squares is accumulated in float64 in a fixed
    order, so every ISA variant gives bit-identical results. Returns out.
    """
    fn = "rmsnorm"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1]
    if D < 1:
        raise ValueError(f"{fn}: x must have at least one column, got shape {x.shape}")
    _f32(fn, "w", w, 1)
    if w.shape[0] != D:
        raise ValueError(f"{fn}: w must have shape ({D},) to match x {x.shape}, got {w.shape}")
    if mod is not None:
        _f32(fn, "mod", mod, 1)
        if mod.shape[0] != D:
            raise ValueError(f"{fn}: mod must have shape ({D},) to match x {x.shape}, "
                             f"got {mod.shape}")
    _out_f32(fn, "out", out, (T, D))
    cdef float feps = _real(fn, "eps", eps, True)
    _no_overlap(fn, "out", out, "x", x, True)
    _no_overlap(fn, "out", out, "w", w, False)
    _no_overlap(fn, "out", out, "mod", mod, False)
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    if a == b:
        return out
    cdef const float *px = _cptr(x)
    cdef const float *pw = _cptr(w)
    cdef const float *pm = _cptr(mod) if mod is not None else NULL
    cdef float *po = _wptr(out)
    with nogil:
        nx_rmsnorm_f32(lvl, px, pw, pm, po, D, feps, a, b)
    return out


def layernorm_mod(x, mod, out, eps, r0=0, r1=None, *, isa=None):
    """out[r] := (x[r] - mean(x[r])) / sqrt(var(x[r]) + eps) * mod, rows [r0, r1) of x [T, D].

    LayerNorm without affine (population variance) times a per-column modulation ``mod``
    (float32 [D]; the denoiser's final layer passes 1 + scale). out: float32 [T, D], may be x
    itself (in place); rows outside the band are untouched. Statistics in float64 in a fixed
    order, the scaling ``((x - mean) * r) * mod`` in float32 (csrc/nx_ops.h): every ISA variant
    gives bit-identical results, for any band split. Returns out.
    """
    fn = "layernorm_mod"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], D = x.shape[1]
    if D < 1:
        raise ValueError(f"{fn}: x must have at least one column, got shape {x.shape}")
    _f32(fn, "mod", mod, 1)
    if mod.shape[0] != D:
        raise ValueError(f"{fn}: mod must have shape ({D},) to match x {x.shape}, got {mod.shape}")
    _out_f32(fn, "out", out, (T, D))
    cdef float feps = _real(fn, "eps", eps, True)
    _no_overlap(fn, "out", out, "x", x, True)
    _no_overlap(fn, "out", out, "mod", mod, False)
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    if a == b:
        return out
    cdef const float *px = _cptr(x)
    cdef const float *pm = _cptr(mod)
    cdef float *po = _wptr(out)
    with nogil:
        nx_layernorm_mod_f32(lvl, px, pm, po, D, feps, a, b)
    return out


_ROPE_PAIRS = {"adjacent": 0, "half": 1}


def qknorm_rope(qkv, q_w, k_w, pe, q_out, k_out, n_heads, n_kv_heads, eps, h0=0, h1=None,
                isa=None, *, rope_pairs="adjacent"):
    """q_out[j, t], k_out[j-H, t] := rope(rmsnorm(qkv[t, head j], q_w|k_w), pe[t]), heads [h0, h1).

    qkv: float32 [T, (H+2*KVH)*hd] (row = [q heads | k heads | v heads]); q_w, k_w: [hd];
    pe: [T, hd/2, 2, 2], pe[t, i] the 2x2 matrix of pair i; q_out: [H, T, hd]; k_out: [KVH, T,
    hd]. rope_pairs: "adjacent" (default) rotates the pairs (2i, 2i+1),
    out[2i+r] = pe[t,i,r,0]*y[2i] + pe[t,i,r,1]*y[2i+1]; "half" (NEOX / HF rotate_half, Qwen3)
    the pairs (i, i+hd/2), out[i + r*hd/2] = pe[t,i,r,0]*y[i] + pe[t,i,r,1]*y[i+hd/2]. The band
    runs over the combined head index j in [0, H+KVH): j < H is query head j, else key head
    j-H. Bit-identical across ISA variants. Returns (q_out, k_out).
    """
    fn = "qknorm_rope"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(rope_pairs, str):
        raise TypeError(f"{fn}: rope_pairs must be a str ('adjacent' or 'half'), got "
                        f"{type(rope_pairs).__name__}")
    if rope_pairs not in _ROPE_PAIRS:
        raise ValueError(f"{fn}: rope_pairs must be 'adjacent' or 'half', got {rope_pairs!r}")
    cdef int half = _ROPE_PAIRS[rope_pairs]
    cdef Py_ssize_t H = _count(fn, "n_heads", n_heads)
    cdef Py_ssize_t KVH = _count(fn, "n_kv_heads", n_kv_heads)
    if H % KVH != 0:
        raise ValueError(f"{fn}: n_heads={H} is not a multiple of n_kv_heads={KVH}")
    _f32(fn, "qkv", qkv, 2)
    cdef Py_ssize_t T = qkv.shape[0], width = qkv.shape[1]
    if width % (H + 2 * KVH) != 0 or width == 0:
        raise ValueError(f"{fn}: qkv width {width} is not (n_heads + 2*n_kv_heads) * head_dim "
                         f"with n_heads={H}, n_kv_heads={KVH}")
    cdef Py_ssize_t hd = width // (H + 2 * KVH)
    if hd % 2 != 0:
        raise ValueError(f"{fn}: head_dim must be even for RoPE pairs, got {hd} "
                         f"(qkv shape {qkv.shape})")
    _f32(fn, "q_w", q_w, 1)
    if q_w.shape[0] != hd:
        raise ValueError(f"{fn}: q_w must have shape ({hd},), got {q_w.shape}")
    _f32(fn, "k_w", k_w, 1)
    if k_w.shape[0] != hd:
        raise ValueError(f"{fn}: k_w must have shape ({hd},), got {k_w.shape}")
    _f32(fn, "pe", pe, 4)
    if tuple(pe.shape) != (T, hd // 2, 2, 2):
        raise ValueError(f"{fn}: pe must have shape {(T, hd // 2, 2, 2)}, got {pe.shape}")
    _out_f32(fn, "q_out", q_out, (H, T, hd))
    _out_f32(fn, "k_out", k_out, (KVH, T, hd))
    cdef float feps = _real(fn, "eps", eps, True)
    for oname, o in (("q_out", q_out), ("k_out", k_out)):
        for iname, i in (("qkv", qkv), ("q_w", q_w), ("k_w", k_w), ("pe", pe)):
            _no_overlap(fn, oname, o, iname, i, False)
    _no_overlap(fn, "q_out", q_out, "k_out", k_out, False)
    lo, hi = _band(fn, "heads", h0, h1, H + KVH)
    cdef int64_t a = lo, b = hi
    if a == b or T == 0:
        return q_out, k_out
    cdef const float *pqkv = _cptr(qkv)
    cdef const float *pqw = _cptr(q_w)
    cdef const float *pkw = _cptr(k_w)
    cdef const float *ppe = _cptr(pe)
    cdef float *pqo = _wptr(q_out)
    cdef float *pko = _wptr(k_out)
    with nogil:
        nx_qknorm_rope_f32(lvl, pqkv, pqw, pkw, ppe, pqo, pko, T, H, KVH, hd, feps, a, b, half)
    return q_out, k_out


def attention(q, k, qkv, out, n_kv_heads, scale, mask=None, h0=0, h1=None, isa=None, *,
              causal=False, precision="f32", t0=0, t1=None):
    """out[:, h*hd:(h+1)*hd] := softmax(q[h] k[g]^T * scale, masked keys excluded) v[g], h in [h0, h1).

    q: float32 [H, T, hd]; k: [KVH, T, hd]; v is read from qkv [T, (H+2*KVH)*hd] at columns
    (H+KVH)*hd + g*hd, g = h // (H/KVH); out: [T, H*hd], other heads' columns untouched.
    mask: None or bool/uint8 [T] over keys (True/nonzero = attend); a query whose keys are all
    masked gets zeros. causal: if True, query row t attends keys j <= t only (the mask, if given,
    still applies to those); the default False is the full attention, unchanged. Flash-style (key
    tiles, online softmax): scratch is one packed K^T per kv head (T*hd floats) plus
    O(tile*hd), never T^2. Returns out.
    precision: "f32" (the default: float32 throughout, its bits unchanged) or "bf16" (q, k, v
    rounded to bfloat16, Q K^T and P V on the bfloat16 dot with P rounded to bfloat16, softmax
    max/sum in float32, float32 output: the contract and error bound of csrc/nx_attn_bf16.h,
    bit-identical for every isa, head band and worker split; kernel_variants() key
    "attention_bf16").
    t0, t1: the query rows [t0, t1) computed (default all; rows outside are left untouched).
    Every key is still read, and a row's result is the same bits whatever band it is computed
    in, so a single head (the autoencoder's mid attention) splits over workers by rows.
    """
    fn = "attention"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(precision, str) or precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"{fn}: precision must be one of {ATTENTION_PRECISIONS}, "
                         f"got {precision!r}")
    cdef bint bf16 = precision == "bf16"
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal must be a bool, got {type(causal).__name__} {causal!r}")
    cdef int icausal = 1 if causal else 0
    cdef Py_ssize_t KVH = _count(fn, "n_kv_heads", n_kv_heads)
    _f32(fn, "q", q, 3)
    cdef Py_ssize_t H = q.shape[0], T = q.shape[1], hd = q.shape[2]
    if H < 1 or hd < 1:
        raise ValueError(f"{fn}: q must be [H, T, hd] with H, hd >= 1, got shape {q.shape}")
    if H % KVH != 0:
        raise ValueError(f"{fn}: n_heads={H} (from q {q.shape}) is not a multiple of "
                         f"n_kv_heads={KVH}")
    _f32(fn, "k", k, 3)
    if tuple(k.shape) != (KVH, T, hd):
        raise ValueError(f"{fn}: k must have shape {(KVH, T, hd)}, got {k.shape}")
    _f32(fn, "qkv", qkv, 2)
    if tuple(qkv.shape) != (T, (H + 2 * KVH) * hd):
        raise ValueError(f"{fn}: qkv must have shape {(T, (H + 2 * KVH) * hd)}, got {qkv.shape}")
    _out_f32(fn, "out", out, (T, H * hd))
    cdef float fscale = _real(fn, "scale", scale, False)
    mask_u8 = None
    if mask is not None:
        if not isinstance(mask, np.ndarray):
            raise TypeError(f"{fn}: mask must be None or a numpy.ndarray, got {type(mask).__name__}")
        if mask.dtype != np.bool_ and mask.dtype != np.uint8:
            raise TypeError(f"{fn}: mask must be bool or uint8, got dtype={mask.dtype}")
        if tuple(mask.shape) != (T,):
            raise ValueError(f"{fn}: mask must have shape ({T},), got {mask.shape}")
        if not mask.flags.c_contiguous:
            raise ValueError(f"{fn}: mask must be C-contiguous, got strides {mask.strides}")
        mask_u8 = mask.view(np.uint8)
    for iname, i in (("q", q), ("k", k), ("qkv", qkv), ("mask", mask_u8)):
        _no_overlap(fn, "out", out, iname, i, False)
    lo, hi = _band(fn, "heads", h0, h1, H)
    cdef int64_t a = lo, b = hi
    rlo, rhi = _band(fn, "query rows", t0, t1, T)
    cdef int64_t ra = rlo, rb = rhi
    if a == b or ra == rb:
        return out
    cdef const float *pq = _cptr(q)
    cdef const float *pk = _cptr(k)
    cdef const float *pqkv = _cptr(qkv)
    cdef const uint8_t *pm = NULL
    if mask_u8 is not None:
        pm = <const uint8_t *> cnp.PyArray_DATA(<cnp.ndarray> mask_u8)
    cdef float *po = _wptr(out)
    cdef int rc
    with nogil:
        if bf16:
            rc = nx_attention_bf16(lvl, pq, pk, pqkv, pm, po, T, H, KVH, hd, fscale, a, b, ra,
                                   rb, icausal)
        else:
            rc = nx_attention_f32(lvl, pq, pk, pqkv, pm, po, T, H, KVH, hd, fscale, a, b, ra, rb,
                                  icausal)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch for T={T}, hd={hd}")
    return out


#: The dots of the AVX-512 BF16 `bf16` attention (nx_attn_bf16.h), by attention_bf16_dot's name.
_ATTN_BF16_DOTS = {"auto": 0, "fma": 1, "vdpbf16ps": 2}


def attention_bf16_dot(choice=None):
    """The dot the AVX-512 BF16 `bf16` attention runs: "fma" or "vdpbf16ps" (same bits).

    "fma" runs each of the contract's steps as a vfmadd231ps on bfloat16-valued float32 under
    MXCSR DAZ|FTZ; "vdpbf16ps" a pair's two steps as one vdpbf16ps. Which is faster is the
    CPU's (vdpbf16ps retires half the float32 FMA's multiply-adds a cycle on the AMX Xeon, twice
    them on AMD Zen 4), so by default ("auto") the first call that needs it times the fma_zmm
    and bf16_zmm peak loops once and takes the faster (a fraction of a millisecond). With
    `choice` ("auto", "fma" or "vdpbf16ps") the choice is set for this process (and the workers
    it forks afterwards); "auto" measures again. Returns the choice in force. Only the
    `avx512bf16` variant reads it: the AMX, AVX2 and generic variants have one dot each, and a
    CPU without AVX-512 BF16 reports "fma".
    """
    fn = "attention_bf16_dot"
    cdef int rc
    if choice is not None:
        if not isinstance(choice, str) or choice not in _ATTN_BF16_DOTS:
            raise ValueError(f"{fn}: choice must be one of {tuple(_ATTN_BF16_DOTS)} or None, "
                             f"got {choice!r}")
        rc = nx_attn_bf16_set_dot(_ATTN_BF16_DOTS[choice])
        if rc < 0:
            raise ValueError(f"{fn}: {choice!r} cannot run here (the CPU has no AVX-512 BF16)")
    else:
        rc = nx_attn_bf16_dot()
    return "vdpbf16ps" if rc == 2 else "fma"


def swiglu(a, b, out, i0=0, i1=None, isa=None):
    """out := silu(a) * b over flat elements [i0, i1); silu(x) = x / (1 + exp(-x)).

    a, b, out: float32, any equal shape, C-contiguous (treated flat). out may be a or b itself.
    Returns out.
    """
    fn = "swiglu"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "a", a, -1)
    _f32(fn, "b", b, -1)
    if b.shape != a.shape:
        raise ValueError(f"{fn}: b must have the shape of a {a.shape}, got {b.shape}")
    _out_f32(fn, "out", out, tuple(a.shape))
    _no_overlap(fn, "out", out, "a", a, True)
    _no_overlap(fn, "out", out, "b", b, True)
    lo, hi = _band(fn, "elements", i0, i1, a.size)
    cdef int64_t e0 = lo, e1 = hi
    if e0 == e1:
        return out
    cdef const float *pa = _cptr(a)
    cdef const float *pb = _cptr(b)
    cdef float *po = _wptr(out)
    with nogil:
        nx_swiglu_f32(lvl, pa, pb, po, e0, e1)
    return out


def gated_residual(resid, y, gate, out, r0=0, r1=None, isa=None):
    """out[r] := resid[r] + tanh(gate) * y[r] for rows [r0, r1); gate [D] broadcast per column.

    resid, y, out: float32 [T, D]; out may be resid (or y) itself. Returns out.
    """
    fn = "gated_residual"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "resid", resid, 2)
    cdef Py_ssize_t T = resid.shape[0], D = resid.shape[1]
    _f32(fn, "y", y, 2)
    if y.shape != resid.shape:
        raise ValueError(f"{fn}: y must have the shape of resid {resid.shape}, got {y.shape}")
    _f32(fn, "gate", gate, 1)
    if gate.shape[0] != D:
        raise ValueError(f"{fn}: gate must have shape ({D},) to match resid {resid.shape}, "
                         f"got {gate.shape}")
    _out_f32(fn, "out", out, (T, D))
    _no_overlap(fn, "out", out, "resid", resid, True)
    _no_overlap(fn, "out", out, "y", y, True)
    _no_overlap(fn, "out", out, "gate", gate, False)
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    if a == b or D == 0:
        return out
    cdef const float *pr = _cptr(resid)
    cdef const float *py = _cptr(y)
    cdef const float *pg = _cptr(gate)
    cdef float *po = _wptr(out)
    cdef int rc
    with nogil:
        rc = nx_gated_residual_f32(lvl, pr, py, pg, po, D, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {D} floats of scratch")
    return out


def norm_residual(y, w, resid, gate, out, eps, w2=None, mod2=None, h=None, r0=0, r1=None,
                  isa=None):
    """A block's residual tail in one pass over each row of ``[r0, r1)``:
    ``out[r] := resid[r] + tanh(gate) * rmsnorm(y[r], w)``, and with ``w2`` also
    ``h[r] := rmsnorm(out[r], w2) [* mod2]``.

    The bits of ``rmsnorm(y, w, tmp, eps)``, ``gated_residual(resid, tmp, gate, out)`` and
    ``rmsnorm(out, w2, h, eps, mod=mod2)`` of the same ISA variant, reading y once and never
    writing it (the normalized y stays in registers). y, resid, out, h: float32 [T, D]; w, gate,
    w2, mod2: float32 [D]. out may be resid or y itself; h (given exactly when w2 is) must not
    overlap any other argument; mod2 needs w2. Returns out.
    """
    fn = "norm_residual"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "y", y, 2)
    cdef Py_ssize_t T = y.shape[0], D = y.shape[1]
    if D < 1:
        raise ValueError(f"{fn}: y must have at least one column, got shape {y.shape}")
    _f32(fn, "resid", resid, 2)
    if resid.shape != y.shape:
        raise ValueError(f"{fn}: resid must have the shape of y {y.shape}, got {resid.shape}")
    for name, v in (("w", w), ("gate", gate), ("w2", w2), ("mod2", mod2)):
        if v is None and name in ("w", "gate"):
            raise TypeError(f"{fn}: {name} must be a float32 array of shape ({D},), got None")
        if v is not None:
            _f32(fn, name, v, 1)
            if v.shape[0] != D:
                raise ValueError(f"{fn}: {name} must have shape ({D},) to match y {y.shape}, "
                                 f"got {v.shape}")
    if (w2 is None) != (h is None):
        raise ValueError(f"{fn}: w2 and h go together (the second norm's weight and output), "
                         f"got w2={'None' if w2 is None else 'an array'}, "
                         f"h={'None' if h is None else 'an array'}")
    if mod2 is not None and w2 is None:
        raise ValueError(f"{fn}: mod2 multiplies the second norm, which needs w2 and h")
    _out_f32(fn, "out", out, (T, D))
    cdef float feps = _real(fn, "eps", eps, True)
    _no_overlap(fn, "out", out, "y", y, True)
    _no_overlap(fn, "out", out, "resid", resid, True)
    for name, v in (("w", w), ("gate", gate), ("w2", w2), ("mod2", mod2)):
        _no_overlap(fn, "out", out, name, v, False)
    if h is not None:
        _out_f32(fn, "h", h, (T, D))
        for name, v in (("y", y), ("resid", resid), ("out", out), ("w", w), ("gate", gate),
                        ("w2", w2), ("mod2", mod2)):
            _no_overlap(fn, "h", h, name, v, False)
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    if a == b:
        return out
    cdef const float *py = _cptr(y)
    cdef const float *pw = _cptr(w)
    cdef const float *pr = _cptr(resid)
    cdef const float *pg = _cptr(gate)
    cdef float *po = _wptr(out)
    cdef const float *pw2 = _cptr(w2) if w2 is not None else NULL
    cdef const float *pm2 = _cptr(mod2) if mod2 is not None else NULL
    cdef float *ph = _wptr(h) if h is not None else NULL
    cdef int rc
    with nogil:
        rc = nx_norm_residual_f32(lvl, py, pw, pr, pg, po, pw2, pm2, ph, D, feps, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {D} floats of scratch")
    return out


_VMATH = {"exp": 0, "tanh": 1, "exp_nosub": 2}


def _vmath(func, x, out, isa=None):
    """Test hook: out := exp(x) (func="exp"), tanh(x) (func="tanh") or exp(x) as the float32
    attention's softmax computes it (func="exp_nosub": exp's bits, subnormal results made
    without an underflowing scaling step), element-wise, with the given variant's
    implementation (SIMD polynomials; libm for generic, both exps). Returns out."""
    fn = "_vmath"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if func not in _VMATH:
        raise ValueError(f"{fn}: func must be 'exp', 'tanh' or 'exp_nosub', got {func!r}")
    _f32(fn, "x", x, -1)
    _out_f32(fn, "out", out, tuple(x.shape))
    _no_overlap(fn, "out", out, "x", x, True)
    cdef int which = _VMATH[func]
    cdef int64_t n = x.size
    cdef const float *px = _cptr(x)
    cdef float *po = _wptr(out)
    with nogil:
        nx_vmath_f32(lvl, which, px, po, n)
    return out
