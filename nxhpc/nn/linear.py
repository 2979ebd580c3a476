"""The one seam between a model's blocks and the matmul kernels: a typed weight in, float32 out.

Owns :func:`matmul` (a band of output columns of ``x @ W^T``), :func:`matmul_glu` (the same
for a SwiGLU pair, ``silu(x @ Wg^T) * (x @ Wu^T)``) and :func:`adaln_linear` (``W @ t + b``),
each taking :class:`~nxhpc.formats.weights.WeightTensor` s and passing their raw bytes and
GGML type to the kernels as stored (no decode, no requantize), and the precision
switch :data:`PRECISIONS` (which kernel a block's projection runs; docs/kernels.md has each
precision's arithmetic contract):

* ``"f32"`` (default): ``matmul`` -- exact dequantized weights, float32 FMA (unchanged bits).
* ``"bf16"``: ``matmul_bf16`` -- x and the decoded weights rounded to bfloat16, float32
  accumulation; every weight type of the traits table.
* ``"q8"``: ``matmul_q8`` for the quantized weight types of :data:`Q8_WEIGHT_TYPES` (x
  quantized per row to Q8_0, int32 dots on the weights' stored codes, per-block float32
  scales/mins). An F32/F16/BF16 weight runs ``matmul_q8`` on its Q8_0 copy when it carries one
  (``weight.int8``, made once at load by :func:`with_int8_copy`; the sessions make them under
  ``q8_float_weights="int8"``, the default, see :data:`Q8_FLOAT_WEIGHTS`), else ``bf16`` as
  stored: :func:`effective_precision` says which, per tensor.

adaLN (:func:`adaln_linear`, O(D) work) stays float32 in every precision. Attention follows the
switch too (:func:`attention_precision`): ``"f32"`` runs the float32 attention, ``"bf16"`` and
``"q8"`` the bf16 attention (Q K^T and P V on the bfloat16 dot, softmax statistics in float32:
csrc/nx_attn_bf16.h).
Must not: compute anything itself, or copy a weight matrix -- except the one Q8_0 copy of a
float matrix that ``q8`` runs (:func:`with_int8_copy`, made once in the parent at load).

Kernel API (``nxhpc._kernels``): ``matmul(x, w, wtype, out, n0, n1)``, ``matmul_bf16(x, w, wtype,
out, n0, n1)``, ``matmul_q8(x, w, out, n0, n1, wtype=...)`` (each with ``up=``, the gated form),
``swiglu``, ``adaln_linear(t_emb, w, wtype, bias, out, silu_input=...)``, ``weight_types()``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nxhpc.formats.weights import FLOAT_TYPES, WeightTensor, block_geometry

__all__ = ["matmul", "matmul_glu", "adaln_linear", "check_runnable", "check_precision",
           "fastest_precision", "effective_precision",
           "attention_precision", "with_int8_copy", "check_q8_float_weights", "Q8Blocks",
           "PRECISIONS", "DEFAULT_PRECISION", "Q8_WEIGHT_TYPES", "Q8_FLOAT_WEIGHTS",
           "DEFAULT_Q8_FLOAT_WEIGHTS"]

#: The matmul precisions of a block (see the module docstring).
PRECISIONS = ("f32", "bf16", "q8")
DEFAULT_PRECISION = "f32"
#: Weight types ``q8`` runs on their integer codes (the kernels' ``Q8_WEIGHT_TYPES``; a test
#: keeps the two equal). An F32/F16/BF16 matrix runs ``q8`` on its Q8_0 copy, or ``bf16``
#: (:data:`Q8_FLOAT_WEIGHTS`).
Q8_WEIGHT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: How ``q8`` runs an F32/F16/BF16 matrix (a session's ``q8_float_weights``): ``"int8"`` -- on a
#: Q8_0 copy made once at load (1.0625 bytes a value; the copy's error is Q8_0's rounding of
#: the stored values) -- or ``"bf16"`` -- on the stored values with the bf16 kernel, no copy.
#: docs/kernels.md ("q8 on float weights") has the measurements behind the default.
Q8_FLOAT_WEIGHTS = ("int8", "bf16")
DEFAULT_Q8_FLOAT_WEIGHTS = "int8"
_COPY_ROWS = 256            # rows decoded and quantized at a time by with_int8_copy
#: The smallest max|w| of a matrix given an int8 copy: 127 * 2^-14, where its largest block's
#: float16 scale ``max|w| / 127`` is still a normal float16. Below it every block's scale is
#: subnormal, rounded to a multiple of 2^-24 or to 0 (a matrix of |w| ~ 1e-6 copied as zeros),
#: and the copy's error is no longer small against the matrix: such a matrix runs ``bf16``.
INT8_COPY_MIN_ABS = 127 * 2.0 ** -14


def check_precision(precision: Any, where: str = "precision") -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else ValueError naming ``where``."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        hint = (" (the command lines' 'auto' is theirs: pass "
                "nxhpc.nn.linear.fastest_precision(), the precision it picks)"
                if precision == "auto" else "")
        raise ValueError(f"{where} must be one of {', '.join(map(repr, PRECISIONS))}, got "
                         f"{precision!r}{hint}")
    return precision


def fastest_precision(variants: Mapping[str, str] | None = None) -> str:
    """The matmul precision measured fastest on a CPU whose kernels run as ``variants``
    (``nxhpc.kernel_variants()``; default: this process's), what the command lines'
    ``--precision auto`` picks (README, "Which precision is fastest"):

    - ``"bf16"`` where ``matmul_bf16`` runs on the AMX tiles (bf16 1.3-2.7x q8 there);
    - ``"q8"`` where ``matmul_q8`` has a SIMD kernel (AVX2: 1.6-2.8x f32, bf16 at f32's speed;
      AVX-VNNI: ~1.2-1.5x the AVX2 kernel; AVX-512 VNNI without AMX: ~1.6x bf16);
    - ``"f32"`` on the generic C code (no SIMD variant, or ``NXHPC_DISABLE_SIMD=1``), where
      nothing was measured faster than the exact path.

    Speed only: the precisions' errors and bits differ (docs/kernels.md)."""
    if variants is None:
        from nxhpc import kernel_variants
        variants = kernel_variants()
    if variants.get("matmul_bf16") == "amx":
        return "bf16"
    if variants.get("matmul_q8", "generic") != "generic":
        return "q8"
    return "f32"


def check_q8_float_weights(value: Any, where: str = "q8_float_weights") -> str:
    """``value`` if it is one of :data:`Q8_FLOAT_WEIGHTS`, else ValueError naming ``where``."""
    if not isinstance(value, str) or value not in Q8_FLOAT_WEIGHTS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, Q8_FLOAT_WEIGHTS))}, got "
                         f"{value!r}")
    return value


