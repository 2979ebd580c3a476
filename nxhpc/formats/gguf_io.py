"""GGUF weight files: validated, memory-mapped reading and policy-driven writing.

Owns everything about the GGUF container: a bounds-checked scan of untrusted files, the name
prefix (``model.diffusion_model.``), per-tensor decoding by stored GGML type, and writing files
the way the community converters do. It knows nothing about the block (``nxhpc.models`` infers
the config). Named ``gguf_io`` rather than ``gguf`` so it never shadows the ``gguf`` package it
is built on.

The format (versions 2 and 3, little-endian), as scanned here before the ``gguf`` package's
reader is allowed near the file:

1. magic ``b"GGUF"``, uint32 version, uint64 tensor count, uint64 key/value count;
2. key/value pairs: string key (uint64 length + UTF-8), uint32 value type, value; arrays are
   uint32 item type + uint64 count + items (strings inside arrays carry their own lengths);
3. tensor infos: string name, uint32 n_dims (1..4), n_dims x uint64 ``ne`` innermost first,
   uint32 GGML type, uint64 offset relative to the data section (a multiple of the alignment);
4. padding up to ``general.alignment`` (uint32 power of two, default 32);
5. the data section: tensor ``i`` occupies ``[data + offset_i, data + offset_i + nbytes_i)``,
   ``nbytes = prod(ne) / block_size * type_size``, inside the file, no two overlapping.

Every violation raises :class:`ModelFileError` naming the file (and the tensor or key). Q8_0
tensors are handed out as read-only ``uint8 [rows, cols//32*34]`` views of the memory map
(never copied); F32/F16/BF16 decode to float32. The error classes shared by the model-file
modules live here (the lowest layer) and are re-exported by ``nxhpc.models``.
"""
from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

import gguf
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from nxhpc.formats.closing import Closing
from nxhpc.formats.ggml_blocks import Q8_0_BLOCK_DTYPE, QK8_0

__all__ = [
    "ModelError", "ModelNotFoundError", "ModelFileError", "MissingTensorError", "QuantizationError",
    "refuse_text_encoder",
    "PREFIX", "BLOCK_INDEX", "Q8_0_BLOCK", "QK8_0", "GGUFFile", "TensorInfo", "Q8_0Tensor", "QuantTensor",
    "LazyTensor", "quantize_q8_0", "dequantize_q8_0", "should_quantize", "write_gguf",
    "atomic_output", "read_field", "read_fields",
]


# ----------------------------------------------------------------------------- errors

class ModelError(Exception):
    """Base class of every model-file error (model ids, GGUF, fixtures)."""


class ModelNotFoundError(ModelError):
    """A model id or directory could not be resolved."""


