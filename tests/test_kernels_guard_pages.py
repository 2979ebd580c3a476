"""No kernel touches memory outside the arrays it is given: every input and output of a call sits
against an unreadable page (PROT_NONE), once ending exactly at one and once starting exactly after
one, so a read or write of a single element past either end faults.

The other tests cannot see such an access: a read past an array returns whatever lies there (a
value the kernel may then discard, e.g. into an output's padding) and a write past it lands in
memory nobody checks. Real arrays can end at unmapped memory: a GGUF file is mapped whole, its
last tensor ends where the file does, and a read past the mapping's last page faults. Each case
runs in a child process (a fault is then a failed test, not a crashed run; faulthandler names
the case's line) and checks its outputs against the same call on ordinary arrays, bit for bit,
so the guarded call did the work. (Arrays on the "end" side are aligned only to their element
size: an aligned vector load of a caller's array would fault here too, a bug as well.)

Negative controls (2026-12-06, each alone): the AVX2 float32 attention loading whole 16-column V
blocks from 8 columns inside hd (a real over-read, which every other test let pass) fails
test_attention_...[avx2-f32]; the AVX2 q8 tile storing all 16 columns when 8 or more are its own
fails test_matmul_...[avx2-q8]; the AVX2 float64 statistics loading a row's second 8 floats
unmasked (then zeroing the lanes past the row: the same values, an over-read that
test_kernels_ops.py and test_kernels_layernorm.py let pass) fails test_ops_...[avx2] (SIGSEGV);
the AVX2 attention backward loading V rows the same way (test_kernels_bwd.py passed) fails
test_backward_...[avx2]; the AVX2 `add` storing its tail unmasked (the reviewer's) fails
test_ops_...[avx2]; test_guard_pages_fault checks the harness itself, both sides, read and
write.
"""
import os
import signal
import subprocess
import sys

import pytest

import nxhpc
from kernelutil import ISAS

TESTS = os.path.dirname(os.path.abspath(__file__))
# the children import the nxhpc this process imported (not whatever their working directory has)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(nxhpc.__file__)))

# the child's helpers: guarded copies of arrays, and a bitwise comparison
_GUARD = r'''
import ctypes, mmap, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]          # the parent's nxhpc, then tests/ (kernelutil)
import numpy as np
from nxhpc import _kernels as K
libc = ctypes.CDLL(None, use_errno=True)
PG = mmap.PAGESIZE
_keep = []

def guarded(a, side):
    """A copy of `a` whose last byte is followed (side "end") or whose first byte is preceded
    (side "start") by a PROT_NONE page."""
    a = np.ascontiguousarray(a)
    n = max(a.nbytes, 1)
    npages = (n + PG - 1) // PG
    buf = mmap.mmap(-1, (npages + 2) * PG)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    for page in (0, npages + 1):
        if libc.mprotect(ctypes.c_void_p(base + page * PG), PG, 0) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
    off = PG if side == "start" else (npages + 1) * PG - a.nbytes
    g = np.frombuffer(buf, a.dtype, count=a.size, offset=off).reshape(a.shape)
    g[...] = a
    _keep.append(buf)
    return g

def same(a, b, what):
    if a.tobytes() != b.tobytes():
        raise SystemExit(f"{what}: guarded result differs from the ordinary one")

def check(what, call, ins, outs):
    """call(**ins, **outs) on ordinary arrays, then on guarded copies of every array, each side;
    the outputs (or, with none, the returned array) compared bit for bit"""
    ref = {k: v.copy() for k, v in outs.items()}
    r = call(**ins, **ref)
    for side in ("end", "start"):
        g_out = {k: guarded(v, side) for k, v in outs.items()}
        g = call(**{k: guarded(v, side) if isinstance(v, np.ndarray) else v
                    for k, v in ins.items()}, **g_out)
        for k in outs:
            same(g_out[k], ref[k], f"{what} {k} {side}")
        if not outs:
            same(np.asarray(g), np.asarray(r), f"{what} {side}")
'''

