"""Per-core peaks measured at run time: operations per second of the register-only loops of
``nxhpc._kernels.peak`` (FMA on ymm / zmm, vpmaddubsw, vpdpbusd, vdpbf16ps, AMX tdpbssd /
tdpbf16ps), so that speed figures are set against the CPU they ran on instead of a figure from
another machine.

Owns: the timing (one thread, CPU time of that thread, best of a few runs), the table of
kinds by precision and the kind of the code that runs a kernel (``kind_for``; ``variant_at``:
the code that an ISA asked for runs). Must not: import the compiled kernels at import time (it
is part of ``runtime``, which works unbuilt: the kernels are imported on the first
measurement), or assert anything about speed.

    python -m nxhpc.runtime.peak          # this CPU's table, GOP/s per core
"""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["KINDS", "PRECISION_KINDS", "measure", "rates", "peaks", "supported", "reachable",
           "kind_for", "variant_at"]

#: Every peak kind (csrc/nx_peak.h), in its order.
KINDS = ("fma_ymm", "i8_ymm", "fma_zmm", "vnni_zmm", "bf16_zmm", "amx_int8", "amx_bf16",
         "vnni_ymm")

#: Per precision tier, the kinds whose instructions its kernels run, fastest unit first:
#: ``f32`` FMA, ``bf16`` bfloat16 dot products, ``q8`` int8 dot products.
PRECISION_KINDS = {"f32": ("fma_zmm", "fma_ymm"), "bf16": ("amx_bf16", "bf16_zmm"),
                   "q8": ("amx_int8", "vnni_zmm", "vnni_ymm", "i8_ymm")}

# The ISA of the code that runs a kernel (a kernel_variants() value) -> the peak kind of the
# instructions that code issues, per precision (bf16 at avx2: float32 FMAs on bfloat16 values).
_KIND_OF_VARIANT = {"f32": {"avx2": "fma_ymm", "avx512": "fma_zmm"},
                    "bf16": {"avx2": "fma_ymm", "avx512bf16": "bf16_zmm", "amx": "amx_bf16",
                             # the bf16 attention's AVX-512 BF16 kernel by its dot
                             # (K.attention_bf16_dot; nn.linear.attention_kernel's labels)
                             "avx512bf16:fma": "fma_zmm", "avx512bf16:vdpbf16ps": "bf16_zmm"},
                    "q8": {"avx2": "i8_ymm", "avxvnni": "vnni_ymm", "avx512": "vnni_zmm",
                           "amx": "amx_int8"}}


def _k():
    from nxhpc import kernels
    return kernels()


def supported() -> list[str]:
    """The kinds this CPU/OS runs (none under ``NXHPC_DISABLE_SIMD=1``)."""
    return list(_k().peak_supported())


def reachable() -> list[str]:
    """The supported kinds the default kernels can run: those of the process's default ISA
    (``cpu_features()["best_isa"]``, which ``NXHPC_MAX_ISA`` caps) and of its ancestors in the
    ISA tree (where its missing kernels come from). Under a cap, the units of the lesser CPU the
    kernels then stand for; none under ``NXHPC_DISABLE_SIMD``."""
    K = _k()
    feats = K.cpu_features()
    chain: set[str] = set()
    isa = feats["best_isa"]
    while isa not in chain:                  # up to generic, its own parent
        chain.add(isa)
        isa = feats["isas"][isa]["parent"]
    info = K.peak_kinds()
    return [k for k in supported() if info[k]["isa"] in chain]


def _run_seconds(kind: str, iters: int) -> tuple[int, float]:
    K = _k()
    t0 = time.thread_time()
    ops, _ = K.peak(kind, iters)
    return ops, time.thread_time() - t0


