"""The autoencoder's 3x3 convolutions: ``conv3x3`` / ``conv3x3_bf16`` (one call, the im2col rows
made as the matmul packs them) against the panel loop they replaced (``im2col3x3`` into 4 MiB
float32 panels, each through ``matmul`` / ``matmul_bf16``) and against torch's ``conv2d`` in the
same precision.

Shapes: one convolution of each width of the FLUX decoder at a 512x512 image -- C = 512 at
64x64, 256 at 128x128, 128 at 256x256 (C in = C out, padding 1) -- random activations and
BF16 weights (N(0, 1/(9C)), the BF16 ``ae.safetensors`` layout), one thread, the whole image.
Each ``benchmark.group`` ("conv3x3 <precision> C=.. HxW") holds the three ways; GFLOP/s (2 H W
9 C^2 / time) and its fraction of this CPU's measured peak for the precision in ``extra_info``.
After timing the one-call output is compared bit for bit with the panels' (the promise of
csrc/nx_conv.h) and torch's within a loose tolerance; speed is not asserted.

    OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_conv.py --benchmark-only \\
        --benchmark-timer=time.process_time
"""
import contextlib

import numpy as np
import pytest
from _bench_util import bench_stats, peak_fields, torch_threads

from nxhpc import _kernels as K

SHAPES = [(64, 64, 512), (128, 128, 256), (256, 256, 128)]   # H, W, C
PANEL_FLOATS = 1 << 20                 # the panel loop's panel: 4 MiB of float32 (before)
WAYS = ["one call", "panels", "torch"]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda s: f"C={s[2]}-{s[0]}x{s[1]}")
def case(request):
    H, W, C = request.param
    rng = np.random.default_rng(C)
    x = rng.standard_normal((H * W, C), dtype=np.float32)
    wf = (rng.standard_normal((C, 9 * C)) / np.sqrt(9 * C)).astype(np.float32)
    w = (wf.view(np.uint32) >> 16).astype(np.uint16)          # BF16 words (truncated)
    b = rng.standard_normal(C).astype(np.float32)
    return H, W, C, x, w, b


def _panels(precision, x, H, W, w, b, out):
    K_ = w.shape[1]
    rows = max(16, PANEL_FLOATS // K_)
    pan = np.empty((rows, K_), np.float32)
    mm = K.matmul_bf16 if precision == "bf16" else K.matmul
    for p0 in range(0, H * W, rows):
        p1 = min(p0 + rows, H * W)
        K.im2col3x3(x, H, W, pan[:p1 - p0], p0, p1)
        mm(pan[:p1 - p0], w.view(np.uint8), "BF16", out[p0:p1], bias=b)


@pytest.mark.parametrize("precision", ["bf16", "f32"])
@pytest.mark.parametrize("way", WAYS)
def test_bench_conv3x3(benchmark, case, precision, way):
    H, W, C, x, w, b = case
    benchmark.group = f"conv3x3 {precision} C={C} {H}x{W}"
    out = np.empty((H * W, C), np.float32)
    if way == "torch":
        torch = pytest.importorskip("torch")
        dt = torch.bfloat16 if precision == "bf16" else torch.float32
        tx = torch.from_numpy(x.T.reshape(1, C, H, W).copy()).to(dt)
        tw = torch.from_numpy((w.astype(np.uint32) << 16).view(np.float32)
                              .reshape(C, C, 3, 3)).to(dt)
        tb = torch.from_numpy(b).to(dt)

        def run():
            return torch.nn.functional.conv2d(tx, tw, tb, padding=1)
    elif way == "panels":
        def run():
            _panels(precision, x, H, W, w, b, out)
    else:
        conv = K.conv3x3_bf16 if precision == "bf16" else K.conv3x3

        def run():
            conv(x, H, W, w, "BF16", out, bias=b)
    with torch_threads(1) if way == "torch" else contextlib.nullcontext():
        res = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    gflop = 2 * H * W * 9 * C * C / 1e9
    t = bench_stats(benchmark).min
    gops = gflop / t
    variant = "torch" if way == "torch" else K.kernel_variants().get(
        "matmul_bf16" if precision == "bf16" else "matmul")
    benchmark.extra_info.update({"gflop_per_s": round(gops, 1), "way": way,
                                 **peak_fields(gops, precision, None if way == "torch"
                                               else variant)})
    # after timing: the one call against the panels (bits) and torch (loose)
    ref = np.empty_like(out)
    _panels(precision, x, H, W, w, b, ref)
    if way == "one call":
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    if way == "torch":
        got = res.float().numpy().reshape(C, H * W).T
        err = np.abs(got - ref).max() / np.abs(ref).max()
        benchmark.extra_info["rel_err_vs_nxhpc"] = float(err)
        assert err < (5e-2 if precision == "bf16" else 1e-4), err