def effective_precision(weight: WeightTensor, precision: str) -> str:
    """The precision ``weight``'s matmul runs under the switch ``precision``: ``"q8"`` for the
    types of :data:`Q8_WEIGHT_TYPES` and for a float matrix carrying its ``int8`` copy, ``"bf16"``
    for any other F32/F16/BF16 matrix, else ``precision``."""
    if precision == "q8" and weight.type_name not in Q8_WEIGHT_TYPES and weight.int8 is None:
        return "bf16"
    return precision


def with_int8_copy(kernels: Any, weight: WeightTensor) -> WeightTensor:
    """``weight`` with its Q8_0 copy attached (``.int8``) if it is an F32/F16/BF16 matrix whose
    rows fill whole blocks of 32; ``weight`` itself otherwise (or if it has one already).

    The copy's bytes are ``gguf.quants.quantize(values, Q8_0)`` of the stored values (exact in
    float32): each block of 32 scaled by max|w|/127 in float16, codes rounded half away from
    zero. Decoded and quantized ``_COPY_ROWS`` rows at a time (no float32 copy of the matrix).
    Each value's error is at most ``max|block| / 254 + 127 |d - f16(d)|`` (the code's rounding,
    then the scale's), so at most ``max|w| * (1/254 + 2^-11)`` over the matrix; a matrix whose
    max|w| is below :data:`INT8_COPY_MIN_ABS` (nonzero) gets no copy (``weight`` itself: it
    runs ``bf16``), as that bound would not hold. ValueError naming the tensor if a block's
    scale overflows float16 (|w| > 65504 * 127).
    """
    qk, qbytes = block_geometry("Q8_0")
    if weight.type_name not in FLOAT_TYPES or weight.int8 is not None or weight.cols % qk:
        return weight
    rows, cols = weight.shape
    q = np.empty((rows, cols // qk * qbytes), dtype=np.uint8)
    buf = np.empty((min(rows, _COPY_ROWS), cols), dtype=np.float32)
    amax = 0.0
    for r0 in range(0, rows, _COPY_ROWS):
        r1 = min(rows, r0 + _COPY_ROWS)
        f = kernels.dequantize(weight.data[r0:r1], weight.type_name, out=buf[:r1 - r0])
        kernels.q8_0_quantize(f, out=q[r0:r1])
        amax = max(amax, float(np.max(np.abs(f), initial=0.0)))
    if 0.0 < amax < INT8_COPY_MIN_ABS:       # every block's float16 scale subnormal
        return weight
    scales = q.reshape(rows, -1, qbytes)[:, :, :2].copy().view(np.float16)
    if not np.isfinite(scales).all():
        raise ValueError(f"weight {weight.name!r} ({weight.type_name} {list(weight.shape)}): "
                         f"values beyond Q8_0's float16 scale (|w| > 65504 * 127) cannot take "
                         f"an int8 copy; run it with q8_float_weights='bf16'")
    copy = WeightTensor(weight.name, "Q8_0", weight.shape, q)
    return WeightTensor(weight.name, weight.ggml_type, weight.shape, weight.data, int8=copy)


def attention_precision(precision: str) -> str:
    """The ``precision=`` of the attention kernel under the switch ``precision``: ``"f32"`` for
    ``"f32"`` (float32 bits unchanged), ``"bf16"`` for ``"bf16"`` and ``"q8"``."""
    return "f32" if check_precision(precision) == "f32" else "bf16"


def attention_kernel(precision: str) -> str:
    """Which attention code runs under the switch ``precision``, for reports: ``"f32"``'s ISA
    variant, or the bf16 attention's (``"avx512bf16:fma"`` / ``"avx512bf16:vdpbf16ps"`` naming
    the dot that variant runs in this process, ``K.attention_bf16_dot``)."""
    from nxhpc import kernels
    K = kernels()
    if attention_precision(precision) == "f32":
        return "f32:" + K.kernel_variants()["attention"]
    v = K.kernel_variants()["attention_bf16"]
    return f"bf16:{v}:{K.attention_bf16_dot()}" if v == "avx512bf16" else f"bf16:{v}"


def check_runnable(kernels: Any, weight: WeightTensor, *, adaln: bool = False) -> None:
    """NotImplementedError naming the tensor unless ``kernels`` can run ``weight`` as stored
    (called before the fork, so a missing type fails in the parent, before any work)."""
    have = kernels.weight_types()
    if weight.type_name not in have:
        raise NotImplementedError(f"weight {weight.name!r} is {weight.type_name}; the "
                                  f"kernels run {', '.join(have)}")


class Q8Blocks:
    """A session's blocks for ``q8``: as bound, or (made once, on first need) with every float
    projection carrying its Q8_0 copy. ``blocks``: key -> a dataclass block whose fields
    ``keys`` are its projections (WeightTensor)."""

    def __init__(self, blocks: dict, keys: tuple[str, ...]) -> None:
        self.plain = blocks
        self.keys = keys
        self._copied: dict | None = None

    def get(self, kernels: Any, choice: str, threads: int = 1) -> dict:
        """The blocks a ``q8`` call runs under ``q8_float_weights=choice``: the plain ones for
        ``"bf16"`` (or when no projection is float: then nothing is copied), else the copies.

        ``threads``: how many copies are made at once (the session's worker count: the copies
        are made before its workers exist). The kernels release the GIL, each copy's bytes are
        its own whatever runs beside it, and the threads are joined before this returns (no
        thread is alive at the next fork). The first failing tensor in block order raises."""
        if check_q8_float_weights(choice) == "bf16":
            return self.plain
        if self._copied is None:
            from dataclasses import replace
            todo = [(key, k, getattr(b, k)) for key, b in self.plain.items() for k in self.keys
                    if isinstance(getattr(b, k), WeightTensor)]
            made = _map_ordered(lambda t: with_int8_copy(kernels, t[2]), todo, threads)
            new: dict = {}
            for (key, k, v), c in zip(todo, made):
                if c is not v:
                    new.setdefault(key, {})[k] = c
            copied = {key: replace(b, **new[key]) if key in new else b
                      for key, b in self.plain.items()}
            self._copied = copied if new else self.plain
        return self._copied


def _map_ordered(fn: Any, items: list, threads: int) -> list:
    """``[fn(i) for i in items]`` on up to ``threads`` threads, in order; the first exception in
    item order is raised after every started call ended, the calls not yet started dropped."""
    if threads <= 1 or len(items) <= 1:
        return [fn(i) for i in items]
    from concurrent.futures import ThreadPoolExecutor
    ex = ThreadPoolExecutor(max_workers=min(threads, len(items)))
    try:
        futures = [ex.submit(fn, i) for i in items]
        return [f.result() for f in futures]
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def _route(weight: WeightTensor, precision: str) -> tuple[str, np.ndarray, str]:
    """(kernel name, weight bytes, GGML type name) of ``weight``'s matmul under ``precision``."""
    if precision == "f32":
        return "matmul", weight.data, weight.type_name
    if precision == "q8" and weight.type_name in Q8_WEIGHT_TYPES:
        return "matmul_q8", weight.data, weight.type_name
    if precision == "q8" and weight.int8 is not None:
        return "matmul_q8", weight.int8.data, "Q8_0"
    if precision in ("bf16", "q8"):
        return "matmul_bf16", weight.data, weight.type_name
    check_precision(precision)
    raise AssertionError("unreachable")


def _call(kernels: Any, route: tuple[str, np.ndarray, str], x: np.ndarray, data: np.ndarray,
          out: np.ndarray, lo: int, hi: int, up: np.ndarray | None = None) -> None:
    fn, _, wtype = route
    if fn == "matmul_q8":
        kernels.matmul_q8(x, data, out, lo, hi, wtype=wtype, up=up)
    else:
        getattr(kernels, fn)(x, data, wtype, out, lo, hi, up=up)


def matmul(kernels: Any, x: np.ndarray, weight: WeightTensor, out: np.ndarray, lo: int,
           hi: int, precision: str = DEFAULT_PRECISION) -> None:
    """out[:, lo:hi] := x @ dequant(weight)[lo:hi]^T   (x float32 [T, K], out float32 [T, N]),
    in ``precision`` ("f32" | "bf16" | "q8"; q8 on an F32/F16/BF16 weight runs its ``int8``
    copy if it carries one, else bf16)."""
    route = _route(weight, precision)
    _call(kernels, route, x, route[1], out, lo, hi)


#: Columns a gated matmul whose two weights run different kernels computes at a time.
_GLU_CHUNK = 512


def matmul_glu(kernels: Any, x: np.ndarray, gate: WeightTensor, up: WeightTensor,
               out: np.ndarray, lo: int, hi: int, precision: str = DEFAULT_PRECISION) -> None:
    """out[:, lo:hi] := silu(x @ gate[lo:hi]^T) * (x @ up[lo:hi]^T): a SwiGLU feed-forward's
    first projection, the bits of :func:`matmul` of each weight and then ``kernels.swiglu``.

    Where both weights run the same kernel on the same type (the usual file), one gated
    kernel call (``up=``: one packed ``x`` for both, the gate applied while each block of
    outputs is in cache, no up output in memory). Otherwise the band is done in chunks of
    :data:`_GLU_CHUNK` columns through two scratch arrays (same bits)."""
    rg, ru = _route(gate, precision), _route(up, precision)
    dg, du = rg[1], ru[1]
    if rg[0] == ru[0] and rg[2] == ru[2] and dg.shape == du.shape and dg.dtype == du.dtype:
        _call(kernels, rg, x, dg, out, lo, hi, up=du)
        return
    T = x.shape[0]
    g = np.empty(T * min(_GLU_CHUNK, max(hi - lo, 0)), dtype=np.float32)   # once per call
    u = np.empty_like(g)
    for c0 in range(lo, hi, _GLU_CHUNK):
        c1 = min(hi, c0 + _GLU_CHUNK)
        gc, uc = g[:T * (c1 - c0)].reshape(T, c1 - c0), u[:T * (c1 - c0)].reshape(T, c1 - c0)
        _call(kernels, rg, x, dg[c0:c1], gc, 0, c1 - c0)
        _call(kernels, ru, x, du[c0:c1], uc, 0, c1 - c0)
        kernels.swiglu(gc, uc, gc)
        out[:, c0:c1] = gc


def adaln_linear(kernels: Any, t_emb: np.ndarray, weight: WeightTensor, bias: np.ndarray,
                 out: np.ndarray, *, silu_input: bool) -> None:
    """out := dequant(weight) @ (silu(t_emb) if silu_input else t_emb) + bias."""
    kernels.adaln_linear(t_emb, weight.data, weight.type_name, bias, out, silu_input=silu_input)
