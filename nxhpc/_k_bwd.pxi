# _k_bwd.pxi -- included by _kernels.pyx (after _k_ops.pxi, whose helpers it uses). Wrappers of
# the backward (vector-Jacobian) kernels of the block's nonlinearities over nxhpc/csrc/nx_bwd*.c:
# rmsnorm_backward, rope_backward, qknorm_rope_backward, swiglu_backward,
# gated_residual_backward, attention_backward, and sum_partials (fixed-order reduction of
# per-band parameter-gradient partials).
# Owns: argument validation for these families (dtype, shape, contiguity, writeability, bands,
# overlap of outputs with inputs and with each other) and their nogil calls.
# Must not: compute anything itself.

cdef extern from "nx_bwd.h" nogil:
    nx_isa nx_bwd_variant(int slot, nx_isa isa)
    int nx_rmsnorm_bwd_f32(nx_isa isa, const float *x, const float *w, const float *mod,
                           const float *dy, float *dx, float *dw, float *dmod, int64_t D,
                           float eps, int64_t r0, int64_t r1)
    void nx_rope_bwd_f32(nx_isa isa, const float *dy, const float *pe, float *dx, int64_t T,
                         int64_t hd, int64_t r0, int64_t r1)
    int nx_qknorm_rope_bwd_f32(nx_isa isa, const float *qkv, const float *q_w, const float *k_w,
                               const float *pe, const float *dq, const float *dk, float *dqkv,
                               float *dq_w, float *dk_w, int64_t T, int64_t H, int64_t KVH,
                               int64_t hd, float eps, int64_t h0, int64_t h1)
    void nx_swiglu_bwd_f32(nx_isa isa, const float *a, const float *b, const float *dout,
                           float *da, float *db, int64_t i0, int64_t i1)
    int nx_gated_residual_bwd_f32(nx_isa isa, const float *y, const float *gate,
                                  const float *dout, float *dresid, float *dy, float *dgate,
                                  int64_t D, int64_t r0, int64_t r1)
    int nx_attention_bwd_f32(nx_isa isa, const float *q, const float *k, const float *v,
                             const float *dout, const uint8_t *mask, float *dq, float *dk,
                             float *dv, int64_t T, int64_t H, int64_t KVH, int64_t hd,
                             float scale, int64_t g0, int64_t g1)
    void nx_sum_partials_f32(const float *partials, float *out, int64_t n, int64_t D)


def _bwd_variant_name(int slot, int isa):
    """Name of the backward variant that runs slot `slot` (0 rmsnorm_backward, 1 rope_backward,
    2 qknorm_rope_backward, 3 swiglu_backward, 4 gated_residual_backward, 5 attention_backward:
    the order of NX_BWD_SLOTS) when ISA `isa` (an index into ISA_NAMES) is requested."""
    return nx_isa_name(nx_bwd_variant(slot, <nx_isa>isa)).decode()


cdef _opt_out_f32(str fn, str name, object a, tuple shape):
    """An optional output buffer: None, or float32 C-contiguous writeable of exactly `shape`."""
    if a is not None:
        _out_f32(fn, name, a, shape)


cdef _outputs_apart(str fn, list named):
    """No two (non-None) outputs may overlap in memory."""
    for i in range(len(named)):
        for j in range(i + 1, len(named)):
            (na, a), (nb, b) = named[i], named[j]
            if a is not None and b is not None and np.may_share_memory(a, b):
                raise ValueError(f"{fn}: outputs {na} and {nb} overlap in memory")


cdef inline float *_wptr_opt(object a):
    return _wptr(a) if a is not None else NULL


