/* nx_lowp_avxvnni.c -- the avxvnni table of the "lowp" family (AVX2 + FMA + F16C + AVX-VNNI):
 * the `q8` matmul of every weight type q8 takes on VEX-encoded vpdpbusd, for CPUs with AVX-VNNI
 * but no usable AVX-512 (Intel Alder Lake, Raptor Lake and later client cores). Everything
 * else -- the bf16 matmul, the rounding, every other family -- is the parent avx2 target's.
 *
 * Owns: nothing of its own: the kernel is nx_q8a_avx2.h's, compiled here with NX_Q8A_VNNI 1
 * (the same panels, tiles and epilogue as the AVX2 kernel, one vpdpbusd per four products
 * instead of vpmaddubsw + vpmaddwd + vpaddd). Both give every part's exact integer sum, so the
 * bits are the spec's (tests/test_kernels_lowp.py and test_kernels_q8_types.py run every q8
 * check at every supported ISA). Entered only after the probe reports AVX2, FMA, F16C, OS YMM
 * support and AVX-VNNI (CPUID 7.1 EAX bit 4). Must not: use AVX-512 instructions.
 */
#define NX_Q8A_VNNI 1
#include "nx_q8a_avx2.h"

const nx_lowp_table nx_lowp_table_avxvnni = {.matmul_q8 = nx_matmul_q8_avxvnni};
