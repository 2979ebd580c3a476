"""What reads the same in every family's attention + SwiGLU block: its extents, projections and
gate.

Owns :func:`block_extents` (the ranges a pre-norm attention + SwiGLU block's stages split over
workers), :class:`Project` (one or more typed-linear projections of a scratch buffer, over a
band of output columns) and :class:`SwiGLU` (the gate, in place, over a band of elements):
task objects for :class:`nxhpc.nn.engine.Stage`, named by the weight fields and scratch
buffers they read and write, so a family's stage table states the names and the body is
written once.
Must not: import a model family, compute anything in Python (the kernels do), or hold state
beyond the names.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nxhpc.nn.linear import matmul, matmul_glu

__all__ = ["block_extents", "Project", "ProjectGLU"]


def block_extents(ffn: Callable[[Any], int]) -> dict[str, tuple[str, Callable[[Any, int], int]]]:
    """extent name -> (description, m(cfg, T)): the range ``[0, m)`` a stage splits over
    workers, for a config with ``dim``, ``n_heads``, ``n_kv_heads`` and ``qkv_width``;
    ``ffn(cfg)`` is its FFN width."""
    return {
        "rows": ("token rows", lambda cfg, T: T),
        "qkv_cols": ("qkv columns", lambda cfg, T: cfg.qkv_width),
        "qk_heads": ("q+k heads", lambda cfg, T: cfg.n_heads + cfg.n_kv_heads),
        "query_heads": ("query heads", lambda cfg, T: cfg.n_heads),
        "dim_cols": ("dim columns", lambda cfg, T: cfg.dim),
        "ffn_cols": ("ffn columns", lambda cfg, T: ffn(cfg)),
    }


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
class ProjectGLU:
    """task(c, lo, hi): ``c.buf[out][:, lo:hi] = silu(c.buf[src] @ c.w.<gate>[lo:hi]^T) *
    (c.buf[src] @ c.w.<up>[lo:hi]^T)`` at ``c.precision`` (:func:`nxhpc.nn.linear.matmul_glu`:
    the bits of the two projections and the ``swiglu`` kernel after them, in one pass)."""
    src: str                             # scratch buffer read: [T, K]
    gate: str                            # weight field of c.w: the gate projection
    up: str                              # weight field of c.w: the up projection
    out: str                             # scratch buffer written [T, F]

    def __call__(self, c: Any, lo: int, hi: int) -> None:
        matmul_glu(c.kernels, c.buf[self.src], getattr(c.w, self.gate), getattr(c.w, self.up),
                   c.buf[self.out], lo, hi, c.precision)
