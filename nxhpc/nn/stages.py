"""Stage tasks that read the same in every family's block: projections and the SwiGLU gate.

Owns :class:`Project` (one or more typed-linear projections of a scratch buffer, over a band of
output columns) and :class:`SwiGLU` (the gate, in place, over a band of elements): task
objects for :class:`nxhpc.nn.engine.Stage`, named by the weight fields and scratch buffers
they read and write, so a family's stage table states the names and the body is written once.
Must not: import a model family, compute anything in Python (the kernels do), or hold state
beyond the names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nxhpc.nn.linear import matmul

__all__ = ["Project", "SwiGLU"]


@dataclass(frozen=True)
class Project:
    """task(c, lo, hi): for each ``(weight, out)`` of ``outs``, in order,
    ``c.buf[out][:, lo:hi] = c.buf[src] @ c.w.<weight>[lo:hi]^T`` at ``c.precision``."""
    src: str                             # scratch buffer read: [T, K]
    outs: tuple[tuple[str, str], ...]    # (weight field of c.w, scratch buffer written [T, N])

    def __call__(self, c: Any, lo: int, hi: int) -> None:
        x = c.buf[self.src]
        for weight, out in self.outs:
            matmul(c.kernels, x, getattr(c.w, weight), c.buf[out], lo, hi, c.precision)


@dataclass(frozen=True)
class SwiGLU:
    """task(c, lo, hi): ``gate := silu(gate) * up`` on the flat elements ``[lo, hi)``."""
    gate: str                            # scratch buffer [T, F], overwritten
    up: str                              # scratch buffer [T, F]

    def __call__(self, c: Any, lo: int, hi: int) -> None:
        g = c.buf[self.gate]
        c.kernels.swiglu(g, c.buf[self.up], g, i0=lo, i1=hi)
