"""The typed weight tensor: a 2-D matrix as stored, GGML type + torch shape + raw row bytes.

Owns :class:`WeightTensor` (tensor name, GGML type, torch shape ``(rows, cols)``, raw bytes as a
zero-copy ``uint8 [rows, rowbytes]`` view of the file's memory map) and the block geometry of
the GGML types (``block_elems`` values in ``block_bytes`` bytes per block, from the ``gguf``
package's table), and :func:`check_finite_weight` (the NaN/Inf scan of an untrusted file's
matrix, on its stored bits). It is what binding, the shape checks and the matmul call pass
around, so a weight is never decoded, copied or requantized on its way to the kernels.
Must not: import the compiled kernels (pure-Python tools use it), or decode a matrix except in
:meth:`WeightTensor.dequantize` (float64/float32 references and tests only).

``RUNNABLE_TYPES`` lists the types the block accepts as projection/adaLN weights; adding a
weight type on the Python side is one entry there (its geometry comes from ``gguf``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from nxhpc.formats.ggml_blocks import QUANT_BLOCKS
from nxhpc.formats.gguf_io import ModelFileError

__all__ = ["WeightTensor", "RUNNABLE_TYPES", "FLOAT_TYPES", "type_id", "type_name",
           "block_geometry", "row_bytes", "as_weight_tensor", "check_finite_weight"]

#: Types a block's matrices may be stored in (the kernels run them as stored; every one is a
#: row of the C weight-type traits table, nxhpc/csrc/nx_wtype.c -- tests/test_kernels_wtype.py
#: checks the two agree). Rows must fill whole blocks: 32 values for Q8_0 and Q4_0..Q5_1, 256
#: for the K-quants Q2_K..Q6_K (checked per tensor, naming it, by row_bytes' callers).
RUNNABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                  "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: The float types among them (a matrix of these may carry an ``int8`` copy).
FLOAT_TYPES = ("F32", "F16", "BF16")


def type_id(t: int | str | GGMLQuantizationType) -> int:
    """GGML type id of a name (``"BF16"``), an enum member or an id; ValueError if unknown."""
    try:
        if isinstance(t, str):
            return int(GGMLQuantizationType[t])
        return int(GGMLQuantizationType(int(t)))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"unknown GGML type {t!r}") from None


def type_name(t: int | str | GGMLQuantizationType) -> str:
    """GGML type name (``"Q8_0"``) of an id, enum member or name; ValueError if unknown."""
    return GGMLQuantizationType(type_id(t)).name


def block_geometry(t: int | str | GGMLQuantizationType) -> tuple[int, int]:
    """``(block_elems, block_bytes)`` of a GGML type: F32 (1, 4), BF16 (1, 2), Q8_0 (32, 34)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(type_id(t))]


def row_bytes(t: int | str | GGMLQuantizationType, cols: int) -> int:
    """Bytes of one stored row of ``cols`` values; ValueError unless ``cols`` fills whole blocks."""
    elems, nbytes = block_geometry(t)
    if cols < 1 or cols % elems:
        raise ValueError(f"a {type_name(t)} row of {cols} values does not fill whole blocks of "
                         f"{elems}")
    return cols // elems * nbytes