class ModelFileError(ModelError):
    """A GGUF or fixture file is malformed, unsupported, or does not fit the model's config.
    ``tensor``: the tensor the problem was found at, when one applies (the message names it
    too)."""

    def __init__(self, message: str = "", tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


class QuantizationError(ModelFileError, ValueError):
    """Weights that cannot be converted to Q8_0 (NaN/inf, or a block whose scale float16 cannot
    hold). A :class:`ModelFileError` -- the weights come from a model file, so the CLIs report it
    as a bad file (exit 4) -- and a ``ValueError`` for callers that check arguments."""


def refuse_text_encoder(g: "GGUFFile", noun: str) -> None:
    """ModelNotFoundError when ``g`` is a Qwen3 text encoder's GGUF (``general.architecture``
    qwen3), opened as ``noun`` (a DiT, a denoiser): for a door whose tensors it lacks, a
    sentence naming the file's kind instead of its first missing tensor."""
    if g.architecture == "qwen3":
        raise ModelNotFoundError(f"{g.path}: a Qwen3 text encoder's GGUF (general.architecture "
                                 f"'qwen3'), not {noun}; open it as a text encoder "
                                 f"(load_text_encoder, --text-encoder, python -m nxhpc.encode)")


class MissingTensorError(ModelFileError):
    """A required tensor or fixture is absent (the message names it). A ModelFileError, so
    ``except ModelFileError`` catches every problem with a file's contents."""


# ----------------------------------------------------------------------------- constants

PREFIX = "model.diffusion_model."
"""Name prefix written by stable-diffusion.cpp's converter (ComfyUI-GGUF writes none)."""

#: A block index in a tensor name as the files write it (``layers.7.``, ``blk.12.``,
#: ``up.3.``): ASCII digits (regex ``\d`` takes any Unicode decimal, "layers.٣" would alias
#: layers.3), no leading zero ("layers.03" would too), at most 18 (int() of thousands of
#: digits raises). A name whose index is anything else is an unexpected tensor.
BLOCK_INDEX = r"(0|[1-9][0-9]{0,17})"

Q8_0_BLOCK = Q8_0_BLOCK_DTYPE
"""One Q8_0 block: float16 scale ``d`` then 32 int8 ``q``; value = d*q (34 bytes, packed).
The one definition (``nxhpc.formats.ggml_blocks``) that the kernels' wrappers also use, so the layout
the files are checked against and the layout the kernels read cannot drift apart."""

_F32, _F16, _BF16, _Q8_0 = (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                            GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0)
DECODABLE_TYPES = ("F32", "F16", "BF16", "Q8_0")
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4                   # GGML_MAX_DIMS
MAX_NAME_BYTES = 1 << 16       # generous; ggml itself caps tensor names at 64 bytes
MAX_ARRAY_DEPTH = 4
QUANTIZE_MIN_ELEMENTS = 1024   # community converters keep tensors this small in F32

_SCALAR_FMT = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


# ----------------------------------------------------------------------------- scanning

class _Truncated(Exception):
    pass


class _Cursor:
    """Bounds-checked little-endian reader over a bytes-like buffer."""

    def __init__(self, buf: memoryview, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, file has {self.size}")

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self) -> int:
        return self.unpack("<I")

    def u64(self) -> int:
        return self.unpack("<Q")

    def string(self, what: str) -> str:
        n = self.u64()
        if n > MAX_NAME_BYTES * 1024:
            raise ValueError(f"{what}: string length {n} is implausible")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{what}: string is not valid UTF-8") from None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored: ``shape`` in numpy order (outermost first), logical elements."""
    name: str            # name as stored in the file (prefix included)
    ggml_type: int
    shape: tuple[int, ...]
    n_bytes: int
    offset: int          # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type#{self.ggml_type}"


@dataclass(frozen=True)
class _NumArray:
    """A numeric metadata array of more than 64 items, left in the file: ``count`` items of
    struct format ``fmt`` at byte ``start`` (decoded only when asked for)."""
    start: int
    fmt: str
    count: int
    type_name: str


def _read_value(cur: _Cursor, vtype: int, what: str, depth: int = 0) -> Any:
    """One value; arrays come back whole (strings decoded) except numeric ones of more than 64
    items, which stay in the file as a :class:`_NumArray`."""
    try:
        vt = GGUFValueType(vtype)
    except ValueError:
        raise ValueError(f"{what}: unknown value type {vtype}") from None
    if vt in _SCALAR_FMT:
        return cur.unpack(_SCALAR_FMT[vt])
    if vt == GGUFValueType.STRING:
        return cur.string(what)
    # ARRAY
    if depth >= MAX_ARRAY_DEPTH:
        raise ValueError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
    itype = cur.u32()
    count = cur.u64()
    try:
        ivt = GGUFValueType(itype)
    except ValueError:
        raise ValueError(f"{what}: unknown array item type {itype}") from None
    if ivt in _SCALAR_FMT:
        fmt = _SCALAR_FMT[ivt]
        size = struct.calcsize(fmt)
        if count > (cur.size - cur.pos) // size:
            raise _Truncated(f"{what}: array of {count} x {ivt.name} runs past the end of the file")
        start = cur.pos
        cur.pos += count * size
        if count <= 64:
            return list(struct.unpack_from("<" + fmt[1] * count, cur.buf, start))
        return _NumArray(start, fmt, count, ivt.name)
    # strings or nested arrays: each item is at least 8 bytes (a length/count)
    if count > (cur.size - cur.pos) // 8:
        raise _Truncated(f"{what}: array of {count} x {ivt.name} runs past the end of the file")
    if ivt == GGUFValueType.STRING:
        return _read_strings(cur, count, what)
    return [_read_value(cur, itype, f"{what}[{i}]", depth + 1) for i in range(count)]


def _read_strings(cur: _Cursor, count: int, what: str) -> list[str]:
    """``count`` length-prefixed UTF-8 strings: :meth:`_Cursor.string` inlined, since a vocab
    holds 300k of them (3x faster than a call per item)."""
    buf, size, pos = cur.buf, cur.size, cur.pos
    length = struct.Struct("<Q").unpack_from
    items: list[str] = []
    add = items.append
    try:
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated(f"needs 8 bytes at offset {pos}, file has {size}")
            n = length(buf, pos)[0]
            pos += 8
            if n > size - pos:
                raise _Truncated(f"needs {n} bytes at offset {pos}, file has {size}")
            add(str(buf[pos:pos + n], "utf-8"))
            pos += n
    except UnicodeDecodeError:
        raise ValueError(f"{what}[{len(items)}]: string is not valid UTF-8") from None
    except _Truncated as e:
        raise _Truncated(f"{what}[{len(items)}]: {e}") from None
    cur.pos = pos
    return items


def _summary(value: Any) -> Any:
    """A metadata value as :attr:`GGUFFile.metadata` shows it: arrays of more than 64 items
    as ``"<array of N TYPE>"``."""
    if isinstance(value, _NumArray):
        return f"<array of {value.count} {value.type_name}>"
    if isinstance(value, list):
        if len(value) > 64:
            kind = "STRING" if isinstance(value[0], str) else "ARRAY"
            return f"<array of {len(value)} {kind}>"
        return [_summary(v) for v in value]
    return value


def _full(value: Any, data: Path | np.ndarray) -> Any:
    """A scanned value with every :class:`_NumArray` read, as lists, from ``data``: the file's
    bytes as mapped when they were scanned (an open :class:`GGUFFile`), or its path (mapped
    here: :func:`read_fields`)."""
    if isinstance(value, _NumArray):
        n = value.count * struct.calcsize(value.fmt)
        mm = np.memmap(data, dtype=np.uint8, mode="r") if isinstance(data, Path) else data
        if value.start + n > mm.shape[0]:       # mapped after the scan, shorter by then
            where = data if isinstance(data, Path) else "the GGUF file"
            raise ModelFileError(f"{where}: the file shrank after it was scanned")
        return mm[value.start:value.start + n].view(np.dtype(value.fmt)).tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [_full(v, data) for v in value]
    return value


def _scan(path: Path, buf: memoryview, size: int
          ) -> tuple[int, int, int, dict, list[TensorInfo], dict]:
    """Validate the whole layout; return (version, alignment, data_start, metadata, tensors,
    fields): ``metadata`` with long arrays summarised, ``fields`` whole (see _read_value)."""
    cur = _Cursor(buf, size)
    where = "header"
    try:
        if size < 4 or bytes(buf[:4]) != b"GGUF":
            got = bytes(buf[:4]) if size >= 4 else bytes(buf[:size])
            raise ModelFileError(f"{path}: not a GGUF file (magic {got!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32()
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise ModelFileError(f"{path}: big-endian GGUF is not supported")
            raise ModelFileError(f"{path}: unsupported GGUF version {version} "
                                 f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        n_tensors = cur.u64()
        n_kv = cur.u64()
        # every kv needs >= 8+4+1 bytes and every tensor info >= 8+4+8+4+8 bytes
        if n_kv > size // 13 or n_tensors > size // 32:
            raise ModelFileError(f"{path}: header claims {n_tensors} tensors and {n_kv} "
                                 f"metadata keys, more than a {size}-byte file can hold")
        metadata: dict[str, Any] = {}
        fields: dict[str, Any] = {}
        for i in range(n_kv):
            where = f"metadata key #{i}"
            key = cur.string(where)
            where = f"metadata key {key!r}"
            vtype = cur.u32()
            if key in metadata:
                raise ModelFileError(f"{path}: duplicate metadata key {key!r}")
            value = _read_value(cur, vtype, where)
            if key == "general.alignment":
                if vtype != GGUFValueType.UINT32:
                    raise ModelFileError(f"{path}: general.alignment must be uint32, "
                                         f"got value type {vtype}")
            fields[key] = value
            metadata[key] = _summary(value)
        alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(f"{path}: general.alignment {alignment!r} is not a power of two")
        raw_infos = []
        seen: set[str] = set()
        for i in range(n_tensors):
            where = f"tensor info #{i}"
            name = cur.string(where)
            where = f"tensor {name!r}"
            if name in seen:
                raise ModelFileError(f"{path}: duplicate tensor {name!r}")
            seen.add(name)
            n_dims = cur.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelFileError(f"{path}: tensor {name!r} has {n_dims} dims "
                                     f"(1..{MAX_DIMS} allowed)")
            ne = [cur.u64() for _ in range(n_dims)]
            ttype = cur.u32()
            offset = cur.u64()
            raw_infos.append((name, ne, ttype, offset))
        where = "tensor data"
        data_start = -(-cur.pos // alignment) * alignment
        if n_tensors and data_start > size:
            raise _Truncated(f"data section would start at {data_start}, file has {size} bytes")
    except _Truncated as e:
        raise ModelFileError(f"{path}: truncated or corrupt GGUF ({where}): {e}") from None
    except ValueError as e:
        raise ModelFileError(f"{path}: corrupt GGUF ({where}): {e}") from None

    infos: list[TensorInfo] = []
    for name, ne, ttype, offset in raw_infos:
        try:
            qt = GGMLQuantizationType(ttype)
        except ValueError:
            raise ModelFileError(f"{path}: tensor {name!r} has unknown GGML type {ttype}") from None
        if any(d == 0 for d in ne):
            raise ModelFileError(f"{path}: tensor {name!r} has an empty dimension (ne={ne})")
        n_el = math.prod(ne)
        if n_el > 1 << 48:
            raise ModelFileError(f"{path}: tensor {name!r} claims {n_el} elements (ne={ne})")
        block, tsize = GGML_QUANT_SIZES[qt]
        if ne[0] % block:
            raise ModelFileError(f"{path}: tensor {name!r} of type {qt.name} has row length "
                                 f"{ne[0]}, not a multiple of its block size {block}")
        n_bytes = n_el // block * tsize
        if offset % alignment:
            raise ModelFileError(f"{path}: tensor {name!r} data offset {offset} is not a "
                                 f"multiple of the alignment {alignment}")
        start = data_start + offset
        if start + n_bytes > size:
            raise ModelFileError(f"{path}: tensor {name!r} data [{start}, {start + n_bytes}) "
                                 f"lies beyond the end of the file ({size} bytes): truncated?")
        infos.append(TensorInfo(name, int(qt), tuple(int(d) for d in reversed(ne)),
                                n_bytes, start))
    by_start = sorted(infos, key=lambda t: t.offset)
    for a, b in zip(by_start, by_start[1:]):
        if a.offset + a.n_bytes > b.offset:
            raise ModelFileError(f"{path}: tensors {a.name!r} and {b.name!r} overlap in the file")
    return version, alignment, data_start, metadata, infos, fields


def _scan_file(path: Path) -> tuple[int, int, int, dict, list[TensorInfo], dict]:
    """:func:`_scan` of the file at ``path`` (mapped for the scan only)."""
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ModelFileError(f"{path}: not a regular file")
    except FileNotFoundError:
        raise ModelFileError(f"{path}: GGUF file not found") from None
    except OSError as e:
        raise ModelFileError(f"{path}: cannot open GGUF file: {e}") from None
    if size < 24:
        raise ModelFileError(f"{path}: truncated GGUF ({size} bytes, header needs 24)")
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = memoryview(mm)
        try:
            return _scan(path, view, size)
        finally:
            view.release()
    finally:
        mm.close()


def read_fields(path: str | os.PathLike, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """The whole values of metadata ``keys`` (every key when None; absent keys are left out)
    of the GGUF at ``path``, after the same validating scan as :class:`GGUFFile` but without
    mapping the tensors or running the ``gguf`` package's reader (which builds numpy parts for
    every vocab string: tens of seconds for a 150k-token vocab). Values as
    :meth:`GGUFFile.field` gives them."""
    path = Path(path)
    fields = _scan_file(path)[5]
    wanted = fields if keys is None else [k for k in keys if k in fields]
    return {k: _full(fields[k], path) for k in wanted}


# ----------------------------------------------------------------------------- reading

# numpy dtypes of the types stored one value per element; every other type (BF16 and the
# block quants) is viewed as uint8 rows of its stored bytes, as the gguf package's reader does
_ELEMENT_DTYPES = {int(GGMLQuantizationType.F32): np.float32,
                   int(GGMLQuantizationType.F16): np.float16,
                   int(GGMLQuantizationType.F64): np.float64,
                   int(GGMLQuantizationType.I8): np.int8,
                   int(GGMLQuantizationType.I16): np.int16,
                   int(GGMLQuantizationType.I32): np.int32,
                   int(GGMLQuantizationType.I64): np.int64}


def _tensor_view(mapping: np.ndarray, info: TensorInfo) -> np.ndarray:
    """Read-only view of one tensor's bytes in ``mapping`` (layout checked by the scan)."""
    raw = mapping[info.offset:info.offset + info.n_bytes]
    dt = _ELEMENT_DTYPES.get(info.ggml_type)
    if dt is not None:
        v = raw.view(dt).reshape(info.shape)
    else:
        block, tsize = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
        v = raw.reshape(info.shape[:-1] + (info.shape[-1] // block * tsize,))
    v = v.view(np.ndarray)
    v.flags.writeable = False
    return v


class GGUFFile(Closing):
    """A validated, memory-mapped GGUF file; tensors addressed with or without the prefix.

    ``names()`` lists canonical names (prefix removed); every accessor accepts both forms.
    Views returned by :meth:`raw` / :meth:`q8_0` are read-only and keep the mapping alive.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        (self.version, self.alignment, self.data_start, self.metadata, infos,
         self._fields) = _scan_file(self.path)
        try:
            self._map: np.ndarray | None = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            if getattr(e, "errno", None) == errno.ENOMEM:
                raise                     # the address space, not the file: the CLIs' exit 7
            raise ModelFileError(f"{self.path}: cannot map the GGUF file: {e}") from None
        if self._map.shape[0] < max((i.offset + i.n_bytes for i in infos), default=0):
            raise ModelFileError(f"{self.path}: the file shrank while it was opened")
        # views are made from the validated scan (offsets, types and sizes checked there), not
        # by the gguf package's reader: that one builds numpy parts for every metadata string,
        # tens of seconds for a 150k-token vocab
        self._views = {i.name: _tensor_view(self._map, i) for i in infos}
        self._infos: dict[str, TensorInfo] = {}
        prefixed = [i for i in infos if i.name.startswith(PREFIX)]
        self.prefix = PREFIX if infos and len(prefixed) * 2 > len(infos) else ""
        for info in infos:
            canon = info.name[len(PREFIX):] if info.name.startswith(PREFIX) else info.name
            if canon in self._infos:
                raise ModelFileError(f"{self.path}: tensor {canon!r} is stored both with and "
                                     f"without the {PREFIX!r} prefix")
            self._infos[canon] = info

    # -- metadata
    @property
    def mapping(self) -> np.ndarray:
        """The whole file as a read-only ``uint8`` memory map (tensor views alias it)."""
        if self._map is None:
            raise ModelFileError(f"{self.path}: the GGUF file is closed")
        return self._map

    @property
    def architecture(self) -> str | None:
        """``general.architecture`` (``"lumina2"`` from ComfyUI-GGUF), or None."""
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None

    def field(self, key: str) -> Any:
        """The whole value of metadata ``key`` (None when absent): a str, int, float or bool,
        or a list (every item -- :attr:`metadata` summarises arrays of more than 64 items),
        from the validating scan (strings already checked as UTF-8)."""
        if self._map is None:
            raise ModelFileError(f"{self.path}: the GGUF file is closed")
        return _full(self._fields.get(key), self._map)   # the validated map, not the path:
        #                                                   the file may have been replaced

    def names(self) -> list[str]:
        """Canonical tensor names (prefix removed), in file order."""
        return list(self._infos)

    def canonical(self, name: str) -> str:
        """``name`` without the ``model.diffusion_model.`` prefix."""
        return name[len(PREFIX):] if name.startswith(PREFIX) else name

    def has(self, name: str) -> bool:
        """Whether the tensor exists (with or without the prefix)."""
        return self.canonical(name) in self._infos

    def info(self, name: str) -> TensorInfo:
        """Stored layout of a tensor; :class:`MissingTensorError` naming it if absent."""
        try:
            return self._infos[self.canonical(name)]
        except KeyError:
            raise MissingTensorError(f"{self.path}: tensor {self.canonical(name)!r} not found "
                                     f"(with or without the {PREFIX!r} prefix)") from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Logical shape in numpy order (outermost first)."""
        return self.info(name).shape

    def type_name(self, name: str) -> str:
        """Stored GGML type name (``F32``, ``Q8_0``, ...)."""
        return self.info(name).type_name

    # -- data
    def raw(self, name: str) -> np.ndarray:
        """The stored data as a read-only view of the map (quantized types as uint8 rows)."""
        info = self.info(name)
        v = self._views[info.name]
        if v.flags.writeable:  # pragma: no cover - the reader maps read-only
            v = v.view()
            v.flags.writeable = False
        return v

    def q8_0(self, name: str) -> np.ndarray:
        """A 2-D Q8_0 tensor as read-only ``uint8 [rows, cols//32*34]`` (zero copy)."""
        info = self.info(name)
        if info.ggml_type != _Q8_0 or len(info.shape) != 2:
            raise ModelFileError(f"{self.path}: tensor {self.canonical(name)!r} is "
                                 f"{info.type_name} {list(info.shape)}, expected 2-D Q8_0")
        v = self.raw(name)
        rows, cols = info.shape
        if v.shape != (rows, cols // QK8_0 * Q8_0_BLOCK.itemsize) or v.dtype != np.uint8:
            raise ModelFileError(f"{self.path}: tensor {self.canonical(name)!r}: mapped view "
                                 f"has shape {v.shape} {v.dtype}")  # pragma: no cover
        return v

    def load_f32(self, name: str) -> np.ndarray:
        """Decode a tensor to float32 by its stored type (F32 stays a read-only view)."""
        info = self.info(name)
        v = self.raw(name)
        t = info.ggml_type
        if t == _F32:
            return v.reshape(info.shape)
        if t == _F16:
            return v.astype(np.float32).reshape(info.shape)
        if t == _BF16:
            bits = np.ascontiguousarray(v).view(np.uint16).astype(np.uint32) << 16
            return bits.view(np.float32).reshape(info.shape)
        if t == _Q8_0:
            return dequantize_q8_0(np.ascontiguousarray(v).reshape(-1, v.shape[-1])
                                   ).reshape(info.shape)
        raise ModelFileError(f"{self.path}: tensor {self.canonical(name)!r} has type "
                             f"{info.type_name}; supported: {', '.join(DECODABLE_TYPES)}")

    def close(self) -> None:
        """Drop this object's references to the map (outstanding views keep it alive)."""
        self._views = {}
        self._map = None

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self._infos)} tensors, "
                f"arch={self.architecture!r}, prefix={self.prefix!r})")


def read_field(reader: "gguf.GGUFReader", key: str, where: str = "GGUF") -> Any:
    """The whole value of metadata ``key`` in a ``gguf.GGUFReader`` (None when absent): a str,
    int, float or bool, or a list of one of those (an empty array is ``[]``). The reader keeps
    values as numpy parts (strings as ``uint8`` arrays); they are decoded here, strings as strict
    UTF-8. An undecodable string or an array of arrays is a :class:`ModelFileError` naming
    ``where`` and the key."""
    f = reader.fields.get(key)
    if f is None:
        return None
    types = list(f.types)
    try:
        if not types:
            raise ValueError("has no value type")
        if types[0] == GGUFValueType.STRING:
            return bytes(f.parts[-1]).decode("utf-8")
        if types[0] != GGUFValueType.ARRAY:
            return f.parts[-1].tolist()[0]
        if len(types) == 1:                    # an empty array records no item type
            return []
        if len(types) > 2:
            raise ValueError("is an array of arrays")
        if types[1] == GGUFValueType.STRING:
            items = []
            for n, i in enumerate(f.data):
                try:
                    items.append(bytes(f.parts[i]).decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise ModelFileError(f"{where}: metadata {key!r}[{n}] is not valid UTF-8 "
                                         f"({e.reason} at byte {e.start})") from None
            return items
        if not f.data:
            return []
        return np.concatenate([np.asarray(f.parts[i]).ravel() for i in f.data]).tolist()
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{where}: metadata {key!r} holds a string that is not valid "
                             f"UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, IndexError, TypeError) as e:
        raise ModelFileError(f"{where}: metadata {key!r} cannot be read: {e}") from None


# ----------------------------------------------------------------------------- quantization

def quantize_q8_0(x: np.ndarray, name: str = "tensor") -> np.ndarray:
    """float ``[R, K]`` (K % 32 == 0) -> Q8_0 ``uint8 [R, K//32*34]``, via the ``gguf`` package
    (bit-exact with ggml). Raises :class:`QuantizationError` (a ModelFileError and a ValueError)
    for non-finite input or a scale beyond float16; ValueError for a bad shape."""
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] % QK8_0:
        raise ValueError(f"quantize_q8_0: {name} has shape {x.shape}, expected [R, K] "
                         f"with K a multiple of {QK8_0}")
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.ascontiguousarray(x, dtype=np.float32)      # float64 beyond float32 -> inf
    if not np.isfinite(x).all():
        raise QuantizationError(f"quantize_q8_0: {name} contains NaN or Inf (as float32)")
    with np.errstate(over="ignore", invalid="ignore"):
        q = gguf.quants.quantize(x, _Q8_0)
    d = q.view(Q8_0_BLOCK)["d"]
    if not np.isfinite(d).all():
        limit = float(np.finfo(np.float16).max) * 127
        raise QuantizationError(f"quantize_q8_0: {name} has values too large for a Q8_0 "
                                f"block's float16 scale (max |x| = {float(np.abs(x).max()):.4g}, "
                                f"at most ~{limit:.4g})")
    return q


def dequantize_q8_0(q: np.ndarray) -> np.ndarray:
    """Q8_0 ``uint8 [R, K//32*34]`` -> float32 ``[R, K]`` (value = d*q), via ``gguf``."""
    q = np.asarray(q)
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] % Q8_0_BLOCK.itemsize:
        raise ValueError(f"dequantize_q8_0: expected uint8 [R, n*34], got {q.dtype} {q.shape}")
    return gguf.quants.dequantize(np.ascontiguousarray(q), _Q8_0)


@dataclass(frozen=True)
class Q8_0Tensor:
    """Already-quantized Q8_0 data for :func:`write_gguf`: blocks ``uint8 [R, K//32*34]``."""
    blocks: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        r, b = self.blocks.shape
        return (r, b // Q8_0_BLOCK.itemsize * QK8_0)


@dataclass(frozen=True)
class QuantTensor:
    """Already-encoded data of any GGML type for :func:`write_gguf`: ``blocks`` uint8
    ``[R, rowbytes]`` holding rows of ``gtype`` blocks (a type name such as ``"Q4_K"``)."""
    blocks: np.ndarray
    gtype: str


def should_quantize(shape: tuple[int, ...]) -> bool:
    """Converter policy: 2-D, row length a multiple of 32, more than 1024 elements -> Q8_0."""
    return len(shape) == 2 and shape[1] % QK8_0 == 0 and math.prod(shape) > QUANTIZE_MIN_ELEMENTS


# ----------------------------------------------------------------------------- writing

@dataclass(frozen=True)
class LazyTensor:
    """A tensor :func:`write_gguf` produces only when it reaches it, so a file of any size is
    written with one tensor in memory: torch ``shape``, GGML type name ``gtype``, ``make()``
    -> its float values (any float dtype, that shape), encoded by
    ``nxhpc.formats.layouts.encode``."""
    shape: tuple[int, ...]
    gtype: str
    make: Callable[[], np.ndarray]


def _lazy_bytes(name: str, t: LazyTensor) -> np.ndarray:
    from nxhpc.formats.layouts import encode
    a = np.asarray(t.make())
    if a.dtype.kind != "f" or tuple(a.shape) != tuple(t.shape):
        raise ValueError(f"write_gguf: {name}: make() gave {a.dtype} {a.shape}, expected float "
                         f"{list(t.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        a32 = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a32).all():
        raise ValueError(f"write_gguf: {name} contains NaN or Inf (as float32)")
    raw = encode(a32.reshape(-1, a32.shape[-1]), t.gtype, name)
    return raw.reshape(gguf.quants.quant_shape_to_byte_shape(tuple(t.shape),
                                                              GGMLQuantizationType[t.gtype]))


def write_gguf(path: str | os.PathLike, tensors: Mapping[str, Any], *, prefix: bool | str = True,
               arch: str | None = "lumina2", metadata: Mapping[str, Any] | None = None,
               quantize: bool = True, progress: Any = None) -> Path:
    """The one GGUF writer: ``tensors`` (canonical name -> a float array, a :class:`Q8_0Tensor`,
    a :class:`QuantTensor` or a :class:`LazyTensor`) to ``path``, streamed tensor by tensor.

    Float arrays are quantized to Q8_0 when :func:`should_quantize` says so (and ``quantize``),
    else stored F32; encoded tensors are stored as given; lazy ones are made and encoded when
    written (one in memory at a time). ``prefix``: True prepends ``model.diffusion_model.`` to
    every name, a string prepends that string. ``arch``: ``general.architecture`` (None: no such
    key, as stable-diffusion.cpp's converter writes). ``metadata`` values: str, bool, int
    (stored int64, or uint32 for ``general.alignment``), float (float64), a non-empty list of
    one of those (strings: an array of strings, e.g. ``tokenizer.ggml.tokens``), or a numpy
    scalar / 1-D array, stored in its own type (``np.uint32(36)``, ``np.float32(1e-6)``,
    ``np.int32`` token types) as llama.cpp's converter writes them. The
    file is written to a temporary name and renamed into place. ``progress(name, i, n)`` is
    called per tensor when given. Output is byte-identical for identical input.
    """
    path = Path(path)
    head = PREFIX if prefix is True else (prefix or "")
    # (name as written, stored shape, dtype, nbytes, raw type, the data or what makes it)
    plan: list[tuple[str, tuple[int, ...], np.dtype, int, Any, Any]] = []
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"write_gguf: tensor names must be non-empty str, got {name!r}")
        full = name if name.startswith(head) else head + name
        if isinstance(value, LazyTensor):
            try:
                qt = GGMLQuantizationType[value.gtype]
            except KeyError:
                raise ValueError(f"write_gguf: {name}: unknown GGML type {value.gtype!r}") from None
            bshape = gguf.quants.quant_shape_to_byte_shape(tuple(value.shape), qt)
            plan.append((full, tuple(bshape), np.dtype(np.uint8), math.prod(bshape), qt,
                         (name, value)))
            continue
        if isinstance(value, Q8_0Tensor):
            b = np.ascontiguousarray(value.blocks)
            if b.dtype != np.uint8 or b.ndim != 2 or b.shape[1] % Q8_0_BLOCK.itemsize:
                raise ValueError(f"write_gguf: {name}: Q8_0 blocks must be uint8 [R, n*34], "
                                 f"got {b.dtype} {b.shape}")
            plan.append((full, b.shape, b.dtype, b.nbytes, _Q8_0, b))
            continue
        if isinstance(value, QuantTensor):
            b = np.ascontiguousarray(value.blocks)
            try:
                qt = GGMLQuantizationType[value.gtype]
            except KeyError:
                raise ValueError(f"write_gguf: {name}: unknown GGML type {value.gtype!r}") from None
            nbytes = gguf.GGML_QUANT_SIZES[qt][1]
            if b.dtype != np.uint8 or b.ndim != 2 or b.shape[1] % nbytes:
                raise ValueError(f"write_gguf: {name}: {value.gtype} blocks must be uint8 "
                                 f"[R, n*{nbytes}], got {b.dtype} {b.shape}")
            plan.append((full, b.shape, b.dtype, b.nbytes, qt, b))
            continue
        a = np.asarray(value)
        if a.dtype.kind != "f":
            raise ValueError(f"write_gguf: {name}: expected a float array, got dtype {a.dtype}")
        if a.ndim == 0 or a.ndim > MAX_DIMS or a.size == 0:
            raise ValueError(f"write_gguf: {name}: unsupported shape {a.shape}")
        if quantize and should_quantize(a.shape):
            q = quantize_q8_0(a, name)
            plan.append((full, q.shape, q.dtype, q.nbytes, _Q8_0, q))
        else:
            a32 = np.ascontiguousarray(a, dtype=np.float32)
            if not np.isfinite(a32).all():
                raise ValueError(f"write_gguf: {name} contains NaN or Inf")
            plan.append((full, a32.shape, a32.dtype, a32.nbytes, None, a32))

    with atomic_output(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch or "unused")
        if arch is None:                    # no general.architecture key at all
            w.kv_data[0].pop("general.architecture", None)
        try:
            for key, val in (metadata or {}).items():
                _add_kv(w, key, val)
            for full, shape, dtype, nbytes, raw, _ in plan:
                w.add_tensor_info(full, shape, dtype, nbytes, raw_dtype=raw)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for i, (full, _, _, _, _, data) in enumerate(plan):
                arr = _lazy_bytes(*data) if isinstance(data, tuple) else data
                w.write_tensor_data(arr)
                del arr
                if progress is not None:
                    progress(full, i + 1, len(plan))
        finally:
            w.close()
    return path


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write; on success it is renamed onto ``path``,
    on any error it is removed, so ``path`` is never seen half-written."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


#: numpy scalar dtype -> the GGUF value type it is written as (kept exactly, as llama.cpp's
#: converter writes ``uint32`` counts and ``float32`` epsilons)
_NUMPY_VALUE_TYPES = {np.dtype(np.uint8): GGUFValueType.UINT8,
                      np.dtype(np.int8): GGUFValueType.INT8,
                      np.dtype(np.uint16): GGUFValueType.UINT16,
                      np.dtype(np.int16): GGUFValueType.INT16,
                      np.dtype(np.uint32): GGUFValueType.UINT32,
                      np.dtype(np.int32): GGUFValueType.INT32,
                      np.dtype(np.uint64): GGUFValueType.UINT64,
                      np.dtype(np.int64): GGUFValueType.INT64,
                      np.dtype(np.float32): GGUFValueType.FLOAT32,
                      np.dtype(np.float64): GGUFValueType.FLOAT64,
                      np.dtype(np.bool_): GGUFValueType.BOOL}


def _add_kv(w: "gguf.GGUFWriter", key: str, val: Any) -> None:
    if isinstance(val, (np.generic, np.ndarray)) and val.dtype in _NUMPY_VALUE_TYPES:
        vt = _NUMPY_VALUE_TYPES[val.dtype]
        if isinstance(val, np.generic):
            w.add_key_value(key, val.item(), vt)
        elif val.ndim == 1 and val.size:
            w.add_key_value(key, val.tolist(), GGUFValueType.ARRAY, sub_type=vt)
        else:
            raise ValueError(f"write_gguf: metadata {key!r}: a numpy array value must be 1-D "
                             f"and non-empty, got shape {val.shape}")
    elif isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, (int, np.integer)):
        if key == "general.alignment":
            w.add_uint32(key, int(val))
        else:
            w.add_int64(key, int(val))
    elif isinstance(val, (float, np.floating)):
        w.add_float64(key, float(val))
    elif isinstance(val, (list, tuple)):
        if not val:
            raise ValueError(f"write_gguf: metadata {key!r}: an empty list cannot be written "
                             f"(a GGUF array needs an item type)")
        w.add_array(key, list(val))
    else:
        raise ValueError(f"write_gguf: metadata {key!r}: unsupported value {val!r}")
