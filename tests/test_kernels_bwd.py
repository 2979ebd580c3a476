"""Tests of the backward kernels in nxhpc._kernels: rmsnorm_backward, rope_backward,
qknorm_rope_backward, swiglu_backward, gated_residual_backward, attention_backward, sum_partials.

Oracles, all independent of the C code:
  1. central finite differences of plain float64 numpy forwards written in this file
     (directional derivatives along random directions, and per element at tiny sizes);
  2. torch.autograd in float64 at realistic sizes (head_dim 128);
  3. the generic variant, for the SIMD variants (bit for bit where nx_bwd.h promises it).
Negative controls: a deliberately wrong gradient (doubled, forward rotation instead of the
transposed one, missing softmax row-sum term, missing sech^2, silu' replaced by sigmoid, no
projection in RMSNorm) must fail the very same check.

Finite-difference error model (h = 2^-14, inputs O(1)): fd(h) = L'(x)v + c h^2 + O(h^4), so the
truncation error is bounded by |fd(h) - fd(2h)| (= 3|c|h^2 to leading order: a 3x margin); each
float64 evaluation of L is a sum of n terms with relative error <= n*2^-53, so the roundoff of the
difference quotient is <= 2*n*2^-53*sum|terms| / (2h). The kernel's own float32 error enters as
sum_i bound_i * |v_i| with the per-element bounds derived next to each kernel (u = 2^-24).
"""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from kernelutil import assert_bitwise, assert_within, isa_chain
from nxhpc import _kernels as K

ISAS = K.supported_isas()
SIMD_ISAS = [i for i in ISAS if i != "generic"]
U = 2.0 ** -24          # float32 unit roundoff
E64 = 2.0 ** -53        # float64 unit roundoff
TINY = 2.0 ** -149 * 4  # a few float32 subnormal ulps
H_FD = 2.0 ** -14       # finite-difference step


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def d64(a):
    return np.asarray(a, dtype=np.float64)





