"""Peak resident set sizes as the models report them (Linux ``/proc``; None elsewhere).

Owns: reading a process's ``VmHWM`` (:func:`peak_rss_mb`) and the ``memory()`` report every
model family gives (:func:`memory_report`: mapped file, arena, peak RSS of this process and of
its workers). Must not: import numpy or the compiled kernels, or reset a counter it reads.
"""
from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["peak_rss_mb", "memory_report"]


def peak_rss_mb(pid: int | str = "self", field: str = "VmHWM") -> float | None:
    """Peak resident set (``VmHWM``; or another ``/proc/PID/status`` field in kB, e.g.
    ``VmRSS``) of process ``pid`` in MB, or None where unavailable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e6
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_report(file_bytes: int, arena_bytes: int | None,
                  worker_pids: Iterable[int] | None = None) -> dict[str, float | None]:
    """MB: the mapped weights file (``weights_mb``), the arena (``arena_mb``; None without one),
    this process's peak resident set (``peak_rss_mb``) and, when ``worker_pids`` is given, the
    largest of those processes' (``worker_peak_rss_mb``; None where none could be read).
    Pages shared between processes count in every process that touched them."""
    report = {"weights_mb": file_bytes / 1e6,
              "arena_mb": arena_bytes / 1e6 if arena_bytes is not None else None,
              "peak_rss_mb": peak_rss_mb(os.getpid())}
    if worker_pids is not None:
        worker = [v for v in (peak_rss_mb(p) for p in worker_pids) if v is not None]
        report["worker_peak_rss_mb"] = max(worker) if worker else None
    return report
