"""How far a DiT block's time is from the machine's limit: the work of each timed part and what
that work takes at the per-core peak of the unit that runs it (a roofline without the memory
side: the projections and the attention are compute-bound at the sizes this targets).

Owns: the block's operation counts per timing key of :mod:`nxhpc.dit.plan` (2 per
multiply-add: the projections' and the attention's; the norms, RoPE and residuals count
none), which peak kind bounds each part for a run (:func:`unit_kinds`: the kernel variant the
process runs for the precision, and the bf16 attention's dot) or for the machine
(:func:`machine_kinds`: the fastest unit of any precision that the kernels can run), and the
arithmetic ``limit = ops / (peak * workers)``, ``frac = limit / measured``.
Must not: time the block (the caller's timings), or guess a peak: peaks are measured on the
machine at hand (``nxhpc.runtime.peak.measure``) or given by the caller.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

#: The matmul slot of ``kernel_variants()`` per precision.
_MATMUL_SLOT = {"f32": "matmul", "bf16": "matmul_bf16", "q8": "matmul_q8"}


def block_ops(cfg: Any, T: int) -> dict[str, dict[str, int]]:
    """Operations (2 per multiply-add) of one block at ``T`` tokens per timing key of
    :data:`nxhpc.dit.plan.TIMING_KEYS` (``block_us`` excluded): ``{"matmul": n}`` for the
    projections charged to the key, ``{"attention": n}`` for Q K^T and P V (every key of every
    query: the kernels run whole tiles, masked or not), ``{}`` for the element-wise stages.
    ``cfg``: a block config (``dim``, ``n_heads``, ``head_dim``, ``qkv_width``, ``ffn_dim``)."""
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise ValueError(f"block_ops: T must be an int >= 1, got {T!r}")
    D, Hd = cfg.dim, cfg.n_heads * cfg.head_dim
    return {"us_prenorm_qkv": {"matmul": 2 * T * D * cfg.qkv_width},
            "us_qknorm_rope": {},
            "us_sdpa": {"attention": 4 * T * T * Hd},
            "us_attn_tail": {"matmul": 2 * T * Hd * D},
            "us_ffn": {"matmul": 2 * T * D * 3 * cfg.ffn_dim}}


def unit_kinds(precision: str, variants: Mapping[str, str] | None = None,
               attention_dot: str | None = None) -> dict[str, str | None]:
    """The peak kind bounding each part of a run of ``precision`` ("f32", "bf16", "q8") whose
    kernels run as ``variants`` (``kernel_variants()``; default: this process's), the bf16
    attention's AVX-512 BF16 variant on ``attention_dot`` ("fma" | "vdpbf16ps"; default: this
    process's, ``K.attention_bf16_dot()``). bf16 and q8 runs use the bf16 attention. None for a
    part where this CPU runs no kind of its precision."""
    from nxhpc import kernels
    from nxhpc.nn.linear import attention_precision, check_precision
    from nxhpc.runtime import peak
    check_precision(precision)
    K = kernels()
    v = dict(K.kernel_variants() if variants is None else variants)
    mm = peak.kind_for(precision, v.get(_MATMUL_SLOT[precision]))
    if attention_precision(precision) == "f32":
        att = peak.kind_for("f32", v.get("attention"))
    else:   # the AVX-512 BF16 kernel's kind is its dot's
        av = v.get("attention_bf16")
        if av == "avx512bf16":
            av += ":" + (attention_dot or K.attention_bf16_dot())
        att = peak.kind_for("bf16", av)
    return {"matmul": mm, "attention": att}


def machine_kinds(rate: Callable[[str], float | None]) -> dict[str, str | None]:
    """The machine's limit: per part the fastest kind the kernels can run here by
    ``rate(kind)`` (ops/s, None when unsupported), projections on any precision's unit (int8
    where an int8 unit is the fastest), attention on a bfloat16 or float32 one (the units the
    bf16 attention can use). The kinds are :func:`nxhpc.runtime.peak.reachable`'s: under
    ``NXHPC_MAX_ISA`` those of the capped CPU (an AMX Xeon capped at ``avx512bf16`` is then
    measured against its AVX-512 units, not its tiles). None for a part with no such kind."""
    from nxhpc.runtime import peak

    sup = peak.reachable()

    def fastest(kinds):
        have = [(r, k) for k, r in ((k, rate(k)) for k in kinds if k in sup) if r is not None]
        return max(have)[1] if have else None
    every = [k for ks in peak.PRECISION_KINDS.values() for k in ks]
    return {"matmul": fastest(every),
            "attention": fastest(peak.PRECISION_KINDS["bf16"] + peak.PRECISION_KINDS["f32"])}


def roofline(timings_us: Mapping[str, float], ops: Mapping[str, Mapping[str, int]],
             kinds: Mapping[str, str | None], rate: Callable[[str], float | None],
             workers: int, layers: int = 1) -> dict[str, Any]:
    """Each timed part against its limit. ``timings_us``: measured microseconds per key of
    ``ops`` (and ``block_us``, the whole block), summed over ``layers`` blocks; ``ops``:
    :func:`block_ops` of one block; ``kinds``: the peak kind per part (:func:`unit_kinds` or
    :func:`machine_kinds`); ``rate(kind)``: that kind's ops/s on one core; ``workers``: cores.
    Returns ``{key: {"s", "limit_s", "frac", "gops"}}`` per key with work (``frac`` = limit /
    measured: 1 is the peak) and the totals ``limit_s`` (the block's: parts with work but no
    supported kind make it None), ``block_s`` and ``x_limit`` (measured / limit)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"roofline: workers must be an int >= 1, got {workers!r}")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"roofline: layers must be an int >= 1, got {layers!r}")
    out: dict[str, Any] = {}
    total: float | None = 0.0
    for key, parts in ops.items():
        work = {p: n * layers for p, n in parts.items() if n}
        if not work:
            continue
        s = timings_us[key] / 1e6
        limit: float | None = 0.0
        for part, n in work.items():
            kind = kinds.get(part)
            r = rate(kind) if kind is not None else None
            limit = None if r is None or limit is None else limit + n / (r * workers)
        out[key] = {"s": s, "limit_s": limit,
                    "frac": None if limit is None or s <= 0 else limit / s,
                    "gops": sum(work.values()) / s / 1e9 if s > 0 else None}
        total = None if limit is None or total is None else total + limit
    block_s = timings_us["block_us"] / 1e6 if "block_us" in timings_us else None
    out["limit_s"] = total
    out["block_s"] = block_s
    out["x_limit"] = block_s / total if total and block_s is not None else None
    return out


