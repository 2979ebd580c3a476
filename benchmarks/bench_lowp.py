"""Benchmarks of the low-precision matmuls (matmul_bf16, matmul_q8) against today's float32 Q8_0
matmul, numpy/OpenBLAS float32 and torch ``linear`` in float32 and bfloat16, one worker each.

Owns: the per-precision matmul GFLOP/s at the issue's shapes. Must not: assert speed (figures go
to ``extra_info``); the correctness checks after timing use the error bounds derived in
tests/test_kernels_lowp.py / csrc/nx_lowp.h.

Run (one thread everywhere; process time so that other jobs time-slicing the cores do not count):

    OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_lowp.py --benchmark-only \\
        --benchmark-timer=time.process_time

Each shape is one ``benchmark.group`` ("matmul precisions T=.. K=.. N=.."):
  nxhpc q8_0_matmul        float32 activations x exact Q8_0 weights (the f32 precision)
  nxhpc matmul_bf16 Q8_0   bf16 precision, weights decoded from Q8_0 panel by panel
  nxhpc matmul_bf16 BF16   bf16 precision on a BF16 copy of the weights (2 bytes/weight)
  nxhpc matmul_q8          q8 precision: Q8_0 activations x Q8_0 weights (ggml's arithmetic)
  numpy f32                x @ w_f32.T, OpenBLAS limited to 1 thread (threadpoolctl)
  torch f32 / torch bf16   torch.nn.functional.linear, torch.set_num_threads(1); the bf16 case
                           gets inputs already in bfloat16 (conversion not timed)
Group "bf16 vs f32 <wtype> T=256 K=3840 N=3840" (Q8_0, Q4_K, BF16 weights): the bf16 matmul's best
variant, the float32 matmul (K.matmul) on the same weights and the bf16 generic spec (one round).
GFLOP/s = 2*T*K*N / time (for q8 these are int8 ops + the float32 block epilogue), with
``frac_of_peak`` against this CPU's peak measured once per session (``_bench_util.peak_fields``,
the kind recorded as ``peak_kind``): f32 -> fma_zmm (AVX-512 code) or fma_ymm (AVX2 code);
bf16 -> fma_ymm (the avx2 variant: float32 FMAs), bf16_zmm (the avx512bf16 variant) or amx_bf16
(an amx variant); q8 -> i8_ymm (the avx2 variant: vpmaddubsw), vnni_zmm (the avx512 variant) or
amx_int8 (amx); generic code and the numpy / torch baselines against the
fastest kind of their precision here. Where the CPU has AMX but the variant does not use it,
``frac_of_machine_peak`` sets the figure against the tile unit too. For reference,
ggml's Q8_0 x Q8_0 matmul (llama.cpp's default tinyBLAS path) is cited at ~110 GFLOP/s per Zen 4
core in issue 11.
"""
import time

import numpy as np
import pytest
from _bench_util import bench_stats, peak_fields, torch_threads
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from threadpoolctl import threadpool_limits

import nxhpc
from nxhpc import _kernels as K

SHAPES = [(256, 3840, 3840), (256, 3840, 10240), (256, 3840, 11520), (256, 10240, 3840),
          (4096, 3840, 3840)]       # the last: weights decoded once per 264-token block
EPS32, UBF = 2.0 ** -24, 2.0 ** -8
_CACHE = {}


def _case(T, Kd, N, seed=0):
    """x float32 [T, K]; w Q8_0 [N, K/32*34]; its exact float32 decoding; a BF16 copy."""
    key = (T, Kd, N, seed)
    if key not in _CACHE:
        _CACHE.clear()
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((T, Kd), dtype=np.float32)
        w = K.q8_0_quantize(rng.standard_normal((N, Kd), dtype=np.float32) * 0.02)
        w_f32 = K.q8_0_dequantize(w)
        w_bf16 = (K.round_bf16(w_f32).view(np.uint32) >> 16).astype(np.uint16)
        _CACHE[key] = (x, w, w_f32, w_bf16)
    return _CACHE[key]


def _info(benchmark, T, Kd, N, variant, prec):
    st = bench_stats(benchmark)
    g = 2.0 * T * Kd * N / st.min / 1e9
    benchmark.extra_info.update({
        "T": T, "K": Kd, "N": N, "variant": variant, "precision": prec,
        "gflops_best": round(g, 1), "gflops_mean": round(2.0 * T * Kd * N / st.mean / 1e9, 1),
        **peak_fields(g, prec, variant),
    })


