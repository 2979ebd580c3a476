# _k_conv.pxi -- included by _kernels.pyx after _k_ops.pxi (whose helpers it uses). Wrappers of
# the convolutional kernels (nxhpc/csrc/nx_conv*.c): GroupNorm in three band-able steps
# (group_norm_partials, group_norm_coeffs, affine_act) and their one-call composition
# group_norm, the im2col panel of a 3x3 convolution, nearest x2 upsampling, the residual add.
# Activations are channels-last rows x[H*W, C] (csrc/nx_conv.h says why).
# Owns: argument validation for these kernels and their nogil calls. Must not: compute anything
# itself, or enter C before every shape, dtype, band and aliasing check passed.

cdef extern from "nx_conv.h" nogil:
    int nx_gn_partials_f32(nx_isa isa, const float *x, int64_t P, int64_t C, int64_t G,
                           int64_t chunk, double *part, int64_t k0, int64_t k1)
    void nx_gn_coeffs_f32(nx_isa isa, const double *part, int64_t P, int64_t C, int64_t G,
                          int64_t chunk, const float *gamma, const float *beta, float eps,
                          float *scale, float *shift)
    void nx_affine_act_f32(nx_isa isa, const float *x, const float *scale, const float *shift,
                           float *out, int64_t C, int silu, int64_t r0, int64_t r1)
    void nx_im2col3x3_f32(nx_isa isa, const float *x, int64_t H, int64_t W, int64_t C, int up,
                          float *panel, int64_t p0, int64_t p1)
    void nx_upsample2x_f32(nx_isa isa, const float *x, int64_t H, int64_t W, int64_t C,
                           float *out, int64_t p0, int64_t p1)
    void nx_add_f32(nx_isa isa, const float *a, const float *b, float *out, int64_t i0,
                    int64_t i1)
    int nx_conv3x3_f32(nx_isa isa, uint32_t type, const float *x, int64_t H, int64_t W,
                       int64_t C, int up, const uint8_t *w, const float *bias, float *out,
                       int64_t N, int64_t p0, int64_t p1)
    int nx_conv3x3_bf16(nx_isa isa, uint32_t type, const float *x, int64_t H, int64_t W,
                        int64_t C, int up, const uint8_t *w, const float *bias, float *out,
                        int64_t N, int64_t p0, int64_t p1, unsigned flags)

#: Rows per GroupNorm statistics chunk: the partition of the rows is fixed by this constant
#: (never by a band or a worker count), so the statistics are bit-identical for any split.
GN_CHUNK = 128


cdef tuple _gn_shape(str fn, object x, object groups):
    """x float32 [P, C] with C a multiple of groups >= 1 -> (P, C, G)."""
    _f32(fn, "x", x, 2)
    cdef Py_ssize_t G = _count(fn, "groups", groups)
    cdef Py_ssize_t P = x.shape[0], C = x.shape[1]
    if C < 1 or C % G != 0:
        raise ValueError(f"{fn}: x has C={C} channels (shape {x.shape}), which is not a "
                         f"positive multiple of groups={G}")
    return P, C, G


cdef object _partials(str fn, object part, tuple shape):
    if not isinstance(part, np.ndarray):
        raise TypeError(f"{fn}: partials must be a numpy.ndarray, got {type(part).__name__}")
    if part.dtype != np.float64:
        raise TypeError(f"{fn}: partials must be float64, got dtype={part.dtype}")
    if tuple(part.shape) != shape:
        raise ValueError(f"{fn}: partials must have shape {shape} (chunks, groups, 2), got "
                         f"{part.shape}")
    if not part.flags.c_contiguous:
        raise ValueError(f"{fn}: partials must be C-contiguous, got strides {part.strides}")
    return part


cdef Py_ssize_t _chunk(str fn, object chunk) except -1:
    return _count(fn, "chunk", chunk)


