"""The fixture store: named activation tensors in one safetensors file, every model's.

Owns reading and writing ``fixtures.safetensors``: a block model's (``t_emb``, ``pe``,
``mask``, ``layers.{i}.blk_in`` / ``adaln_m`` / ``ref_out``, optionally weights under their GGUF
names) and a whole denoiser's (``latents``, ``cap_feats``, ``timestep``, optionally its float64
``reference``). Every fixture is float32 except those saved with ``float64=``.
It checks names, dims, dtype and finiteness and raises errors naming the file and the fixture;
it knows nothing about the block's semantics.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from nxhpc.formats.gguf_io import MissingTensorError, ModelFileError, atomic_output
from nxhpc.formats.safetensors_io import json_value

__all__ = ["FixtureStore", "FIXTURES_FILE"]

FIXTURES_FILE = "fixtures.safetensors"


class FixtureStore:
    """Read access to one safetensors file of fixtures (names, dims, load)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise ModelFileError(f"{self.path}: fixture file not found") from None
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot open fixture file: {e}") from None
        self._header = self._read_header(size)

    def _read_header(self, size: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Parse and bounds-check the safetensors header (8-byte length, JSON, offsets)."""
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise ModelFileError(f"{self.path}: truncated fixture file ({size} bytes)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > 100 << 20:
                    raise ModelFileError(f"{self.path}: corrupt fixture file (header length {n}, "
                                         f"file has {size} bytes)")
                raw = fh.read(n)
        except OSError as e:
            raise ModelFileError(f"{self.path}: cannot read fixture file: {e}") from None
        meta = json_value(raw, f"{self.path}: the fixture file header")
        if not isinstance(meta, dict):
            raise ModelFileError(f"{self.path}: corrupt fixture file header: not a JSON object")
        data_size = size - 8 - n
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        itemsize = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I16": 2,
                    "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1}
        for name, ent in meta.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = ent["dtype"], ent["shape"], ent["data_offsets"]
                shape = tuple(int(s) for s in shape)
                ok = (isinstance(dtype, str) and all(s >= 0 for s in shape)
                      and 0 <= int(a) <= int(b) <= data_size
                      and (dtype not in itemsize
                           or int(b) - int(a) == itemsize[dtype] * math.prod(shape)))
                #                 (Python ints: np.prod wraps in int64, 2**62 x 32 x 4 -> 0)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise ModelFileError(f"{self.path}: fixture {name!r} has a corrupt header entry "
                                     f"{ent!r} (data section is {data_size} bytes)")
            out[name] = (dtype, shape)
        return out

    def names(self) -> list[str]:
        """Fixture names, sorted."""
        return sorted(self._header)

    def has(self, name: str) -> bool:
        """Whether fixture ``name`` exists."""
        return name in self._header

    def dims(self, name: str) -> tuple[int, ...]:
        """Shape of a fixture (numpy order); :class:`MissingTensorError` if absent."""
        return self._entry(name)[1]

    def dtype(self, name: str) -> str:
        """The stored safetensors dtype (``"F32"`` for every fixture nxhpc writes)."""
        return self._entry(name)[0]

    def _entry(self, name: str) -> tuple[str, tuple[int, ...]]:
        try:
            return self._header[name]
        except KeyError:
            raise MissingTensorError(f"{self.path}: fixture {name!r} not found "
                                     f"({len(self._header)} fixtures present)") from None

    def load(self, name: str, shape: Sequence[int] | None = None, *,
             check_finite: bool = True, float64: bool = False) -> np.ndarray:
        """Load a fixture as a float32 C-contiguous array (``float64``: an F64 fixture, exactly,
        as float64).

        ``shape`` (optional) is the expected shape; a mismatch, another stored dtype, or (with
        ``check_finite``) NaN/Inf raise :class:`ModelFileError` naming the fixture.
        """
        dtype, dims = self._entry(name)
        want = "F64" if float64 else "F32"
        if dtype != want:
            raise ModelFileError(f"{self.path}: fixture {name!r} is {dtype}, expected {want}")
        if shape is not None and tuple(dims) != tuple(int(s) for s in shape):
            raise ModelFileError(f"{self.path}: fixture {name!r} has dims {list(dims)}, "
                                 f"expected {list(shape)}")
        try:
            from safetensors import safe_open
            with safe_open(str(self.path), framework="np") as f:
                arr = f.get_tensor(name)
        except MemoryError:      # the address-space limit, not a damaged file
            raise
        except Exception as e:  # SafetensorError and friends on corrupt files
            raise ModelFileError(f"{self.path}: cannot load fixture {name!r}: "
                                 f"{type(e).__name__}: {e}") from None
        arr = np.array(arr, dtype=np.float64 if float64 else np.float32, order="C")
        if arr.shape != tuple(dims):
            raise ModelFileError(f"{self.path}: fixture {name!r} loaded as {arr.shape}, header "
                                 f"says {list(dims)}")  # pragma: no cover
        if check_finite and not np.isfinite(arr).all():
            bad = int(np.count_nonzero(~np.isfinite(arr)))
            raise ModelFileError(f"{self.path}: fixture {name!r} has {bad} NaN/Inf values")
        return arr

    def metadata(self) -> dict[str, str]:
        """The file's ``__metadata__`` string map (empty if none)."""
        try:
            from safetensors import safe_open
            with safe_open(str(self.path), framework="np") as f:
                return dict(f.metadata() or {})
        except MemoryError:
            raise
        except Exception as e:
            raise ModelFileError(f"{self.path}: cannot read fixture metadata: {e}") from None

    @staticmethod
    def save(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
             metadata: Mapping[str, str] | None = None, *,
             float64: Sequence[str] = ()) -> Path:
        """Write ``tensors`` (name -> numeric array, stored float32; the names in ``float64``
        stored float64) atomically to ``path``.

        Floats are rounded to float32 (the store's dtype); bool and integer arrays (a mask,
        position ids) must convert exactly. NaN/Inf, or a value that overflows float32, raises
        ValueError naming the fixture. Names and metadata are sorted, so the same tensors
        always give the same bytes."""
        path = Path(path)
        out: dict[str, np.ndarray] = {}
        for name, value in tensors.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"FixtureStore.save: names must be non-empty str, got {name!r}")
            a = np.asarray(value)
            if a.dtype.kind not in "fbiu":
                raise ValueError(f"FixtureStore.save: fixture {name!r} has dtype {a.dtype}, "
                                 f"expected a numeric array")
            with np.errstate(over="ignore", invalid="ignore"):
                a32 = np.array(a, dtype=np.float64 if name in float64 else np.float32,
                               order="C")           # (not ascontiguousarray: keeps 0-d)
            if not np.isfinite(a32).all():
                raise ValueError(f"FixtureStore.save: fixture {name!r} contains NaN/Inf "
                                 f"(after conversion to float32)")
            if a.dtype.kind in "iu" and not np.array_equal(a32.astype(a.dtype), a):
                raise ValueError(f"FixtureStore.save: fixture {name!r} has integers beyond "
                                 f"float32's exact range (|v| > 2**24); they would be rounded")
            out[name] = a32
        # Written here rather than by safetensors.save_file, whose metadata order varies from
        # run to run: names sorted, metadata keys sorted, header padded to 8 bytes -> the same
        # tensors always give the same bytes.
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
        off = 0
        for name in sorted(out):
            a = out[name]
            header[name] = {"dtype": "F64" if a.dtype == np.float64 else "F32",
                            "shape": list(a.shape),
                            "data_offsets": [off, off + a.nbytes]}
            off += a.nbytes
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        with atomic_output(path) as tmp, open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(hb)))
            fh.write(hb)
            for name in sorted(out):
                a = out[name]
                fh.write(a.astype("<f8" if a.dtype == np.float64 else "<f4",
                                  copy=False).tobytes())
        return path

    def __repr__(self) -> str:
        return f"FixtureStore({str(self.path)!r}, {len(self._header)} fixtures)"