@dataclass(frozen=True, eq=False)
class WeightTensor:
    """One matrix as stored: ``data`` is ``uint8 [rows, rowbytes]``, ``shape`` is ``(rows, cols)``.

    Build it with :meth:`from_raw` (bytes of a GGUF map: zero copy), :meth:`from_array` (a
    float32/float16 numpy matrix, viewed as its bytes) or :meth:`from_gguf`; the constructor
    checks that ``data`` holds exactly ``rows`` rows of whole ``type`` blocks and names the
    tensor otherwise.

    ``int8``: None, or for an F32/F16/BF16 matrix its Q8_0 copy (a WeightTensor of the same
    name and shape, made once at load by :func:`nxhpc.nn.linear.with_int8_copy`): what the
    ``q8`` precision runs for this matrix. The stored ``data`` stays what every other precision
    reads.
    """
    name: str
    ggml_type: int
    shape: tuple[int, int]
    data: np.ndarray
    int8: Optional["WeightTensor"] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ggml_type", type_id(self.ggml_type))
        rows, cols = (int(s) for s in self.shape)
        object.__setattr__(self, "shape", (rows, cols))
        d = self.data
        where = f"weight {self.name!r} ({self.type_name} [{rows}, {cols}])"
        if not isinstance(d, np.ndarray) or d.dtype != np.uint8 or d.ndim != 2:
            got = f"{d.dtype} {d.shape}" if isinstance(d, np.ndarray) else type(d).__name__
            raise ValueError(f"{where}: data must be uint8 [rows, rowbytes], got {got}")
        try:
            rb = row_bytes(self.ggml_type, cols)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if d.shape != (rows, rb):
            raise ValueError(f"{where}: data must be uint8 {(rows, rb)}, got {d.shape}")
        if not d.flags.c_contiguous:
            raise ValueError(f"{where}: data is not C-contiguous")
        c = self.int8
        if c is not None and (not isinstance(c, WeightTensor) or c.type_name != "Q8_0"
                              or c.shape != self.shape or c.int8 is not None
                              or self.type_name not in FLOAT_TYPES):
            raise ValueError(f"{where}: int8 must be None or, for an F32/F16/BF16 matrix, a "
                             f"Q8_0 WeightTensor of the same shape, got {c!r}")

    # -- construction
    @classmethod
    def from_raw(cls, name: str, ggml_type: int | str, cols: int, data: np.ndarray
                 ) -> "WeightTensor":
        """Stored rows of ``ggml_type`` (any dtype; viewed as bytes, never copied)."""
        a = np.asarray(data)
        if a.ndim != 2 or not a.flags.c_contiguous:
            raise ValueError(f"weight {name!r}: raw data must be a C-contiguous 2-D array, got "
                             f"{a.dtype} {a.shape}")
        return cls(name, type_id(ggml_type), (a.shape[0], cols), a.view(np.uint8))

    @classmethod
    def from_array(cls, name: str, a: np.ndarray) -> "WeightTensor":
        """A float32 (F32) or float16 (F16) matrix, its bytes viewed in place when contiguous."""
        a = np.asarray(a)
        kinds = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
        if a.ndim != 2 or a.dtype not in kinds:
            raise ValueError(f"weight {name!r}: from_array takes a float32 or float16 matrix, "
                             f"got {a.dtype} {a.shape}")
        a = np.ascontiguousarray(a)
        return cls(name, type_id(kinds[a.dtype]), a.shape, a.view(np.uint8))

    @classmethod
    def from_gguf(cls, gguf_file: Any, name: str) -> "WeightTensor":
        """Tensor ``name`` of an open :class:`~nxhpc.formats.gguf_io.GGUFFile` (zero copy)."""
        info = gguf_file.info(name)
        canon = gguf_file.canonical(name)
        if len(info.shape) != 2:
            raise ModelFileError(f"{gguf_file.path}: tensor {canon!r} has shape "
                                 f"{list(info.shape)}, expected 2-D")
        return cls.from_raw(canon, info.ggml_type, info.shape[1], gguf_file.raw(name))

    # -- geometry
    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def block_elems(self) -> int:
        return block_geometry(self.ggml_type)[0]

    @property
    def block_bytes(self) -> int:
        return block_geometry(self.ggml_type)[1]

    @property
    def rowbytes(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    # -- decoding (references and tests)
    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``, decoded by the ``gguf`` package (every GGML type)."""
        import gguf
        d = gguf.quants.dequantize(self.data, GGMLQuantizationType(self.ggml_type))
        return np.array(d, dtype=np.float32).reshape(self.shape)

    def __repr__(self) -> str:
        copy = " + int8 copy" if self.int8 is not None else ""
        return f"WeightTensor({self.name!r}, {self.type_name}, {list(self.shape)}{copy})"


def as_weight_tensor(value: Any, name: str) -> WeightTensor:
    """A :class:`WeightTensor` as is; a bare ``uint8 [rows, n*34]`` array as Q8_0 (the layout
    every weight had before types were carried); a float32/float16 matrix as F32/F16.
    TypeError/ValueError for anything else."""
    if isinstance(value, WeightTensor):
        return value
    if not isinstance(value, np.ndarray):
        raise TypeError(f"weight {name!r}: expected a WeightTensor or a numpy matrix, got "
                        f"{type(value).__name__}")
    if value.dtype == np.uint8 and value.ndim == 2:
        elems, nbytes = block_geometry("Q8_0")
        if value.shape[1] % nbytes or not value.shape[1]:
            raise ValueError(f"weight {name!r}: a bare uint8 matrix is read as Q8_0 rows of "
                             f"{nbytes}-byte blocks; got {value.shape[1]} bytes per row")
        return WeightTensor.from_raw(name, "Q8_0", value.shape[1] // nbytes * elems, value)
    return WeightTensor.from_array(name, value)


_CHUNK_BYTES = 1 << 20      # bytes of a matrix scanned at once by the NaN/Inf check
_SCALE_FIELDS = ("d", "m", "dmin")   # the float16 fields of the GGML block types
#: exponent-all-ones masks on the stored bits: such a value is Inf or NaN
_NONFINITE = {"F32": (np.uint32, 0x7F800000), "F16": (np.uint16, 0x7C00),
              "BF16": (np.uint16, 0x7F80)}


def check_finite_weight(w: WeightTensor, where: str) -> None:
    """ModelFileError unless every stored value of ``w`` is finite (block types: every float16
    scale d / m / dmin of every block; the integer codes are finite by construction).

    Reads the stored bits in chunks of rows (a few MB at a time), so no float copy is made.
    """
    n_rows = max(1, _CHUNK_BYTES // max(1, w.rowbytes))
    bad = 0
    for r0 in range(0, w.rows, n_rows):
        rows = w.data[r0:r0 + n_rows]
        if w.type_name in QUANT_BLOCKS:          # block types: every float16 scale field
            blk = rows.reshape(-1).view(QUANT_BLOCKS[w.type_name].dtype)
            for f in _SCALE_FIELDS:
                if f in blk.dtype.names:
                    bad += int(np.count_nonzero(~np.isfinite(blk[f])))
        elif w.type_name in _NONFINITE:
            dt, mask = _NONFINITE[w.type_name]
            bits = rows.reshape(-1).view(dt)
            bad += int(np.count_nonzero((bits & dt(mask)) == dt(mask)))
    if bad:
        what = f"{w.type_name} blocks have a NaN/Inf scale" if w.type_name in QUANT_BLOCKS \
            else f"{w.type_name} values are NaN/Inf"
        raise ModelFileError(f"{where}: {bad} {what}")
