"""The build: generic kernels alone outside x86, and the ISA flags table of setup.py.

The SIMD files use x86 intrinsics, so a non-x86 build (setup.py) leaves them out and every
reference to them in the dispatch code is wrapped in NX_X86_ONLY(...). This test cross-compiles
the remaining C files for aarch64 and links them with --no-undefined: a dispatch reference left
unwrapped shows up as an undefined symbol. CI installs the cross compiler (.ci/run).
Which files are "SIMD" comes from setup.py's ISA_FLAGS (read with ast, not imported), so a new
ISA suffix is covered without editing this file; the flags of each suffix are checked against the
features its ISA requires at run time (nx_cpu.h NX_ISA_LIST, via cpu_features()["isas"]).
"""
import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "nxhpc" / "csrc"
CROSS = shutil.which("aarch64-linux-gnu-gcc")


def _isa_flags():
    """setup.py's ISA_FLAGS literal: {"_avx2.c": [...flags], ...}."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ISA_FLAGS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no ISA_FLAGS literal")


def _generic_sources():
    suffixes = tuple(_isa_flags())
    return sorted(p for p in CSRC.glob("*.c") if not p.name.endswith(suffixes))


def test_isa_flags_table_is_read():
    flags = _isa_flags()
    assert "_avx2.c" in flags and "_avx512.c" in flags
    generic = {p.name for p in _generic_sources()}
    assert "nx_matmul.c" in generic and "nx_matmul_avx512.c" not in generic


# Compiler flag -> the cpu_features() bit it lets the compiler use.
FLAG_FEATURE = {"-mavx": "avx", "-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c",
                "-mavx512f": "avx512f", "-mavx512bw": "avx512bw", "-mavx512vl": "avx512vl",
                "-mavx512dq": "avx512dq", "-mavx512vnni": "avx512vnni",
                "-mavx512bf16": "avx512bf16", "-mavx512vbmi": "avx512vbmi",
                "-mavxvnni": "avxvnni", "-mamx-tile": "amx_tile", "-mamx-int8": "amx_int8",
                "-mamx-bf16": "amx_bf16"}


def test_isa_flags_stay_within_the_features_the_isa_requires():
    """A file compiled for ISA X only runs where X's required bits are present, so its flags must
    not let the compiler use any other feature (an Illegal instruction on a CPU that lacks it)."""
    from nxhpc import _kernels as K
    isas = K.cpu_features()["isas"]
    for suffix, flags in _isa_flags().items():
        isa = suffix[1:-2]
        assert isa in isas, f"setup.py suffix {suffix} names no ISA of NX_ISA_LIST ({sorted(isas)})"
        needs = set(isas[isa]["needs"])
        for flag in flags:
            assert flag in FLAG_FEATURE, f"{suffix}: unknown ISA flag {flag} (add it to FLAG_FEATURE)"
            assert FLAG_FEATURE[flag] in needs, (f"{suffix}: {flag} uses {FLAG_FEATURE[flag]}, which "
                                                 f"ISA {isa!r} does not require ({sorted(needs)})")
    # every file named like an ISA variant has its flags
    for p in CSRC.glob("*_*.c"):
        tail = p.stem.rsplit("_", 1)[1]
        if tail in isas and tail != "generic":
            assert f"_{tail}.c" in _isa_flags(), f"{p.name} would be compiled without ISA flags"


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed")
def test_generic_kernels_link_for_aarch64(tmp_path):
    objs = []
    for src in _generic_sources():
        obj = tmp_path / (src.stem + ".o")
        r = subprocess.run([CROSS, "-O2", "-std=c11", "-Wall", "-Wno-unused-function", "-fPIC",
                            "-c", str(src), "-o", str(obj)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, f"{src.name} does not compile for aarch64:\n{r.stderr}"
        objs.append(str(obj))
    so = tmp_path / "k.so"
    r = subprocess.run([CROSS, "-shared", "-o", str(so), *objs, "-lm", "-Wl,--no-undefined"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, f"generic kernels do not link alone:\n{r.stderr}"


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed")
def test_negative_control_simd_source_does_not_build_for_aarch64(tmp_path):
    """Proves the check above can fail: an x86 SIMD file does not compile for aarch64."""
    src = next(CSRC.glob("*_avx512.c"))
    r = subprocess.run([CROSS, "-O2", "-std=c11", "-c", str(src), "-o", str(tmp_path / "x.o")],
                       capture_output=True, text=True, check=False)
    assert r.returncode != 0


@pytest.mark.skipif(CROSS is None, reason="aarch64-linux-gnu-gcc not installed")
def test_negative_control_unwrapped_dispatch_does_not_link(tmp_path):
    """Proves the link check can fail: a table list naming an x86 table outside NX_X86_ONLY
    leaves an undefined symbol in the generic build."""
    src = (CSRC / "nx_q8_0.c").read_text()
    broken = src.replace("NX_X86_ONLY([NX_ISA_AVX2] = &nx_q8_0_table_avx2,",
                         "[NX_ISA_AVX2] = &nx_q8_0_table_avx2, NX_X86_ONLY(")
    assert broken != src
    objs = []
    for p in _generic_sources():
        c = tmp_path / p.name
        c.write_text(broken if p.name == "nx_q8_0.c" else p.read_text())
        obj = tmp_path / (p.stem + ".o")
        r = subprocess.run([CROSS, "-O2", "-std=c11", "-fPIC", f"-I{CSRC}", "-c", str(c), "-o",
                            str(obj)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr
        objs.append(str(obj))
    r = subprocess.run([CROSS, "-shared", "-o", str(tmp_path / "k.so"), *objs, "-lm",
                        "-Wl,--no-undefined"], capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "nx_q8_0_table_avx2" in r.stderr
