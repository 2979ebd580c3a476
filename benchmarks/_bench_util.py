"""Helpers shared by the benchmarks: timing statistics, peak RSS of this process and its
workers, per-layer timing hooks on a torch model, and the end-of-module summary table."""
import json
import math
import os
import time
import types
from pathlib import Path

from nxhpc.runtime.memory import peak_rss_mb

__all__ = ["bench_stats", "rope_pe", "peak_rss_mb", "reset_peak_rss", "children", "rss_cell",
           "layer_timer", "write_summary"]

# With --benchmark-disable each benchmark runs once as a smoke test (its correctness check
# included) and pytest-benchmark keeps no statistics: report NaN rates instead of failing.
_NO_STATS = types.SimpleNamespace(min=math.nan, max=math.nan, mean=math.nan, median=math.nan,
                                  stddev=math.nan)


def bench_stats(benchmark):
    """The timing statistics of a finished benchmark (``.min``, ``.mean``, ``.median`` in s)."""
    return _NO_STATS if benchmark.stats is None else benchmark.stats.stats


def rope_pe(rng, T: int, hd: int):
    """A RoPE table [T, hd/2, 2, 2] float32 of rotations [[cos, -sin], [sin, cos]] by angles
    drawn uniformly from [-10, 10)."""
    import numpy as np
    ang = rng.uniform(-10, 10, (T, hd // 2))
    return np.stack([np.stack([np.cos(ang), -np.sin(ang)], -1),
                     np.stack([np.sin(ang), np.cos(ang)], -1)], -2).astype(np.float32)


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


def write_summary(request, name: str, text: str, results: dict) -> None:
    """Write ``text`` to ``.benchmarks/NAME.md`` and ``results`` (keyed ``(backend, size)``,
    each result's ``output`` array left out) to ``.benchmarks/NAME.json``, then print ``text``
    past pytest's capture."""
    out = Path(".benchmarks")
    out.mkdir(exist_ok=True)
    (out / f"{name}.md").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {f"{k[0]}@{k[1]}": {a: b for a, b in v.items() if a != "output"}
         for k, v in results.items()}, indent=1, default=float))
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    with cap.global_and_fixture_disabled() if cap is not None else open(os.devnull):
        print("\n" + text, flush=True)
