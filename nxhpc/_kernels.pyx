# cython: language_level=3
"""nxhpc._kernels -- the only Cython module: validate arguments, then call nogil C kernels.

Owns: dtype/shape/contiguity checks with errors that name the argument and what was received,
band checks, ISA selection (``isa=None`` -> best usable variant), the views of the C probe and
dispatch tables (``cpu_features``, ``kernel_variants``). Must not: allocate per-row, hold the GIL
inside kernels, or enter C with unvalidated shapes.

Kernel families are split across ``.pxi`` files included below (one per family) so that they can
be developed independently; they all share the helpers defined here.
"""
import operator
import os

import numpy as np
cimport numpy as cnp

from nxhpc._kernels cimport (nx_isa, NX_ISA_GENERIC, NX_ISA_AVX2, NX_ISA_AVX512, NX_ISA_COUNT,
                             NX_CPU_NFEATURES, nx_cpu_features, nx_cpu_feature_name,
                             nx_cpu_best_isa, nx_cpu_isa_supported, nx_isa_name, nx_isa_parent,
                             nx_isa_needs, nx_isa_rank, nx_family_info, nx_families,
                             nx_nfamilies, nx_dispatch_init)

cnp.import_array()
nx_dispatch_init()  # probe the CPU and resolve every dispatch table once, before any fork

# Names come from the C tables (nx_cpu.h NX_ISA_LIST, nx_cpu.c feature names): one source.
_FEATURE_BITS = {nx_cpu_feature_name(i).decode(): 1 << i for i in range(NX_CPU_NFEATURES)}
ISA_NAMES = tuple(nx_isa_name(<nx_isa>i).decode() for i in range(NX_ISA_COUNT))
_ISA_BY_NAME = {name: i for i, name in enumerate(ISA_NAMES)}
# NXHPC_MAX_ISA caps the default ISA (nx_cpu_best_isa); a name the C tables do not know would
# silently cap nothing there, so it is an error here, before any kernel runs.
_MAX_ISA = os.environ.get("NXHPC_MAX_ISA", "")
if _MAX_ISA and _MAX_ISA not in _ISA_BY_NAME:
    from nxhpc.runtime.checks import SettingError
    _ranked = sorted(ISA_NAMES, key=lambda n: nx_isa_rank(<nx_isa>_ISA_BY_NAME[n]))
    raise SettingError(f"NXHPC_MAX_ISA={_MAX_ISA!r}: must be one of {', '.join(_ranked)} "
                       "(or unset)")

# NXHPC_DISABLE_SIMD: "1" runs the scalar spec, "0" or unset the SIMD kernels. The C reads any
# other non-empty value as "1": "false" or "off" would silently run 60x slower, so it is an
# error here too.
_DISABLE_SIMD = os.environ.get("NXHPC_DISABLE_SIMD", "")
if _DISABLE_SIMD not in ("", "0", "1"):
    from nxhpc.runtime.checks import SettingError
    raise SettingError(f"NXHPC_DISABLE_SIMD={_DISABLE_SIMD!r}: must be 1 (the scalar path), 0 "
                       "or unset")

# Families whose dispatch is not yet a C table register {name: callable(isa index) -> ISA name}
# here from their .pxi (kernel_variants() merges them with the C registry). Prefer a C table.
_VARIANT_OF = {}

# Older names of kernel_variants() entries still read (benchmarks) -> the slot that runs them.
_VARIANT_ALIASES = {"q8_0_matmul": "matmul"}


def _isa_info(int i):
    cdef uint32_t needs = nx_isa_needs(<nx_isa>i)
    return {"parent": ISA_NAMES[<int>nx_isa_parent(<nx_isa>i)],
            "rank": nx_isa_rank(<nx_isa>i),
            "needs": [n for n, bit in _FEATURE_BITS.items() if needs & bit],
            "supported": bool(nx_cpu_isa_supported(<nx_isa>i))}


cdef extern from "nx_sigbus.h" nogil:
    int nx_sigbus_install(const char *msg, int code)
    int nx_sigbus_uninstall()