def _mag_ref(x, w_f32, rows):
    x64, w64 = x[:rows].astype(np.float64), w_f32.astype(np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def _check(prec, out, x, w_f32, rows=16, any_order=False, out_rounded=False):
    """Error bounds (derivations: tests/test_kernels_lowp.py) on a sample of rows."""
    ref, mag = _mag_ref(x, w_f32, rows)
    Kd = x.shape[1]
    g = Kd * EPS32 / (1 - Kd * EPS32) + 2 * Kd * 2.0 ** -53
    if prec == "f32":
        n = Kd if any_order else min(Kd, 128) + -(-Kd // 128) - 1
        bound = (n * EPS32 / (1 - n * EPS32) + 2 * Kd * 2.0 ** -53) * mag
    elif prec == "bf16":
        bound = ((2 * UBF + UBF ** 2) + g * (1 + UBF) ** 2) * mag + 1e-30
        if out_rounded:                                   # torch returns bfloat16 outputs
            bound = bound * (1 + UBF) + UBF * np.abs(ref)
    else:
        xt = gguf_dequantize(gguf_quantize(x[:rows], QT.Q8_0), QT.Q8_0).astype(np.float64)
        w64 = np.abs(w_f32.astype(np.float64))
        bound = np.abs(x[:rows] - xt) @ w64.T + g * (np.abs(xt) @ w64.T) + g * mag
    out = np.asarray(out[:rows], np.float64)
    assert (np.abs(out - ref) <= bound).all(), (np.abs(out - ref) / bound).max()


def _rounds(T):
    return 5 if T <= 256 else 3


def _group(benchmark, T, Kd, N):
    benchmark.group = f"matmul precisions T={T} K={Kd} N={N}"


def _bench(benchmark, T, Kd, N, slot, label, fn, args, out, precision, w_ref, x):
    """Time one nxhpc kernel on one shape (its variant named), then check its output."""
    v = nxhpc.kernel_variants()[slot]
    _group(benchmark, T, Kd, N)
    benchmark.name = f"nxhpc {label} ({v})"
    benchmark.pedantic(fn, args=args, rounds=_rounds(T), warmup_rounds=1)
    _info(benchmark, T, Kd, N, v, precision)
    _check(precision, out, x, w_ref)


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=str)
def test_bench_q8_0_matmul_f32(benchmark, T, Kd, N):
    x, w, w_f32, _ = _case(T, Kd, N)
    out = np.empty((T, N), np.float32)
    _bench(benchmark, T, Kd, N, "q8_0_matmul", "q8_0_matmul f32", K.q8_0_matmul, (x, w, out),
           out, "f32", w_f32, x)


@pytest.mark.parametrize("wtype", ["Q8_0", "BF16"])
@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=str)
def test_bench_matmul_bf16(benchmark, T, Kd, N, wtype):
    """matmul_bf16 on Q8_0 weights and on BF16 weights (checked against their own values)."""
    x, w, w_f32, w_bf16 = _case(T, Kd, N)
    if wtype == "BF16":
        w, w_f32 = w_bf16, (w_bf16.astype(np.uint32) << 16).view(np.float32)
    out = np.empty((T, N), np.float32)
    _bench(benchmark, T, Kd, N, "matmul_bf16", f"matmul_bf16 {wtype} weights", K.matmul_bf16,
           (x, w, wtype, out), out, "bf16", w_f32, x)


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=str)
def test_bench_matmul_q8(benchmark, T, Kd, N):
    x, w, w_f32, _ = _case(T, Kd, N)
    out = np.empty((T, N), np.float32)
    _bench(benchmark, T, Kd, N, "matmul_q8", "matmul_q8", K.matmul_q8, (x, w, out), out, "q8",
           w_f32, x)


