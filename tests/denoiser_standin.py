"""A stand-in for ``nxhpc.dit.denoiser.Denoiser`` while that module is not on this branch.

Owns :class:`StandInDenoiser` and :func:`open_denoiser` with exactly the announced API
(``open_denoiser(model, *, workers=None, models_dir=None, gguf_path=None)``, ``.config`` a
``DenoiserConfig``, ``.forward(latents [C,H,W] | [C,1,H,W] float32, t, cap_feats [L, cap_dim])
-> float32 of the input's shape``, ``.last_timings``, ``close()`` / context manager), computing
with the float64 reference ``nxhpc.dit.denoiser_ref.denoiser_forward_f64`` on the weights of a
GGUF read back by the ``gguf`` package (``nxhpc.models.zimage_files.read_zimage_gguf``).
Test tooling only: the package never imports it. Must not stand in for the real denoiser once
``nxhpc.dit.denoiser`` exists (see :func:`real_denoiser_available`).
"""
from __future__ import annotations

import importlib.util
import os
import time

import numpy as np

from nxhpc.dit.denoiser_config import infer_denoiser_config
from nxhpc.dit.denoiser_ref import denoiser_forward_f64
from nxhpc.formats.gguf_io import ModelNotFoundError

__all__ = ["StandInDenoiser", "open_denoiser", "real_denoiser_available"]


def real_denoiser_available() -> bool:
    return importlib.util.find_spec("nxhpc.dit.denoiser") is not None


class StandInDenoiser:
    def __init__(self, path: str | os.PathLike) -> None:
        from nxhpc.models.zimage_files import read_zimage_gguf
        f = read_zimage_gguf(path)
        self.path = f.path
        self.config = infer_denoiser_config(f.tensors, allow_extra=True)
        self.weights = f.weights
        self.last_timings: dict[str, float] = {}
        self.calls = 0
        self.closed = False

    def forward(self, latents, t: float, cap_feats) -> np.ndarray:
        if self.closed:
            raise RuntimeError("StandInDenoiser: closed")
        lat = np.asarray(latents)
        if lat.dtype != np.float32:
            raise TypeError(f"StandInDenoiser.forward: latents must be float32, got {lat.dtype}")
        squeeze = lat.ndim == 4
        if squeeze:
            if lat.shape[1] != 1:
                raise ValueError(f"StandInDenoiser.forward: latents {lat.shape}, expected "
                                 f"[C, 1, H, W]")
            lat = lat[:, 0]
        t0 = time.perf_counter()
        r = denoiser_forward_f64(lat, t, cap_feats, self.weights, self.config)
        self.calls += 1
        self.last_timings = {"us_total": (time.perf_counter() - t0) * 1e6}
        r = r.astype(np.float32)
        return r[:, None] if squeeze else r

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> StandInDenoiser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_denoiser(model, *, workers=None, models_dir=None, gguf_path=None) -> StandInDenoiser:
    path = gguf_path or model
    if not os.path.isfile(os.fspath(path)):
        raise ModelNotFoundError(f"stand-in denoiser: {path}: not a GGUF file")
    return StandInDenoiser(path)
