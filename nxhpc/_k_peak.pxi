# Peak loops (included by _kernels.pyx): register-only loops of the instructions the kernels are
# built on (csrc/nx_peak.h: FMA on ymm / zmm, vpmaddubsw, vpdpbusd on zmm / ymm, vdpbf16ps, AMX
# tdpbssd / tdpbf16ps), so
# that speed figures can be set against what this CPU issues. Owns the validation of peak()'s
# kind, iteration count and operands; the timing lives in nxhpc.runtime.peak. Must not: enter a
# loop whose ISA the probe has not reported, or write into the caller's arrays.
from libc.stdint cimport uint64_t

cdef extern from "nx_peak.h" nogil:
    enum: NX_PEAK_COUNT
    ctypedef struct nx_peak_info:
        const char *name
        nx_isa isa
        size_t a_bytes, b_bytes, acc_bytes
        uint64_t ops_per_iter
    const nx_peak_info *nx_peak_get(int kind)
    int nx_peak_supported(int kind)
    void nx_peak_run(int kind, size_t iters, const void *a, const void *b, void *acc)

#: The peak kinds of csrc/nx_peak.h, in its order.
PEAK_KINDS = tuple(nx_peak_get(i).name.decode() for i in range(NX_PEAK_COUNT))
_PEAK_INDEX = {name: i for i, name in enumerate(PEAK_KINDS)}

# Operand layouts (dtype, shape) of a, b, acc per kind: the contract of nx_peak.h.
_F32, _I32, _U16 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint16)
_PEAK_LAYOUT = {
    "fma_ymm": ((_F32, (8,)), (_F32, (8,)), (_F32, (12, 8))),
    "i8_ymm": ((np.dtype(np.uint8), (32,)), (np.dtype(np.int8), (32,)),
               (np.dtype(np.int16), (12, 16))),
    "fma_zmm": ((_F32, (16,)), (_F32, (16,)), (_F32, (16, 16))),
    "vnni_zmm": ((np.dtype(np.uint8), (64,)), (np.dtype(np.int8), (64,)), (_I32, (16, 16))),
    "bf16_zmm": ((_U16, (32,)), (_U16, (32,)), (_F32, (16, 16))),
    "amx_int8": ((np.dtype(np.int8), (2, 16, 64)), (np.dtype(np.int8), (2, 16, 64)),
                 (_I32, (4, 16, 16))),
    "amx_bf16": ((_U16, (2, 16, 32)), (_U16, (2, 16, 32)), (_F32, (4, 16, 16))),
    "vnni_ymm": ((np.dtype(np.uint8), (32,)), (np.dtype(np.int8), (32,)), (_I32, (12, 8))),
}
_BF16_ONE = 0x3F80  # bfloat16 bits of 1.0


def _peak_layout_matches_c():
    for i, name in enumerate(PEAK_KINDS):
        p = nx_peak_get(i)
        got = tuple(dt.itemsize * int(np.prod(shape)) for dt, shape in _PEAK_LAYOUT[name])
        if got != (p.a_bytes, p.b_bytes, p.acc_bytes):
            raise ImportError(f"_k_peak.pxi: layout of {name!r} is {got} bytes, nx_peak.h says "
                              f"{(p.a_bytes, p.b_bytes, p.acc_bytes)}")


_peak_layout_matches_c()


def _peak_default(str kind):
    """The operands the timing runs use: values whose recurrences stay finite and normal for
    any iteration count (fma: a = 0.5, b = 1 converges to 2; the dot products add small
    integers: int32 wraps, float32 saturates at a large normal value)."""
    (da, sa), (db, sb), (dc, sc) = _PEAK_LAYOUT[kind]
    if kind.startswith("fma"):
        return np.full(sa, 0.5, da), np.full(sb, 1.0, db), np.zeros(sc, dc)
    one = _BF16_ONE if da == _U16 else 1
    return np.full(sa, one, da), np.full(sb, one, db), np.zeros(sc, dc)


def peak_supported():
    """The peak kinds this CPU/OS runs (PEAK_KINDS order); none under NXHPC_DISABLE_SIMD=1."""
    return [name for i, name in enumerate(PEAK_KINDS) if nx_peak_supported(i)]