_MATMUL = _GUARD + r'''
from kernelutil import finite_scale_blocks, gguf_bytes
fam, isa = sys.argv[3], sys.argv[4]
rng = np.random.default_rng(7)
types = [t for t in K.weight_types() if not (fam == "q8" and t in ("F32", "F16", "BF16"))]
for wtype in types:
    big = 96 if K.weight_types()[wtype]["block_elems"] <= 32 else 512   # 3 blocks of 32 / 2 of 256
    for T, KD, N, gated in ((1, 256, 1, False), (4, 256, 17, False), (5, 256, 40, True),
                            (19, big, 33, False)):
        x = rng.standard_normal((T, KD)).astype(np.float32)
        def weight():
            if wtype.endswith("_K"):
                return finite_scale_blocks(rng, wtype, N, KD)
            w = (rng.standard_normal((N, KD)) * 0.1).astype(np.float32)
            return w if wtype == "F32" else gguf_bytes(w, wtype)
        w, up = weight(), (weight() if gated else None)
        bias = None if gated else rng.standard_normal(N).astype(np.float32)  # gated: no bias
        def call(x, w, up, bias, out):
            if fam == "q8":
                return K.matmul_q8(x, w, out, wtype=wtype, bias=bias, isa=isa, up=up)
            fn = K.matmul if fam == "f32" else K.matmul_bf16
            return fn(x, w, wtype, out, bias=bias, isa=isa, up=up)
        ref = call(x, w, up, bias, np.empty((T, N), np.float32))
        for side in ("end", "start"):
            out = guarded(np.zeros((T, N), np.float32), side)
            call(guarded(x, side), guarded(w, side), None if up is None else guarded(up, side),
                 None if bias is None else guarded(bias, side), out)
            same(out, ref, f"{fam} {wtype} T={T} K={KD} N={N} gated={gated} {side}")
print("ok")
'''

_ATTENTION = _GUARD + r'''
isa, precision = sys.argv[3], sys.argv[4]
for hd in (1, 8, 24, 30, 40, 128):
    for T, H, KVH in ((1, 1, 1), (17, 2, 1), (70, 1, 1)):
        for causal, masked in ((False, False), (False, True), (True, True)):
            rng = np.random.default_rng(hd * 100 + T)
            q = rng.standard_normal((H, T, hd), dtype=np.float32)
            k = rng.standard_normal((KVH, T, hd), dtype=np.float32)
            qkv = rng.standard_normal((T, (H + 2 * KVH) * hd), dtype=np.float32)
            mask = None
            if masked:                          # key 0 kept: no row has every key masked
                mask = rng.random(T) < 0.7
                mask[0] = True
            ref = np.empty((T, H * hd), np.float32)
            K.attention(q, k, qkv, ref, KVH, hd ** -0.5, mask=mask, isa=isa, causal=causal,
                        precision=precision)
            for side in ("end", "start"):
                out = guarded(np.zeros((T, H * hd), np.float32), side)
                K.attention(guarded(q, side), guarded(k, side), guarded(qkv, side), out, KVH,
                            hd ** -0.5, mask=None if mask is None else guarded(mask, side),
                            isa=isa, causal=causal,
                            precision=precision)
                same(out, ref, f"attention hd={hd} T={T} H={H}/{KVH} causal={causal} "
                               f"masked={masked} {side}")
print("ok")
'''