def group_norm_chunks(P, chunk=GN_CHUNK):
    """The number of statistics chunks of P rows: ceil(P / chunk)."""
    fn = "group_norm_chunks"
    cdef Py_ssize_t c = _chunk(fn, chunk)
    if isinstance(P, (bool, np.bool_)) or not isinstance(P, (int, np.integer)) or P < 0:
        raise ValueError(f"{fn}: P must be a non-negative integer, got {P!r}")
    return (int(P) + c - 1) // c


def group_norm_partials(x, groups, partials, k0=0, k1=None, *, chunk=GN_CHUNK, isa=None):
    """partials[k, g] := (mean, sum of squared deviations) of group g over chunk k's rows.

    x: float32 [P, C] channels-last rows, C % groups == 0; chunk k = rows [k*chunk,
    min((k+1)*chunk, P)). partials: float64 [ceil(P/chunk), groups, 2], writeable; only chunks
    [k0, k1) are written. Float64 sums in a fixed order (csrc/nx_conv.h): bit-identical for every
    band split and ISA. Returns partials.
    """
    fn = "group_norm_partials"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    P, C, G = _gn_shape(fn, x, groups)
    cdef Py_ssize_t ch = _chunk(fn, chunk)
    cdef Py_ssize_t nk = (P + ch - 1) // ch
    _partials(fn, partials, (nk, G, 2))
    if not partials.flags.writeable:
        raise ValueError(f"{fn}: partials is read-only")
    lo, hi = _band(fn, "chunks", _index(fn, "k0", k0), _index(fn, "k1", k1), nk)
    cdef int64_t a = lo, b = hi, iP = P, iC = C, iG = G, ich = ch
    if a == b:
        return partials
    cdef const float *px = _cptr(x)
    cdef double *pp = <double *> cnp.PyArray_DATA(<cnp.ndarray> partials)
    cdef int rc
    with nogil:
        rc = nx_gn_partials_f32(lvl, px, iP, iC, iG, ich, pp, a, b)
    if rc != 0:
        raise MemoryError(f"{fn}: could not allocate {2 * C} doubles of scratch")
    return partials


