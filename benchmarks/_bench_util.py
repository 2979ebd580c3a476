"""Helpers shared by the benchmarks: timing statistics, this CPU's per-core peaks (measured
once per session) and a figure's fraction of them, peak RSS of this process and its workers, a
torch model timed per layer (in a dtype switched in place), and the end-of-module summary
table."""
import json
import math
import os
import time
import types
from contextlib import contextmanager
from pathlib import Path

from nxhpc.runtime.memory import peak_rss_mb

__all__ = ["bench_stats", "peak_of", "peak_fields", "rope_pe", "qknorm_rope_inputs",
           "peak_rss_mb", "reset_peak_rss", "children", "rss_cell", "layer_timer", "model_as",
           "run_timed_layers", "record", "err_cell", "write_summary", "summary_fixture",
           "torch_threads"]

# With --benchmark-disable each benchmark runs once as a smoke test (its correctness check
# included) and pytest-benchmark keeps no statistics: report NaN rates instead of failing.
_NO_STATS = types.SimpleNamespace(min=math.nan, max=math.nan, mean=math.nan, median=math.nan,
                                  stddev=math.nan)


def lowp_is_scalar() -> bool:
    """Whether ``bf16`` and ``q8`` run their scalar spec here (a CPU without AVX2, or
    ``NXHPC_DISABLE_SIMD``): minutes where the SIMD kernels take seconds, so the benchmarks that
    time them leave them out or time one round."""
    import nxhpc
    return nxhpc.kernels().cpu_features()["best_isa"] == "generic"   # the switches honoured


def bench_stats(benchmark):
    """The timing statistics of a finished benchmark (``.min``, ``.mean``, ``.median`` in s)."""
    return _NO_STATS if benchmark.stats is None else benchmark.stats.stats


#: ``nxhpc.runtime.peak.rates(0.3)``, made on first use: one figure per kind and session.
_RATE = None


def peak_of(kind: str) -> float | None:
    """Operations per second of one core running peak ``kind`` (``nxhpc.runtime.peak``:
    register-only loop, best of 5 runs over 0.3 s, thread CPU time), measured once per session;
    None where this CPU (or NXHPC_DISABLE_SIMD) does not run the kind."""
    global _RATE
    if _RATE is None:
        from nxhpc.runtime import peak
        _RATE = peak.rates(0.3)
    return _RATE(kind)


def peak_fields(gops: float, precision: str, variant: str | None = None,
                workers: int = 1, slot: str | None = None) -> dict:
    """``extra_info`` fields setting ``gops`` (GFLOP/s or GOP/s, 2 per multiply-add) against the
    measured peak: ``peak_kind`` (the kind whose instructions ``variant``'s code of ``precision``
    issues, ``nxhpc.runtime.peak.kind_for``; for baselines and generic code, this CPU's fastest
    kind of the precision), ``peak_gops`` (its peak times ``workers`` cores) and
    ``frac_of_peak``; where this CPU has a faster unit for the precision (AMX), also
    ``machine_peak_kind`` / ``frac_of_machine_peak``. A bfloat16 baseline on a CPU without a
    bfloat16 unit (torch there widens to float32) is set against the float32 FMA peak. Empty
    when no kind of the precision runs here. With ``slot`` (a ``kernel_variants()`` key), ``variant`` is the ISA a call asked for,
    resolved first to the code that runs kernel ``slot`` there (``peak.variant_at``: the float32
    attention asked for at "avxvnni" is the avx2 code)."""
    from nxhpc.runtime import peak
    if slot is not None and variant is not None:
        variant = peak.variant_at(slot, variant)
    kind = peak.kind_for(precision, variant)
    if kind is None and precision == "bf16" and variant is None:
        precision = "f32"                       # no bf16 unit: float32 FMAs do the work
        kind = peak.kind_for(precision)
    if kind is None:
        return {}
    p = peak_of(kind) * workers / 1e9
    out = {"peak_kind": kind, "peak_gops": round(p, 1), "frac_of_peak": round(gops / p, 3)}
    best = peak.kind_for(precision)
    if best is not None and best != kind:   # None: the variant runs another precision's unit
        pb = peak_of(best) * workers / 1e9
        out.update({"machine_peak_kind": best, "frac_of_machine_peak": round(gops / pb, 4)})
    return out


