"""q8_kernel_ops.py -- probe: how close is each AVX2 `q8` micro-kernel to what its instructions allow?

    python benchmarks/probes/q8_kernel_ops.py [--cc gcc] [--runs 3] [-D NAME=VALUE ...]

(after ``pip install -e .``; x86-64 with AVX2, gcc and objdump; ~5 s a run). It builds
``avx2_tile_stores.c`` (the micro-kernels of ``nxhpc/csrc/nx_q8a_avx2.h``) with the flags the
package's AVX2 files get (setup.py's ``-O3 ... -mavx2 -mfma -mf16c`` and Python's own ``-fwrapv
-fPIC``; ``-D NAME=VALUE`` adds a define, e.g. another tile: ``-D NX_Q8A_MR=2``), disassembles it
and counts, in each kernel's loop over 32-k groups (of its backward jumps, the one around the most
``vpmaddubsw``, the shortest of those), the ``vpmaddubsw`` and every other vector instruction that
is not a plain load, broadcast or store. It then runs the probe (each kernel alone on panels that
stay in L1) and measures ``i8_ymm`` (``nxhpc.runtime.peak``: 12 chains of ``vpaddw(acc,
vpmaddubsw(a, b))``) after each run, the best of ``--runs`` kept for each.

The bound. ``i8_ymm`` issues two vector instructions per ``vpmaddubsw`` (the product and its add),
so at that rate the vector pipes retire ``2 * i8_ymm / 64`` instructions a second (64 operations
per ``vpmaddubsw``). A kernel that needs ``n`` vector instructions per ``vpmaddubsw`` can then run at
most at ``2 / n`` of ``i8_ymm`` -- if every one of them took one slot of the same pipes, which is
optimistic (conversions and FMAs go to fewer pipes than integer adds on some cores, and a register
move counted here may be eliminated at rename). The table prints ``n``, that bound, and the
measured fraction: where measured / bound is near 1 the kernel is limited by how many instructions
it needs, not by their schedule, and only fewer instructions per product can make it faster.

Owns nothing the package uses; the compiled probe goes to a temporary folder.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PROBE = os.path.join(HERE, "avx2_tile_stores.c")
MEMORY_MOVES = ("vmov", "vpbroadcast", "vbroadcast")
# setup.py's BASE_FLAGS (less its warnings) and "_avx2.c" flags, with the -fwrapv and -fPIC that
# Python's build configuration adds: nx_lowp_avx2.c as the package compiles it
BUILD_FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-fPIC",
               "-mavx2", "-mfma", "-mf16c"]


def loop_counts(disasm: str) -> dict[str, tuple[int, int]]:
    """``{kernel: (vpmaddubsw, vector instructions)}`` in each ``nx_q8a_kern_*``'s group loop: of its
    backward jumps, the one around the most ``vpmaddubsw``, the shortest of those."""
    out = {}
    for chunk in re.split(r"\n(?=[0-9a-f]+ <)", disasm):
        m = re.match(r"[0-9a-f]+ <nx_q8a_kern_(\w+)>:", chunk)
        if not m:
            continue
        ins = []
        for line in chunk.splitlines()[1:]:
            if ":\t" in line:
                addr, text = line.split(":\t", 1)
                ins.append((int(addr, 16), text.strip()))
        span = None  # the loop with the most vpmaddubsw, the shortest of those: the group loop
        for i, (addr, text) in enumerate(ins):
            j = re.match(r"j\w+\s+([0-9a-f]+)", text)
            if j and int(j.group(1), 16) < addr:
                start = next(k for k, (a, _) in enumerate(ins) if a == int(j.group(1), 16))
                n = sum(t.startswith("vpmaddubsw") for _, t in ins[start:i + 1])
                if span is None or (n, start - i) > (span[2], span[0] - span[1]):
                    span = (start, i, n)
        if span is None:
            raise SystemExit(f"nx_q8a_kern_{m.group(1)}: no loop found in the disassembly")
        body = [t for _, t in ins[span[0]:span[1] + 1]]
        maddubs = sum(t.startswith("vpmaddubsw") for t in body)
        vector = 0
        for t in body:
            op, _, args = t.partition(" ")
            if not op.startswith("v") or op == "vzeroupper":
                continue
            if op.startswith(MEMORY_MOVES) and "(" in args:
                continue                                  # a load, broadcast or store only
            vector += 1
        out[m.group(1)] = (maddubs, vector)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="gcc", help="C compiler (default gcc)")
    ap.add_argument("--runs", type=int, default=3, help="probe runs, best kept (default 3)")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                    help="a define for the probe's build (repeatable), e.g. -D NX_Q8A_MR=2")
    a = ap.parse_args(argv)
    from nxhpc.runtime import peak
    if "i8_ymm" not in peak.supported():
        print("this CPU has no AVX2: nothing to measure", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "probe")
        subprocess.run([a.cc, *BUILD_FLAGS, *(f"-D{d}" for d in a.defines), "-I",
                        os.path.join(ROOT, "nxhpc", "csrc"), PROBE, "-o", exe], check=True)
        counts = loop_counts(subprocess.run(["objdump", "-d", "--no-show-raw-insn", exe], check=True,
                                            capture_output=True, text=True).stdout)
        best: dict[str, tuple[str, float]] = {}
        i8 = 0.0
        for _ in range(a.runs):
            run = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
            for m in re.finditer(r"micro-kernel (\w+)\s+\(([^)]*)\), 32 groups .*?:\s+([\d.]+) GOP/s", run):
                name, types, gops = m.group(1), m.group(2).strip(), float(m.group(3))
                if name not in best or gops > best[name][1]:
                    best[name] = (types, gops)
            i8 = max(i8, peak.measure("i8_ymm") * 1e-9)
    print(f"i8_ymm {i8:.1f} GOP/s (one thread, the best of the runs)")
    print(f"{'kernel':7s} {'types':10s} {'vpmaddubsw':>10s} {'vector':>7s} {'per':>6s} {'bound':>6s} "
          f"{'GOP/s':>7s} {'of i8':>6s} {'of bound':>8s}")
    for name, (types, gops) in best.items():
        mub, vec = counts[name]
        bound = 2 * mub / vec
        print(f"{name:7s} {types:10s} {mub:10d} {vec:7d} {vec / mub:6.3f} {bound:6.3f} {gops:7.1f} "
              f"{gops / i8:6.3f} {gops / i8 / bound:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