def peak_kinds():
    """{kind: {"isa", "supported", "ops_per_iter", "a", "b", "acc"}} for every peak kind: the ISA
    target its loop is compiled for, whether it runs here, the operations one iteration counts
    (2 per multiply-add), and each operand's (dtype name, shape)."""
    out = {}
    for i, name in enumerate(PEAK_KINDS):
        p = nx_peak_get(i)
        lay = _PEAK_LAYOUT[name]
        out[name] = {"isa": nx_isa_name(p.isa).decode(), "supported": bool(nx_peak_supported(i)),
                     "ops_per_iter": int(p.ops_per_iter),
                     **{k: (dt.name, shape) for k, (dt, shape) in zip(("a", "b", "acc"), lay)}}
    return out


cdef object _peak_operand(str fn, str kind, str name, object arr, object dt, tuple shape):
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray ({dt.name} {shape} for {kind!r}), "
                        f"got {type(arr).__name__}")
    if arr.dtype != dt:
        raise TypeError(f"{fn}: {name} for {kind!r} must be {dt.name}, got dtype={arr.dtype}")
    if tuple(arr.shape) != shape:
        raise ValueError(f"{fn}: {name} for {kind!r} must have shape {shape}, got {arr.shape}")
    return np.ascontiguousarray(arr)


#: The most iterations one call takes (~10 minutes of the slowest kind's loop at 4 GHz).
PEAK_MAX_ITERS = 1 << 40


def peak(kind, iters, a=None, b=None, acc=None):
    """Run `iters` iterations of the register-only loop of peak `kind` (csrc/nx_peak.h):
    (operations done, the final accumulators).

    kind: a name of PEAK_KINDS that this CPU supports (peak_supported()). iters: int in
    [0, PEAK_MAX_ITERS]. a, b, acc: the operands and starting accumulators in the kind's layout
    (peak_kinds()[kind]; nx_peak.h gives the recurrence); None takes the timing defaults (a and
    b constant, acc zero). acc is not modified: the result is a new array. Operations are
    iters * ops_per_iter, counting 2 per multiply-add. The GIL is released during the loop.
    """
    fn = "peak"
    if not isinstance(kind, str) or kind not in _PEAK_INDEX:
        raise ValueError(f"{fn}: kind must be one of {PEAK_KINDS}, got {kind!r}")
    cdef int k = _PEAK_INDEX[kind]
    if not nx_peak_supported(k):
        why = ("NXHPC_DISABLE_SIMD is set" if cpu_features()["simd_disabled"]
               else f"needs the {nx_isa_name(nx_peak_get(k).isa).decode()!r} ISA")
        raise ValueError(f"{fn}: kind {kind!r} is not supported on this CPU ({why}); "
                         f"supported: {peak_supported()}")
    if isinstance(iters, bool):
        raise TypeError(f"{fn}: iters must be an int, got {iters!r}")
    try:
        n = operator.index(iters)
    except TypeError:
        raise TypeError(f"{fn}: iters must be an int, got {type(iters).__name__}") from None
    if not 0 <= n <= PEAK_MAX_ITERS:
        raise ValueError(f"{fn}: iters must be in [0, {PEAK_MAX_ITERS}], got {n}")
    da, db, dc = _peak_default(kind)
    (ta, sa), (tb, sb), (tc, sc) = _PEAK_LAYOUT[kind]
    a = da if a is None else _peak_operand(fn, kind, "a", a, ta, sa)
    b = db if b is None else _peak_operand(fn, kind, "b", b, tb, sb)
    c = dc if acc is None else np.array(_peak_operand(fn, kind, "acc", acc, tc, sc), order="C")
    cdef const void *ap = cnp.PyArray_DATA(a)
    cdef const void *bp = cnp.PyArray_DATA(b)
    cdef void *cp = cnp.PyArray_DATA(c)
    cdef size_t ni = n
    with nogil:
        nx_peak_run(k, ni, ap, bp, cp)
    return n * int(nx_peak_get(k).ops_per_iter), c