_OPS = _GUARD + r"""
from kernelutil import finite_scale_blocks, gguf_bytes
isa = sys.argv[3]
rng = np.random.default_rng(11)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)


def typed(wtype, n, k):
    if wtype.endswith("_K"):
        return finite_scale_blocks(rng, wtype, n, k)
    w = f32(n, k) * 0.1
    return w if wtype == "F32" else gguf_bytes(w, wtype)

for T, D in ((1, 1), (3, 7), (5, 37)):
    check(f"rmsnorm T={T} D={D}", lambda **a: K.rmsnorm(eps=1e-6, isa=isa, **a),
          {"x": f32(T, D), "w": f32(D), "mod": f32(D)}, {"out": np.zeros((T, D), np.float32)})
    check(f"layernorm_mod T={T} D={D}", lambda **a: K.layernorm_mod(eps=1e-6, isa=isa, **a),
          {"x": f32(T, D), "mod": f32(D)}, {"out": np.zeros((T, D), np.float32)})
    check(f"swiglu T={T} D={D}", lambda **a: K.swiglu(isa=isa, **a),
          {"a": f32(T, D), "b": f32(T, D)}, {"out": np.zeros((T, D), np.float32)})
    check(f"add T={T} D={D}", lambda **a: K.add(isa=isa, **a),
          {"a": f32(T, D), "b": f32(T, D)}, {"out": np.zeros((T, D), np.float32)})
    check(f"gated_residual T={T} D={D}", lambda **a: K.gated_residual(isa=isa, **a),
          {"resid": f32(T, D), "y": f32(T, D), "gate": f32(D)}, {"out": np.zeros((T, D), np.float32)})
    check(f"norm_residual T={T} D={D}", lambda **a: K.norm_residual(eps=1e-6, isa=isa, **a),
          {"y": f32(T, D), "w": f32(D), "resid": f32(T, D), "gate": f32(D), "w2": f32(D),
           "mod2": f32(D)}, {"out": np.zeros((T, D), np.float32), "h": np.zeros((T, D), np.float32)})
    check(f"round_bf16 T={T} D={D}", lambda **a: K.round_bf16(isa=isa, **a), {"x": f32(T, D)}, {})
for T, hd in ((1, 2), (5, 6), (17, 128)):
    H, KVH = 2, 1
    for pairs in ("adjacent", "half"):
        check(f"qknorm_rope T={T} hd={hd} {pairs}",
              lambda **a: K.qknorm_rope(n_heads=H, n_kv_heads=KVH, eps=1e-6, isa=isa,
                                        rope_pairs=pairs, **a),
              {"qkv": f32(T, (H + 2 * KVH) * hd), "q_w": f32(hd), "k_w": f32(hd),
               "pe": f32(T, hd // 2, 2, 2)},
              {"q_out": np.zeros((H, T, hd), np.float32), "k_out": np.zeros((KVH, T, hd), np.float32)})
for T in (1, 3):
    x = f32(T, 64)
    check(f"q8_0_quantize T={T}", lambda **a: K.q8_0_quantize(isa=isa, **a), {"x": x},
          {"out": np.zeros_like(K.q8_0_quantize(x))})
for wtype in K.weight_types():
    for n in (1, 3):
        w = typed(wtype, n, 256)
        check(f"dequantize {wtype} n={n}", lambda **a: K.dequantize(wtype=wtype, isa=isa, **a),
              {"w": w}, {"out": np.zeros((n, 256), np.float32)})
        check(f"embed_rows {wtype} n={n}", lambda **a: K.embed_rows(wtype=wtype, isa=isa, **a),
              {"w": w, "ids": np.array([n - 1, 0, n - 1], np.int32)},
              {"out": np.zeros((3, 256), np.float32)})
for P, C, G in ((1, 4, 2), (7, 12, 3), (33, 32, 8)):
    check(f"group_norm P={P} C={C}", lambda **a: K.group_norm(groups=G, eps=1e-6, silu=True, isa=isa, **a),
          {"x": f32(P, C), "gamma": f32(C), "beta": f32(C)}, {"out": np.zeros((P, C), np.float32)})
for wtype in ("F32", "Q8_0", "Q4_K", "Q6_K"):
    for N in (1, 17):
        check(f"adaln_linear {wtype} N={N}",
              lambda **a: K.adaln_linear(wtype=wtype, silu_input=True, isa=isa, **a),
              {"t_emb": f32(256), "w": typed(wtype, N, 256), "bias": f32(N)},
              {"out": np.zeros(N, np.float32)})
for T, N in ((1, 1), (4, 17)):
    check(f"q8_0_matmul T={T} N={N}", lambda **a: K.q8_0_matmul(isa=isa, **a),
          {"x": f32(T, 64), "w": typed("Q8_0", N, 64)}, {"out": np.zeros((T, N), np.float32)})
    check(f"q8_0_dequantize N={N}", lambda **a: K.q8_0_dequantize(isa=isa, **a),
          {"w": typed("Q8_0", N, 64)}, {"out": np.zeros((N, 64), np.float32)})
    check(f"sum_partials T={T} N={N}", lambda **a: K.sum_partials(**a),
          {"partials": f32(T, N)}, {"out": np.zeros(N, np.float32)})
for Hh, Ww, C in ((1, 1, 3), (3, 5, 4)):
    for up in (False, True):
        npx = (4 if up else 1) * Hh * Ww
        check(f"im2col3x3 {Hh}x{Ww}x{C} up={up}",
              lambda **a: K.im2col3x3(H=Hh, W=Ww, upsample=up, isa=isa, **a),
              {"x": f32(Hh * Ww, C)}, {"panel": np.zeros((npx, 9 * C), np.float32)})
    check(f"affine_act {Hh}x{Ww}x{C}", lambda **a: K.affine_act(silu=True, isa=isa, **a),
          {"x": f32(Hh * Ww, C), "scale": f32(C), "shift": f32(C)},
          {"out": np.zeros((Hh * Ww, C), np.float32)})
for P, C, G in ((1, 4, 2), (70, 12, 3)):
    x, gamma, beta = f32(P, C), f32(C), f32(C)
    nchunk = K.group_norm_chunks(P, 16)
    check(f"group_norm_partials P={P} C={C}",
          lambda **a: K.group_norm_partials(groups=G, chunk=16, isa=isa, **a), {"x": x},
          {"partials": np.zeros((nchunk, G, 2), np.float64)})
    parts = K.group_norm_partials(x, G, np.zeros((nchunk, G, 2), np.float64), chunk=16)
    check(f"group_norm_coeffs P={P} C={C}",
          lambda **a: K.group_norm_coeffs(P=P, eps=1e-6, chunk=16, isa=isa, **a),
          {"partials": parts, "gamma": gamma, "beta": beta},
          {"scale": np.zeros(C, np.float32), "shift": np.zeros(C, np.float32)})
for Hh, Ww, C in ((1, 1, 3), (3, 5, 4)):
    check(f"upsample_nearest2x {Hh}x{Ww}x{C}", lambda **a: K.upsample_nearest2x(H=Hh, W=Ww, isa=isa, **a),
          {"x": f32(Hh * Ww, C)}, {"out": np.zeros((4 * Hh * Ww, C), np.float32)})
for wtype, C in (("F32", 3), ("F16", 5), ("Q8_0", 32), ("Q4_K", 256)):
    for Hh, Ww, Cout in ((1, 1, 1), (3, 5, 17)):
        for up in (False, True):
            npx = (4 if up else 1) * Hh * Ww
            w = typed(wtype, Cout, 9 * C)
            for name, fn in (("conv3x3", K.conv3x3), ("conv3x3_bf16", K.conv3x3_bf16)):
                check(f"{name} {wtype} {Hh}x{Ww}x{C}->{Cout} up={up}",
                      lambda **a: fn(H=Hh, W=Ww, wtype=wtype, upsample=up, isa=isa, **a),
                      {"x": f32(Hh * Ww, C), "w": w, "bias": f32(Cout)},
                      {"out": np.zeros((npx, Cout), np.float32)})
print("ok")
"""


