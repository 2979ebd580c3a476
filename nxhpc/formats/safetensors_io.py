"""Checked, zero-copy reading of safetensors files (the autoencoder's weights).

Owns :class:`SafetensorsFile`: the file memory-mapped read-only, every tensor a numpy view of
the map (float32 / float16 as such, bfloat16 as its uint16 bit patterns: numpy has no
bfloat16), after checking the header against the file. The format, as read here:

1. 8 bytes: N, the header length, unsigned little-endian.
2. N bytes: a JSON object ``{name: {"dtype": D, "shape": [..], "data_offsets": [b, e]}, ...}``,
   optionally ``"__metadata__": {str: str}``.
3. The data section: tensor ``name`` is bytes ``[b, e)`` of it, C order, little-endian;
   ``e - b`` is its element count times the dtype's size.

Every size and offset is checked against the file, with an error naming the file and the
tensor (:class:`~nxhpc.formats.ModelFileError`). The ``safetensors`` package is the oracle in
the tests (its numpy loader copies and has no bfloat16, so it is not used to read).
Must not: import the compiled kernels, a model family, or torch.
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from nxhpc.formats.closing import Closing
from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError
from nxhpc.runtime.checks import file_kind

__all__ = ["SafetensorsFile", "STInfo", "DTYPES", "MAX_HEADER_BYTES", "json_value"]

#: safetensors dtype name -> (numpy dtype of one element's bits, bytes per element).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}

#: The largest header accepted (the safetensors package's own limit is 100 MB).
MAX_HEADER_BYTES = 100_000_000


class STInfo(NamedTuple):
    """One tensor of the header: its name, safetensors dtype, shape and byte range [begin, end)
    within the data section."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class _DuplicateKey(ValueError):
    """A JSON object naming one key twice (valid JSON, but ambiguous data)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict, refusing a key given twice (json keeps the last one silently: a
    header naming a tensor twice would run the second entry's bytes)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def json_value(data: bytes, what: str) -> Any:
    """The JSON value of UTF-8 ``data`` (``what`` names the text: ``"{path}: the safetensors
    header"``); ModelFileError ``"{what} is not valid JSON (why)"`` for any text Python's
    json cannot make a value of: not UTF-8, not JSON (``ValueError``, which also covers an
    integer of more digits than ``int()`` converts), nesting past the recursion limit; and
    ``"{what} names the key ... twice"`` for an object repeating a key (valid JSON, but which
    entry is meant?)."""
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ModelFileError(f"{what} names the key {str(e.args[0])[:120]!r} twice in one "
                             f"object (which entry is meant?)") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ModelFileError(f"{what} is not valid JSON ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None


def _parse_header(path: Path, size: int, head: bytes) -> tuple[int, dict[str, str],
                                                                 dict[str, STInfo]]:
    """(data start, metadata, {name: STInfo}) of a file of ``size`` bytes beginning ``head``."""
    where = str(path)
    if size < 8:
        raise ModelFileError(f"{where}: not a safetensors file ({size} bytes, shorter than its "
                             f"8-byte header length)")
    if head[:4] == b"GGUF":
        raise ModelFileError(f"{where}: a GGUF file, not a safetensors file (a GGUF holds a "
                             f"transformer or a text encoder; an autoencoder is ae.safetensors "
                             f"or a diffusers vae/ directory)")
    n = int.from_bytes(head[:8], "little")
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise ModelFileError(f"{where}: not a safetensors file: header length {n} is absurd for "
                             f"a file of {size} bytes (at most {MAX_HEADER_BYTES:,} and within "
                             f"the file)")
    header = json_value(head[8:8 + n], f"{where}: the safetensors header")
    if not isinstance(header, dict):
        raise ModelFileError(f"{where}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {}) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise ModelFileError(f"{where}: __metadata__ must map strings to strings")
    data_start, data_size = 8 + n, size - 8 - n
    infos: dict[str, STInfo] = {}
    for name, ent in header.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(ent, dict):
            raise ModelFileError(f"{at}: header entry is not an object", tensor=name)
        dt, shape, offs = ent.get("dtype"), ent.get("shape"), ent.get("data_offsets")
        if dt not in DTYPES:
            raise ModelFileError(f"{at}: dtype {dt!r} is not one of {', '.join(DTYPES)}",
                                 tensor=name)
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2 ** 40
                           for s in shape)):
            raise ModelFileError(f"{at}: shape {shape!r} is not a list of non-negative "
                                 f"integers", tensor=name)
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise ModelFileError(f"{at}: data_offsets {offs!r} is not [begin, end]", tensor=name)
        b, e = offs
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if not 0 <= b <= e:
            raise ModelFileError(f"{at}: data_offsets [{b}, {e}) are not a byte range (0 <= "
                                 f"begin <= end)", tensor=name)
        if e - b != nbytes:
            raise ModelFileError(f"{at}: data_offsets [{b}, {e}) hold {e - b} bytes, but "
                                 f"{dt} {tuple(shape)} needs {nbytes}", tensor=name)
        if e > data_size:
            raise ModelFileError(f"{at}: its data [{b}, {e}) runs past the end of the data "
                                 f"section ({data_size} bytes): the file is truncated",
                                 tensor=name)
        infos[name] = STInfo(name, dt, tuple(shape), b, e)
    by_begin = sorted((t for t in infos.values() if t.end > t.begin), key=lambda t: t.begin)
    for t, u in zip(by_begin, by_begin[1:]):
        if t.end > u.begin:   # the safetensors package refuses such a file too
            raise ModelFileError(f"{where}: tensors {t.name!r} [{t.begin}, {t.end}) and "
                                 f"{u.name!r} [{u.begin}, {u.end}) overlap in the data section",
                                 tensor=u.name)
    return data_start, dict(meta), infos


class SafetensorsFile(Closing):
    """A validated, read-only memory map of one safetensors file.

    ``names()`` lists the tensors, :meth:`info` gives one's dtype and shape, :meth:`array` a
    zero-copy read-only view (bfloat16 as uint16 bits), ``metadata`` the ``__metadata__``
    strings. Views keep the map alive after :meth:`close` (which only drops this object's
    reference); a context manager.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            mode = os.stat(self.path).st_mode
            if not stat.S_ISREG(mode):   # a FIFO would block the open, a device read forever
                raise ModelFileError(f"{self.path}: not a regular file ({file_kind(mode)}): "
                                     f"a safetensors file was expected")
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                first = fh.read(8)
                n = int.from_bytes(first, "little") if len(first) == 8 else 0
                head = first + (fh.read(n) if 8 + n <= size and n <= MAX_HEADER_BYTES else b"")
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read the safetensors file: "
                                 f"{e.strerror or e}") from None
        self.data_start, self.metadata, self._infos = _parse_header(self.path, size, head)
        self._map: np.ndarray | None = None
        if size > self.data_start:
            try:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
            except (OSError, ValueError) as e:
                if getattr(e, "errno", None) == errno.ENOMEM:
                    raise                 # the address space, not the file: the CLIs' exit 7
                raise ModelFileError(f"{self.path}: cannot map the file: {e}") from None
            if self._map.shape[0] != size:
                raise ModelFileError(f"{self.path}: the file changed size while it was opened")

    def names(self) -> list[str]:
        """Every tensor name, in header order."""
        return list(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def info(self, name: str) -> STInfo:
        """The header entry of ``name`` (MissingTensorError naming it if absent)."""
        try:
            return self._infos[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: no tensor {name!r}", tensor=name) from None

    def array(self, name: str) -> np.ndarray:
        """A read-only view of ``name``'s data in its shape: float32 / float16 / ... as stored,
        bfloat16 as uint16 bit patterns. Zero copy."""
        info = self.info(name)
        dt = DTYPES[info.dtype]
        if info.end == info.begin:
            return np.zeros(info.shape, dtype=dt)
        if self._map is None:
            raise ModelFileError(f"{self.path}: the file is closed")
        raw = self._map[self.data_start + info.begin:self.data_start + info.end]
        return raw.view(dt).reshape(info.shape)

    def close(self) -> None:
        """Drop this object's reference to the map (outstanding views keep it alive)."""
        self._map = None

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._infos)} tensors)"