def rmsnorm_backward(x, w, dy, dx, eps, mod=None, dw=None, r0=0, r1=None, isa=None, dmod=None):
    """dx[r] := inv_r * (g - xhat * mean(g * xhat)) for rows [r0, r1), the gradient of
    y = rmsnorm(x, w) [* mod] (``rmsnorm``), with g = dy * w [* mod], xhat = x * inv_r,
    inv_r = 1 / sqrt(mean(x[r]^2) + eps).

    x, dy, dx: float32 [T, D]; w, mod: [D] (mod may be None). dx may be x or dy itself (in
    place); rows outside the band are untouched. Optional parameter gradients, written as the
    *partial* sum over the band's rows (float64 accumulation in ascending row order, rounded
    once): dw [D] := sum_r dy[r] * xhat[r] [* mod]; dmod [D] := sum_r dy[r] * xhat[r] * w (only
    with mod). To reduce partials reproducibly, split rows by a fixed partition that does not
    depend on the worker count (e.g. bands of 64 rows), give band b the row b of a float32
    [n_bands, D] array, and add them with ``sum_partials`` (fixed order). Everything is computed
    in float64 from the float32 inputs: every ISA variant gives bit-identical results.
    Returns dx.
    """
    fn = "rmsnorm_backward"
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
    _f32(fn, "dy", dy, 2)
    if dy.shape != x.shape:
        raise ValueError(f"{fn}: dy must have the shape of x {x.shape}, got {dy.shape}")
    _out_f32(fn, "dx", dx, (T, D))
    _opt_out_f32(fn, "dw", dw, (D,))
    _opt_out_f32(fn, "dmod", dmod, (D,))
    if dmod is not None and mod is None:
        raise ValueError(f"{fn}: dmod was given but mod is None (no modulation to differentiate)")
    cdef float feps = _real(fn, "eps", eps, True)
    _no_overlap(fn, "dx", dx, "x", x, True)
    _no_overlap(fn, "dx", dx, "dy", dy, True)
    for oname, o in (("dx", dx), ("dw", dw), ("dmod", dmod)):
        if o is None:
            continue
        for iname, i in (("w", w), ("mod", mod)):
            _no_overlap(fn, oname, o, iname, i, False)
        if oname != "dx":
            for iname, i in (("x", x), ("dy", dy)):
                _no_overlap(fn, oname, o, iname, i, False)
    _outputs_apart(fn, [("dx", dx), ("dw", dw), ("dmod", dmod)])
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    cdef const float *px = _cptr(x)
    cdef const float *pw = _cptr(w)
    cdef const float *pm = _cptr(mod) if mod is not None else NULL
    cdef const float *pdy = _cptr(dy)
    cdef float *pdx = _wptr(dx)
    cdef float *pdw = _wptr_opt(dw)
    cdef float *pdm = _wptr_opt(dmod)
    cdef int rc
    with nogil:  # an empty band still writes zero partials
        rc = nx_rmsnorm_bwd_f32(lvl, px, pw, pm, pdy, pdx, pdw, pdm, D, feps, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {2 * D} doubles of scratch")
    return dx


def rope_backward(dy, pe, dx, r0=0, r1=None, isa=None):
    """dx[.., t, 2i+c] := pe[t,i,0,c]*dy[.., t, 2i] + pe[t,i,1,c]*dy[.., t, 2i+1]: the transposed
    (for rotations: inverse) RoPE of ``qknorm_rope``'s layout, pe [T, hd/2, 2, 2].

    dy, dx: float32 [T, hd] or [n, T, hd] (heads-major, as qknorm_rope's q_out/k_out); the band
    [r0, r1) runs over the rows of the flattened [n*T, hd] view (row r is token r % T). dx may be
    dy itself; rows outside the band are untouched. Bit-identical across ISA variants. Returns dx.
    """
    fn = "rope_backward"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "dy", dy, -1)
    if dy.ndim not in (2, 3):
        raise ValueError(f"{fn}: dy must be [T, hd] or [n, T, hd], got shape {dy.shape}")
    cdef Py_ssize_t T = dy.shape[dy.ndim - 2], hd = dy.shape[dy.ndim - 1]
    if hd < 2 or hd % 2 != 0:
        raise ValueError(f"{fn}: head_dim (last dim of dy) must be even and >= 2, got shape "
                         f"{dy.shape}")
    _f32(fn, "pe", pe, 4)
    if tuple(pe.shape) != (T, hd // 2, 2, 2):
        raise ValueError(f"{fn}: pe must have shape {(T, hd // 2, 2, 2)} for dy {dy.shape}, "
                         f"got {pe.shape}")
    _out_f32(fn, "dx", dx, tuple(dy.shape))
    _no_overlap(fn, "dx", dx, "dy", dy, True)
    _no_overlap(fn, "dx", dx, "pe", pe, False)
    cdef Py_ssize_t R = dy.size // hd if T > 0 else 0
    lo, hi = _band(fn, "rows", r0, r1, R)
    cdef int64_t a = lo, b = hi
    if a == b:
        return dx
    cdef const float *pdy = _cptr(dy)
    cdef const float *ppe = _cptr(pe)
    cdef float *pdx = _wptr(dx)
    with nogil:
        nx_rope_bwd_f32(lvl, pdy, ppe, pdx, T, hd, a, b)
    return dx


def qknorm_rope_backward(qkv, q_w, k_w, pe, dq, dk, dqkv, n_heads, n_kv_heads, eps,
                         dq_w=None, dk_w=None, h0=0, h1=None, isa=None):
    """Gradient of ``qknorm_rope``: for heads j in [h0, h1) of the combined [q | k] head index and
    every token t, dqkv[t, j*hd:(j+1)*hd] := rmsnorm_backward(x, w, rope_backward(d)), with
    x = qkv[t, head j], w = q_w (j < H) or k_w, d = dq[j, t] (j < H) or dk[j-H, t].

    qkv, dqkv: float32 [T, (H+2*KVH)*hd]; q_w, k_w: [hd]; pe: [T, hd/2, 2, 2]; dq: [H, T, hd];
    dk: [KVH, T, hd]. Only the q/k columns of the band's heads are written (v columns are the
    caller's: the attention backward's dv). Optional dq_w / dk_w [hd]: partial sums over the
    band's q / k heads and all tokens of rope_backward(d) * xhat (float64 in ascending (head,
    token) order, rounded once; reduce bands with ``sum_partials``). Computed in float64 from
    the float32 inputs. Returns dqkv.
    """
    fn = "qknorm_rope_backward"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
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
    for name, wt in (("q_w", q_w), ("k_w", k_w)):
        _f32(fn, name, wt, 1)
        if wt.shape[0] != hd:
            raise ValueError(f"{fn}: {name} must have shape ({hd},), got {wt.shape}")
    _f32(fn, "pe", pe, 4)
    if tuple(pe.shape) != (T, hd // 2, 2, 2):
        raise ValueError(f"{fn}: pe must have shape {(T, hd // 2, 2, 2)}, got {pe.shape}")
    _f32(fn, "dq", dq, 3)
    if tuple(dq.shape) != (H, T, hd):
        raise ValueError(f"{fn}: dq must have shape {(H, T, hd)}, got {dq.shape}")
    _f32(fn, "dk", dk, 3)
    if tuple(dk.shape) != (KVH, T, hd):
        raise ValueError(f"{fn}: dk must have shape {(KVH, T, hd)}, got {dk.shape}")
    _out_f32(fn, "dqkv", dqkv, (T, width))
    _opt_out_f32(fn, "dq_w", dq_w, (hd,))
    _opt_out_f32(fn, "dk_w", dk_w, (hd,))
    cdef float feps = _real(fn, "eps", eps, True)
    for oname, o in (("dqkv", dqkv), ("dq_w", dq_w), ("dk_w", dk_w)):
        if o is None:
            continue
        for iname, i in (("qkv", qkv), ("q_w", q_w), ("k_w", k_w), ("pe", pe), ("dq", dq),
                         ("dk", dk)):
            _no_overlap(fn, oname, o, iname, i, False)
    _outputs_apart(fn, [("dqkv", dqkv), ("dq_w", dq_w), ("dk_w", dk_w)])
    lo, hi = _band(fn, "heads", h0, h1, H + KVH)
    cdef int64_t a = lo, b = hi
    cdef const float *pqkv = _cptr(qkv)
    cdef const float *pqw = _cptr(q_w)
    cdef const float *pkw = _cptr(k_w)
    cdef const float *ppe = _cptr(pe)
    cdef const float *pdq = _cptr(dq)
    cdef const float *pdk = _cptr(dk)
    cdef float *pout = _wptr(dqkv)
    cdef float *pdqw = _wptr_opt(dq_w)
    cdef float *pdkw = _wptr_opt(dk_w)
    cdef int rc
    with nogil:  # an empty band still writes zero partials
        rc = nx_qknorm_rope_bwd_f32(lvl, pqkv, pqw, pkw, ppe, pdq, pdk, pout, pdqw, pdkw,
                                    T, H, KVH, hd, feps, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {3 * hd} doubles of scratch")
    return dqkv


def swiglu_backward(a, b, dout, da, db, i0=0, i1=None, isa=None):
    """da := dout * b * silu'(a), db := dout * silu(a) over flat elements [i0, i1): the gradient of
    out = silu(a) * b (``swiglu``); silu'(x) = s(x) * (1 + x * (1 - s(x))), s = sigmoid.

    a, b, dout, da, db: float32, one shape, C-contiguous (treated flat). da and db may each be
    one of the inputs itself (in place) but must not overlap each other. Returns (da, db).
    """
    fn = "swiglu_backward"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "a", a, -1)
    for name, arr in (("b", b), ("dout", dout)):
        _f32(fn, name, arr, -1)
        if arr.shape != a.shape:
            raise ValueError(f"{fn}: {name} must have the shape of a {a.shape}, got {arr.shape}")
    _out_f32(fn, "da", da, tuple(a.shape))
    _out_f32(fn, "db", db, tuple(a.shape))
    for oname, o in (("da", da), ("db", db)):
        for iname, i in (("a", a), ("b", b), ("dout", dout)):
            _no_overlap(fn, oname, o, iname, i, True)
    _outputs_apart(fn, [("da", da), ("db", db)])
    lo, hi = _band(fn, "elements", i0, i1, a.size)
    cdef int64_t e0 = lo, e1 = hi
    if e0 == e1:
        return da, db
    cdef const float *pa = _cptr(a)
    cdef const float *pb = _cptr(b)
    cdef const float *pg = _cptr(dout)
    cdef float *pda = _wptr(da)
    cdef float *pdb = _wptr(db)
    with nogil:
        nx_swiglu_bwd_f32(lvl, pa, pb, pg, pda, pdb, e0, e1)
    return da, db


def gated_residual_backward(y, gate, dout, dresid, dy, dgate=None, r0=0, r1=None, isa=None):
    """Gradient of out = resid + tanh(gate) * y (``gated_residual``) for rows [r0, r1):
    dresid[r] := dout[r] (skipped when dresid is None: it is dout itself),
    dy[r] := dout[r] * tanh(gate), and dgate [D] := sech^2(gate) * sum_r dout[r] * y[r] as the
    *partial* sum over the band (float64 in ascending row order, rounded once; reduce bands
    with ``sum_partials``).

    y, dout, dy, dresid: float32 [T, D]; gate, dgate: [D]. dy may be dout or y itself; dresid
    may be dout itself (then nothing is copied). tanh and sech^2 are evaluated in float64 once
    per column: every ISA variant gives bit-identical results. Returns dy.
    """
    fn = "gated_residual_backward"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "y", y, 2)
    cdef Py_ssize_t T = y.shape[0], D = y.shape[1]
    _f32(fn, "gate", gate, 1)
    if gate.shape[0] != D:
        raise ValueError(f"{fn}: gate must have shape ({D},) to match y {y.shape}, "
                         f"got {gate.shape}")
    _f32(fn, "dout", dout, 2)
    if dout.shape != y.shape:
        raise ValueError(f"{fn}: dout must have the shape of y {y.shape}, got {dout.shape}")
    _opt_out_f32(fn, "dresid", dresid, (T, D))
    _out_f32(fn, "dy", dy, (T, D))
    _opt_out_f32(fn, "dgate", dgate, (D,))
    _no_overlap(fn, "dy", dy, "dout", dout, True)
    _no_overlap(fn, "dy", dy, "y", y, True)
    _no_overlap(fn, "dy", dy, "gate", gate, False)
    if dresid is not None:
        _no_overlap(fn, "dresid", dresid, "dout", dout, True)
        _no_overlap(fn, "dresid", dresid, "y", y, False)
        _no_overlap(fn, "dresid", dresid, "gate", gate, False)
    if dgate is not None:
        for iname, i in (("y", y), ("gate", gate), ("dout", dout)):
            _no_overlap(fn, "dgate", dgate, iname, i, False)
    _outputs_apart(fn, [("dresid", dresid), ("dy", dy), ("dgate", dgate)])
    lo, hi = _band(fn, "rows", r0, r1, T)
    cdef int64_t a = lo, b = hi
    cdef const float *py = _cptr(y)
    cdef const float *pg = _cptr(gate)
    cdef const float *pdo = _cptr(dout)
    cdef float *pdr = NULL
    if dresid is not None and not (dresid.__array_interface__["data"][0]
                                   == dout.__array_interface__["data"][0]):
        pdr = _wptr(dresid)
    cdef float *pdy = _wptr(dy)
    cdef float *pdg = _wptr_opt(dgate)
    cdef int rc
    with nogil:  # an empty band still writes zero partials
        rc = nx_gated_residual_bwd_f32(lvl, py, pg, pdo, pdr, pdy, pdg, D, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {3 * D} doubles of scratch")
    return dy


def attention_backward(q, k, v, dout, dq, dk, dv, scale, mask=None, g0=0, g1=None, isa=None):
    """Gradient of o[h] = softmax(q[h] k[g]^T * scale [masked]) v[g] (g = h // (H/KVH)) for the
    kv heads [g0, g1) and their query heads: with P recomputed row by row (never T^2 storage),
    dP = dO V^T, dS = P * (dP - rowsum(dP * P)):
    dq[h] := scale * dS K,  dk[g] := scale * sum_h dS^T Q,  dv[g] := sum_h P^T dO.

    Plain layouts: q, dout, dq float32 [H, T, hd]; k, v, dk, dv [KVH, T, hd] (KVH = k.shape[0];
    H % KVH == 0). From the forward's layouts: q and k are qknorm_rope's q_out / k_out; v is
    ``qkv[:, (H+KVH)*hd:].reshape(T, KVH, hd).transpose(1, 0, 2)`` (copied C-contiguous); dout
    is ``d_out.reshape(T, H, hd).transpose(1, 0, 2)`` of attention's out [T, H*hd]. The band is
    over kv heads because dk/dv sum over a group's query heads. mask: None or bool/uint8 [T]
    over keys (True = attend); a query whose keys are all masked has zero gradient.
    Returns (dq, dk, dv).
    """
    fn = "attention_backward"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "q", q, 3)
    cdef Py_ssize_t H = q.shape[0], T = q.shape[1], hd = q.shape[2]
    if H < 1 or hd < 1:
        raise ValueError(f"{fn}: q must be [H, T, hd] with H, hd >= 1, got shape {q.shape}")
    _f32(fn, "k", k, 3)
    cdef Py_ssize_t KVH = k.shape[0]
    if KVH < 1 or H % KVH != 0:
        raise ValueError(f"{fn}: k must be [KVH, T, hd] with H={H} a multiple of KVH >= 1, "
                         f"got shape {k.shape}")
    if tuple(k.shape) != (KVH, T, hd):
        raise ValueError(f"{fn}: k must have shape {(KVH, T, hd)}, got {k.shape}")
    _f32(fn, "v", v, 3)
    if tuple(v.shape) != (KVH, T, hd):
        raise ValueError(f"{fn}: v must have shape {(KVH, T, hd)}, got {v.shape}")
    _f32(fn, "dout", dout, 3)
    if tuple(dout.shape) != (H, T, hd):
        raise ValueError(f"{fn}: dout must have shape {(H, T, hd)}, got {dout.shape}")
    _out_f32(fn, "dq", dq, (H, T, hd))
    _out_f32(fn, "dk", dk, (KVH, T, hd))
    _out_f32(fn, "dv", dv, (KVH, T, hd))
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
    for oname, o in (("dq", dq), ("dk", dk), ("dv", dv)):
        for iname, i in (("q", q), ("k", k), ("v", v), ("dout", dout), ("mask", mask_u8)):
            _no_overlap(fn, oname, o, iname, i, False)
    _outputs_apart(fn, [("dq", dq), ("dk", dk), ("dv", dv)])
    lo, hi = _band(fn, "kv heads", g0, g1, KVH)
    cdef int64_t a = lo, b = hi
    if a == b or T == 0:
        return dq, dk, dv
    cdef const float *pq = _cptr(q)
    cdef const float *pk = _cptr(k)
    cdef const float *pv = _cptr(v)
    cdef const float *pdo = _cptr(dout)
    cdef const uint8_t *pm = NULL
    if mask_u8 is not None:
        pm = <const uint8_t *> cnp.PyArray_DATA(<cnp.ndarray> mask_u8)
    cdef float *pdq = _wptr(dq)
    cdef float *pdk = _wptr(dk)
    cdef float *pdv = _wptr(dv)
    cdef int rc
    with nogil:
        rc = nx_attention_bwd_f32(lvl, pq, pk, pv, pdo, pm, pdq, pdk, pdv, T, H, KVH, hd,
                                  fscale, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate scratch for T={T}, hd={hd}")
    return dq, dk, dv


def sum_partials(partials, out):
    """out[c] := sum_b partials[b, c], added in float64 in ascending b and rounded once.

    partials: float32 [n_bands, D] (one row per band's parameter-gradient partial, in band
    order); out: float32 [D], must not overlap partials. The order is fixed, so the total is
    bit-reproducible for a fixed band partition. Returns out.
    """
    fn = "sum_partials"
    _f32(fn, "partials", partials, 2)
    cdef Py_ssize_t n = partials.shape[0], D = partials.shape[1]
    _out_f32(fn, "out", out, (D,))
    _no_overlap(fn, "out", out, "partials", partials, False)
    cdef const float *pp = _cptr(partials)
    cdef float *po = _wptr(out)
    with nogil:
        nx_sum_partials_f32(pp, po, n, D)
    return out
