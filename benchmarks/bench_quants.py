"""Benchmarks of the GGML block dequantizers (Q4_0..Q5_1, Q2_K..Q6_K) beside Q8_0's q8_0_dequantize.

Run:

    python -m pytest benchmarks/bench_quants.py --benchmark-only --benchmark-timer=time.process_time

(``time.process_time``: CPU time of this single-threaded process, so other jobs time-slicing the
cores do not count.) One weight matrix of 3840 x 3840 per type (rows of Gaussian * 0.02 values
encoded by nxhpc.formats.quants), decoded whole into a preallocated float32 buffer (59 MB: the
write stream dominates, as it does not for the matmul's L2-sized panels). One group per ISA
level: every type at that level plus ``q8_0_dequantize`` as the baseline. ``extra_info``: the
variant that ran, GB/s of float32 output written, GB/s of blocks read, Gelem/s. Correctness is
checked after timing: a sample of rows bit-identical to ``gguf.quants.dequantize``.

A second family of groups (``dequant L2 ...``) decodes only the first 32 rows (480 KB of float32,
inside a 1 MB L2) over and over: the decode rate when the output stays in cache, as it does for
the matmul's weight panels (the packer decodes into an L2-sized scratch). The Python call
overhead (~1 us of ~8-20 us) is included there; each timed round is 20 calls.
"""
import gguf
import numpy as np
import pytest
from _bench_util import bench_stats
from gguf.quants import dequantize as gguf_dequantize

import nxhpc
from nxhpc import _kernels as K
from nxhpc.formats.ggml_blocks import QUANT_BLOCKS
from nxhpc.formats.quants import quantize

N = KD = 3840
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_CACHE = {}


def _weights(name):
    if name not in _CACHE:
        w = np.random.default_rng(0).standard_normal((N, KD), dtype=np.float32) * 0.02
        _CACHE[name] = quantize(w, name)
    return _CACHE[name]


def _run(name, raw, out, isa):
    if name == "Q8_0":
        return K.q8_0_dequantize(raw, out, isa=isa)
    return K.dequantize_blocks(raw, name, out, isa=isa)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_dequant(benchmark, name, isa):
    if isa not in nxhpc.supported_isas():
        pytest.skip(f"CPU lacks {isa}")
    raw = _weights(name)
    out = np.empty((N, KD), np.float32)
    benchmark.group = f"dequant {N}x{KD} {isa}"
    benchmark(_run, name, raw, out, isa)
    variant = K._variant(f"dequantize[{name}]", isa)     # the code that ran, from the table
    sec = bench_stats(benchmark).min
    benchmark.extra_info.update({
        "type": name, "isa": isa, "variant": variant,
        "out_GBps": round(out.nbytes / sec / 1e9, 2),
        "in_GBps": round(raw.nbytes / sec / 1e9, 2),
        "Gelem_per_s": round(out.size / sec / 1e9, 3),
        "bits_per_weight": round(QUANT_BLOCKS[name].nbytes * 8 / QUANT_BLOCKS[name].elems, 3),
    })
    _check(name, raw, out)


L2_ROWS = 32


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_dequant_l2(benchmark, name, isa):
    if isa not in nxhpc.supported_isas():
        pytest.skip(f"CPU lacks {isa}")
    raw = _weights(name)[:L2_ROWS]
    out = np.empty((L2_ROWS, KD), np.float32)
    benchmark.group = f"dequant L2 {L2_ROWS}x{KD} {isa}"
    # 20 calls per timed round: one call (~10-300 us) is near this VM's process_time resolution
    benchmark.pedantic(_run, (name, raw, out, isa), rounds=40, iterations=20, warmup_rounds=2)
    sec = bench_stats(benchmark).min
    benchmark.extra_info.update({
        "type": name, "isa": isa, "variant": K._variant(f"dequantize[{name}]", isa),
        "out_GBps": round(out.nbytes / sec / 1e9, 2),
        "Gelem_per_s": round(out.size / sec / 1e9, 3),
    })
    _check(name, raw, out)


def _check(name, raw, out):
    rows = np.random.default_rng(1).choice(raw.shape[0], 16, replace=False)
    want = gguf_dequantize(raw[rows], gguf.GGMLQuantizationType[name])
    np.testing.assert_array_equal(out[rows].view(np.uint32), want.view(np.uint32))