_BACKWARD = _GUARD + r"""
isa = sys.argv[3]
rng = np.random.default_rng(13)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
z = lambda *shape: np.zeros(shape, np.float32)


for T, D in ((1, 1), (3, 7), (5, 37)):
    check(f"rmsnorm_backward T={T} D={D}", lambda **a: K.rmsnorm_backward(eps=1e-6, isa=isa, **a),
          {"x": f32(T, D), "w": f32(D), "dy": f32(T, D), "mod": f32(D)},
          {"dx": z(T, D), "dw": z(D), "dmod": z(D)})
    check(f"swiglu_backward T={T} D={D}", lambda **a: K.swiglu_backward(isa=isa, **a),
          {"a": f32(T, D), "b": f32(T, D), "dout": f32(T, D)}, {"da": z(T, D), "db": z(T, D)})
    check(f"gated_residual_backward T={T} D={D}", lambda **a: K.gated_residual_backward(isa=isa, **a),
          {"y": f32(T, D), "gate": f32(D), "dout": f32(T, D)},
          {"dresid": z(T, D), "dy": z(T, D), "dgate": z(D)})
for T, hd in ((1, 2), (5, 6), (17, 128), (70, 8)):
    H, KVH = 2, 1
    check(f"rope_backward T={T} hd={hd}", lambda **a: K.rope_backward(isa=isa, **a),
          {"dy": f32(H, T, hd), "pe": f32(T, hd // 2, 2, 2)}, {"dx": z(H, T, hd)})
    check(f"qknorm_rope_backward T={T} hd={hd}",
          lambda **a: K.qknorm_rope_backward(n_heads=H, n_kv_heads=KVH, eps=1e-6, isa=isa, **a),
          {"qkv": f32(T, (H + 2 * KVH) * hd), "q_w": f32(hd), "k_w": f32(hd),
           "pe": f32(T, hd // 2, 2, 2), "dq": f32(H, T, hd), "dk": f32(KVH, T, hd)},
          {"dqkv": z(T, (H + 2 * KVH) * hd), "dq_w": z(hd), "dk_w": z(hd)})
    check(f"attention_backward T={T} hd={hd}",
          lambda **a: K.attention_backward(scale=hd ** -0.5, isa=isa, **a),
          {"q": f32(H, T, hd), "k": f32(KVH, T, hd), "v": f32(KVH, T, hd), "dout": f32(H, T, hd),
           "mask": np.r_[True, rng.random(T - 1) < 0.7]},
          {"dq": z(H, T, hd), "dk": z(KVH, T, hd), "dv": z(KVH, T, hd)})
    check(f"attention_backward T={T} hd={hd} no mask",
          lambda **a: K.attention_backward(scale=hd ** -0.5, isa=isa, **a),
          {"q": f32(H, T, hd), "k": f32(KVH, T, hd), "v": f32(KVH, T, hd), "dout": f32(H, T, hd)},
          {"dq": z(H, T, hd), "dk": z(KVH, T, hd), "dv": z(KVH, T, hd)})
print("ok")
"""


