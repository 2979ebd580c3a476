"""The exact residual add on the kernels: ``out := resid + y`` through ``gated_residual``.

Owns :data:`UNIT_GATE`, a gate whose float32 tanh is exactly 1.0 in every kernel variant
(tanh(20) = 1 - 8.5e-18 rounds to 1; ``tests/test_plan.py`` pins it at every ISA), so the
gated-residual kernel ``resid + tanh(g) * y`` run with a gate vector of it is exactly
``resid + y`` -- the residual of an unmodulated block (the DiT's context refiner, every Qwen3
block) -- :func:`residual_add`, and :class:`UnitGateState`, the plan mixin that fills a
``unit_gate`` state buffer with it. Must not: compute anything itself.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["UNIT_GATE", "residual_add", "UnitGateState"]

#: A gate value whose tanh rounds to exactly 1.0f (see the module docstring).
UNIT_GATE = 20.0


def residual_add(kernels: Any, resid: np.ndarray, y: np.ndarray, unit_gate: np.ndarray,
                 out: np.ndarray, lo: int, hi: int) -> None:
    """out[lo:hi] := resid[lo:hi] + y[lo:hi] (rows; ``unit_gate``: [D] filled with
    :data:`UNIT_GATE`; out may be resid)."""
    kernels.gated_residual(resid, y, unit_gate, out, r0=lo, r1=hi)


class UnitGateState:
    """Mixin for a :class:`~nxhpc.nn.engine.Plan` whose state has a ``unit_gate`` buffer [D]:
    ``init_state`` fills it with :data:`UNIT_GATE` (list it before ``Plan`` in the bases)."""

    def init_state(self, views: Mapping[str, np.ndarray]) -> None:
        views["unit_gate"][:] = np.float32(UNIT_GATE)