def sigbus_exit(message, code=None):
    """For the CLIs only: on SIGBUS (a read of a mapped file past its end: a model file truncated
    or rewritten in place during the run) this process writes ``message`` (str, a line) to
    stderr and exits with ``code`` (1..125), from a C handler (Python's run too late for a
    fault). Forked children die by SIGBUS as before. ``message=None`` restores the action from
    before the first call."""
    if message is None:
        if nx_sigbus_uninstall() != 0:
            raise OSError("sigbus_exit: sigaction failed")
        return
    if not isinstance(message, str):
        raise TypeError(f"sigbus_exit: message must be a str or None, got {type(message).__name__}")
    if isinstance(code, bool) or not isinstance(code, int) or not 1 <= code <= 125:
        raise ValueError(f"sigbus_exit: code must be an int in 1..125, got {code!r}")
    cdef bytes b = message.encode("utf-8", "replace")[:1023]
    if nx_sigbus_install(b, code) != 0:
        raise OSError("sigbus_exit: sigaction failed")


def cpu_features():
    """CPU/OS features found by the probe (CPUID + OSXSAVE/xgetbv + Linux AMX permission).

    Returns a dict: each feature name (``"avx2"``, ``"avx512bf16"``, ``"amx_tile"``, the OS-state
    bits ``"os_ymm"``, ``"os_zmm"``, ``"os_amx"``, ``"amx_permitted"``, ...) -> bool;
    ``"best_isa"`` -> the ISA kernels use by default (``"generic"`` when ``NXHPC_DISABLE_SIMD`` is
    set; else the supported ISA of highest rank, at most ``NXHPC_MAX_ISA``'s when that is set:
    ``"max_isa"``), ``"supported_isas"`` -> the ISAs this CPU runs,
    ``"isas"`` -> per ISA its parent (where missing kernels come from), its preference rank, the
    features it needs and whether they are all present.
    """
    cdef uint32_t f = nx_cpu_features()
    out = {name: bool(f & bit) for name, bit in _FEATURE_BITS.items()}
    out["best_isa"] = nx_isa_name(nx_cpu_best_isa()).decode()
    out["supported_isas"] = supported_isas()
    out["isas"] = {ISA_NAMES[i]: _isa_info(i) for i in range(NX_ISA_COUNT)}
    out["simd_disabled"] = os.environ.get("NXHPC_DISABLE_SIMD", "0") not in ("", "0")
    out["max_isa"] = _MAX_ISA or None
    return out


def supported_isas():
    """ISAs this CPU/OS can run (ignores NXHPC_DISABLE_SIMD): a subset of ISA_NAMES, in order of
    preference rank (the last is the default one, unless NXHPC_MAX_ISA caps it)."""
    return sorted((n for i, n in enumerate(ISA_NAMES) if nx_cpu_isa_supported(<nx_isa>i)),
                  key=lambda n: nx_isa_rank(<nx_isa>_ISA_BY_NAME[n]))


def _variants_at(int isa):
    """{slot name: ISA name} of every slot of every dispatch family for a request of `isa`."""
    cdef const nx_family_info *fam
    cdef const char *name
    cdef int f, s
    cdef nx_isa v
    out = {}
    for f in range(nx_nfamilies):
        fam = nx_families[f]
        for s in range(fam.nslots):
            name = fam.slot_name(s)
            if name == NULL:
                continue
            v = fam.variant(s, <nx_isa>isa)
            out[name.decode()] = nx_isa_name(v).decode()
    for old, new in _VARIANT_ALIASES.items():
        out[old] = out[new]
    for kernel, variant_of in _VARIANT_OF.items():
        out.setdefault(kernel, variant_of(isa))
    return out


def kernel_variants():
    """Which compiled variant each kernel runs by default: {kernel: "generic"|"avx2"|"avx512"}.

    Read from the C dispatch tables (csrc/nx_dispatch.h): a kernel without a variant at the
    default ISA reports the ISA it inherits from. Weight types appear as ``"dequantize[F16]"``;
    ``"matmul"`` is the matmul of every type (``q8_0_matmul``, its older name, and
    ``adaln_linear`` run it).
    """
    return dict(sorted(_variants_at(<int>nx_cpu_best_isa()).items()))


def _variant(str kernel, str isa):
    """The ISA name whose code runs `kernel` (a kernel_variants() key) when `isa` is requested."""
    if isa not in _ISA_BY_NAME:
        raise ValueError(f"_variant: isa must be one of {ISA_NAMES}, got {isa!r}")
    table = _variants_at(_ISA_BY_NAME[isa])
    if kernel not in table:
        raise ValueError(f"_variant: unknown kernel {kernel!r} (known: {sorted(table)})")
    return table[kernel]


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
        if isinstance(lo, (bool, np.bool_)) or isinstance(hi, (bool, np.bool_)):
            raise TypeError
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
include "_k_lowp.pxi"
include "_k_conv.pxi"
include "_k_peak.pxi"
