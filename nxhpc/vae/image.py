"""Pixels out: the decoder's float output as the uint8 picture, and PNG files.

Owns :func:`to_uint8` (exactly diffusers' ``VaeImageProcessor`` postprocess: ``(x / 2 + 0.5)``
clamped to [0, 1], times 255, rounded half to even, in float32), :func:`write_png` (Pillow,
optional text chunks, written atomically: a temporary sibling renamed over the target when
complete) and :func:`load_png_writer` (Pillow loaded before a long run that ends in a PNG).
Must not: import compiled code, torch or diffusers.
"""
from __future__ import annotations

import io
import os
from collections.abc import Mapping

import numpy as np

from nxhpc.runtime.checks import CheckError
from nxhpc.runtime.outfile import check_output_path, write_atomic

__all__ = ["load_png_writer", "to_uint8", "write_png"]


def to_uint8(image: np.ndarray) -> np.ndarray:
    """uint8 [H, W, C] of decoder output float [C, H, W] (about [-1, 1]), as diffusers'
    ``VaeImageProcessor.postprocess`` + ``numpy_to_pil`` on a tensor of the input's dtype:
    ``clamp(x/2 + 0.5, 0, 1)`` in that dtype (float16, float32 or float64; a wider float as
    float64), then to float32, ``round(y * 255)`` in float32 (numpy's round: half to even)."""
    a = np.asarray(image)
    if a.ndim != 3 or a.dtype.kind != "f":
        raise CheckError(f"image: {a.dtype} {list(a.shape)}, expected a 3-d floating-point "
                         f"array [C, H, W]")
    bad = int(a.size - np.count_nonzero(np.isfinite(a)))
    if bad:
        raise CheckError(f"image: {bad} of {a.size} values are NaN or inf")
    dt = a.dtype if a.dtype in (np.float16, np.float32, np.float64) else np.dtype(np.float64)
    x = a.astype(dt, copy=False)
    y = np.clip(x / dt.type(2) + dt.type(0.5), dt.type(0), dt.type(1)).astype(np.float32)
    return np.ascontiguousarray((y.transpose(1, 2, 0) * np.float32(255)).round().astype(np.uint8))


def load_png_writer() -> None:
    """Load Pillow's PNG writer now: import it and encode a 1x1 picture in memory (zlib and the
    encoder included). For a command that writes its PNGs only after a long run (``generate``:
    the encode, every step, the decode): Pillow maps its shared libraries on first import, and
    under an address-space limit (ulimit -v) near the run's needs that mapping failed after
    all the work, with nothing written. Called first, it fails before the work (the same
    ImportError / OSError), and the address-space checks that follow count its mappings."""
    from PIL import Image, PngImagePlugin
    Image.new("RGB", (1, 1)).save(io.BytesIO(), format="PNG", pnginfo=PngImagePlugin.PngInfo())


def _png_keyword(key: str) -> str:
    """``key`` if the PNG specification (11.3.4.2) allows it as a text chunk's keyword: 1-79
    Latin-1 characters, printable (32-126, 161-255), no leading, trailing or consecutive
    spaces; ValueError naming it otherwise (Pillow writes any key: an empty one is dropped by
    readers, a NUL moves the rest into the text, a long one breaks the chunk)."""
    ok = (0 < len(key) <= 79 and all(32 <= ord(c) <= 126 or 161 <= ord(c) <= 255 for c in key)
          and key == key.strip(" ") and "  " not in key)
    if not ok:
        raise ValueError(f"write_png: text keyword {key!r} is not a PNG keyword (1-79 printable "
                         f"Latin-1 characters, no leading, trailing or double spaces)")
    return key


def write_png(path: str | os.PathLike, pixels: np.ndarray,
              text: Mapping[str, str] | None = None, *, exclusive: bool = False) -> None:
    """Write uint8 [H, W, 3] (or [H, W] / [H, W, 1] grey) ``pixels`` as a PNG at ``path``, with
    ``text`` as tEXt chunks; atomically (the old file stays untouched on any failure).
    ``exclusive``: never over an existing file (FileExistsError; a name the caller made up,
    which another process may have taken meanwhile). A keyword the PNG format does not allow,
    or a text holding NUL, is a ValueError before anything is written."""
    from PIL import Image, PngImagePlugin
    a = np.asarray(pixels)
    if a.dtype != np.uint8 or a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[2] not in (1, 3)):
        raise ValueError(f"write_png: pixels must be uint8 [H, W, 3] or [H, W], got {a.dtype} "
                         f"{list(a.shape)}")
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    check_output_path(path, what="PNG output")
    info = PngImagePlugin.PngInfo()
    for k, v in (text or {}).items():
        key, value = _png_keyword(str(k)), str(v)
        if "\0" in value:
            raise ValueError(f"write_png: the text of {key!r} holds a NUL character, which a PNG "
                             f"text chunk cannot (readers end the keyword there)")
        info.add_text(key, value)
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(a)).save(buf, format="PNG", pnginfo=info)
    data = buf.getvalue()
    write_atomic(path, lambda fh: fh.write(data), exclusive=exclusive)
