"""Two builds of nxhpc timed against each other, alternately, on one matmul shape or attention
length: not a pytest-benchmark file but the A/B harness for a kernel change on a noisy host.

Each round starts one child process per checkout (``PYTHONPATH`` = that checkout, built in place
with ``python setup.py build_ext --inplace``), the order flipped every round, and each child
times every case ``--calls`` times (process time: the child's own CPU, one thread); the best of
all rounds is kept per checkout and case. Both checkouts get the same inputs (a fixed seed) and
their outputs' float64 sums are compared (``same_sum``: a change that keeps the bits must print
True everywhere). Cases are ``precision:type`` with precision ``q8`` (``matmul_q8``), ``bf16``
(``matmul_bf16``) or ``f32`` (``matmul``) and a type of ``weight_types()`` (quantized with
nxhpc's synthetic-model quantizers, ``nxhpc.formats.quants.quantize``), or ``attention-P:T``:
``K.attention`` of precision P (``f32``, ``bf16``) at T tokens, 2 heads of 128 (the DiT's head
size), on the process's own ISA (GFLOP/s = 4 T^2 hd H / s; ``--shape`` does not apply).

    git worktree add /tmp/base <commit> && (cd /tmp/base && python setup.py build_ext --inplace -q)
    python benchmarks/ab_checkouts.py /tmp/base . --rounds 4 --cases q8:Q4_0,q8:Q4_K,f32:Q4_K

Prints one line per case: GOP/s (matmul) or GFLOP/s (attention) of each checkout, their ratio (new / base), same_sum.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
from nxhpc import _kernels as K
from nxhpc.formats.quants import quantize
T, Kd, N, calls = (int(v) for v in sys.argv[1:5])
rng = np.random.default_rng(0)
x = rng.standard_normal((T, Kd)).astype(np.float32)
wf = (rng.standard_normal((N, Kd)) * 0.05).astype(np.float32)
out = np.empty((T, N), np.float32)
res = {}
for case in sys.argv[5].split(","):
    prec, t = case.split(":")
    if prec.startswith("attention-"):
        Ta, H, hd, ap = int(t), 2, 128, prec.split("-", 1)[1]
        ar = np.random.default_rng(1)
        aq, ak = (ar.standard_normal((H, Ta, hd), dtype=np.float32) for _ in range(2))
        aqkv = ar.standard_normal((Ta, 3 * H * hd), dtype=np.float32)
        res_out, ops = np.empty((Ta, H * hd), np.float32), 4.0 * Ta * Ta * hd * H
        fn = lambda: K.attention(aq, ak, aqkv, res_out, H, hd ** -0.5, precision=ap)
    else:
        q = quantize(wf, t)
        res_out, ops = out, 2.0 * T * Kd * N
        fn = {"q8": lambda: K.matmul_q8(x, q, out, wtype=t), "bf16": lambda: K.matmul_bf16(x, q, t, out),
              "f32": lambda: K.matmul(x, q, t, out)}[prec]
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    res[case] = (ops / best * 1e-9, float(res_out.astype(np.float64).sum()))
print(json.dumps(res))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="checkout of the baseline, built in place")
    ap.add_argument("new", help="checkout of the change, built in place")
    ap.add_argument("--rounds", type=int, default=4, help="alternated rounds (default 4)")
    ap.add_argument("--calls", type=int, default=3, help="timed calls per case and round (default 3)")
    ap.add_argument("--shape", default="256,3840,3840", help="T,K,N (default 256,3840,3840)")
    ap.add_argument("--cases", default="q8:Q4_0,q8:Q4_K,q8:Q6_K,q8:Q8_0,bf16:Q4_K,f32:Q4_K",
                    help="comma-separated precision:type or attention-P:T (default %(default)s)")
    a = ap.parse_args(argv)
    try:
        T, Kd, N = (int(v) for v in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape must be T,K,N integers, got {a.shape!r}")
    trees = {"base": os.path.abspath(a.base), "new": os.path.abspath(a.new)}
    for name, path in trees.items():
        if not os.path.isdir(os.path.join(path, "nxhpc")):
            ap.error(f"{name}: {path} is not an nxhpc checkout")
    best: dict[str, dict] = {k: {} for k in trees}
    for r in range(a.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for name, path in order:
            env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1")
            p = subprocess.run([sys.executable, "-c", CHILD, str(T), str(Kd), str(N), str(a.calls), a.cases],
                               env=env, capture_output=True, text=True, cwd="/")
            if p.returncode:
                print(f"{name} ({path}) failed:\n{p.stderr}", file=sys.stderr)
                return 1
            for case, (g, s) in json.loads(p.stdout).items():
                old = best[name].get(case)
                best[name][case] = (max(g, old[0]) if old else g, s)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    for case in best["base"]:
        (gb, sb), (gn, sn) = best["base"][case], best["new"][case]
        print(f"{case:20s} base {gb:7.1f}  new {gn:7.1f} G(FL)OP/s  ratio {gn / gb:5.3f}  same_sum {sb == sn}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
