"""Tests of the convolutional kernels (csrc/nx_conv.h): GroupNorm in three steps (partials,
coefficients, affine + SiLU) and composed, the 3x3 im2col panel (plain and through a nearest x2
upsampling), nearest x2 upsampling, the residual add.

Oracles: float64 numpy written from the formulas, and torch.nn.functional (group_norm, conv2d,
interpolate nearest) in float64 on the NCHW view. Activations are channels-last rows [H*W, C].
Tolerances, from the contract's operation order (u = 2^-24):
  GroupNorm affine: y = fl(fl(x * a') + b') with a' = fl(a), b' = fl(b) (a = gamma*r, b = beta -
  mean*a exact up to float64 statistics): |y - y_exact| <= 2u|x a| + 2u|b| + u|y| (+ the
  statistics' float64 error, ~1e-13 relative here); 3u(|x a| + |b| + |y|) covers it.
  SiLU on top: silu' <= 1.1, the SIMD silu itself <= 8u relative (test_kernels_ops), so
  1.1 * that + 8u|silu(y)| + 2^-140.
  im2col / upsample / add: exact (copies; one IEEE add).
  conv = im2col + matmul vs torch float64: the matmul's own bound (kernelutil.matmul_bound).
  conv3x3 / conv3x3_bf16 (no panel): bit for bit im2col3x3 then matmul / matmul_bf16 at the
  same isa on any panel split; conv3x3_bf16 vs torch float64 within matmul_bf16's bound
  (test_kernels_lowp.bf16_bound).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernelutil import (EPS32, EPS64, ISAS, SIMD_ISAS, assert_bitwise, bits, finite_scale_blocks,
                        matmul_bound, random_weight)

from nxhpc import _kernels as K

U = EPS32
TINY = 2.0 ** -140


def ref_group_norm(x, H, W, groups, gamma, beta, eps):
    """float64 GroupNorm of channels-last rows x [H*W, C], written from the formula."""
    x = x.astype(np.float64)
    P, C = x.shape
    g = x.reshape(P, groups, C // groups)
    mean = g.mean(axis=(0, 2), keepdims=True)
    var = ((g - mean) ** 2).mean(axis=(0, 2), keepdims=True)
    y = ((g - mean) / np.sqrt(var + eps)).reshape(P, C)
    return y * gamma.astype(np.float64) + beta.astype(np.float64), mean, var


def silu64(y):
    return y / (1.0 + np.exp(-y))


def gn_bound(x, groups, gamma, beta, eps, silu):
    """(reference, elementwise bound) of group_norm (see the module docstring)."""
    P, C = x.shape
    y, mean, var = ref_group_norm(x, 1, P, groups, gamma, beta, eps)
    a = (gamma.astype(np.float64).reshape(groups, C // groups)
         / np.sqrt(var.reshape(groups, 1) + eps)).reshape(C)
    b = beta.astype(np.float64) - np.repeat(mean.reshape(groups), C // groups) * a
    e = 3 * U * (np.abs(x.astype(np.float64) * a) + np.abs(b) + np.abs(y)) + TINY
    if not silu:
        return y, e
    s = silu64(y)
    return s, 1.1 * e + 8 * U * np.abs(s) + TINY


def assert_within(out, ref, bound, what):
    err = np.abs(out.astype(np.float64) - ref)
    bad = np.flatnonzero(~(err <= bound))
    assert bad.size == 0, (f"{what}: {bad.size} elements out of bound, worst err/bound "
                           f"{np.max(err / bound):.3g}")


def rand_act(rng, P, C, offset=0.0, scale=1.0):
    return (rng.standard_normal((P, C)) * scale + offset).astype(np.float32)


GN_CASES = [(1, 32, 32), (7, 32, 8), (129, 64, 32), (300, 96, 32), (257, 16, 4), (40, 33, 11)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("P,C,G", GN_CASES)
@pytest.mark.parametrize("silu", [False, True])
def test_group_norm_vs_float64(isa, P, C, G, silu):
    rng = np.random.default_rng(P * 1000 + C + silu)
    x = rand_act(rng, P, C, offset=0.5, scale=2.0)
    gamma = rng.standard_normal(C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    out = np.empty_like(x)
    K.group_norm(x, G, gamma, beta, 1e-6, out, silu=silu, isa=isa)
    ref, bound = gn_bound(x, G, gamma, beta, 1e-6, silu)
    assert_within(out, ref, bound, f"group_norm {isa} P={P} C={C} G={G} silu={silu}")


def test_group_norm_vs_torch_and_eps_negative_control():
    """torch's float64 group_norm on the NCHW view agrees; eps 1e-2 instead of 1e-6 must not."""
    rng = np.random.default_rng(5)
    H, W, C, G = 6, 9, 64, 32
    x = rand_act(rng, H * W, C, scale=0.05)          # small variance: eps matters
    gamma = rng.standard_normal(C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    nchw = torch.from_numpy(x.astype(np.float64).T.reshape(1, C, H, W))
    ref = F.group_norm(nchw, G, torch.from_numpy(gamma.astype(np.float64)),
                       torch.from_numpy(beta.astype(np.float64)), 1e-6)
    ref = ref.reshape(C, H * W).T.numpy()
    out = K.group_norm(x, G, gamma, beta, 1e-6, np.empty_like(x))
    _, bound = gn_bound(x, G, gamma, beta, 1e-6, False)
    assert_within(out, ref, bound, "group_norm vs torch")
    wrong = K.group_norm(x, G, gamma, beta, 1e-2, np.empty_like(x))
    assert np.max(np.abs(wrong - ref)) > 100 * np.max(bound), "eps must change the result"


def test_group_norm_large_offset():
    """mean 1000x the spread: the per-chunk two-pass statistics keep the variance accurate."""
    rng = np.random.default_rng(6)
    x = rand_act(rng, 1000, 32, offset=300.0, scale=0.3)
    gamma = np.ones(32, np.float32)
    beta = np.zeros(32, np.float32)
    out = K.group_norm(x, 8, gamma, beta, 1e-6, np.empty_like(x))
    ref, bound = gn_bound(x, 8, gamma, beta, 1e-6, False)
    assert_within(out, ref, bound, "group_norm with a large offset")


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("P, C, G", [(333, 48, 16), (300, 52, 4), (129, 8, 2), (40, 3, 1)])
def test_group_norm_isa_bits(isa, P, C, G):
    """partials (the SIMD variants' float64 chains, a vector of channels, with a channel tail
    past the last whole vector and a short last chunk) and coefficients bit-identical to the
    spec; the affine map bit-identical to the spec at every ISA; with silu within the SIMD
    silu's tolerance of it."""
    rng = np.random.default_rng(7)
    x = rand_act(rng, P, C) + np.float32(3.0)   # a mean far from 0: the d = x - mean step matters
    gamma = rng.standard_normal(C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    nk = K.group_norm_chunks(P)
    pa = K.group_norm_partials(x, G, np.empty((nk, G, 2)), isa="generic")
    pb = K.group_norm_partials(x, G, np.empty((nk, G, 2)), isa=isa)
    assert np.array_equal(pa.view(np.uint64), pb.view(np.uint64))
    sa, ta = K.group_norm_coeffs(pa, P, gamma, beta, 1e-6, np.empty(C, np.float32),
                                 np.empty(C, np.float32), isa="generic")
    sb, tb = K.group_norm_coeffs(pa, P, gamma, beta, 1e-6, np.empty(C, np.float32),
                                 np.empty(C, np.float32), isa=isa)
    assert_bitwise(sa, sb, "scale")
    assert_bitwise(ta, tb, "shift")
    g = K.affine_act(x, sa, ta, np.empty_like(x), isa="generic")
    v = K.affine_act(x, sa, ta, np.empty_like(x), isa=isa)
    assert_bitwise(g, v, f"affine {isa}")
    gs = K.affine_act(x, sa, ta, np.empty_like(x), silu=True, isa="generic")
    vs = K.affine_act(x, sa, ta, np.empty_like(x), silu=True, isa=isa)
    assert np.all(np.abs(gs - vs) <= 16 * U * np.abs(gs) + TINY)


@pytest.mark.parametrize("isa", ISAS)
def test_group_norm_bands_bit_identical(isa):
    """Chunk bands of the partials and row bands of the affine map, in any split, give the
    one-call bits; rows outside a band are untouched; in place works."""
    rng = np.random.default_rng(8)
    P, C, G = 1000, 32, 8
    x = rand_act(rng, P, C)
    gamma = rng.standard_normal(C).astype(np.float32)
    beta = rng.standard_normal(C).astype(np.float32)
    whole = K.group_norm(x, G, gamma, beta, 1e-6, np.empty_like(x), silu=True, isa=isa)
    nk = K.group_norm_chunks(P)
    part = np.full((nk, G, 2), np.nan)
    for k0, k1 in [(0, 3), (3, 4), (4, nk)]:
        K.group_norm_partials(x, G, part, k0, k1, isa=isa)
    scale, shift = np.empty(C, np.float32), np.empty(C, np.float32)
    K.group_norm_coeffs(part, P, gamma, beta, 1e-6, scale, shift, isa=isa)
    out = np.full_like(x, 7.0)
    K.affine_act(x, scale, shift, out, 0, 1, silu=True, isa=isa)
    assert np.all(out[1:] == 7.0)
    K.affine_act(x, scale, shift, out, 1, 555, silu=True, isa=isa)
    K.affine_act(x, scale, shift, out, 555, P, silu=True, isa=isa)
    assert_bitwise(out, whole, "banded group_norm")
    y = x.copy()
    K.group_norm(y, G, gamma, beta, 1e-6, y, silu=True, isa=isa)
    assert_bitwise(y, whole, "in place")


def ref_im2col(x, H, W, up):
    """float64-free plain loops: the panel of a padded 3x3 convolution (x through a nearest x2
    upsampling when up)."""
    C = x.shape[1]
    img = x.reshape(H, W, C)
    if up:
        img = np.repeat(np.repeat(img, 2, axis=0), 2, axis=1)
    Ho, Wo = img.shape[:2]
    pad = np.zeros((Ho + 2, Wo + 2, C), np.float32)
    pad[1:-1, 1:-1] = img
    panel = np.empty((Ho * Wo, C, 3, 3), np.float32)
    for ky in range(3):
        for kx in range(3):
            panel[:, :, ky, kx] = pad[ky:ky + Ho, kx:kx + Wo].reshape(Ho * Wo, C)
    return panel.reshape(Ho * Wo, 9 * C)


IM_CASES = [(1, 1, 1), (1, 5, 3), (4, 6, 8), (7, 3, 16), (5, 5, 17), (3, 4, 33), (2, 9, 64)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,W,C", IM_CASES)
@pytest.mark.parametrize("up", [False, True])
def test_im2col_exact(isa, H, W, C, up):
    rng = np.random.default_rng(H * 100 + W * 10 + C)
    x = rand_act(rng, H * W, C)
    ref = ref_im2col(x, H, W, up)
    n = ref.shape[0]
    panel = K.im2col3x3(x, H, W, np.full((n, 9 * C), np.nan, np.float32), upsample=up, isa=isa)
    assert_bitwise(panel, ref, f"im2col {isa}")
    # any band of output pixels is the matching rows
    for p0, p1 in [(0, 1), (n // 3, n // 2 + 1), (n - 1, n)]:
        part = K.im2col3x3(x, H, W, np.empty((p1 - p0, 9 * C), np.float32), p0, p1,
                           upsample=up, isa=isa)
        assert_bitwise(part, ref[p0:p1], f"im2col band [{p0}, {p1})")


@pytest.mark.parametrize("H,W,Cin,Cout", [(5, 7, 16, 32), (4, 4, 32, 3), (3, 8, 33, 20)])
@pytest.mark.parametrize("up", [False, True])
def test_conv3x3_as_panel_matmul_vs_torch(H, W, Cin, Cout, up):
    """im2col panel @ weight[Cout, Cin*9]^T + bias is torch's conv2d(padding=1) (after
    interpolate nearest x2 when up), within the matmul's bound; the upsample/conv order
    swapped (conv, then upsample) must not match."""
    rng = np.random.default_rng(Cin + Cout + up)
    x = rand_act(rng, H * W, Cin)
    w = (rng.standard_normal((Cout, Cin, 3, 3)) / np.sqrt(9 * Cin)).astype(np.float32)
    b = rng.standard_normal(Cout).astype(np.float32)
    Ho, Wo = (2 * H, 2 * W) if up else (H, W)
    panel = K.im2col3x3(x, H, W, np.empty((Ho * Wo, 9 * Cin), np.float32), upsample=up)
    out = K.matmul(panel, w.reshape(Cout, 9 * Cin), "F32", np.empty((Ho * Wo, Cout), np.float32),
                   bias=b)
    t = torch.from_numpy(x.astype(np.float64).T.reshape(1, Cin, H, W))
    if up:
        t = F.interpolate(t, scale_factor=2, mode="nearest")
    ref = F.conv2d(t, torch.from_numpy(w.astype(np.float64)),
                   torch.from_numpy(b.astype(np.float64)), padding=1)
    ref = ref.reshape(Cout, Ho * Wo).T.numpy()
    mag = np.abs(panel.astype(np.float64)) @ np.abs(w.reshape(Cout, -1).astype(np.float64)).T
    bound = matmul_bound(9 * Cin, mag) + 2 * U * np.abs(ref) + TINY
    assert_within(out, ref, bound, "conv3x3")
    if up:
        t0 = torch.from_numpy(x.astype(np.float64).T.reshape(1, Cin, H, W))
        swapped = F.interpolate(F.conv2d(t0, torch.from_numpy(w.astype(np.float64)),
                                         torch.from_numpy(b.astype(np.float64)), padding=1),
                                scale_factor=2, mode="nearest")
        swapped = swapped.reshape(Cout, Ho * Wo).T.numpy()
        assert np.max(np.abs(out - swapped)) > 100 * np.max(bound)


def _conv_weight(rng, wtype, N, C):
    """The weight [N, 9C] as conv3x3 / matmul_bf16 take it, of type `wtype`."""
    wf = (rng.standard_normal((N, 9 * C)) / np.sqrt(9 * C)).astype(np.float32)
    if wtype == "F32":
        return wf
    if wtype == "F16":
        return wf.astype(np.float16)
    if wtype == "BF16":
        return (wf.view(np.uint32) >> 16).astype(np.uint16)
    if wtype in ("Q8_0", "Q4_0"):                   # gguf quantizes these
        return random_weight(rng, N, 9 * C, wtype, scale=1 / np.sqrt(9 * C))[0]
    return finite_scale_blocks(rng, wtype, N, 9 * C)   # random valid K-quant blocks


CONV = {"f32": (K.conv3x3, K.matmul), "bf16": (K.conv3x3_bf16, K.matmul_bf16)}


def _panel_split_conv(x, H, W, w, wtype, bias, up, isa, rows, precision):
    """The reference composition: im2col3x3 then the precision's matmul, `rows` output pixels a
    panel."""
    n = (H << up) * (W << up)
    C = x.shape[1]
    out = np.empty((n, w.shape[0]), np.float32)
    for p0 in range(0, n, rows):
        p1 = min(p0 + rows, n)
        pan = K.im2col3x3(x, H, W, np.empty((p1 - p0, 9 * C), np.float32), p0, p1,
                          upsample=up, isa=isa)
        CONV[precision][1](pan, w.view(np.uint8).reshape(w.shape[0], -1), wtype, out[p0:p1],
                           bias=bias, isa=isa)
    return out


CONV_CASES = [  # H, W, C, N, wtype: C off and on 32, one output block past the driver's
    (5, 7, 3, 5, "F32"), (6, 4, 16, 32, "BF16"), (3, 9, 33, 40, "F16"),   # token block (1156
    (4, 4, 64, 17, "Q8_0"), (2, 3, 256, 8, "Q4_K"), (34, 34, 8, 12, "BF16")]  # pixels)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,W,C,N,wtype", CONV_CASES)
@pytest.mark.parametrize("up", [False, True])
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_conv3x3_is_im2col_then_matmul(isa, H, W, C, N, wtype, up, precision):
    """conv3x3 / conv3x3_bf16 over a band = the rows of im2col3x3 + matmul / matmul_bf16 at the
    same isa, bit for bit, whatever the panel split; rows outside the band untouched. Negative
    control: the same call with the other upsampling setting differs."""
    conv = CONV[precision][0]
    rng = np.random.default_rng([H, W, C, N, up])
    x = rand_act(rng, H * W, C)
    w = _conv_weight(rng, wtype, N, C)
    bias = None if C == 16 else rng.standard_normal(N).astype(np.float32)
    n = (H << up) * (W << up)
    ref = _panel_split_conv(x, H, W, w, wtype, bias, up, isa, 37, precision)
    assert_bitwise(_panel_split_conv(x, H, W, w, wtype, bias, up, isa, 1000, precision), ref,
                   "panels")
    for p0, p1 in [(0, n), (1, n - 1), (n // 3, n // 2 + 1)]:
        out = np.full((n, N), np.nan, np.float32)
        conv(x, H, W, w, wtype, out, p0, p1, bias=bias, upsample=up, isa=isa)
        assert_bitwise(out[p0:p1], ref[p0:p1], f"{precision} {isa} band [{p0}, {p1})")
        assert np.isnan(out[:p0]).all() and np.isnan(out[p1:]).all(), "rows outside the band"
    flip = (H << (not up)) * (W << (not up))
    other = conv(x, H, W, w, wtype, np.empty((flip, N), np.float32), bias=bias,
                 upsample=not up, isa=isa)
    m = min(flip, n)
    assert not np.array_equal(bits(other[:m]), bits(ref[:m])), "negative control"


@pytest.mark.parametrize("H,W,Cin,Cout", [(5, 7, 16, 32), (3, 8, 33, 20)])
@pytest.mark.parametrize("up", [False, True])
def test_conv3x3_bf16_vs_torch(H, W, Cin, Cout, up):
    """conv3x3_bf16 is torch's float64 conv2d(padding=1) (after interpolate nearest x2 when up)
    within matmul_bf16's bound: input rounding (2u + u^2) and a K-step chain gamma_K, over
    sum |panel| |w| (u = 2^-8); the conv-then-upsample order must not match."""
    rng = np.random.default_rng(Cin * Cout + up)
    x = rand_act(rng, H * W, Cin)
    w = (rng.standard_normal((Cout, Cin, 3, 3)) / np.sqrt(9 * Cin)).astype(np.float32)
    b = rng.standard_normal(Cout).astype(np.float32)
    Ho, Wo = (2 * H, 2 * W) if up else (H, W)
    out = K.conv3x3_bf16(x, H, W, w.reshape(Cout, 9 * Cin), "F32",
                         np.empty((Ho * Wo, Cout), np.float32), bias=b, upsample=up)
    t = torch.from_numpy(x.astype(np.float64).T.reshape(1, Cin, H, W))
    if up:
        t = F.interpolate(t, scale_factor=2, mode="nearest")
    wt = torch.from_numpy(w.astype(np.float64))
    bt = torch.from_numpy(b.astype(np.float64))
    ref = F.conv2d(t, wt, bt, padding=1).reshape(Cout, Ho * Wo).T.numpy()
    Kd = 9 * Cin
    mag = np.abs(ref_im2col(x, H, W, up).astype(np.float64)) @ np.abs(
        w.reshape(Cout, Kd).astype(np.float64)).T
    ubf = 2.0 ** -8
    g = Kd * U / (1 - Kd * U)
    g64 = 2 * Kd * EPS64 / (1 - 2 * Kd * EPS64)
    bound = ((2 * ubf + ubf ** 2) + g * (1 + ubf) ** 2 + g64) * mag + 2 * U * np.abs(ref) + TINY
    assert_within(out, ref, bound, "conv3x3_bf16 vs torch")
    if up:
        t0 = torch.from_numpy(x.astype(np.float64).T.reshape(1, Cin, H, W))
        swapped = F.interpolate(F.conv2d(t0, wt, bt, padding=1), scale_factor=2,
                                mode="nearest").reshape(Cout, Ho * Wo).T.numpy()
        assert np.max(np.abs(out - swapped)) > 10 * np.max(bound)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,W,C", [(1, 1, 1), (3, 5, 7), (4, 4, 64)])
def test_upsample_nearest2x(isa, H, W, C):
    rng = np.random.default_rng(C)
    x = rand_act(rng, H * W, C)
    ref = np.repeat(np.repeat(x.reshape(H, W, C), 2, 0), 2, 1).reshape(4 * H * W, C)
    t = torch.from_numpy(x.T.reshape(1, C, H, W).copy())
    tref = F.interpolate(t, scale_factor=2, mode="nearest").reshape(C, -1).T.numpy()
    out = K.upsample_nearest2x(x, H, W, np.empty((4 * H * W, C), np.float32), isa=isa)
    assert_bitwise(out, ref, "upsample")
    assert_bitwise(out, np.ascontiguousarray(tref), "upsample vs torch")
    part = np.full_like(out, 3.0)
    K.upsample_nearest2x(x, H, W, part, 1, 4 * H * W - 1, isa=isa)
    assert np.all(part[0] == 3.0) and np.all(part[-1] == 3.0)
    assert_bitwise(part[1:-1], ref[1:-1], "upsample band")
    # im2col through the upsampling = im2col of the upsampled image
    p1 = K.im2col3x3(x, H, W, np.empty((4 * H * W, 9 * C), np.float32), upsample=True, isa=isa)
    p2 = K.im2col3x3(out, 2 * H, 2 * W, np.empty((4 * H * W, 9 * C), np.float32), isa=isa)
    assert_bitwise(p1, p2, "fused upsampling")


@pytest.mark.parametrize("isa", ISAS)
def test_add(isa):
    rng = np.random.default_rng(9)
    a = rand_act(rng, 37, 33)
    b = rand_act(rng, 37, 33)
    ref = a + b
    assert_bitwise(K.add(a, b, np.empty_like(a), isa=isa), ref, "add")
    c = a.copy()
    K.add(c, b, c, 5, 700, isa=isa)
    flat, rflat, aflat = c.reshape(-1), ref.reshape(-1), a.reshape(-1)
    assert_bitwise(flat[5:700], rflat[5:700], "add band in place")
    assert_bitwise(flat[:5], aflat[:5], "untouched")
    assert_bitwise(flat[700:], aflat[700:], "untouched")


def test_bad_input():
    x = np.zeros((12, 32), np.float32)
    g = np.ones(32, np.float32)
    out = np.empty_like(x)
    with pytest.raises(ValueError, match="group_norm: x has C=32 .* groups=5"):
        K.group_norm(x, 5, g, g, 1e-6, out)
    with pytest.raises(TypeError, match="group_norm_partials: x must be float32"):
        K.group_norm_partials(x.astype(np.float64), 8, np.empty((1, 8, 2)))
    with pytest.raises(TypeError, match="partials must be float64"):
        K.group_norm_partials(x, 8, np.empty((1, 8, 2), np.float32))
    with pytest.raises(ValueError, match=r"partials must have shape \(1, 8, 2\)"):
        K.group_norm_partials(x, 8, np.empty((2, 8, 2)))
    with pytest.raises(ValueError, match="band"):
        K.group_norm_partials(x, 8, np.empty((1, 8, 2)), 0, 2)
    with pytest.raises(ValueError, match="eps must be a finite non-negative"):
        K.group_norm(x, 8, g, g, float("nan"), out)
    with pytest.raises(ValueError, match="beta must have shape"):
        K.group_norm(x, 8, g, g[:16], 1e-6, out)
    with pytest.raises(TypeError, match="silu must be a bool"):
        K.affine_act(x, g, g, out, silu=1)
    with pytest.raises(ValueError, match="scale must have shape"):
        K.affine_act(x, g[:8], g, out)
    with pytest.raises(ValueError, match="out overlaps scale"):
        big = np.zeros((2, 32), np.float32)
        K.affine_act(big, big[0], g, big)
    with pytest.raises(ValueError, match=r"im2col3x3: x must be \[H\*W, C\] = \[15"):
        K.im2col3x3(x, 3, 5, np.empty((15, 288), np.float32))
    with pytest.raises(ValueError, match=r"panel must have shape \(12, 288\)"):
        K.im2col3x3(x, 3, 4, np.empty((12, 287), np.float32))
    with pytest.raises(ValueError, match="H must be >= 1"):
        K.im2col3x3(x, 0, 4, np.empty((0, 288), np.float32))
    # H * W must not wrap in C: 20 * 922337203685477581 is 2^64 + 4, which would pass for 4 rows
    with pytest.raises(ValueError, match="W = 922337203685477581 is too large"):
        K.im2col3x3(np.zeros((4, 32), np.float32), 20, 922337203685477581,
                    np.empty((4, 288), np.float32))
    with pytest.raises(ValueError, match=r"band \[0, 49\) for output pixels"):
        K.im2col3x3(x, 3, 4, np.empty((49, 288), np.float32), 0, 49, upsample=True)
    with pytest.raises(ValueError, match="panel overlaps x"):
        y = np.zeros((12 * 10, 32), np.float32)
        K.im2col3x3(y[:12], 3, 4, y.reshape(-1)[:12 * 288].reshape(12, 288))
    w = np.zeros((4, 288), np.float32)
    with pytest.raises(ValueError, match=r"conv3x3_bf16: x must be \[H\*W, C\] = \[15"):
        K.conv3x3_bf16(x, 3, 5, w, "F32", np.empty((15, 4), np.float32))
    with pytest.raises(ValueError, match="conv3x3_bf16"):            # w rows of 9*C = 288
        K.conv3x3_bf16(x, 3, 4, w[:, :280].copy(), "F32", np.empty((12, 4), np.float32))
    with pytest.raises(ValueError, match=r"conv3x3_bf16: out must have shape \(48, 4\)"):
        K.conv3x3_bf16(x, 3, 4, w, "F32", np.empty((12, 4), np.float32), upsample=True)
    with pytest.raises(ValueError, match=r"band \[0, 13\) for output pixels"):
        K.conv3x3_bf16(x, 3, 4, w, "F32", np.empty((12, 4), np.float32), 0, 13)
    with pytest.raises(TypeError, match="upsample must be a bool"):
        K.conv3x3_bf16(x, 3, 4, w, "F32", np.empty((12, 4), np.float32), upsample=1)
    with pytest.raises(TypeError, match="conv3x3: upsample must be a bool"):
        K.conv3x3(x, 3, 4, w, "F32", np.empty((12, 4), np.float32), upsample=1)
    with pytest.raises(ValueError, match=r"conv3x3: band \[2, 1\) for output pixels"):
        K.conv3x3(x, 3, 4, w, "F32", np.empty((12, 4), np.float32), 2, 1)
    with pytest.raises(ValueError, match=r"conv3x3: out must have shape \(12, 4\)"):
        K.conv3x3(x, 3, 4, w, "F32", np.empty((12, 5), np.float32))
    with pytest.raises(ValueError, match="bias"):
        K.conv3x3_bf16(x, 3, 4, w, "F32", np.empty((12, 4), np.float32),
                       bias=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="out must not overlap x"):
        y = np.zeros(12 * 32, np.float32)
        K.conv3x3_bf16(y.reshape(12, 32), 3, 4, w, "F32", y[:48].reshape(12, 4))
    with pytest.raises((ValueError, TypeError), match="wtype|type"):
        K.conv3x3_bf16(x, 3, 4, w, "Q9_9", np.empty((12, 4), np.float32))
    with pytest.raises(ValueError, match=r"conv3x3: the weight's rows hold 9\*C = 27 values"):
        K.conv3x3(np.zeros((12, 3), np.float32), 3, 4, np.zeros((4, 34), np.uint8), "Q8_0",
                  np.empty((12, 4), np.float32))
    with pytest.raises(ValueError, match=r"upsample_nearest2x: out must have shape \(48, 32\)"):
        K.upsample_nearest2x(x, 3, 4, np.empty((12, 32), np.float32))
    with pytest.raises(ValueError, match="add: b must have the shape"):
        K.add(x, x[:3], out)
    with pytest.raises(ValueError, match="out overlaps a"):
        K.add(x[1:], x[1:], x[:11])