def block_limit_s(cfg: Any, T: int, kinds: Mapping[str, str | None],
                  rate: Callable[[str], float | None], workers: int) -> float | None:
    """Seconds one block at ``T`` tokens takes at the peaks of ``kinds`` on ``workers`` cores
    (the :func:`roofline` limit with no timings); None if a part with work has no kind."""
    ops = block_ops(cfg, T)
    return roofline({k: 1.0 for k in ops}, ops, kinds, rate, workers)["limit_s"]


def report_fields(timings_us: Mapping[str, float], cfg: Any, T: int, precision: str,
                  workers: int, layers: int = 1,
                  rate: Callable[[str], float | None] | None = None) -> dict[str, Any]:
    """Flat report fields (the command lines' ``--roofline``, the benchmarks' ``extra_info``):
    per key with work ``frac_<stage>`` (its limit over its time on this run's units), the
    blocks' ``limit_us`` (the ``layers`` blocks the timings sum, as ``block_us`` does) and
    ``x_limit`` on this run's units, ``machine_limit_us`` and
    ``x_machine_limit`` on the machine's fastest units, the kinds (``unit_matmul``,
    ``unit_attention``, ``machine_matmul``, ``machine_attention``) and ``peak_gops_<kind>`` of
    each kind used (one core). ``rate``: default ``nxhpc.runtime.peak.rates()`` (measures each
    kind once, ~0.3 s)."""
    from nxhpc.runtime import peak
    rate = rate or peak.rates()
    ops = block_ops(cfg, T)
    own, best = unit_kinds(precision), machine_kinds(rate)
    r_own = roofline(timings_us, ops, own, rate, workers, layers)
    r_best = roofline(timings_us, ops, best, rate, workers, layers)
    out: dict[str, Any] = {}
    for key in ops:
        if key in r_own:
            out[f"frac_{key[3:]}"] = r_own[key]["frac"]
    us = lambda s: None if s is None else round(s * 1e6)  # noqa: E731
    out.update({"limit_us": us(r_own["limit_s"]), "x_limit": r_own["x_limit"],
                "machine_limit_us": us(r_best["limit_s"]), "x_machine_limit": r_best["x_limit"],
                "unit_matmul": own["matmul"], "unit_attention": own["attention"],
                "machine_matmul": best["matmul"], "machine_attention": best["attention"]})
    for kind in sorted({k for k in (*own.values(), *best.values()) if k is not None}):
        r = rate(kind)
        out[f"peak_gops_{kind}"] = None if r is None else round(r / 1e9, 1)
    return out