def measure(kind: str, seconds: float = 0.2, runs: int = 5) -> float:
    """Operations per second (2 per multiply-add) of one thread running peak ``kind``: the best
    of ``runs`` runs of about ``seconds / runs`` each, after a calibration of the iteration
    count. Time is this thread's CPU time (``time.thread_time``): time slices that other
    processes take on a shared core do not count. ValueError (naming the supported kinds) for a
    kind this CPU lacks."""
    if not seconds > 0:
        raise ValueError(f"measure: seconds must be > 0, got {seconds!r}")
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"measure: runs must be an int >= 1, got {runs!r}")
    per_run = seconds / runs
    iters = 256
    _, t = _run_seconds(kind, iters)             # raises for an unknown / unsupported kind
    while t < min(0.005, per_run / 4):
        iters *= 8
        _, t = _run_seconds(kind, iters)
    iters = max(1, int(iters * per_run / max(t, 1e-9)))
    best = 0.0
    for _ in range(runs):
        ops, t = _run_seconds(kind, iters)
        if t > 0:
            best = max(best, ops / t)
    return best


def rates(seconds: float = 0.3) -> Callable[[str], float | None]:
    """``rate(kind)``: one core's ops/s of peak ``kind`` (:func:`measure` over ``seconds``, on
    first use, then kept), None for a kind this CPU does not run (or under
    ``NXHPC_DISABLE_SIMD``): one figure per kind for as long as the function is kept."""
    cache: dict[str, float | None] = {}

    def rate(kind: str) -> float | None:
        if kind not in cache:
            cache[kind] = measure(kind, seconds) if kind in supported() else None
        return cache[kind]
    return rate


def peaks(seconds: float = 0.2, runs: int = 5) -> dict[str, float]:
    """{kind: operations per second} of every kind this CPU supports (:func:`measure`)."""
    return {kind: measure(kind, seconds, runs) for kind in supported()}


def variant_at(slot: str, isa: str) -> str:
    """The variant (a ``kernel_variants()`` value) whose code runs kernel ``slot`` (a
    ``kernel_variants()`` key) when a call asks for ``isa``: an ISA with no code of its own for
    the slot runs its ancestor's (the float32 "attention" asked for at "avxvnni" is the "avx2"
    code, at "amx" the "avx512" one). ``isa`` may carry a benchmark's ":dot" suffix (the AVX-512
    BF16 attention's dot, ``K.attention_bf16_dot``: "avx512bf16:fma"), kept where that ISA's own
    code runs. ValueError for an unknown slot or ISA name."""
    base, sep, dot = isa.partition(":")
    v = _k()._variant(slot, base)
    return v + sep + dot if v == base else v


def kind_for(precision: str, variant: str | None = None) -> str | None:
    """The peak kind that bounds a kernel of ``precision`` ("f32", "bf16", "q8") whose code is
    ``variant`` (an ISA name from ``kernel_variants()``): the kind of the instructions that code
    issues; for None, "generic" or a variant of no known kind, the fastest kind of the precision
    this CPU supports. None when the CPU supports none of them. ``variant`` is the code that
    runs, not the ISA a call asked for: a requested ISA with no code of its own for the kernel
    (the float32 attention at "avxvnni") would fall to the fastest kind here, so resolve it with
    :func:`variant_at` first."""
    if precision not in PRECISION_KINDS:
        raise ValueError(f"kind_for: precision must be one of {sorted(PRECISION_KINDS)}, "
                         f"got {precision!r}")
    have = supported()
    kind = _KIND_OF_VARIANT[precision].get(variant or "")
    if kind in have:
        return kind
    return next((k for k in PRECISION_KINDS[precision] if k in have), None)


def _main() -> None:
    K = _k()
    info = K.peak_kinds()
    feats = K.cpu_features()
    print(f"best ISA {feats['best_isa']}; one thread, best of 5 runs over 0.5 s each kind")
    print(f"{'kind':<10} {'isa':<11} {'GOP/s':>9}")
    for kind in KINDS:
        if info[kind]["supported"]:
            print(f"{kind:<10} {info[kind]['isa']:<11} {measure(kind, 0.5) / 1e9:9.1f}")
        else:
            print(f"{kind:<10} {info[kind]['isa']:<11} {'unsupported':>11}")


if __name__ == "__main__":
    _main()
