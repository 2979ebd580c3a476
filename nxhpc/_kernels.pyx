# cython: language_level=3
"""nxhpc._kernels -- the only Cython module: validate arguments, then call nogil C kernels.

Owns: dtype/shape/contiguity checks with errors that name the argument and what was received,
band checks, ISA selection (``isa=None`` -> best usable variant). Must not: allocate per-row,
hold the GIL inside kernels, or enter C with unvalidated shapes.

Kernel families are split across ``.pxi`` files included below (one per family) so that they can
be developed independently; they all share the helpers defined here.
"""
import operator
import os

import numpy as np
cimport numpy as cnp

from nxhpc._kernels cimport (nx_isa, NX_ISA_GENERIC, NX_ISA_AVX2, NX_ISA_AVX512,
                             nx_cpu_features, nx_cpu_best_isa, nx_cpu_isa_supported,
                             nx_isa_name)

cnp.import_array()

_FEATURE_BITS = {
    "sse2": 1 << 0, "avx": 1 << 1, "avx2": 1 << 2, "fma": 1 << 3, "f16c": 1 << 4,
    "avx512f": 1 << 5, "avx512bw": 1 << 6, "avx512vl": 1 << 7, "avx512dq": 1 << 8,
    "avx512vnni": 1 << 9, "avx512bf16": 1 << 10, "os_ymm": 1 << 11, "os_zmm": 1 << 12,
}
_ISA_BY_NAME = {"generic": NX_ISA_GENERIC, "avx2": NX_ISA_AVX2, "avx512": NX_ISA_AVX512}
ISA_NAMES = ("generic", "avx2", "avx512")

# family name -> callable(isa_int) -> name of the variant that actually runs for that request.
# Each .pxi registers its families here.
_VARIANT_OF = {}


def cpu_features():
    """CPU/OS features found by the probe (CPUID + OSXSAVE/xgetbv), plus the ISA level in use.

    Returns a dict: each feature name -> bool, ``"best_isa"`` -> the level kernels use by default
    (``"generic"`` when ``NXHPC_DISABLE_SIMD`` is set), ``"supported_isas"`` -> levels this CPU runs.
    """
    cdef uint32_t f = nx_cpu_features()
    out = {name: bool(f & bit) for name, bit in _FEATURE_BITS.items()}
    out["best_isa"] = nx_isa_name(nx_cpu_best_isa()).decode()
    out["supported_isas"] = [n for n in ISA_NAMES if nx_cpu_isa_supported(_ISA_BY_NAME[n])]
    out["simd_disabled"] = os.environ.get("NXHPC_DISABLE_SIMD", "0") not in ("", "0")
    return out


def supported_isas():
    """ISA levels this CPU/OS can run (ignores NXHPC_DISABLE_SIMD): a subset of ISA_NAMES."""
    return [n for n in ISA_NAMES if nx_cpu_isa_supported(_ISA_BY_NAME[n])]


def kernel_variants():
    """Which compiled variant each kernel family runs by default: {family: "generic"|"avx2"|"avx512"}."""
    cdef nx_isa best = nx_cpu_best_isa()
    return {fam: fn(<int>best) for fam, fn in sorted(_VARIANT_OF.items())}


cdef nx_isa _resolve_isa(str fn, object isa) except *:
    """None -> best usable level; a name -> that level, if this CPU supports it."""
    if isa is None:
        return nx_cpu_best_isa()
    if not isinstance(isa, str) or isa not in _ISA_BY_NAME:
        raise ValueError(f"{fn}: isa must be None or one of {ISA_NAMES}, got {isa!r}")
    cdef nx_isa level = _ISA_BY_NAME[isa]
    if not nx_cpu_isa_supported(level):
        raise ValueError(f"{fn}: isa={isa!r} is not supported on this CPU "
                         f"(supported: {supported_isas()})")
    return level


cdef object _f32(str fn, str name, object a, int ndim):
    """Check that `a` is a float32, C-contiguous ndarray with `ndim` dims; return it."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{fn}: {name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{fn}: {name} must be float32, got dtype={a.dtype}")
    if ndim >= 0 and a.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous, got strides {a.strides}")
    return a


cdef object _out_f32(str fn, str name, object a, tuple shape):
    """Check an output buffer: float32, C-contiguous, writeable, exactly `shape`."""
    _f32(fn, name, a, len(shape))
    if tuple(a.shape) != shape:
        raise ValueError(f"{fn}: {name} must have shape {shape}, got {a.shape}")
    if not a.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only")
    return a


cdef tuple _band(str fn, str what, object lo, object hi, Py_ssize_t n):
    """Validate a half-open band [lo, hi) within [0, n); hi=None means n."""
    if hi is None:
        hi = n
    if lo is None:
        lo = 0
    try:
        lo_i = operator.index(lo)
        hi_i = operator.index(hi)
    except TypeError:
        raise TypeError(f"{fn}: band bounds for {what} must be integers, got {lo!r}, {hi!r}") from None
    if not (0 <= lo_i <= hi_i <= n):
        raise ValueError(f"{fn}: band [{lo_i}, {hi_i}) for {what} is out of range [0, {n}]")
    return lo_i, hi_i


include "_k_matmul.pxi"
include "_k_ops.pxi"
include "_k_bwd.pxi"
include "_k_quants.pxi"
include "_k_lowp.pxi"