def group_norm_coeffs(partials, P, gamma, beta, eps, scale, shift, *, chunk=GN_CHUNK, isa=None):
    """scale, shift := GroupNorm's per-channel affine map from every chunk's partials.

    partials: float64 [ceil(P/chunk), G, 2] (group_norm_partials over all chunks of P rows);
    gamma, beta: float32 [C] (C % G == 0); eps >= 0. scale, shift: float32 [C], writeable. Then
    x * scale + shift = (x - mean_g) / sqrt(var_g + eps) * gamma + beta. Chunks merged in order
    in float64, each coefficient rounded once (csrc/nx_conv.h). Returns (scale, shift).
    """
    fn = "group_norm_coeffs"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(partials, np.ndarray) or partials.ndim != 3:
        raise ValueError(f"{fn}: partials must be a float64 [chunks, G, 2] array, got "
                         f"{getattr(partials, 'shape', type(partials).__name__)}")
    cdef Py_ssize_t ch = _chunk(fn, chunk)
    cdef Py_ssize_t nP = _count(fn, "P", P)
    cdef Py_ssize_t G = partials.shape[1]
    _partials(fn, partials, ((nP + ch - 1) // ch, G, 2))
    _f32(fn, "gamma", gamma, 1)
    cdef Py_ssize_t C = gamma.shape[0]
    if G < 1 or C < 1 or C % G != 0:
        raise ValueError(f"{fn}: gamma has {C} channels, which is not a positive multiple of "
                         f"the partials' {G} groups")
    _f32(fn, "beta", beta, 1)
    if beta.shape[0] != C:
        raise ValueError(f"{fn}: beta must have shape ({C},), got {beta.shape}")
    cdef float feps = _real(fn, "eps", eps, True)
    _out_f32(fn, "scale", scale, (C,))
    _out_f32(fn, "shift", shift, (C,))
    if np.may_share_memory(scale, shift):
        raise ValueError(f"{fn}: scale overlaps shift in memory")
    for oname, o in (("scale", scale), ("shift", shift)):
        for iname, i in (("gamma", gamma), ("beta", beta), ("partials", partials)):
            _no_overlap(fn, oname, o, iname, i, False)
    cdef int64_t iP = nP, iC = C, iG = G, ich = ch
    cdef const double *pp = <const double *> cnp.PyArray_DATA(<cnp.ndarray> partials)
    cdef const float *pg = _cptr(gamma)
    cdef const float *pb = _cptr(beta)
    cdef float *ps = _wptr(scale)
    cdef float *pt = _wptr(shift)
    with nogil:
        nx_gn_coeffs_f32(lvl, pp, iP, iC, iG, ich, pg, pb, feps, ps, pt)
    return scale, shift


def affine_act(x, scale, shift, out, r0=0, r1=None, *, silu=False, isa=None):
    """out[r] := act(x[r] * scale + shift) for rows [r0, r1) of x [P, C]; act = silu or identity.

    scale, shift: float32 [C]; out: float32 [P, C], may be x itself (in place); other rows
    untouched. (x * scale) + shift unfused in float32 (bit-identical across ISAs); silu =
    y / (1 + exp(-y)) with the ISA's exp (generic: libm; SIMD: the shared polynomial).
    Returns out.
    """
    fn = "affine_act"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(silu, (bool, np.bool_)):
        raise TypeError(f"{fn}: silu must be a bool, got {type(silu).__name__} {silu!r}")
    _f32(fn, "x", x, 2)
    cdef Py_ssize_t P = x.shape[0], C = x.shape[1]
    for name, v in (("scale", scale), ("shift", shift)):
        _f32(fn, name, v, 1)
        if v.shape[0] != C:
            raise ValueError(f"{fn}: {name} must have shape ({C},) for x {x.shape}, got "
                             f"{v.shape}")
    _out_f32(fn, "out", out, (P, C))
    _no_overlap(fn, "out", out, "x", x, True)
    _no_overlap(fn, "out", out, "scale", scale, False)
    _no_overlap(fn, "out", out, "shift", shift, False)
    lo, hi = _band(fn, "rows", _index(fn, "r0", r0), _index(fn, "r1", r1), P)
    cdef int64_t a = lo, b = hi, iC = C
    cdef int isilu = 1 if silu else 0
    if a == b or C == 0:
        return out
    cdef const float *px = _cptr(x)
    cdef const float *ps = _cptr(scale)
    cdef const float *pt = _cptr(shift)
    cdef float *po = _wptr(out)
    with nogil:
        nx_affine_act_f32(lvl, px, ps, pt, po, iC, isilu, a, b)
    return out


def group_norm(x, groups, gamma, beta, eps, out, *, silu=False, chunk=GN_CHUNK, isa=None):
    """out := act(GroupNorm(x)) in one call: group_norm_partials over every chunk,
    group_norm_coeffs, affine_act over every row (the three steps a worker pool runs in bands).

    x, out: float32 [P, C] (out may be x); gamma, beta: float32 [C]; groups divides C; the
    statistics are the population mean and variance over all P rows and the group's C/groups
    channels. Returns out.
    """
    fn = "group_norm"
    P, C, G = _gn_shape(fn, x, groups)
    if P == 0:
        _out_f32(fn, "out", out, (P, C))
        return out
    partials = np.empty((group_norm_chunks(P, chunk), G, 2), dtype=np.float64)
    scale = np.empty(C, dtype=np.float32)
    shift = np.empty(C, dtype=np.float32)
    group_norm_partials(x, G, partials, chunk=chunk, isa=isa)
    group_norm_coeffs(partials, P, gamma, beta, eps, scale, shift, chunk=chunk, isa=isa)
    return affine_act(x, scale, shift, out, silu=silu, isa=isa)


cdef tuple _image(str fn, object x, object H, object W):
    """x float32 [H*W, C], C >= 1 -> (H, W, C)."""
    cdef Py_ssize_t h = _count(fn, "H", H), w = _count(fn, "W", W)
    _f32(fn, "x", x, 2)
    if x.shape[0] != h * w or x.shape[1] < 1:
        raise ValueError(f"{fn}: x must be [H*W, C] = [{h * w}, C >= 1] for H={h}, W={w}, got "
                         f"shape {x.shape}")
    return h, w, x.shape[1]


def im2col3x3(x, H, W, panel, p0=0, p1=None, *, upsample=False, isa=None):
    """panel := the im2col rows of a 3x3 convolution (stride 1, padding 1) for output pixels
    [p0, p1) of the image x [H*W, C] -- read through a nearest x2 upsampling if `upsample`
    (output grid 2H x 2W).

    panel: float32 [p1 - p0, 9*C], row t = pixel p0 + t, column c*9 + ky*3 + kx = the input at
    (y + ky - 1, x + kx - 1), channel c (0 outside the image): the column order of a conv weight
    [C_out, C, 3, 3] seen as [C_out, 9*C], so ``matmul(panel, weight)`` is the convolution.
    Copies only (bit-exact at every ISA). Returns panel.
    """
    fn = "im2col3x3"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(upsample, (bool, np.bool_)):
        raise TypeError(f"{fn}: upsample must be a bool, got {type(upsample).__name__}")
    h, w, C = _image(fn, x, H, W)
    cdef int up = 1 if upsample else 0
    cdef Py_ssize_t npix = (h << up) * (w << up)
    lo, hi = _band(fn, "output pixels", _index(fn, "p0", p0), _index(fn, "p1", p1), npix)
    _out_f32(fn, "panel", panel, (hi - lo, 9 * C))
    _no_overlap(fn, "panel", panel, "x", x, False)
    cdef int64_t a = lo, b = hi, iH = h, iW = w, iC = C
    if a == b:
        return panel
    cdef const float *px = _cptr(x)
    cdef float *pp = _wptr(panel)
    with nogil:
        nx_im2col3x3_f32(lvl, px, iH, iW, iC, up, pp, a, b)
    return panel


def conv3x3(x, H, W, w, wtype, out, p0=0, p1=None, *, bias=None, upsample=False, isa=None):
    """out[p0:p1] := the 3x3 convolution (stride 1, padding 1) of the image x [H*W, C] -- read
    through a nearest x2 upsampling if `upsample` -- with the weight w as stored ([C_out, C, 3, 3]
    seen as [C_out, 9*C] rows of GGML type `wtype`: raw block bytes uint8, or for F32 / F16 /
    BF16 the element array float32 / float16 / uint16), float32 (+ bias [C_out] after the sum):
    output pixels [p0, p1) of the (2H x 2W if `upsample` else H x W) grid; other rows of out
    [pixels, C_out] untouched.

    The bits of ``im2col3x3`` then ``matmul`` at the same isa on any panel split, but no panel
    is made: the SIMD matmuls take the im2col rows as their packer asks for them, so one call
    covers the whole band (its weight decoded once per token block, not once per panel).
    Returns out.
    """
    return _conv3x3("conv3x3", x, H, W, w, wtype, out, p0, p1, bias, upsample, isa, False)


def conv3x3_bf16(x, H, W, w, wtype, out, p0=0, p1=None, *, bias=None, upsample=False,
                 isa=None):
    """``conv3x3`` in ``bf16``: the bits of ``im2col3x3`` then ``matmul_bf16`` at the same isa
    on any panel split (the matmul_bf16 contract), no panel made. Returns out."""
    return _conv3x3("conv3x3_bf16", x, H, W, w, wtype, out, p0, p1, bias, upsample, isa, True)


cdef object _conv3x3(str fn, object x, object H, object W, object w, object wtype, object out,
                     object p0, object p1, object bias, object upsample, object isa, bint bf16):
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    if not isinstance(upsample, (bool, np.bool_)):
        raise TypeError(f"{fn}: upsample must be a bool, got {type(upsample).__name__}")
    h, wd, C = _image(fn, x, H, W)
    cdef int up = 1 if upsample else 0
    cdef Py_ssize_t npix = (h << up) * (wd << up)
    wid, tname, E, B = _wtype(fn, wtype)
    cdef uint32_t tid = wid
    cdef Py_ssize_t K = 9 * C
    if K % E != 0:
        raise ValueError(f"{fn}: the weight's rows hold 9*C = {K} values (C={C}), which is not a "
                         f"multiple of {E} ({tname} block size)")
    w = _lowp_w(fn, w, wid, tname, E, B, K)
    cdef Py_ssize_t N = w.shape[0]
    if out is None:
        raise TypeError(f"{fn}: out must be a float32 array of shape ({npix}, {N}), got None")
    _out_f32(fn, "out", out, (npix, N))
    bias = _lowp_bias(fn, bias, N)
    lo, hi = _band(fn, "output pixels", _index(fn, "p0", p0), _index(fn, "p1", p1), npix)
    _no_alias(fn, "out", out, "x", x)
    _no_alias(fn, "out", out, "w", w)
    _no_alias(fn, "out", out, "bias", bias)
    if lo == hi:
        return out
    cdef int64_t a = lo, b = hi, iH = h, iW = wd, iC = C, iN = N
    cdef const float *px = _cptr(x)
    cdef const uint8_t *wp = <const uint8_t *>cnp.PyArray_DATA(w)
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>cnp.PyArray_DATA(bias)
    cdef float *op = _wptr(out)
    cdef int rc
    with nogil:
        if bf16:
            rc = nx_conv3x3_bf16(lvl, tid, px, iH, iW, iC, up, wp, bp, op, iN, a, b, 0)
        else:
            rc = nx_conv3x3_f32(lvl, tid, px, iH, iW, iC, up, wp, bp, op, iN, a, b)
    if rc == -1:
        raise MemoryError(f"{fn}: could not allocate scratch buffers (pixels={hi - lo}, K={K}, "
                          f"N={N})")
    if rc != 0:
        raise RuntimeError(f"{fn}: kernel returned {rc}")
    return out


def upsample_nearest2x(x, H, W, out, p0=0, p1=None, *, isa=None):
    """out[p] := x[(yo // 2) * W + xo // 2] for output pixels p in [p0, p1) of the 2H x 2W grid
    (yo, xo = divmod(p, 2W)): nearest x2 upsampling of x [H*W, C] into out [4*H*W, C]; other
    rows untouched. Returns out."""
    fn = "upsample_nearest2x"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    h, w, C = _image(fn, x, H, W)
    _out_f32(fn, "out", out, (4 * h * w, C))
    _no_overlap(fn, "out", out, "x", x, False)
    lo, hi = _band(fn, "output pixels", _index(fn, "p0", p0), _index(fn, "p1", p1), 4 * h * w)
    cdef int64_t a = lo, b = hi, iH = h, iW = w, iC = C
    if a == b:
        return out
    cdef const float *px = _cptr(x)
    cdef float *po = _wptr(out)
    with nogil:
        nx_upsample2x_f32(lvl, px, iH, iW, iC, po, a, b)
    return out


def add(a, b, out, i0=0, i1=None, *, isa=None):
    """out := a + b over flat elements [i0, i1) (the residual add); a, b, out float32 of one
    shape (any ndim, C-contiguous); out may be a or b itself. Returns out."""
    fn = "add"
    cdef nx_isa lvl = _resolve_isa(fn, isa)
    _f32(fn, "a", a, -1)
    _f32(fn, "b", b, -1)
    if b.shape != a.shape:
        raise ValueError(f"{fn}: b must have the shape of a {a.shape}, got {b.shape}")
    _out_f32(fn, "out", out, tuple(a.shape))
    _no_overlap(fn, "out", out, "a", a, True)
    _no_overlap(fn, "out", out, "b", b, True)
    lo, hi = _band(fn, "elements", _index(fn, "i0", i0), _index(fn, "i1", i1), a.size)
    cdef int64_t e0 = lo, e1 = hi
    if e0 == e1:
        return out
    cdef const float *pa = _cptr(a)
    cdef const float *pb = _cptr(b)
    cdef float *po = _wptr(out)
    with nogil:
        nx_add_f32(lvl, pa, pb, po, e0, e1)
    return out