@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=str)
def test_bench_numpy_f32(benchmark, T, Kd, N):
    x, _, w_f32, _ = _case(T, Kd, N)
    _group(benchmark, T, Kd, N)
    benchmark.name = "numpy x @ w_f32.T (1 thread)"
    with threadpool_limits(1):
        info = [d for d in __import__("threadpoolctl").threadpool_info() if d.get("user_api") == "blas"]
        assert all(d["num_threads"] == 1 for d in info), info
        out = benchmark.pedantic(lambda: x @ w_f32.T, rounds=_rounds(T), warmup_rounds=1)
    _info(benchmark, T, Kd, N, "openblas", "f32")
    _check("f32", out, x, w_f32, any_order=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,Kd,N", SHAPES, ids=str)
def test_bench_torch_linear(benchmark, T, Kd, N, dtype):
    torch = pytest.importorskip("torch")
    x, _, w_f32, _ = _case(T, Kd, N)
    dt = getattr(torch, dtype)
    xt = torch.from_numpy(x).to(dt)
    wt = torch.from_numpy(w_f32).to(dt)
    with torch_threads(1):
        _group(benchmark, T, Kd, N)
        benchmark.name = f"torch linear {dtype} (1 thread)"
        with torch.no_grad():
            out = benchmark.pedantic(torch.nn.functional.linear, args=(xt, wt),
                                     rounds=_rounds(T), warmup_rounds=1)
    prec = "f32" if dtype == "float32" else "bf16"
    _info(benchmark, T, Kd, N, f"torch {torch.__version__}", prec)
    w_eff = wt.float().numpy()
    _check(prec, out.float().numpy(), x, w_eff, any_order=True, out_rounded=dtype == "bfloat16")


Q8_SIMD = K.lowp_variants("q8")[1:]   # the ISAs with a q8 kernel of their own (AVX2, VNNI, AMX)


@pytest.mark.skipif(len(Q8_SIMD) < 2, reason="one q8 SIMD variant: nothing to compare")
@pytest.mark.parametrize("isa", Q8_SIMD)
@pytest.mark.parametrize("T,Kd,N", SHAPES[:1] + SHAPES[3:4], ids=str)
def test_bench_matmul_q8_isa(benchmark, T, Kd, N, isa):
    """Every q8 kernel of this CPU on the same shape (same bits: the lowp contract), side by side."""
    x, w, w_f32, _ = _case(T, Kd, N)
    out = np.empty((T, N), np.float32)
    _group(benchmark, T, Kd, N)
    benchmark.name = f"nxhpc matmul_q8 isa={isa}"
    benchmark.pedantic(K.matmul_q8, args=(x, w, out), kwargs={"isa": isa}, rounds=_rounds(T),
                       warmup_rounds=1)
    _info(benchmark, T, Kd, N, isa, "q8")
    _check("q8", out, x, w_f32)


BF16_SIMD = K.lowp_variants("bf16")[1:]   # vdpbf16ps (avx512bf16), tdpbf16ps (amx)


@pytest.mark.skipif(len(BF16_SIMD) < 2, reason="one bf16 SIMD variant: nothing to compare")
@pytest.mark.parametrize("isa", BF16_SIMD)
@pytest.mark.parametrize("T,Kd,N", SHAPES[:1] + SHAPES[3:4], ids=str)
def test_bench_matmul_bf16_isa(benchmark, T, Kd, N, isa):
    """Every bf16 kernel of this CPU on Q8_0 weights, side by side (AMX within the same bound)."""
    x, w, w_f32, _ = _case(T, Kd, N)
    out = np.empty((T, N), np.float32)
    _group(benchmark, T, Kd, N)
    benchmark.name = f"nxhpc matmul_bf16 isa={isa}"
    benchmark.pedantic(K.matmul_bf16, args=(x, w, "Q8_0", out), kwargs={"isa": isa},
                       rounds=_rounds(T), warmup_rounds=1)
    _info(benchmark, T, Kd, N, isa, "bf16")
    _check("bf16", out, x, w_f32)


# ---------------------------------------------------------------- q8 on every quantized weight type

Q8_TYPES = ["Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K"]
# float16 fields (byte offsets) of each K-quant block's d / dmin, written with sane values over
# random code/scale bytes (gguf's Python quantizer has no K-quants).
_KQ_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_WCACHE = {}


def _typed_case(wtype, Kd, N, seed=0):
    """w raw rows of `wtype` [N, rowbytes] and its gguf dequantization (float32)."""
    key = (wtype, Kd, N, seed)
    if key not in _WCACHE:
        _WCACHE.clear()
        rng = np.random.default_rng(seed)
        if wtype in _KQ_FIELDS:
            b = _BLOCK_BYTES[wtype]
            nb = N * Kd // 256
            raw = rng.integers(0, 256, (nb, b), dtype=np.uint8)
            for off in _KQ_FIELDS[wtype]:
                raw[:, off:off + 2] = (rng.uniform(2.0 ** -12, 2.0 ** -7, nb).astype("<f2")
                                       .view(np.uint8).reshape(nb, 2))
            w = raw.reshape(N, -1)
        else:
            w = gguf_quantize((rng.standard_normal((N, Kd)) * 0.02).astype(np.float32), QT[wtype])
        _WCACHE[key] = (w, gguf_dequantize(w, QT[wtype]).astype(np.float32))
    return _WCACHE[key]


_MIN_FIELDS = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q4_K": (0, 2), "Q5_K": (0, 2)}
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q2_K": 84,
                "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _check_q8_typed(out, x, w, w_f32, wtype, rows=16):
    """The q8 contract's error bound (nx_lowp.h; derivation in tests/test_kernels_q8_types.py)
    on a sample of rows: sum|x - x~||w| + gamma_{n+2} sum|x~| |w|' + [min] 2^-24 sum|x~ w|, with
    |w|' = |sw qw| + |mw| read back from gguf's dequantize with the d or the min field zeroed."""
    H = 2 if wtype in ("Q2_K", "Q3_K", "Q6_K") else 1
    has_min = wtype in _MIN_FIELDS
    Kd = x.shape[1]
    xs = x[:rows]
    qx = gguf_quantize(xs, QT.Q8_0).reshape(rows, Kd // 32, 34)[:, :, 2:].view(np.int8)
    dx = (np.abs(xs.reshape(rows, -1, 32)).max(axis=2) / np.float32(127)).astype(np.float32)
    xt = (qx.astype(np.float64) * dx[:, :, None].astype(np.float64)).reshape(rows, Kd)
    wd = np.abs(w_f32.astype(np.float64))
    wabs = wd
    if has_min:
        parts = []
        for f in _MIN_FIELDS[wtype]:                    # zero d (-> mw), then dmin/m (-> sw qw)
            blocks = w.copy().reshape(-1, _BLOCK_BYTES[wtype])
            blocks[:, f:f + 2] = 0
            parts.append(np.abs(gguf_dequantize(blocks.reshape(w.shape), QT[wtype])))
        wabs = parts[0].astype(np.float64) + parts[1].astype(np.float64)
    n = Kd // 32 * (1 + H * has_min)
    g = (n + 2) * EPS32 / (1 - (n + 2) * EPS32)
    x64 = xs.astype(np.float64)
    bound = (np.abs(x64 - xt) @ wd.T + g * (np.abs(xt) @ wabs.T)
             + (EPS32 * (np.abs(xt) @ wd.T) if has_min else 0)
             + 3 * Kd * 2.0 ** -53 * (np.abs(x64) @ wd.T))
    ref = x64 @ w_f32.astype(np.float64).T
    got = np.asarray(out[:rows], np.float64)
    assert (np.abs(got - ref) <= bound).all(), (np.abs(got - ref) / bound).max()


@pytest.mark.parametrize("prec", [f"q8-{i}" for i in Q8_SIMD] + ["bf16"])
@pytest.mark.parametrize("wtype", Q8_TYPES)
def test_bench_q8_weight_types(benchmark, wtype, prec):
    """q8 and bf16 on each quantized weight type, T=256 K=N=3840, one group (the q8 Q8_0 row of
    each ISA is the baseline that ISA's other types are compared with). q8 runs every SIMD
    variant (avx2, avx512 = VNNI, amx = tdpbssd, as the CPU has them); bf16 the best variant."""
    T, Kd, N = 256, 3840, 3840
    x = _case(T, Kd, 32)[0]
    w, w_f32 = _typed_case(wtype, Kd, N)
    out = np.empty((T, N), np.float32)
    slot = "matmul_q8" if prec != "bf16" else "matmul_bf16"
    v = prec[3:] if prec != "bf16" else nxhpc.kernel_variants()[slot]
    benchmark.group = f"q8 weight types T={T} K={Kd} N={N}"
    benchmark.name = f"nxhpc {slot} {wtype} ({v})"
    if prec != "bf16":
        fn, args = (lambda: K.matmul_q8(x, w, out, wtype=wtype, isa=v)), ()
    else:
        fn, args = K.matmul_bf16, (x, w, wtype, out)
    benchmark.pedantic(fn, args=args, rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, v, "q8" if prec != "bf16" else "bf16")
    benchmark.extra_info["wtype"] = wtype
    if prec != "bf16":
        _check_q8_typed(out, x, w, w_f32, wtype)
    else:
        _check("bf16", out, x, w_f32)


# ---------------------------------------------------------------- bf16 vs f32 on the AVX2 path

_F32_TYPES = ("Q8_0", "Q4_K", "BF16")


def _bf16_f32_case(wtype, T=256, Kd=3840, N=3840):
    """x [T, K]; w raw rows of `wtype` and its float32 values (Q8_0 / Q4_K as in the q8 group,
    BF16 = bf() of the Q8_0 weights' values)."""
    x = _case(T, Kd, 32)[0]
    if wtype == "BF16":
        w, w_f32 = _typed_case("Q8_0", Kd, N)
        w = (K.round_bf16(w_f32).view(np.uint32) >> 16).astype("<u2")
        return x, w.view(np.uint8), (w.astype(np.uint32) << 16).view(np.float32)
    return (x, *_typed_case(wtype, Kd, N))


@pytest.mark.parametrize("kernel", ["bf16 best", "f32 matmul", "bf16 generic"])
@pytest.mark.parametrize("wtype", _F32_TYPES)
def test_bench_bf16_vs_f32(benchmark, wtype, kernel):
    """T=256, K=N=3840, one group per weight type: the bf16 matmul's best variant (avx2 on an
    AVX2-only CPU: float32 FMA chains over bfloat16-valued panels) against the float32 matmul
    (K.matmul, the same weights) and the bf16 generic spec (one round: it is scalar)."""
    T, Kd, N = 256, 3840, 3840
    x, w, w_f32 = _bf16_f32_case(wtype, T, Kd, N)
    out = np.empty((T, N), np.float32)
    benchmark.group = f"bf16 vs f32 {wtype} T={T} K={Kd} N={N}"
    if kernel == "f32 matmul":
        v, prec = nxhpc.kernel_variants()["matmul"], "f32"
        fn = lambda: K.matmul(x, w, wtype, out)          # noqa: E731
    else:
        v = "generic" if kernel == "bf16 generic" else nxhpc.kernel_variants()["matmul_bf16"]
        prec = "bf16"
        fn = lambda: K.matmul_bf16(x, w, wtype, out, isa=v)   # noqa: E731
    benchmark.name = f"nxhpc {kernel} {wtype} ({v})"
    rounds = (1, 0) if v == "generic" else (5, 1)
    benchmark.pedantic(fn, rounds=rounds[0], warmup_rounds=rounds[1])
    _info(benchmark, T, Kd, N, v, prec)
    benchmark.extra_info["wtype"] = wtype
    _check(prec, out, x, w_f32, any_order=False)


# ---------------------------------------------------------------- q8 on float weights: copy or not

_FLOAT_ROWS = ["bf16-" + i for i in BF16_SIMD] + ["q8-int8copy-" + i for i in Q8_SIMD]


@pytest.mark.parametrize("row", _FLOAT_ROWS)
@pytest.mark.parametrize("wtype", ["BF16", "F16"])
def test_bench_q8_float_weights(benchmark, wtype, row):
    """The two ways ``q8`` can run an F16/BF16 matrix (``nxhpc.nn.linear.Q8_FLOAT_WEIGHTS``),
    T=256 K=N=3840, one group per weight type, every SIMD variant of each: ``bf16`` on the
    stored values, or ``matmul_q8`` on the Q8_0 copy ``with_int8_copy`` makes once at load
    (``extra_info``: the copy's one-off seconds and bytes, and its values' RMS error relative
    to the stored ones). The q8 rows are checked against the q8 bound on the copy's values,
    the bf16 rows against the bf16 bound on the stored ones."""
    from nxhpc.formats.weights import WeightTensor
    from nxhpc.nn.linear import with_int8_copy
    T, Kd, N = 256, 3840, 3840
    x = _case(T, Kd, 32)[0]
    _, w_f32 = _typed_case("Q8_0", Kd, N)
    if wtype == "BF16":
        w = (K.round_bf16(w_f32).view(np.uint32) >> 16).astype("<u2")
        vals = (w.astype(np.uint32) << 16).view(np.float32)
    else:
        w = w_f32.astype(np.float16)
        vals = w.astype(np.float32)
    wt = WeightTensor.from_raw("w", wtype, Kd, w)
    out = np.empty((T, N), np.float32)
    benchmark.group = f"q8 on float weights {wtype} T={T} K={Kd} N={N}"
    kind, isa = row.rsplit("-", 1)
    benchmark.name = f"nxhpc {kind} {wtype} ({isa})"
    if kind == "bf16":
        fn = lambda: K.matmul_bf16(x, wt.data, wtype, out, isa=isa)   # noqa: E731
    else:
        t0 = time.perf_counter()
        copy = with_int8_copy(K, wt).int8
        made = time.perf_counter() - t0
        fn = lambda: K.matmul_q8(x, copy.data, out, wtype="Q8_0", isa=isa)   # noqa: E731
    benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
    _info(benchmark, T, Kd, N, isa, "bf16" if kind == "bf16" else "q8")
    benchmark.extra_info["wtype"] = wtype
    if kind == "bf16":
        _check("bf16", out, x, vals)
    else:
        cv = K.q8_0_dequantize(copy.data)
        benchmark.extra_info.update({
            "copy_s": round(made, 4), "copy_bytes": int(copy.nbytes),
            "stored_bytes": int(wt.nbytes),
            "copy_rms_rel": float(np.sqrt(((cv.astype(np.float64) - vals) ** 2).mean()
                                          / (vals.astype(np.float64) ** 2).mean()))})
        _check("q8", out, x, cv)