@contextmanager
def torch_threads(n: int):
    """torch's intra-op threads at ``n`` inside the block, restored after it (also on error)."""
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def rope_pe(rng, T: int, hd: int):
    """A RoPE table [T, hd/2, 2, 2] float32 of rotations [[cos, -sin], [sin, cos]] by angles
    drawn uniformly from [-10, 10)."""
    import numpy as np
    ang = rng.uniform(-10, 10, (T, hd // 2))
    return np.stack([np.stack([np.cos(ang), -np.sin(ang)], -1),
                     np.stack([np.sin(ang), np.cos(ang)], -1)], -2).astype(np.float32)


def qknorm_rope_inputs(rng, T: int, heads: int, hd: int):
    """(qkv [T, 3*heads*hd], q_w [hd], k_w [hd], pe [T, hd/2, 2, 2]) float32 standard normal
    (pe: :func:`rope_pe`), drawn in that order."""
    import numpy as np
    qkv = rng.standard_normal((T, 3 * heads * hd), dtype=np.float32)
    qw, kw = rng.standard_normal(hd, dtype=np.float32), rng.standard_normal(hd, dtype=np.float32)
    return qkv, qw, kw, rope_pe(rng, T, hd)


def reset_peak_rss(pids=("self",)) -> None:
    """Reset the VmHWM of each process in ``pids`` (Linux: ``echo 5 > /proc/PID/clear_refs``;
    a process that cannot be reset keeps its peak)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def children() -> list[int]:
    """The pids of this process's children (every thread's), from ``/proc``."""
    out = []
    base = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def rss_cell(r: dict) -> str:
    """A result's peak RSS as a table cell: the parent's MB, and its workers' when known."""
    rss = f"{r.get('peak_rss_mb') or 0:.0f}"
    if r.get("worker_peak_rss_mb"):
        rss += f" (workers {r['worker_peak_rss_mb']:.0f})"
    return rss


def layer_timer(layers):
    """Forward hooks timing each module of ``layers``: (the list of per-layer seconds, the
    hooks to remove)."""
    spans: list[float] = []
    starts: list[float] = []
    hooks = []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a: starts.append(time.perf_counter())))
        hooks.append(layer.register_forward_hook(
            lambda m, a, o: spans.append(time.perf_counter() - starts.pop())))
    return spans, hooks


def model_as(tm: dict, dtype):
    """``tm["model"]`` (a torch module, its dtype in ``tm["dtype"]``) converted to ``dtype`` in
    place: the previous copy is not kept."""
    if tm["dtype"] != dtype:
        tm["model"].to(dtype)
        tm["dtype"] = dtype
    return tm["model"]


def run_timed_layers(benchmark, layers, fn, n: int, rounds: int):
    """``benchmark.pedantic(fn)`` (``rounds`` after one warm-up; this process's peak RSS reset
    just before) with each module of ``layers`` timed by hooks (``n`` of them run per call):
    (the last call's output, then the fastest timed call's seconds and the seconds of its
    ``n`` layers -- the minimum over the rounds, as the nxhpc side of each benchmark takes)."""
    spans, hooks = layer_timer(layers)
    calls: list[tuple[float, float]] = []

    def call():
        k = len(spans)
        t0 = time.perf_counter()
        o = fn()
        calls.append((time.perf_counter() - t0, sum(spans[k:k + n])))
        return o
    reset_peak_rss()
    try:
        out = benchmark.pedantic(call, rounds=rounds, warmup_rounds=1)
    finally:
        for h in hooks:
            h.remove()
    total, layer_s = min(calls[1:] or calls)          # the warm-up call left out
    return out, total, layer_s


def record(benchmark, results: dict, key, r: dict) -> None:
    """Keep result ``r`` under ``key`` and show it (but its ``output`` array) in the
    benchmark's ``extra_info``."""
    results[key] = r
    benchmark.extra_info.update({k: v for k, v in r.items() if k != "output"})


def err_cell(err: float | None, fmt: str) -> str:
    """A relative error as a table cell: ``format(err, fmt)``, empty when there is none."""
    return "" if err is None else format(err, fmt)


def write_summary(request, name: str, title: str, head: str, row, results: dict) -> None:
    """The table ``title``, ``head`` (a Markdown header row) and a row of the cells
    ``row((backend, size), r)`` for each result, sorted by size then backend: written to
    ``.benchmarks/NAME.md``, the
    results (keyed ``(backend, size)``, each ``output`` array left out) to
    ``.benchmarks/NAME.json``, and printed past pytest's capture."""
    lines = [title, "", head, "|" + "---|" * (head.count("|") - 1)]
    lines += ["| " + " | ".join(str(c) for c in row(k, r)) + " |"
              for k, r in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    text = "\n".join(lines)
    out = Path(".benchmarks")
    out.mkdir(exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {f"{k[0]}@{k[1]}": {a: b for a, b in v.items() if a != "output"}
         for k, v in results.items()}, indent=1, default=float))
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    with cap.global_and_fixture_disabled() if cap is not None else open(os.devnull):
        print("\n" + text, flush=True)


def summary_fixture(results: dict, name: str, title: str, head: str, row):
    """A module-scoped autouse fixture: after the module's benchmarks, :func:`write_summary`
    of whatever ``results`` holds (nothing when it is empty). Assign it to a module name."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def _summary(request):
        yield
        if results:
            write_summary(request, name, title, head, row, results)
    return _summary
