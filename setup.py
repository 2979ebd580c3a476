"""Build the nxhpc._kernels extension.

Portable by default: the generic C files are compiled with no ISA flags; each SIMD file
(``*_avx2.c``, ``*_avx512.c``) is compiled with its own flags and only ever entered after the
run-time CPU probe (``csrc/nx_cpu.c``) says the CPU and OS support it. Adding an ISA is one entry
in ISA_FLAGS below (suffix -> flags; the flags must not use a feature the ISA's entry in
``csrc/nx_cpu.h`` NX_ISA_LIST does not require -- tests/test_build.py checks), besides that line
in NX_ISA_LIST and the ``nx_<family>_<isa>.c`` table files.

Opt-in native build for local experiments: ``NXHPC_MARCH_NATIVE=1 pip install .`` adds
the native-arch flag (opt-in) to every file (the result only runs on machines like the build machine).
Debug build: ``NXHPC_CYTHON_DEBUG=1`` turns on Cython bounds/initialisation checks.
"""
import os
import platform
import sys
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
CSRC = Path("nxhpc") / "csrc"

BASE_FLAGS = ["-O3", "-std=c11", "-fno-math-errno", "-fno-trapping-math", "-Wall",
              "-Wno-unused-function", "-Wno-unknown-pragmas"]
# Per-file ISA flags, chosen by filename suffix "_<isa>.c" (<isa> as named in NX_ISA_LIST). A
# literal: tests/test_build.py reads it with ast. E.g. a BF16 target would add
#     "_avx512bf16.c": [*ISA_FLAGS["_avx512.c"], "-mavx512bf16"]   (as a literal list)
ISA_FLAGS = {
    "_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "_avxvnni.c": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "_avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                  "-mavx2", "-mfma", "-mf16c"],
    "_avx512bf16.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                      "-mavx2", "-mfma", "-mf16c", "-mavx512bf16"],
    "_amx.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
               "-mavx2", "-mfma", "-mf16c", "-mavx512bf16", "-mamx-tile", "-mamx-int8",
               "-mamx-bf16"],
}
NATIVE_OPT_IN = os.environ.get("NXHPC_MARCH_NATIVE") == "1"  # local opt-in only, off by default
if NATIVE_OPT_IN:
    BASE_FLAGS.append("-march=native")  # opt-in (NXHPC_MARCH_NATIVE=1): not portable


def isa_of(src: str):
    for suffix, flags in ISA_FLAGS.items():
        if src.endswith(suffix):
            return flags
    return []


#: Where the objects live between builds: in the checkout (gitignored), not in pip's throw-away
#: build directory, so that `pip install -e '.[extra]'` recompiles only what changed.
OBJ_CACHE = HERE / "build" / f"obj-{sys.implementation.cache_tag}-{platform.machine()}"


def _stale(obj: Path, src: Path, flags: list[str], headers: list[Path]) -> bool:
    """Recompile unless ``obj`` exists, is newer than its source and every header, and was
    built with exactly ``flags`` (recorded next to it)."""
    stamp = obj.with_suffix(".flags")
    if not obj.is_file() or not stamp.is_file() or stamp.read_text() != " ".join(flags):
        return True
    t = obj.stat().st_mtime
    return any(p.stat().st_mtime > t for p in [src, *headers])


class BuildExt(build_ext):
    """Compile each C source with its own ISA flags into :data:`OBJ_CACHE` (skipping objects
    that are up to date), then link them into the extension."""

    def build_extension(self, ext):
        if sys.platform == "win32":  # MSVC: no per-file GCC flags; SIMD files use /arch
            return super().build_extension(ext)
        headers = sorted((HERE / CSRC).glob("*.h"))
        macros = [(n, v) for n, v in ext.define_macros]
        objects = []
        for src in [s for s in ext.sources if s.endswith(".c")]:
            ours = "csrc" in src
            flags = BASE_FLAGS + isa_of(src) if ours else list(ext.extra_compile_args)
            obj = OBJ_CACHE / Path(src).with_suffix(".o")
            record = flags + [f"-D{n}={v}" for n, v in macros] + [np.get_include(),
                                                                    self.compiler.compiler_so[0]]
            if self.force or _stale(obj, HERE / src, record, headers):
                out = self.compiler.compile(
                    [src], output_dir=str(OBJ_CACHE), include_dirs=ext.include_dirs,
                    macros=macros, extra_postargs=flags)
                assert Path(out[0]).resolve() == obj.resolve(), (out, obj)
                obj.with_suffix(".flags").write_text(" ".join(record))
            objects.append(str(obj))
        ext_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(ext_path) or ".", exist_ok=True)
        self.compiler.link_shared_object(
            objects, ext_path, libraries=self.get_libraries(ext),
            library_dirs=ext.library_dirs, runtime_library_dirs=ext.runtime_library_dirs,
            extra_postargs=ext.extra_link_args or [], export_symbols=self.get_export_symbols(ext),
            debug=self.debug, build_temp=self.build_temp, target_lang="c")


debug = os.environ.get("NXHPC_CYTHON_DEBUG") == "1"
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
c_files = sorted(str(p) for p in (HERE / CSRC).glob("*.c"))
if not X86:  # the SIMD files are x86 intrinsics: other CPUs build the generic kernels only
    c_files = [p for p in c_files if not isa_of(p)]
c_files = [os.path.relpath(p, HERE) for p in c_files]

ext = Extension(
    "nxhpc._kernels",
    sources=["nxhpc/_kernels.pyx"] + c_files,
    include_dirs=[str(CSRC), np.get_include()],
    # Every C file too: an edited .c recompiles its object (BuildExt), and relinks the module.
    depends=[str(p) for p in (HERE / CSRC).glob("*.[ch]")] + [str(p) for p in (HERE / "nxhpc").glob("*.pxi")],
    extra_compile_args=["-O3", "-fno-math-errno", "-Wno-unused-function"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    libraries=["m"],
)

setup(
    ext_modules=cythonize(
        [ext],
        language_level=3,
        compiler_directives={
            "boundscheck": debug,
            "initializedcheck": debug,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
    ),
    cmdclass={"build_ext": BuildExt},
)