def _child(code, *args):
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, PACKAGE_ROOT, TESTS,
                        *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", \
        f"{args}: exit {r.returncode} (negative: killed by that signal)\n{r.stdout[-1000:]}{r.stderr[-3000:]}"


@pytest.mark.parametrize("fam", ["f32", "bf16", "q8"])
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_touches_nothing_outside_its_arrays(fam, isa):
    """Every weight type of each matmul family (q8: the quantized ones), plain with a bias and
    gated (which takes none), at tiles' tails (T 1, 4, 5, 19; N 1, 17, 33, 40; K one and more
    blocks)."""
    _child(_MATMUL, fam, isa)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_attention_touches_nothing_outside_its_arrays(isa, precision):
    """Every attention variant: hd 1 to 128 (whole and partial 16-column blocks), T past one
    64-key tile, causal and not, MHA and GQA, with and without a key mask."""
    _child(_ATTENTION, isa, precision)


@pytest.mark.parametrize("isa", ISAS)
def test_ops_touch_nothing_outside_their_arrays(isa):
    """The other kernels of inference: the norms, residual tails, swiglu, add, qk-norm + RoPE
    (both pairings), bf16 rounding, the Q8_0 activation quantizer, matmul and dequantizer,
    dequantize and embed_rows of every weight type, adaln_linear, sum_partials, and the
    autoencoder's group norm (whole, and its partials and coefficients), affine + SiLU,
    upsampling, im2col and 3x3 convolutions (f32 and bf16, plain and upsampling), at sizes with
    tails. (round_bf16 allocates its own output: only its input is guarded.)"""
    _child(_OPS, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_backward_kernels_touch_nothing_outside_their_arrays(isa):
    """The training primitives: the backward kernels of rmsnorm, swiglu, the gated residual, RoPE,
    qk-norm + RoPE and attention, with their parameter gradients, at sizes with tails."""
    _child(_BACKWARD, isa)


@pytest.mark.parametrize("side,index", [("end", 10), ("start", -1)])
@pytest.mark.parametrize("access", ["read", "write"])
def test_guard_pages_fault(side, index, access):
    """The negative control of the harness itself: touching one element past either end of a
    guarded array kills the child with SIGSEGV (so a clean exit above means nothing was touched),
    while the array's own first and last elements are there."""
    code = _GUARD + f"""
a = guarded(np.arange(10, dtype=np.float32), {side!r})
p = ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float))
print(p[0], p[9], flush=True)
if {access!r} == "read":
    print(p[{index}], flush=True)
else:
    p[{index}] = 1.0
print("ok", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code, PACKAGE_ROOT, TESTS], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == -signal.SIGSEGV and r.stdout.split() == ["0.0", "9.0"], \
        (r.returncode, r.stdout, r.stderr[-500:])
