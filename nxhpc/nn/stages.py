"""What reads the same in every family's attention + SwiGLU block: its extents, projections and
gate.

Owns :func:`block_extents` (the ranges a pre-norm attention + SwiGLU block's stages split over
workers), :func:`proj_by_rows` (when a projection splits over token rows instead),
:class:`Project` (one or more typed-linear projections of a scratch buffer, over a band of
output columns or of token rows) and :class:`ProjectGLU` (the gated pair, the same way):
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

__all__ = ["block_extents", "proj_by_rows", "PROJ_ROWS_PER_WORKER", "Project", "ProjectGLU"]

#: A projection splits over token rows, not output columns, once every worker gets at least this
#: many rows. Each worker then packs only its own rows of x (by columns every worker packs all of
#: x) and computes whole output rows, but decodes every weight instead of its band's: below this
#: the decoding costs more than the packing saves. Every kernel computes a row's outputs the same
#: whatever the rows and columns beside it, so the bits do not change. Measured on the AMX Xeon,
#: 2 workers, `bf16`, Z-Image dims on Q4_K_M weights (docs/architecture.md): the block API,
#: median of 20 calls, two runs each way: 128 rows a worker 10% slower by rows, 256 3% faster,
#: 384 8%; a denoiser's main layer, calls alternating in one process: 576 rows (512x512 px) 6.4%
#: faster, 2112 (1024x1024) 3.1%; after the AMX kernel's token blocks went from 1024 to 512
#: (benchmarks/bench_split.py): 3.5% and level.
PROJ_ROWS_PER_WORKER = 256


def proj_by_rows(T: int, workers: int) -> bool:
    """Whether a projection over ``T`` token rows splits over rows across ``workers`` workers
    (:data:`PROJ_ROWS_PER_WORKER`)."""
    return T >= PROJ_ROWS_PER_WORKER * max(1, workers)


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


def _by_rows(c: Any) -> bool:
    """The run splits its projections over token rows (the context's ``proj_rows``; a family
    whose context has none splits them over columns)."""
    return bool(getattr(c, "proj_rows", False))


@dataclass(frozen=True)
class Project:
    """task(c, lo, hi): for each ``(weight, out)`` of ``outs``, in order,
    ``c.buf[out][:, lo:hi] = c.buf[src] @ c.w.<weight>[lo:hi]^T`` at ``c.precision``; when the
    context's ``proj_rows`` is set, ``[lo, hi)`` are token rows instead:
    ``c.buf[out][lo:hi] = c.buf[src][lo:hi] @ c.w.<weight>^T``."""
    src: str                             # scratch buffer read: [T, K]
    outs: tuple[tuple[str, str], ...]    # (weight field of c.w, scratch buffer written [T, N])

    def __call__(self, c: Any, lo: int, hi: int) -> None:
        x = c.buf[self.src]
        rows = _by_rows(c)
        for weight, out in self.outs:
            o = c.buf[out]
            if rows:
                matmul(c.kernels, x[lo:hi], getattr(c.w, weight), o[lo:hi], 0, o.shape[1],
                       c.precision)
            else:
                matmul(c.kernels, x, getattr(c.w, weight), o, lo, hi, c.precision)


@dataclass(frozen=True)
class ProjectGLU:
    """task(c, lo, hi): ``c.buf[out][:, lo:hi] = silu(c.buf[src] @ c.w.<gate>[lo:hi]^T) *
    (c.buf[src] @ c.w.<up>[lo:hi]^T)`` at ``c.precision`` (:func:`nxhpc.nn.linear.matmul_glu`:
    the bits of the two projections and the ``swiglu`` kernel after them, in one pass); token
    rows ``[lo, hi)``, every column, when the context's ``proj_rows`` is set."""
    src: str                             # scratch buffer read: [T, K]
    gate: str                            # weight field of c.w: the gate projection
    up: str                              # weight field of c.w: the up projection
    out: str                             # scratch buffer written [T, F]

    def __call__(self, c: Any, lo: int, hi: int) -> None:
        x, o = c.buf[self.src], c.buf[self.out]
        gate, up = getattr(c.w, self.gate), getattr(c.w, self.up)
        if _by_rows(c):
            matmul_glu(c.kernels, x[lo:hi], gate, up, o[lo:hi], 0, o.shape[1], c.precision)
        else:
            matmul_glu(c.kernels, x, gate, up, o, lo, hi, c.precision)
