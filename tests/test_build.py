"""The build outside x86: with no SIMD files, the generic kernels must compile and link alone.

The SIMD files use x86 intrinsics, so a non-x86 build (setup.py) leaves them out and every call
into them in the dispatch code is wrapped in NX_X86_ONLY(...). This test cross-compiles the
remaining C files for aarch64 and links them with --no-undefined: a dispatch call left
unwrapped shows up as an undefined symbol. CI installs the cross compiler (.ci/run).
"""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "nxhpc" / "csrc"
CROSS = shutil.which("aarch64-linux-gnu-gcc")


def _generic_sources():
    return sorted(p for p in CSRC.glob("*.c")
                  if not p.name.endswith(("_avx2.c", "_avx512.c", "_avx512bf16.c")))


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed")
def test_generic_kernels_link_for_aarch64(tmp_path):
    objs = []
    for src in _generic_sources():
        obj = tmp_path / (src.stem + ".o")
        r = subprocess.run([CROSS, "-O2", "-std=c11", "-Wall", "-Wno-unused-function", "-fPIC",
                            "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
        assert r.returncode == 0, f"{src.name} does not compile for aarch64:\n{r.stderr}"
        objs.append(str(obj))
    so = tmp_path / "k.so"
    r = subprocess.run([CROSS, "-shared", "-o", str(so), *objs, "-lm", "-Wl,--no-undefined"],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"generic kernels do not link alone:\n{r.stderr}"


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed")
def test_negative_control_simd_source_does_not_build_for_aarch64(tmp_path):
    """Proves the check above can fail: an x86 SIMD file does not compile for aarch64."""
    src = next(CSRC.glob("*_avx512.c"))
    r = subprocess.run([CROSS, "-O2", "-std=c11", "-c", str(src), "-o", str(tmp_path / "x.o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
