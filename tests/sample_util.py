"""Shared test tooling for the sampler, its CLI and the diffusers drop-in.

Owns: opening the nxhpc denoiser the tests drive (:func:`open_test_denoiser`, 2 workers by
default), diffusers' own Turbo loop as the oracle
(:func:`diffusers_turbo_loop`: ``FlowMatchEulerDiscreteScheduler(shift=3.0,
use_dynamic_shifting=False)`` stepping exactly as ``ZImagePipeline`` does), and small process
probes (:func:`child_pids`, :func:`shm_entries`). Must not: be imported by the package.
"""
from __future__ import annotations

import os

import numpy as np


__all__ = ["child_pids", "diffusers_turbo_loop", "open_test_denoiser", "shm_entries"]


def open_test_denoiser(model, workers: int = 2, **kw):
    """``nxhpc.models.open_denoiser`` (the real one: C kernels in forked workers)."""
    from nxhpc.models.registry import open_denoiser
    return open_denoiser(os.fspath(model), workers=workers, **kw)


def diffusers_turbo_loop(model, cap: np.ndarray, noise, steps: int = 8, shift: float = 3.0):
    """``ZImagePipeline``'s denoising loop at batch 1 without CFG, written out (diffusers 0.42
    ``pipeline_z_image.py``): sigmas ``linspace(1, 1/N, N)`` given to the scheduler (which
    shifts them), the transformer called at ``t = (1000 - timestep) / 1000`` in float32, its
    output negated, then ``scheduler.step``. ``noise`` a torch ``[1, C, H, W]`` tensor. Returns
    the final latents float64 ``[C, H, W]``."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    sch = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift,
                                          use_dynamic_shifting=False)
    sch.set_timesteps(steps, sigmas=torch.linspace(1.0, 1 / steps, steps).tolist(), mu=0.5)
    sch.set_begin_index(0)
    dtype = next(model.parameters()).dtype
    latents = noise.clone().to(torch.float32)
    capt = torch.from_numpy(np.ascontiguousarray(cap)).to(dtype)
    with torch.no_grad():
        for t in sch.timesteps:
            timestep = (1000 - t.expand(1)) / 1000
            out = model([latents.to(dtype).unsqueeze(2)[0]], timestep.to(dtype), [capt],
                        return_dict=False)[0]
            noise_pred = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
            latents = sch.step(noise_pred.to(torch.float32), t, latents, return_dict=False)[0]
    return latents[0].double().numpy()


def child_pids() -> set[int]:
    """Live child processes of this process (all threads), from /proc."""
    out: set[int] = set()
    base = f"/proc/{os.getpid()}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/children") as f:
                out.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def shm_entries() -> set[str]:
    """nxhpc's shared-memory names visible in /dev/shm that this test could have left: made by
    this process or by one that has exited (a CLI child). A segment of another live process
    (a concurrent job on a shared machine, ``nxhpc_<pid>_...``) is not this test's."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("nxhpc_")]
    except FileNotFoundError:
        return set()

    def ours(name: str) -> bool:
        try:
            pid = int(name.split("_")[1])
        except (IndexError, ValueError):
            return True
        if pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True                    # its maker is gone: a leak
        except PermissionError:
            return False
        return False
    return {n for n in names if ours(n)}
