"""No kernel touches memory outside the arrays it is given: every input and output of a call sits
against an unreadable page (PROT_NONE), once ending exactly at one and once starting exactly after
one, so a read or write of a single element past either end faults.

The other tests cannot see such an access: a read past an array returns whatever lies there (a
value the kernel may then discard, e.g. into an output's padding) and a write past it lands in
memory nobody checks. Real arrays do end at unmapped pages: a GGUF file is mapped whole, and its
last tensor ends where the file does. Each case runs in a child process (a fault is then a
failed test, not a crashed run) and checks its outputs against the same call on ordinary arrays,
bit for bit, so the guarded call did the work.

Negative controls (2026-12-06, each alone): the AVX2 float32 attention loading whole 16-column V
blocks from 8 columns inside hd (a real over-read, which every other test let pass) fails
test_attention_...[avx2-f32]; the AVX2 q8 tile storing all 16 columns when 8 or more are its own
fails test_matmul_...[avx2-q8]; test_guard_pages_fault checks the harness itself.
"""
import os
import subprocess
import sys

import pytest

from kernelutil import ISAS
from nxhpc import _kernels as K

TESTS = os.path.dirname(os.path.abspath(__file__))

# the child's helpers: guarded copies of arrays, and a bitwise comparison
_GUARD = r'''
import ctypes, mmap, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
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
'''

_MATMUL = _GUARD + r'''
from kernelutil import finite_scale_blocks, gguf_bytes
fam, isa = sys.argv[2], sys.argv[3]
KD = 256
rng = np.random.default_rng(7)
types = [t for t in K.weight_types() if not (fam == "q8" and t in ("F32", "F16", "BF16"))]
for wtype in types:
    for T, N, gated in ((1, 1, False), (4, 17, False), (5, 40, True)):
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
            same(out, ref, f"{fam} {wtype} T={T} N={N} gated={gated} {side}")
print("ok")
'''

_ATTENTION = _GUARD + r'''
isa, precision = sys.argv[2], sys.argv[3]
for hd in (1, 8, 24, 30, 40, 128):
    for T, H, KVH in ((1, 1, 1), (17, 2, 1), (40, 1, 1)):
        for causal in (False, True):
            rng = np.random.default_rng(hd * 100 + T)
            q = rng.standard_normal((H, T, hd), dtype=np.float32)
            k = rng.standard_normal((KVH, T, hd), dtype=np.float32)
            qkv = rng.standard_normal((T, (H + 2 * KVH) * hd), dtype=np.float32)
            mask = rng.random(T) < 0.7
            ref = np.empty((T, H * hd), np.float32)
            K.attention(q, k, qkv, ref, KVH, hd ** -0.5, mask=mask, isa=isa, causal=causal,
                        precision=precision)
            for side in ("end", "start"):
                out = guarded(np.zeros((T, H * hd), np.float32), side)
                K.attention(guarded(q, side), guarded(k, side), guarded(qkv, side), out, KVH,
                            hd ** -0.5, mask=guarded(mask, side), isa=isa, causal=causal,
                            precision=precision)
                same(out, ref, f"attention hd={hd} T={T} H={H}/{KVH} causal={causal} {side}")
print("ok")
'''


def _child(code, *args):
    r = subprocess.run([sys.executable, "-c", code, TESTS, *args], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", \
        f"{args}: exit {r.returncode} (negative: killed by that signal)\n{r.stdout[-1000:]}{r.stderr[-3000:]}"


@pytest.mark.parametrize("fam", ["f32", "bf16", "q8"])
@pytest.mark.parametrize("isa", ISAS)
def test_matmul_touches_nothing_outside_its_arrays(fam, isa):
    """Every weight type of each matmul family (q8: the quantized ones), plain with a bias and
    gated (which takes none), at tiles' tails (T 1, 4, 5; N 1, 17, 40)."""
    _child(_MATMUL, fam, isa)


@pytest.mark.parametrize("precision", ["f32", "bf16"])
@pytest.mark.parametrize("isa", ISAS)
def test_attention_touches_nothing_outside_its_arrays(isa, precision):
    """Every attention variant: hd 1 to 128 (whole and partial 16-column blocks), causal and not,
    MHA and GQA, with a key mask."""
    _child(_ATTENTION, isa, precision)


def test_guard_pages_fault():
    """The negative control of the harness itself: reading one element past a guarded array
    kills the child (so a clean exit above means nothing was touched)."""
    code = _GUARD + r'''
a = guarded(np.arange(10, dtype=np.float32), "end")
p = ctypes.cast(a.ctypes.data, ctypes.POINTER(ctypes.c_float))
print(p[9])
print(p[10])
print("ok")
'''
    r = subprocess.run([sys.executable, "-c", code, TESTS], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and r.stdout.split() == ["9.0"], (r.returncode, r.stdout, r.stderr[-500:])