def rope_pe(rng, T, hd, rotation=True):
    """[T, hd/2, 2, 2]: real rotations [[cos, -sin], [sin, cos]] (docs/block.md) or a general matrix."""
    if not rotation:
        return f32(rng, T, hd // 2, 2, 2)
    ang = (np.arange(T)[:, None] * 256.0 ** (-2.0 * np.arange(hd // 2) / hd)
           + rng.uniform(0, 2 * np.pi, (1, hd // 2)))
    c, s = np.cos(ang), np.sin(ang)
    return np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2).astype(np.float32)


# ----------------------------------------------------------------------------- float64 forwards

def rms64(x, w, eps, mod=None):
    inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    y = x * inv * w
    return y * mod if mod is not None else y


def rope64(x, pe):
    """out[..., t, 2i+r] = pe[t,i,r,0] x[2i] + pe[t,i,r,1] x[2i+1]; x [..., T, hd]."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty(np.broadcast_shapes(x.shape, x.shape), dtype=np.result_type(x, pe))
    out[..., 0::2] = pe[:, :, 0, 0] * x0 + pe[:, :, 0, 1] * x1
    out[..., 1::2] = pe[:, :, 1, 0] * x0 + pe[:, :, 1, 1] * x1
    return out


def qknorm64(qkv, q_w, k_w, pe, H, KVH, eps):
    T = qkv.shape[0]
    hd = qkv.shape[1] // (H + 2 * KVH)
    heads = qkv.reshape(T, H + 2 * KVH, hd).transpose(1, 0, 2)
    return (rope64(rms64(heads[:H], q_w, eps), pe), rope64(rms64(heads[H:H + KVH], k_w, eps), pe))


def softmax_rows64(q, k, scale, mask):
    """P [H, T, T] in float64 for q [H,T,hd], k [KVH,T,hd] (GQA by repetition); masked keys 0;
    a row with every key masked is all zeros."""
    group = q.shape[0] // k.shape[0]
    s = scale * (q @ np.repeat(k, group, axis=0).transpose(0, 2, 1))
    if mask is not None:
        s = np.where(mask[None, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return np.divide(p, l, out=np.zeros_like(p), where=l > 0)


def attn64(q, k, v, scale, mask=None):
    group = q.shape[0] // k.shape[0]
    return softmax_rows64(q, k, scale, mask) @ np.repeat(v, group, axis=0)


def silu64(x):
    return x / (1.0 + np.exp(-x))


# ----------------------------------------------------------------------------- finite differences

def fd_dir(L, xs, vs, h):
    return (L(*[x + h * v for x, v in zip(xs, vs)]) - L(*[x - h * v for x, v in zip(xs, vs)])) / (2 * h)


def fd_tol(L, xs, vs, labs, n_ops, h=H_FD):
    """(fd(h), error bound of fd(h)) per the model in the module docstring."""
    f1, f2 = fd_dir(L, xs, vs, h), fd_dir(L, xs, vs, 2 * h)
    return f1, abs(f1 - f2) + 2 * n_ops * E64 * labs / (2 * h)


def gradcheck_dirs(L, labs, n_ops, xs, grads, bounds, rng, n_dirs=3, wrong=None):
    """Directional check: |fd - sum <g_i, v_i>| <= fd error + sum <bound_i, |v_i|> for random v.
    `wrong`: list of alternative gradient lists that must FAIL the same check (negative controls).
    """
    for _ in range(n_dirs):
        vs = [rng.standard_normal(x.shape) for x in xs]
        fd, tol = fd_tol(L, xs, vs, labs, n_ops)
        kerr = sum(float((d64(b) * np.abs(v)).sum()) for b, v in zip(bounds, vs))
        pred = sum(float((d64(g) * v).sum()) for g, v in zip(grads, vs))
        assert abs(fd - pred) <= tol + kerr, (
            f"gradcheck: fd {fd!r} vs kernel {pred!r}: diff {abs(fd - pred):.3g} > "
            f"fd tol {tol:.3g} + kernel bound {kerr:.3g}")
        for bad in wrong or []:
            pw = sum(float((d64(g) * v).sum()) for g, v in zip(bad, vs))
            assert abs(fd - pw) > tol + kerr, "negative control passed the gradient check"


def gradcheck_elems(L, labs, n_ops, xs, grads, bounds):
    """Per-element check along every unit direction (tiny sizes only)."""
    for i, x in enumerate(xs):
        for idx in np.ndindex(x.shape):
            vs = [np.zeros_like(y) for y in xs]
            vs[i][idx] = 1.0
            fd, tol = fd_tol(L, xs, vs, labs, n_ops)
            g, b = float(grads[i][idx]), float(bounds[i][idx])
            assert abs(fd - g) <= tol + b, f"input {i} element {idx}: fd {fd!r} vs kernel {g!r}"


# ----------------------------------------------------------------------------- error bounds

def rms_bwd_bounds(x, w, dy, eps, mod=None):
    """Per-element bounds for the float64-internal rmsnorm_backward rounded once to float32:
    |err| <= (u + 8*D*2^-53) * inv * (|g| + |x| inv^2 sum|g x| / D) for dx, and
    (u + 8*T*2^-53) * sum_r |dy xhat mod| (resp. |w|) for dw (dmod)."""
    x, w, dy = d64(x), d64(w), d64(dy)
    T, D = x.shape
    m = d64(mod) if mod is not None else np.ones_like(w)
    inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = np.abs(dy * w * m)
    bdx = (U + 8 * D * E64) * inv * (g + np.abs(x) * inv ** 2 * (g * np.abs(x)).sum(-1, keepdims=True) / D)
    hx = np.abs(dy * x * inv)
    bdw = (U + 8 * (T + 2) * E64) * (hx * np.abs(m)).sum(0)
    bdm = (U + 8 * (T + 2) * E64) * (hx * np.abs(w)).sum(0)
    return bdx + TINY, bdw + TINY, bdm + TINY


def rope_bwd_bound(dy, pe):
    """fl(fl(a) + fl(b)) with a, b products: |err| <= 2u(|a| + |b|) + O(u^2)."""
    a = np.abs(rope64(np.abs(d64(dy)), np.abs(d64(pe)).transpose(0, 1, 3, 2)))
    return (2 * U + 4 * U * U) * a + TINY


def swiglu_bwd_bounds(a, b, dout):
    """Rounding count of nx_bwd.c's evaluation (e = exp(-|x|) <= 2 ulp = 4u relative; 1 + e,
    1/(.), e*d, x*s, x*sc, 1 + (.), s*(.), dout*b, (.)*dsilu: one u each): s, 1 - s carry <= 7u,
    silu <= 8u, db <= 9u; 1 + x*sc <= (8u)(1 + |x sc|) absolute; dsilu <= 16u * s(1 + |x sc|);
    da <= 18u * |dout b| s (1 + |x sc|). Bounds used: 32u and 16u (2x margin for the O(u^2)
    terms and the exp bound), plus an absolute floor for a subnormal e (x < -87)."""
    x, b, g = d64(a), d64(b), d64(dout)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-x))
    sc = 1.0 - s
    floor = 2.0 ** -146 * (1 + np.abs(x))
    bda = 32 * U * np.abs(g * b) * s * (1 + np.abs(x) * sc) + np.abs(g * b) * floor + TINY
    bdb = 16 * U * np.abs(g * x * s) + np.abs(g) * floor + TINY
    return bda, bdb


def gated_bwd_bounds(y, gate, dout):
    """dy = dout * fl(tanh): 2u|dout tanh| (+u^2); dgate: float64 row sum (T+4 ulps of
    sum|dout y|) times sech^2, rounded once: (u + (T+4)*2^-53) sech^2 sum|dout y|."""
    y, gt, g = d64(y), d64(gate), d64(dout)
    T = y.shape[0]
    bdy = (2 * U + 2 * U * U) * np.abs(g * np.tanh(gt)) + TINY
    with np.errstate(over="ignore"):  # cosh overflows to inf: sech^2 = 0
        bdg = (U + (T + 4) * E64) * (np.abs(g * y).sum(0) / np.cosh(gt) ** 2) + TINY
    return bdy, bdg


def attn_bwd_bounds(q, k, v, dout, scale, mask, u):
    """First-order error bounds for attention_backward whose arithmetic has unit roundoff `u`
    (float32: 2^-24 for the SIMD variant; 2^-53 for the float64 generic), element-wise:
      score s = scale q.k: es = (hd + 2) u scale |q||k|;  row max error <= max_j es
      P = exp(s - m) / l: rel err <= es_j + 3 max_j es + (T + 9) u   (exp 2 ulp, sum, divide)
      dP = dO.v: edP = (hd + 1) u |dO||v|;  Delta = sum P dP: eDelta = sum(eP|dP| + P edP) + (T+1) u sum P|dP|
      dS = P (dP - Delta): edS = eP |dP - Delta| + P (edP + eDelta) + 3u P |dP - Delta|
      dq = scale dS K: scale (edS |K| + (T + 2) u |dS||K|);  dk, dv likewise over group*T terms.
    Returned x2 to cover the second-order terms."""
    q, k, v, dout = d64(q), d64(k), d64(v), d64(dout)
    H, T, hd = q.shape
    KVH = k.shape[0]
    group = H // KVH
    kk, vv = np.repeat(k, group, 0), np.repeat(v, group, 0)
    P = softmax_rows64(q, k, scale, mask)
    live = (P > 0)
    es = (hd + 2) * u * abs(scale) * (np.abs(q) @ np.abs(kk).transpose(0, 2, 1))
    es_max = np.where(live, es, 0).max(-1, keepdims=True)
    eP = P * (es + 3 * es_max + (T + 9) * u)
    dP = dout @ vv.transpose(0, 2, 1)
    edP = (hd + 1) * u * (np.abs(dout) @ np.abs(vv).transpose(0, 2, 1))
    delta = (P * dP).sum(-1, keepdims=True)
    eDelta = (eP * np.abs(dP) + P * edP).sum(-1, keepdims=True) + (T + 1) * u * (P * np.abs(dP)).sum(-1, keepdims=True)
    r = np.abs(dP - delta)
    edS = eP * r + P * (edP + eDelta) + 3 * u * P * r
    adS = P * (np.abs(dP) + np.abs(delta))
    edq = abs(scale) * (edS @ np.abs(kk) + (T + 2) * u * adS @ np.abs(kk))
    edk_h = abs(scale) * (edS.transpose(0, 2, 1) @ np.abs(q) + (group * T + 2) * u * adS.transpose(0, 2, 1) @ np.abs(q))
    edv_h = eP.transpose(0, 2, 1) @ np.abs(dout) + (group * T + 1) * u * P.transpose(0, 2, 1) @ np.abs(dout)
    edk = edk_h.reshape(KVH, group, T, hd).sum(1)
    edv = edv_h.reshape(KVH, group, T, hd).sum(1)
    return 2 * edq + TINY, 2 * edk + TINY, 2 * edv + TINY


def attn_bounds_for(isa, q, k, v, dout, scale, mask, grads):
    """generic: float64 arithmetic rounded once (u|g| + the float64 first-order bound);
    SIMD: the float32 bound."""
    if _variant("attention_backward", isa) == "generic":
        b64 = attn_bwd_bounds(q, k, v, dout, scale, mask, 4 * E64)
        return [bb + U * np.abs(d64(g)) for bb, g in zip(b64, grads)]
    return list(attn_bwd_bounds(q, k, v, dout, scale, mask, U))


def _variant(family, isa):
    return K._bwd_variant_name({"rmsnorm_backward": 0, "rope_backward": 1,
                                "qknorm_rope_backward": 2, "swiglu_backward": 3,
                                "gated_residual_backward": 4, "attention_backward": 5}[family],
                               K.ISA_NAMES.index(isa))


# ----------------------------------------------------------------------------- rmsnorm

def run_rms(x, w, dy, eps, mod=None, isa=None, **kw):
    dx = np.empty_like(x)
    D = x.shape[1]
    dw = np.empty(D, np.float32)
    dmod = np.empty(D, np.float32) if mod is not None else None
    K.rmsnorm_backward(x, w, dy, dx, eps, mod=mod, dw=dw, dmod=dmod, isa=isa, **kw)
    return dx, dw, dmod


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,D,use_mod,eps", [(3, 7, True, 1e-5), (4, 33, False, 1e-6),
                                             (2, 64, True, 0.0), (5, 16, True, 0.5)])
def test_rmsnorm_backward_gradcheck(isa, T, D, use_mod, eps):
    eps = float(np.float32(eps))  # the kernel takes eps as float32
    rng = np.random.default_rng(T * 100 + D)
    x, w, dy = f32(rng, T, D), f32(rng, D), f32(rng, T, D)
    mod = (1 + f32(rng, D, scale=0.3)) if use_mod else None
    dx, dw, dmod = run_rms(x, w, dy, eps, mod, isa)
    bdx, bdw, bdm = rms_bwd_bounds(x, w, dy, eps, mod)
    dy64, m64 = d64(dy), (d64(mod) if use_mod else None)

    if use_mod:
        def L(x_, w_, m_):
            return float((dy64 * rms64(x_, w_, eps, m_)).sum())
        xs, grads, bounds = [d64(x), d64(w), m64], [dx, dw, dmod], [bdx, bdw, bdm]
        wrong = [[2 * dx, dw, dmod], [dx, dw, 2 * dmod]]
    else:
        def L(x_, w_):
            return float((dy64 * rms64(x_, w_, eps)).sum())
        xs, grads, bounds = [d64(x), d64(w)], [dx, dw], [bdx, bdw]
        wrong = [[2 * dx, dw], [dx, 2 * dw]]
    labs = float((np.abs(dy64) * np.abs(rms64(d64(x), d64(w), eps, m64))).sum())
    gradcheck_dirs(L, labs, T * D + 2 * D + 10, xs, grads, bounds, rng, wrong=wrong)
    # each input alone, so a wrong gradient of one cannot hide behind another
    for i in range(len(xs)):
        def Li(xi, i=i):
            return L(*[xi if j == i else xs[j] for j in range(len(xs))])
        gradcheck_dirs(Li, labs, T * D + 2 * D + 10, [xs[i]], [grads[i]], [bounds[i]], rng,
                       n_dirs=1, wrong=[[2 * grads[i]]])


def test_rmsnorm_backward_elementwise_tiny():
    rng = np.random.default_rng(5)
    x, w, dy, mod = f32(rng, 2, 5), f32(rng, 5), f32(rng, 2, 5), 1 + f32(rng, 5, scale=0.3)
    eps = float(np.float32(1e-5))
    for isa in ISAS:
        dx, dw, dmod = run_rms(x, w, dy, eps, mod, isa)
        bounds = rms_bwd_bounds(x, w, dy, eps, mod)

        def L(x_, w_, m_):
            return float((d64(dy) * rms64(x_, w_, eps, m_)).sum())
        labs = float((np.abs(d64(dy) * rms64(d64(x), d64(w), eps, d64(mod)))).sum())
        gradcheck_elems(L, labs, 40, [d64(x), d64(w), d64(mod)], [dx, dw, dmod], bounds)


def torch_grads(fn, inputs, upstream):
    """float64 torch.autograd: gradients of sum(upstream_i * fn(inputs)_i) w.r.t. each input."""
    ts = [torch.tensor(d64(a), requires_grad=True) for a in inputs]
    outs = fn(*ts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * torch.tensor(d64(g))).sum() for o, g in zip(outs, upstream))
    loss.backward()
    return [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm_backward_vs_torch(isa):
    rng = np.random.default_rng(11)
    T, D, eps = 6, 384, float(np.float32(1e-5))
    x, w, dy, mod = f32(rng, T, D, scale=3.0), f32(rng, D), f32(rng, T, D), 1 + f32(rng, D, scale=0.2)
    dx, dw, dmod = run_rms(x, w, dy, eps, mod, isa)
    ref = torch_grads(lambda x_, w_, m_: x_ * torch.rsqrt((x_ * x_).mean(-1, keepdim=True) + eps) * w_ * m_,
                      [x, w, mod], [dy])
    for got, r, b, name in zip((dx, dw, dmod), ref, rms_bwd_bounds(x, w, dy, eps, mod), "dx dw dmod".split()):
        assert_within(got, r, b, f"{name}[{isa}]")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.1])
def test_rmsnorm_backward_scale_invariance(isa, eps):
    """sum_i dx_i x_i = inv * S * eps / (ms + eps) with S = sum g x (exactly 0 for eps = 0):
    y(c x) = y(x) when eps = 0, so the gradient is orthogonal to x. The kernel's value is within
    sum_i |x_i| bound_i (+ float64 dot roundoff) of it; a gradient without the projection term
    (inv * g, the classic mistake) must fail."""
    eps = float(np.float32(eps))  # the kernel takes eps as float32
    rng = np.random.default_rng(3)
    T, D = 4, 96
    x, w, dy = f32(rng, T, D, scale=2.0), f32(rng, D), f32(rng, T, D)
    dx, _, _ = run_rms(x, w, dy, eps, None, isa)
    x64, g = d64(x), d64(dy) * d64(w)
    ms = (x64 * x64).mean(-1)
    inv = 1.0 / np.sqrt(ms + eps)
    expect = inv * (g * x64).sum(-1) * eps / (ms + eps)
    got = (d64(dx) * x64).sum(-1)
    bound = (np.abs(x64) * rms_bwd_bounds(x, w, dy, eps)[0]).sum(-1) \
        + 2 * D * E64 * np.abs(d64(dx) * x64).sum(-1)
    assert (np.abs(got - expect) <= bound).all(), (got, expect, bound)
    if eps == 0.0:
        assert (np.abs(got) <= bound).all()
    naive = (inv[:, None] * g * x64).sum(-1)  # negative control: no projection
    assert (np.abs(naive - expect) > bound).all()


@pytest.mark.parametrize("isa", ISAS)
def test_rmsnorm_backward_bands_partials_inplace(isa):
    rng = np.random.default_rng(8)
    T, D = 37, 50
    x, w, dy, mod = f32(rng, T, D), f32(rng, D), f32(rng, T, D), 1 + f32(rng, D, scale=0.2)
    full_dx, full_dw, full_dm = run_rms(x, w, dy, 1e-6, mod, isa)
    for cuts in ([0, 37], [0, 1, 36, 37], [0, 10, 11, 30, 37], [0, 5, 5, 37]):
        dx = np.full_like(x, np.nan)
        parts_w = np.empty((len(cuts) - 1, D), np.float32)
        parts_m = np.empty((len(cuts) - 1, D), np.float32)
        for bnd, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            K.rmsnorm_backward(x, w, dy, dx, 1e-6, mod=mod, dw=parts_w[bnd], r0=a, r1=b,
                               isa=isa, dmod=parts_m[bnd])
        assert_bitwise(dx, full_dx, f"dx bands {cuts}")
        tot_w, tot_m = np.empty(D, np.float32), np.empty(D, np.float32)
        K.sum_partials(parts_w, tot_w)
        K.sum_partials(parts_m, tot_m)
        _, bdw, bdm = rms_bwd_bounds(x, w, dy, 1e-6, mod)
        nb = len(cuts) - 1  # each partial rounded once, then a float64 sum rounded once
        assert_within(tot_w, d64(full_dw), (nb + 2) * bdw, "dw from partials")
        assert_within(tot_m, d64(full_dm), (nb + 2) * bdm, "dmod from partials")
    dx = np.full_like(x, 7.0)
    K.rmsnorm_backward(x, w, dy, dx, 1e-6, mod=mod, r0=3, r1=9, isa=isa)
    assert (dx[:3] == 7).all() and (dx[9:] == 7).all()
    assert_bitwise(dx[3:9], full_dx[3:9], "band rows")
    for alias in ("x", "dy"):  # in place over either input
        xx, dd = x.copy(), dy.copy()
        out = xx if alias == "x" else dd
        K.rmsnorm_backward(xx, w, dd, out, 1e-6, mod=mod, isa=isa)
        assert_bitwise(out, full_dx, f"in place over {alias}")


def test_rmsnorm_backward_simd_bitwise():
    rng = np.random.default_rng(21)
    for T, D in ((3, 1), (2, 7), (3, 31), (2, 33), (1, 4097)):
        x, w, dy, mod = f32(rng, T, D), f32(rng, D), f32(rng, T, D), f32(rng, D)
        ref = run_rms(x, w, dy, 1e-5, mod, "generic")
        ref_nm = run_rms(x, w, dy, 1e-5, None, "generic")
        for isa in SIMD_ISAS:
            for got, r, n in zip(run_rms(x, w, dy, 1e-5, mod, isa), ref, ("dx", "dw", "dmod")):
                assert_bitwise(got, r, f"{n} {isa} D={D}")
            for got, r, n in zip(run_rms(x, w, dy, 1e-5, None, isa)[:2], ref_nm[:2], ("dx", "dw")):
                assert_bitwise(got, r, f"{n} no mod {isa} D={D}")


def test_sum_partials_fixed_order():
    rng = np.random.default_rng(2)
    p = f32(rng, 9, 40, scale=1e4)
    p[3] = -p[2]  # cancellation: order matters in float32, not here
    out = np.empty(40, np.float32)
    K.sum_partials(p, out)
    acc = np.zeros(40)
    for row in p:  # float64 accumulation in ascending band order, rounded once
        acc += d64(row)
    assert_bitwise(out, acc.astype(np.float32), "sum_partials")


# ----------------------------------------------------------------------------- rope

def run_rope(dy, pe, isa=None, **kw):
    dx = np.empty_like(dy)
    K.rope_backward(dy, pe, dx, isa=isa, **kw)
    return dx


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape,rotation", [((5, 8), True), ((3, 6, 34), True), ((2, 4, 128), True),
                                            ((3, 5, 18), False)])
def test_rope_backward_gradcheck(isa, shape, rotation):
    """Includes a general (non-rotation) pe: the backward is the transpose, not the inverse. The
    forward rotation applied to dy (the kernel fed pe with its 2x2 blocks transposed) must fail."""
    rng = np.random.default_rng(sum(shape))
    T, hd = shape[-2], shape[-1]
    x, dy, pe = f32(rng, *shape), f32(rng, *shape), rope_pe(rng, T, hd, rotation)
    dx = run_rope(dy, pe, isa)
    fwd_rot = run_rope(dy, np.ascontiguousarray(pe.transpose(0, 1, 3, 2)), isa)
    bound = rope_bwd_bound(dy, pe)
    L = lambda x_: float((d64(dy) * rope64(x_, d64(pe))).sum())  # noqa: E731
    labs = float((np.abs(d64(dy)) * rope64(np.abs(d64(x)), np.abs(d64(pe)))).sum())
    gradcheck_dirs(L, labs, x.size + 4, [d64(x)], [dx], [bound], rng,
                   wrong=[[fwd_rot], [2 * dx]])


def test_rope_backward_elementwise_tiny_and_torch():
    rng = np.random.default_rng(4)
    T, hd = 2, 4
    x, dy, pe = f32(rng, T, hd), f32(rng, T, hd), rope_pe(rng, T, hd, rotation=False)
    L = lambda x_: float((d64(dy) * rope64(x_, d64(pe))).sum())  # noqa: E731
    labs = float((np.abs(d64(dy)) * rope64(np.abs(d64(x)), np.abs(d64(pe)))).sum())
    for isa in ISAS:
        gradcheck_elems(L, labs, 12, [d64(x)], [run_rope(dy, pe, isa)], [rope_bwd_bound(dy, pe)])
    # torch at head_dim 128 with real rotations, [n, T, hd] layout
    x, dy, pe = f32(rng, 3, 9, 128), f32(rng, 3, 9, 128), rope_pe(rng, 9, 128)
    pt = torch.tensor(d64(pe))

    def fwd(x_):
        o0 = pt[:, :, 0, 0] * x_[..., 0::2] + pt[:, :, 0, 1] * x_[..., 1::2]
        o1 = pt[:, :, 1, 0] * x_[..., 0::2] + pt[:, :, 1, 1] * x_[..., 1::2]
        return torch.stack([o0, o1], -1).reshape(x_.shape)
    ref, = torch_grads(fwd, [x], [dy])
    for isa in ISAS:
        assert_within(run_rope(dy, pe, isa), ref, rope_bwd_bound(dy, pe), f"rope vs torch [{isa}]")


@pytest.mark.parametrize("isa", ISAS)
def test_rope_backward_bands_inplace_and_simd_bitwise(isa):
    rng = np.random.default_rng(6)
    for hd in (2, 14, 16, 34, 128):
        dy, pe = f32(rng, 3, 7, hd), rope_pe(rng, 7, hd, rotation=False)
        full = run_rope(dy, pe, isa)
        assert_bitwise(full, run_rope(dy, pe, "generic"), f"{isa} vs generic hd={hd}")
        out = np.full_like(dy, np.nan)
        for a, b in ((0, 4), (4, 4), (4, 20), (20, 21)):
            K.rope_backward(dy, pe, out, r0=a, r1=b, isa=isa)
        assert_bitwise(out, full, "bands")
        out = np.full_like(dy, 5.0)
        K.rope_backward(dy, pe, out, r0=8, r1=10, isa=isa)
        flat = out.reshape(-1, hd)
        assert (np.delete(flat, [8, 9], axis=0) == 5).all()
        d2 = dy.copy()
        K.rope_backward(d2, pe, d2, isa=isa)
        assert_bitwise(d2, full, "in place")


# ----------------------------------------------------------------------------- qknorm + rope

def qk_bounds(qkv, q_w, k_w, pe, dq, dk, H, KVH, eps):
    """Per-element bounds (float64 inside, one rounding): like rmsnorm_backward with
    |g| <= |w| (|pe0 d0| + |pe1 d1|)."""
    T = qkv.shape[0]
    hd = qkv.shape[1] // (H + 2 * KVH)
    heads = d64(qkv).reshape(T, H + 2 * KVH, hd).transpose(1, 0, 2)
    ad = np.concatenate([d64(dq), d64(dk)])
    agr = rope64(np.abs(ad), np.abs(d64(pe)).transpose(0, 1, 3, 2))
    x = heads[:H + KVH]
    wts = np.concatenate([np.repeat(d64(q_w)[None], H, 0), np.repeat(d64(k_w)[None], KVH, 0)])[:, None, :]
    inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    g = agr * np.abs(wts)
    b = (U + 8 * hd * E64) * inv * (g + np.abs(x) * inv ** 2 * (g * np.abs(x)).sum(-1, keepdims=True) / hd)
    bqkv = np.zeros((T, H + 2 * KVH, hd))
    bqkv[:, :H + KVH] = b.transpose(1, 0, 2)
    hx = agr * np.abs(x) * inv
    c = U + 8 * (T * (H + KVH) + 2) * E64
    return bqkv.reshape(T, -1) + TINY, c * hx[:H].sum((0, 1)) + TINY, c * hx[H:].sum((0, 1)) + TINY


def run_qk(qkv, q_w, k_w, pe, dq, dk, H, KVH, eps, isa=None, **kw):
    out = np.zeros_like(qkv)
    hd = q_w.shape[0]
    dqw, dkw = np.empty(hd, np.float32), np.empty(hd, np.float32)
    K.qknorm_rope_backward(qkv, q_w, k_w, pe, dq, dk, out, H, KVH, eps, dq_w=dqw, dk_w=dkw,
                           isa=isa, **kw)
    return out, dqw, dkw


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,H,KVH,hd", [(3, 2, 1, 8), (2, 3, 3, 128), (4, 4, 2, 18)])
def test_qknorm_rope_backward_gradcheck_and_torch(isa, T, H, KVH, hd):
    rng = np.random.default_rng(T + H + hd)
    eps = float(np.float32(1e-5))
    W = (H + 2 * KVH) * hd
    qkv, q_w, k_w = f32(rng, T, W, scale=2.0), f32(rng, hd), f32(rng, hd)
    pe, dq, dk = rope_pe(rng, T, hd), f32(rng, H, T, hd), f32(rng, KVH, T, hd)
    dqkv, dqw, dkw = run_qk(qkv, q_w, k_w, pe, dq, dk, H, KVH, eps, isa)
    assert (dqkv[:, (H + KVH) * hd:] == 0).all()  # v columns untouched
    bq, bqw, bkw = qk_bounds(qkv, q_w, k_w, pe, dq, dk, H, KVH, eps)

    def L(x_, qw_, kw_):
        q, k = qknorm64(x_, qw_, kw_, d64(pe), H, KVH, eps)
        return float((d64(dq) * q).sum() + (d64(dk) * k).sum())
    q, k = qknorm64(d64(qkv), d64(q_w), d64(k_w), d64(pe), H, KVH, eps)
    labs = float(np.abs(d64(dq) * q).sum() + np.abs(d64(dk) * k).sum())
    wrong_rot = run_qk(qkv, q_w, k_w, np.ascontiguousarray(pe.transpose(0, 1, 3, 2)), dq, dk, H,
                       KVH, eps, isa)
    gradcheck_dirs(L, labs, qkv.size + 4 * hd, [d64(qkv), d64(q_w), d64(k_w)], [dqkv, dqw, dkw],
                   [bq, bqw, bkw], rng, wrong=[list(wrong_rot), [dqkv, 2 * dqw, dkw]])
    pt = torch.tensor(d64(pe))

    def fwd(x_, qw_, kw_):
        hds = x_.reshape(T, H + 2 * KVH, hd).transpose(0, 1)

        def nr(a, w_):
            y = a * torch.rsqrt((a * a).mean(-1, keepdim=True) + eps) * w_
            o0 = pt[:, :, 0, 0] * y[..., 0::2] + pt[:, :, 0, 1] * y[..., 1::2]
            o1 = pt[:, :, 1, 0] * y[..., 0::2] + pt[:, :, 1, 1] * y[..., 1::2]
            return torch.stack([o0, o1], -1).reshape(y.shape)
        return nr(hds[:H], qw_), nr(hds[H:H + KVH], kw_)
    ref = torch_grads(fwd, [qkv, q_w, k_w], [dq, dk])
    for got, r, b, n in zip((dqkv, dqw, dkw), ref, (bq, bqw, bkw), ("dqkv", "dq_w", "dk_w")):
        assert_within(got, r, b, f"{n} vs torch [{isa}]")


def test_qknorm_rope_backward_bands():
    rng = np.random.default_rng(9)
    T, H, KVH, hd = 5, 4, 2, 16
    qkv, q_w, k_w = f32(rng, T, (H + 2 * KVH) * hd), f32(rng, hd), f32(rng, hd)
    pe, dq, dk = rope_pe(rng, T, hd), f32(rng, H, T, hd), f32(rng, KVH, T, hd)
    full, fqw, fkw = run_qk(qkv, q_w, k_w, pe, dq, dk, H, KVH, 1e-6)
    out = np.full_like(qkv, np.nan)
    pq, pk = np.zeros((3, hd), np.float32), np.zeros((3, hd), np.float32)
    for i, (a, b) in enumerate(((0, 3), (3, 5), (5, 6))):
        K.qknorm_rope_backward(qkv, q_w, k_w, pe, dq, dk, out, H, KVH, 1e-6, dq_w=pq[i],
                               dk_w=pk[i], h0=a, h1=b)
    assert_bitwise(out[:, :(H + KVH) * hd], full[:, :(H + KVH) * hd], "bands")
    assert np.isnan(out[:, (H + KVH) * hd:]).all()  # v columns never written
    tq, tk = np.empty(hd, np.float32), np.empty(hd, np.float32)
    _, bqw, bkw = qk_bounds(qkv, q_w, k_w, pe, dq, dk, H, KVH, 1e-6)
    assert_within(K.sum_partials(pq, tq), d64(fqw), 5 * bqw, "dq_w partials")
    assert_within(K.sum_partials(pk, tk), d64(fkw), 5 * bkw, "dk_w partials")
    assert (pk[0] == 0).all() and (pq[2] == 0).all()  # bands with no k / no q heads


# ----------------------------------------------------------------------------- swiglu

def run_swiglu(a, b, g, isa=None, **kw):
    da, db = np.empty_like(a), np.empty_like(a)
    K.swiglu_backward(a, b, g, da, db, isa=isa, **kw)
    return da, db


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape,scale", [((7,), 1.0), ((3, 33), 4.0), ((2, 4, 17), 12.0)])
def test_swiglu_backward_gradcheck(isa, shape, scale):
    rng = np.random.default_rng(len(shape) * 7 + int(scale))
    a, b, g = f32(rng, *shape, scale=scale), f32(rng, *shape), f32(rng, *shape)
    da, db = run_swiglu(a, b, g, isa)
    bda, bdb = swiglu_bwd_bounds(a, b, g)
    L = lambda a_, b_: float((d64(g) * silu64(a_) * b_).sum())  # noqa: E731
    labs = float(np.abs(d64(g) * silu64(d64(a)) * d64(b)).sum())
    sig = 1.0 / (1.0 + np.exp(-d64(a)))
    wrong = [[d64(g) * d64(b) * sig, db], [da, 2 * db]]  # silu' taken as sigmoid; doubled db
    gradcheck_dirs(L, labs, a.size + 8, [d64(a), d64(b)], [da, db], [bda, bdb], rng, wrong=wrong)
    if a.size <= 7:
        gradcheck_elems(L, labs, a.size + 8, [d64(a), d64(b)], [da, db], [bda, bdb])


def test_swiglu_backward_vs_torch_and_extremes():
    rng = np.random.default_rng(12)
    a = np.concatenate([f32(rng, 4096, scale=6.0),
                        np.array([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, -100.0,
                                  -103.0, 1e30, -1e30, -3e38, -1.2785, 9.5], np.float32)])
    b, g = f32(rng, a.size), f32(rng, a.size)
    ref = torch_grads(lambda a_, b_: torch.nn.functional.silu(a_) * b_, [a, b], [g])
    bda, bdb = swiglu_bwd_bounds(a, b, g)
    outs = {}
    for isa in ISAS:
        da, db = run_swiglu(a, b, g, isa)
        assert_within(da, ref[0], bda, f"da vs torch [{isa}]")
        assert_within(db, ref[1], bdb, f"db vs torch [{isa}]")
        outs[isa] = (da, db)
    sp = np.array([np.inf, -np.inf, np.nan], np.float32)
    one = np.ones(3, np.float32)
    for isa in ISAS:  # limits: silu'(inf) = 1, silu'(-inf) = 0, silu(-inf) = 0; NaN propagates
        da, db = run_swiglu(sp, one, one, isa)
        assert da[0] == 1 and da[1] == 0 and np.isnan(da[2]), (isa, da)
        assert db[0] == np.inf and db[1] == 0 and np.isnan(db[2]), (isa, db)
    for isa in SIMD_ISAS:  # both within the bound of the truth -> within twice of each other
        assert_within(outs[isa][0], d64(outs["generic"][0]), 2 * bda, f"da {isa} vs generic")
        assert_within(outs[isa][1], d64(outs["generic"][1]), 2 * bdb, f"db {isa} vs generic")


@pytest.mark.parametrize("isa", ISAS)
def test_swiglu_backward_bands_and_aliasing(isa):
    rng = np.random.default_rng(13)
    a, b, g = f32(rng, 5, 41), f32(rng, 5, 41), f32(rng, 5, 41)
    fa, fb = run_swiglu(a, b, g, isa)
    da, db = np.full_like(a, np.nan), np.full_like(a, np.nan)
    for lo, hi in ((0, 1), (1, 17), (17, 17), (17, 200), (200, 205)):
        K.swiglu_backward(a, b, g, da, db, i0=lo, i1=hi, isa=isa)
    assert_bitwise(da, fa, "da bands")
    assert_bitwise(db, fb, "db bands")
    aa, bb = a.copy(), b.copy()
    K.swiglu_backward(aa, bb, g, aa, bb, isa=isa)  # in place over the inputs
    assert_bitwise(aa, fa, "da in place")
    assert_bitwise(bb, fb, "db in place")
    gg, bb = g.copy(), b.copy()
    K.swiglu_backward(a, bb, gg, gg, bb, isa=isa)  # da over dout, db over b
    assert_bitwise(gg, fa, "da over dout")
    assert_bitwise(bb, fb, "db over b")


# ----------------------------------------------------------------------------- gated residual

def run_gated(y, gate, g, isa=None, resid=True, **kw):
    dy = np.empty_like(y)
    dr = np.empty_like(y) if resid else None
    dgate = np.empty(y.shape[1], np.float32)
    K.gated_residual_backward(y, gate, g, dr, dy, dgate=dgate, isa=isa, **kw)
    return dr, dy, dgate


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,D,gscale", [(2, 3, 1.0), (5, 33, 2.0), (4, 70, 6.0)])
def test_gated_residual_backward_gradcheck(isa, T, D, gscale):
    rng = np.random.default_rng(T * D)
    resid, y, g, gate = f32(rng, T, D), f32(rng, T, D), f32(rng, T, D), f32(rng, D, scale=gscale)
    dr, dy, dgate = run_gated(y, gate, g, isa)
    assert_bitwise(dr, g, "dresid is dout")
    bdy, bdg = gated_bwd_bounds(y, gate, g)
    L = lambda r_, y_, gt_: float((d64(g) * (r_ + np.tanh(gt_) * y_)).sum())  # noqa: E731
    labs = float(np.abs(d64(g) * (np.abs(d64(resid)) + np.abs(np.tanh(d64(gate)) * d64(y)))).sum())
    nosech = (d64(g) * d64(y)).sum(0)  # negative control: the derivative of tanh forgotten
    xs = [d64(resid), d64(y), d64(gate)]
    grads, bounds = [dr, dy, dgate], [np.full(resid.shape, TINY), bdy, bdg]
    gradcheck_dirs(L, labs, T * D + 8, xs, grads, bounds, rng,
                   wrong=[[dr, dy, nosech], [dr, 2 * dy, dgate]])
    if T * D <= 6:
        gradcheck_elems(L, labs, T * D + 8, xs, grads, bounds)
    ref = torch_grads(lambda r_, y_, gt_: r_ + torch.tanh(gt_) * y_, [resid, y, gate], [g])
    assert_within(dy, ref[1], bdy, "dy vs torch")
    # torch differentiates tanh as 1 - tanh^2 in float64: an absolute error of ~2^-52 in sech^2
    # (all of it once |gate| > 18), so its own error, 4 * 2^-53 * sum|dout y|, joins the bound
    assert_within(dgate, ref[2], bdg + 4 * E64 * np.abs(d64(g) * d64(y)).sum(0), "dgate vs torch")


def test_gated_residual_backward_simd_bitwise_bands_saturation():
    rng = np.random.default_rng(14)
    T, D = 9, 37
    y, g = f32(rng, T, D), f32(rng, T, D)
    gate = f32(rng, D, scale=3.0)
    gate[:6] = [30.0, -30.0, 400.0, 1e30, np.inf, -np.inf]  # sech^2 underflows / is 0
    ref = run_gated(y, gate, g, "generic")
    assert (ref[2][2:6] == 0).all() and (ref[1][:, 4] == g[:, 4]).all() and (ref[1][:, 5] == -g[:, 5]).all()
    for isa in ISAS:
        got = run_gated(y, gate, g, isa)
        for a, b, n in zip(got, ref, ("dresid", "dy", "dgate")):
            assert_bitwise(a, b, f"{n} {isa}")
        dy = np.full_like(y, np.nan)
        parts = np.empty((3, D), np.float32)
        for i, (a, b) in enumerate(((0, 4), (4, 4), (4, 9))):
            K.gated_residual_backward(y, gate, g, None, dy, dgate=parts[i], r0=a, r1=b, isa=isa)
        assert_bitwise(dy, ref[1], "dy bands")
        assert (parts[1] == 0).all()
        _, bdg = gated_bwd_bounds(y, gate, g)
        tot = np.empty(D, np.float32)
        assert_within(K.sum_partials(parts, tot), d64(ref[2]), 5 * bdg, "dgate from partials")
        gg = g.copy()  # dy over dout, dresid = dout itself (no copy)
        K.gated_residual_backward(y, gate, gg, None, gg, isa=isa)
        assert_bitwise(gg, ref[1], "dy in place over dout")


# ----------------------------------------------------------------------------- attention

def attn_case(rng, H, KVH, T, hd, qscale=1.0):
    return (f32(rng, H, T, hd, scale=qscale), f32(rng, KVH, T, hd, scale=qscale),
            f32(rng, KVH, T, hd), f32(rng, H, T, hd))


def run_attn(q, k, v, dout, scale, mask=None, isa=None, **kw):
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    K.attention_backward(q, k, v, dout, dq, dk, dv, scale, mask=mask, isa=isa, **kw)
    return dq, dk, dv


def attn_no_delta(q, k, v, dout, scale, mask):
    """Negative control: dq with the softmax row-sum term dropped (dS = P * dP)."""
    q, k, v, dout = d64(q), d64(k), d64(v), d64(dout)
    group = q.shape[0] // k.shape[0]
    P = softmax_rows64(q, k, scale, mask)
    dP = dout @ np.repeat(v, group, 0).transpose(0, 2, 1)
    return scale * (P * dP) @ np.repeat(k, group, 0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,KVH,T,hd,mask_kind,qscale", [
    (2, 1, 5, 4, None, 1.0), (2, 2, 9, 16, "some", 1.0), (4, 2, 33, 24, "some", 2.0),
    (3, 1, 70, 8, "first_only", 1.0)])
def test_attention_backward_gradcheck(isa, H, KVH, T, hd, mask_kind, qscale):
    rng = np.random.default_rng(H * 1000 + T * 10 + hd)
    q, k, v, dout = attn_case(rng, H, KVH, T, hd, qscale)
    scale = float(np.float32(hd ** -0.5))  # the kernel takes scale as float32
    mask = None
    if mask_kind == "some":
        mask = rng.random(T) < 0.7
        mask[0] = True
    elif mask_kind == "first_only":
        mask = np.zeros(T, bool)
        mask[0] = True
    dq, dk, dv = run_attn(q, k, v, dout, scale, mask, isa)
    bounds = attn_bounds_for(isa, q, k, v, dout, scale, mask, (dq, dk, dv))
    if mask is not None:
        assert (dk[:, ~mask] == 0).all() and (dv[:, ~mask] == 0).all()
    do64 = d64(dout)
    L = lambda q_, k_, v_: float((do64 * attn64(q_, k_, v_, scale, mask)).sum())  # noqa: E731
    labs = float(np.abs(do64 * (softmax_rows64(d64(q), d64(k), scale, mask)
                                @ np.abs(np.repeat(d64(v), H // KVH, 0)))).sum())
    n_ops = H * T * hd + T + hd + 10
    xs = [d64(q), d64(k), d64(v)]
    wrong = [[attn_no_delta(q, k, v, dout, scale, mask), dk, dv], [dq, dk, 2 * dv],
             [dq, dk / scale, dv]]
    if mask_kind == "first_only":  # P is one-hot: dq = dk = 0 exactly, the no-delta control is void
        wrong = [[dq, dk, 2 * dv]]
        assert (dq == 0).all() and (dk == 0).all()
    gradcheck_dirs(L, labs, n_ops, xs, [dq, dk, dv], bounds, rng, wrong=wrong)
    if q.size <= 40:
        gradcheck_elems(L, labs, n_ops, xs, [dq, dk, dv], bounds)


@pytest.mark.parametrize("isa", ISAS)
def test_attention_backward_vs_torch(isa):
    """Realistic head: hd = 128, GQA (4 query heads on 2 kv heads), a key mask."""
    rng = np.random.default_rng(31)
    H, KVH, T, hd = 4, 2, 48, 128
    q, k, v, dout = attn_case(rng, H, KVH, T, hd, qscale=1.5)
    mask = rng.random(T) < 0.8
    scale = float(np.float32(hd ** -0.5))  # the kernel takes scale as float32
    dq, dk, dv = run_attn(q, k, v, dout, scale, mask, isa)
    mt = torch.tensor(mask)

    def fwd(q_, k_, v_):
        kk, vv = k_.repeat_interleave(H // KVH, 0), v_.repeat_interleave(H // KVH, 0)
        return torch.nn.functional.scaled_dot_product_attention(q_, kk, vv, attn_mask=mt, scale=scale)
    ref = torch_grads(fwd, [q, k, v], [dout])
    bounds = attn_bounds_for(isa, q, k, v, dout, scale, mask, (dq, dk, dv))
    for got, r, b, n in zip((dq, dk, dv), ref, bounds, ("dq", "dk", "dv")):
        assert_within(got, r, b, f"{n} vs torch [{isa}]")


def test_attention_backward_simd_vs_generic_and_edge_rows():
    rng = np.random.default_rng(41)
    for H, KVH, T, hd in ((2, 1, 1, 5), (2, 2, 7, 17), (6, 3, 65, 40), (2, 1, 130, 96)):
        q, k, v, dout = attn_case(rng, H, KVH, T, hd)
        mask = rng.random(T) < 0.6
        mask[-1] = True
        scale = float(np.float32(hd ** -0.5))  # the kernel takes scale as float32
        gen = run_attn(q, k, v, dout, scale, mask, "generic")
        b32 = attn_bwd_bounds(q, k, v, dout, scale, mask, U)
        for isa in SIMD_ISAS:
            for got, ref, b, n in zip(run_attn(q, k, v, dout, scale, mask, isa), gen, b32, ("dq", "dk", "dv")):
                assert_within(got, d64(ref), 2 * b, f"{n} {isa} vs generic T={T} hd={hd}")
    q, k, v, dout = attn_case(rng, 2, 1, 6, 8)
    for isa in ISAS:  # every key masked: zero gradients, no NaN
        for got in run_attn(q, k, v, dout, 0.3, np.zeros(6, bool), isa):
            assert (got == 0).all()


# (H, KVH, T, hd, mask, q/k scale): the shapes of the checks above
PIN_CASES = [(2, 1, 5, 4, None, 1.0), (2, 2, 9, 16, "some", 1.0), (4, 2, 33, 24, "some", 2.0),
             (3, 1, 70, 8, "first_only", 1.0), (4, 2, 48, 128, "some", 1.5), (2, 1, 1, 5, "some", 1.0),
             (2, 2, 7, 17, "some", 1.0), (6, 3, 65, 40, "some", 1.0), (2, 1, 130, 96, "some", 1.0)]
ATTN_BWD_PIN = 0.05


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_attention_backward_error_is_pinned_near_its_measurement(isa):
    """The formal float32 bound (attn_bwd_bounds) is a worst case, ~70x above the largest
    measured error: at hd = 128, T = 130 outputs scaled by 1 + 1e-3 still pass it. Measured
    against float64 torch.autograd on these cases (the AVX2 and AVX-512 variants alike, AMX Xeon
    family 6 model 167): max |err| / bound = 0.0148 per element. Pinned at ATTN_BWD_PIN = 0.05
    (3.4x that); the same outputs scaled by 1 + 1e-3 measured 0.77 or more on every case (the
    negative control below). The variants' bits do not depend on the CPU beyond their ISA."""
    worst = 0.0
    for H, KVH, T, hd, mask_kind, qscale in PIN_CASES:
        rng = np.random.default_rng(H * 1000 + T * 10 + hd)
        q, k, v, dout = attn_case(rng, H, KVH, T, hd, qscale)
        scale = float(np.float32(hd ** -0.5))
        mask = np.ones(T, bool)
        if mask_kind == "some":
            mask = rng.random(T) < 0.7
            mask[0] = True
        elif mask_kind == "first_only":
            mask[1:] = False
        mt = torch.tensor(mask)

        def fwd(q_, k_, v_):
            kk, vv = k_.repeat_interleave(H // KVH, 0), v_.repeat_interleave(H // KVH, 0)
            return torch.nn.functional.scaled_dot_product_attention(q_, kk, vv, attn_mask=mt, scale=scale)
        ref = torch_grads(fwd, [q, k, v], [dout])
        kmask = None if mask_kind is None else mask
        got = run_attn(q, k, v, dout, scale, kmask, isa)
        bounds = attn_bwd_bounds(q, k, v, dout, scale, kmask, U)
        for g, r, b, n in zip(got, ref, bounds, ("dq", "dk", "dv")):
            assert_within(g, r, ATTN_BWD_PIN * b, f"{n} [{isa}] {H, KVH, T, hd} pinned")
            worst = max(worst, float((np.abs(d64(g) - r) / b).max()))
        # negative control: a relative error of 1e-3 in the outputs fails the pinned check
        assert any((np.abs(d64(g) * (1 + 1e-3) - r) > ATTN_BWD_PIN * b).any()
                   for g, r, b in zip(got, ref, bounds)), (H, KVH, T, hd)
    assert worst > 0  # the check compared something: not every gradient was exact


@pytest.mark.parametrize("isa", ISAS)
def test_attention_backward_kv_head_bands(isa):
    rng = np.random.default_rng(51)
    H, KVH, T, hd = 6, 3, 21, 16
    q, k, v, dout = attn_case(rng, H, KVH, T, hd)
    full = run_attn(q, k, v, dout, 0.25, None, isa)
    outs = [np.full_like(a, np.nan) for a in (q, k, v)]
    for a, b in ((0, 1), (1, 1), (1, 3)):
        K.attention_backward(q, k, v, dout, *outs, 0.25, g0=a, g1=b, isa=isa)
    for got, ref, n in zip(outs, full, ("dq", "dk", "dv")):
        assert_bitwise(got, ref, f"{n} bands")
    outs = [np.full_like(a, 3.0) for a in (q, k, v)]
    K.attention_backward(q, k, v, dout, *outs, 0.25, g0=1, g1=2, isa=isa)
    assert (outs[0][[0, 1, 4, 5]] == 3).all() and (outs[1][[0, 2]] == 3).all()
    assert_bitwise(outs[0][2:4], full[0][2:4], "dq of kv head 1")
    assert_bitwise(outs[2][1], full[2][1], "dv of kv head 1")


# ----------------------------------------------------------------------------- variants, bad input

AVX2_FAMILIES = {"swiglu_backward", "attention_backward"}
AVX512_FAMILIES = {"rmsnorm_backward", "rope_backward", "swiglu_backward", "gated_residual_backward",
                   "attention_backward"}


def test_variants_reported():
    v = K.kernel_variants()
    fams = ("rmsnorm_backward", "rope_backward", "qknorm_rope_backward", "swiglu_backward",
            "gated_residual_backward", "attention_backward")
    best = K.cpu_features()["best_isa"]
    for f in fams:
        assert v[f] in ISAS
        if best == "generic":
            assert v[f] == "generic"
        # families without an AVX2 variant run generic for an "avx2" request
        assert _variant(f, "avx2") == ("avx2" if f in AVX2_FAMILIES else "generic"), f
        assert _variant(f, "generic") == "generic"
    if "avx512" in isa_chain(best):  # families with an AVX-512 variant (nx_bwd.h)
        for f in fams:
            assert v[f] == ("avx512" if f in AVX512_FAMILIES else "generic"), f


def _rms_args():
    rng = np.random.default_rng(0)
    return dict(x=f32(rng, 3, 8), w=f32(rng, 8), dy=f32(rng, 3, 8), dx=np.empty((3, 8), np.float32),
                eps=1e-5)


def _bad_cases():
    z = np.zeros
    f = np.float32
    rms = [
        (dict(x=z((3, 8), np.float64)), TypeError, "x must be float32"),
        (dict(x=[[1.0]]), TypeError, "x must be a numpy.ndarray"),
        (dict(x=z((3, 8, 1), f)), ValueError, "x must be 2-D"),
        (dict(x=z((3, 0), f), dx=z((3, 0), f), dy=z((3, 0), f)), ValueError, "at least one column"),
        (dict(w=z(7, f)), ValueError, "w must have shape (8,)"),
        (dict(mod=z(9, f)), ValueError, "mod must have shape (8,)"),
        (dict(dy=z((2, 8), f)), ValueError, "dy must have the shape of x"),
        (dict(dx=z((3, 9), f)), ValueError, "dx must have shape (3, 8)"),
        (dict(dx=z((8, 3), f).T), ValueError, "dx must be C-contiguous"),
        (dict(dw=z(3, f)), ValueError, "dw must have shape (8,)"),
        (dict(dmod=z(8, f)), ValueError, "dmod was given but mod is None"),
        (dict(eps=-1.0), ValueError, "eps must be a finite non-negative"),
        (dict(eps=float("nan")), ValueError, "eps must be a finite"),
        (dict(eps="1e-5"), TypeError, "eps must be a real number"),
        (dict(r0=2, r1=1), ValueError, "band [2, 1) for rows"),
        (dict(r1=4), ValueError, "out of range [0, 3]"),
        (dict(r0=1.5), TypeError, "must be integers"),
        (dict(isa="sse9"), ValueError, "isa must be None or one of"),
    ]
    return rms


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[2][:30])
def test_rmsnorm_backward_bad_input(case):
    over, exc, msg = case
    args = _rms_args()
    args.update(over)
    with pytest.raises(exc, match="rmsnorm_backward: .*" + __import__("re").escape(msg)):
        K.rmsnorm_backward(**args)


def test_bad_input_other_wrappers():
    rng = np.random.default_rng(0)
    f = np.float32
    z = np.zeros

    def raises(exc, msg, fn, *a, **kw):
        with pytest.raises(exc, match=__import__("re").escape(msg)):
            fn(*a, **kw)
    # aliasing / overlap
    a = _rms_args()
    raises(ValueError, "rmsnorm_backward: dw overlaps w", K.rmsnorm_backward, a["x"], a["w"],
           a["dy"], a["dx"], 1e-5, dw=a["w"])  # dw is w
    dxv = a["dx"]
    raises(ValueError, "outputs dx and dw overlap", K.rmsnorm_backward, a["x"], a["w"], a["dy"],
           dxv, 1e-5, dw=dxv[0])
    ro = a["dx"].copy()
    ro.flags.writeable = False
    raises(ValueError, "dx is read-only", K.rmsnorm_backward, a["x"], a["w"], a["dy"], ro, 1e-5)
    # rope
    dy, pe = f32(rng, 2, 4, 8), rope_pe(rng, 4, 8)
    raises(ValueError, "rope_backward: dy must be [T, hd] or [n, T, hd]", K.rope_backward,
           z(8, f), pe, z(8, f))
    raises(ValueError, "head_dim (last dim of dy) must be even", K.rope_backward, z((4, 7), f),
           pe, z((4, 7), f))
    raises(ValueError, "pe must have shape (4, 4, 2, 2)", K.rope_backward, dy, pe[:3].copy(),
           np.empty_like(dy))
    raises(ValueError, "dx must be 3-D, got shape (4, 8)", K.rope_backward, dy, pe, z((4, 8), f))
    buf = z(2 * 4 * 8 + 8, f)  # two views of one buffer, shifted by one row
    raises(ValueError, "dx overlaps dy", K.rope_backward, buf[:64].reshape(2, 4, 8), pe,
           buf[8:].reshape(2, 4, 8))
    raises(ValueError, "band [0, 9) for rows is out of range [0, 8]", K.rope_backward, dy, pe,
           np.empty_like(dy), r1=9)
    raises(TypeError, "pe must be float32", K.rope_backward, dy, pe.astype(np.float16),
           np.empty_like(dy))
    # qknorm_rope
    T, H, KVH, hd = 3, 2, 1, 8
    qkv, w8 = f32(rng, T, 4 * hd), f32(rng, hd)
    pe3, dq, dk = rope_pe(rng, T, hd), f32(rng, H, T, hd), f32(rng, KVH, T, hd)
    out = np.empty_like(qkv)
    Q = K.qknorm_rope_backward
    raises(ValueError, "n_heads=2 is not a multiple of n_kv_heads=3", Q, qkv, w8, w8, pe3, dq,
           dk, out, 2, 3, 1e-5)
    raises(TypeError, "n_heads must be an integer", Q, qkv, w8, w8, pe3, dq, dk, out, 2.0, 1, 1e-5)
    raises(ValueError, "n_kv_heads must be >= 1", Q, qkv, w8, w8, pe3, dq, dk, out, 2, 0, 1e-5)
    raises(ValueError, "qkv width 32 is not", Q, qkv, w8, w8, pe3, dq, dk, out, 3, 1, 1e-5)
    raises(ValueError, "k_w must have shape (8,)", Q, qkv, w8, w8[:4].copy(), pe3, dq, dk, out, H, KVH, 1e-5)
    raises(ValueError, "dq must have shape (2, 3, 8)", Q, qkv, w8, w8, pe3, dk, dk, out, H, KVH, 1e-5)
    raises(ValueError, "dk must have shape (1, 3, 8)", Q, qkv, w8, w8, pe3, dq, dq, out, H, KVH, 1e-5)
    raises(ValueError, "dqkv must have shape (3, 32)", Q, qkv, w8, w8, pe3, dq, dk, out[:2], H, KVH, 1e-5)
    raises(ValueError, "dqkv overlaps qkv", Q, qkv, w8, w8, pe3, dq, dk, qkv, H, KVH, 1e-5)
    raises(ValueError, "dq_w must have shape (8,)", Q, qkv, w8, w8, pe3, dq, dk, out, H, KVH, 1e-5,
           dq_w=z(4, f))
    raises(ValueError, "band [0, 4) for heads is out of range [0, 3]", Q, qkv, w8, w8, pe3, dq,
           dk, out, H, KVH, 1e-5, h1=4)
    # swiglu
    a3, b3 = f32(rng, 5), f32(rng, 5)
    S = K.swiglu_backward
    raises(ValueError, "b must have the shape of a (5,)", S, a3, z(4, f), a3, z(5, f), z(5, f))
    raises(ValueError, "dout must have the shape of a", S, a3, b3, z(6, f), z(5, f), z(5, f))
    raises(TypeError, "dout must be float32", S, a3, b3, z(5), z(5, f), z(5, f))
    raises(ValueError, "db must have shape (5,)", S, a3, b3, a3, z(5, f), z(4, f))
    buf = z(5, f)
    raises(ValueError, "outputs da and db overlap", S, a3, b3, b3, buf, buf)
    buf = z(6, f)
    raises(ValueError, "da overlaps a in memory (only exactly", S, buf[:5], b3, b3, buf[1:], z(5, f))
    raises(ValueError, "band [0, 6) for elements", S, a3, b3, b3, z(5, f), z(5, f), i1=6)
    # gated residual
    y, gate, g = f32(rng, 3, 4), f32(rng, 4), f32(rng, 3, 4)
    G = K.gated_residual_backward
    raises(ValueError, "gate must have shape (4,)", G, y, z(3, f), g, None, z((3, 4), f))
    raises(ValueError, "dout must have the shape of y", G, y, gate, z((2, 4), f), None, z((3, 4), f))
    raises(ValueError, "dresid overlaps y", G, y, gate, g, y, z((3, 4), f))
    raises(ValueError, "dgate overlaps gate", G, y, gate, g, None, z((3, 4), f), dgate=gate)
    raises(ValueError, "outputs dresid and dy overlap", G, y, gate, g, g, g)
    raises(ValueError, "dgate must have shape (4,)", G, y, gate, g, None, z((3, 4), f), dgate=z(3, f))
    raises(ValueError, "band [1, 5) for rows", G, y, gate, g, None, z((3, 4), f), r0=1, r1=5)
    # attention
    q, k, v, do = attn_case(rng, 4, 2, 5, 8)
    A = K.attention_backward
    e = [np.empty_like(x) for x in (q, k, v)]
    raises(ValueError, "k must be [KVH, T, hd] with H=4 a multiple of KVH", A, q, f32(rng, 3, 5, 8),
           v, do, *e, 0.3)
    raises(ValueError, "k must have shape (2, 5, 8)", A, q, f32(rng, 2, 5, 4), v, do, *e, 0.3)
    raises(ValueError, "v must have shape (2, 5, 8)", A, q, k, f32(rng, 2, 4, 8), do, *e, 0.3)
    raises(ValueError, "dout must have shape (4, 5, 8)", A, q, k, v, q[:2].copy(), *e, 0.3)
    raises(ValueError, "dv must have shape (2, 5, 8)", A, q, k, v, do, e[0], e[1], e[0], 0.3)
    raises(ValueError, "dq overlaps q", A, q, k, v, do, q, e[1], e[2], 0.3)
    raises(ValueError, "outputs dk and dv overlap", A, q, k, v, do, e[0], e[1], e[1], 0.3)
    raises(TypeError, "mask must be bool or uint8", A, q, k, v, do, *e, 0.3, mask=z(5, np.int32))
    raises(ValueError, "mask must have shape (5,)", A, q, k, v, do, *e, 0.3, mask=z(4, bool))
    raises(TypeError, "mask must be None or a numpy.ndarray", A, q, k, v, do, *e, 0.3, mask=[1] * 5)
    raises(ValueError, "scale must be a finite", A, q, k, v, do, *e, float("inf"))
    raises(ValueError, "band [0, 3) for kv heads is out of range [0, 2]", A, q, k, v, do, *e, 0.3, g1=3)
    raises(ValueError, "isa must be None or one of", A, q, k, v, do, *e, 0.3, isa="AVX512")
    # sum_partials
    raises(ValueError, "sum_partials: out must have shape (4,)", K.sum_partials, z((2, 4), f), z(3, f))
    raises(TypeError, "sum_partials: partials must be float32", K.sum_partials, z((2, 4)), z(4, f))
    p = z((2, 4), f)
    raises(ValueError, "out overlaps partials", K.sum_partials, p, p[1])


@given(T=st.integers(0, 9), D=st.integers(1, 40), data=st.data())
def test_rmsnorm_backward_any_band_split(T, D, data):
    """Property: any split of the rows into bands gives the full-range dx bit for bit."""
    rng = np.random.default_rng(T * 41 + D)
    x, w, dy = f32(rng, T, D), f32(rng, D), f32(rng, T, D)
    full = np.empty_like(x)
    K.rmsnorm_backward(x, w, dy, full, 1e-5)
    cuts = sorted(data.draw(st.lists(st.integers(0, T), max_size=4)))
    out = np.full_like(x, np.nan)
    for a, b in zip([0] + cuts, cuts + [T]):
        K.rmsnorm_backward(x, w, dy, out, 1e-5, r0=a, r1=b)
    assert_bitwise(out, full, "any split")
