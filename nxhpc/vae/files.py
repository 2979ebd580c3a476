"""Opening the autoencoder's files: a BFL/ComfyUI single ``ae.safetensors`` (LDM key names,
encoder keys present and ignored) or a diffusers ``vae/`` directory (``config.json`` +
``diffusion_pytorch_model.safetensors``), in float32, float16 or bfloat16.

Owns :func:`open_vae_file` -> :class:`VaeFile` (the config, the layout, and each decoder tensor
by its diffusers name as a zero-copy view of the map) and :func:`bind` (the views typed for the
kernels: convolution weights as :class:`~nxhpc.formats.weights.WeightTensor` ``[C_out, C_in*k*k]``
in the stored type, vectors as float32). Must not: import compiled code or the registry.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nxhpc.formats.closing import Closing
from nxhpc.formats.gguf_io import ModelFileError, ModelNotFoundError
from nxhpc.formats.safetensors_io import SafetensorsFile, json_value
from nxhpc.formats.weights import WeightTensor
from nxhpc.runtime.checks import file_kind
from nxhpc.vae.config import VaeConfig, detect_layout, infer_config, ldm_name, tensor_names

__all__ = ["VaeFile", "open_vae_file", "bind", "WEIGHT_FILE", "CONFIG_FILE", "FLOAT_DTYPES"]

WEIGHT_FILE = "diffusion_pytorch_model.safetensors"
CONFIG_FILE = "config.json"
#: The stored dtypes read (safetensors name -> GGML type name of the kernels' matmul).
FLOAT_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


@dataclass
class VaeFile(Closing):
    """An opened checkpoint: ``config``, ``layout`` ("ldm" | "diffusers"), ``path`` (the
    safetensors file), ``dtype`` (of the decoder's tensors), the open file."""
    config: VaeConfig
    layout: str
    path: Path
    dtype: str
    st: SafetensorsFile
    prefix: str = ""

    def stored_name(self, name: str) -> str:
        """How the file spells diffusers decoder tensor ``name``."""
        n = ldm_name(name, self.config.levels) if self.layout == "ldm" else name
        return self.prefix + n

    def array(self, name: str) -> np.ndarray:
        """Diffusers decoder tensor ``name`` as stored (a read-only view; bfloat16 as uint16),
        in the diffusers shape (the LDM attention's 1x1 convs seen as [C, C])."""
        a = self.st.array(self.stored_name(name))
        if ".attentions.0." in name and a.ndim == 4:
            a = a.reshape(a.shape[:2])
        return a

    def float64(self, name: str) -> np.ndarray:
        """Tensor ``name``'s values in float64 (for references)."""
        a = self.array(name)
        if self.st.info(self.stored_name(name)).dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return a.astype(np.float64)

    def close(self) -> None:
        self.st.close()


def _resolve(path: str | os.PathLike) -> tuple[Path, dict[str, Any] | None]:
    """(safetensors file, config.json or None) of a file or a diffusers directory."""
    p = Path(path)
    if p.is_dir():
        for cand in (p, p / "vae"):
            wf = cand / WEIGHT_FILE
            if wf.is_file():
                cj = cand / CONFIG_FILE
                cfg = None
                if cj.is_file():
                    try:
                        raw = cj.read_bytes()
                    except OSError as e:
                        raise ModelFileError(f"{cj}: not a readable JSON config ({e})") from None
                    cfg = json_value(raw, f"{cj}: the config")
                    if not isinstance(cfg, dict):
                        raise ModelFileError(f"{cj}: not a JSON object")
                return wf, cfg
        raise ModelNotFoundError(f"{p}: a directory without {WEIGHT_FILE} (nor vae/{WEIGHT_FILE}): "
                                 f"not a diffusers autoencoder directory")
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise ModelNotFoundError(f"{p}: no such file or directory" if isinstance(
            e, FileNotFoundError) else f"{p}: cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):   # a FIFO would block the open
        raise ModelNotFoundError(f"{p}: {file_kind(mode)}, not a regular file or a directory: give "
                                 f"an ae.safetensors file or a diffusers VAE directory")
    return p, None


def open_vae_file(path: str | os.PathLike) -> VaeFile:
    """Open ``path`` (an ``ae.safetensors`` file, a diffusers VAE directory, or a pipeline
    directory holding ``vae/``), infer and check the decoder's config; ModelFileError /
    MissingTensorError naming the file and tensor otherwise."""
    wf, cj = _resolve(path)
    st = SafetensorsFile(wf)
    try:
        layout, prefix = detect_layout(st.names(), str(wf))
        shapes = {n[len(prefix):]: st.info(n).shape for n in st.names() if n.startswith(prefix)}
        dec = [n for n in st.names() if n.startswith(prefix + "decoder.")]
        dtypes = {st.info(n).dtype for n in dec}
        bad = [n for n in dec if st.info(n).dtype not in FLOAT_DTYPES]
        if bad:
            raise ModelFileError(f"{wf}: tensor {bad[0]!r} is {st.info(bad[0]).dtype}; the decoder "
                                 f"reads {', '.join(FLOAT_DTYPES)}", tensor=bad[0])
        dtype = "F32" if "F32" in dtypes else sorted(dtypes)[0]
        cfg = infer_config(shapes, layout, str(wf), cj)
        return VaeFile(cfg, layout, wf, dtype, st, prefix)
    except BaseException:
        st.close()
        raise


@dataclass(frozen=True)
class Conv:
    """One convolution (or linear) as the kernels take it: ``w`` [C_out, C_in*k*k] in its
    stored type (zero copy), ``b`` float32 [C_out], kernel size ``k``."""
    name: str
    w: WeightTensor
    b: np.ndarray
    k: int


@dataclass(frozen=True)
class Norm:
    """One GroupNorm's affine parameters (float32 [C])."""
    name: str
    gamma: np.ndarray
    beta: np.ndarray


def _finite(f: VaeFile, name: str) -> np.ndarray:
    """Tensor ``name``'s values in float64; NaN/inf is an error naming the tensor (a weight,
    a conv bias or a GroupNorm's beta alike)."""
    vals = f.float64(name)
    if not np.all(np.isfinite(vals)):
        stored = f.stored_name(name)
        raise ModelFileError(f"{f.path}: tensor {stored!r} holds NaN or inf", tensor=stored)
    return vals


def _vector(f: VaeFile, name: str) -> np.ndarray:
    """A 1-D tensor as float32 (a copy; small), checked finite."""
    return np.ascontiguousarray(_finite(f, name).astype(np.float32))


def bind(f: VaeFile) -> dict[str, Conv | Norm]:
    """Every decoder module by its diffusers name (``decoder.conv_in``, ..., without
    ``.weight``): convolutions and linears as :class:`Conv`, GroupNorms as :class:`Norm`.
    Matrices are views of the map in the stored type; NaN/inf anywhere is an error naming the
    tensor."""
    mods: dict[str, Conv | Norm] = {}
    for name in tensor_names(f.config):
        if not name.endswith(".weight"):
            continue
        mod = name[:-len(".weight")]
        w = f.array(name)
        stored = f.stored_name(name)
        sdt = f.st.info(stored).dtype
        if w.ndim == 1:               # _vector checks each
            mods[mod] = Norm(mod, _vector(f, name), _vector(f, mod + ".bias"))
            continue
        _finite(f, name)
        k = w.shape[2] if w.ndim == 4 else 1
        mat = np.ascontiguousarray(w).reshape(w.shape[0], -1)
        wt = WeightTensor.from_raw(stored, FLOAT_DTYPES[sdt], mat.shape[1], mat)
        mods[mod] = Conv(mod, wt, _vector(f, mod + ".bias"), k)
    return mods
