/* nx_lowp_avx2.c -- the avx2 table of the "lowp" family (AVX2 + FMA + F16C): the `q8` matmul on
 * every weight type q8 takes (Q8_0, Q4_0 .. Q6_K) with vpmaddubsw / vpmaddwd, for CPUs without
 * VNNI (AMD Zen 2/3, Intel Haswell .. Coffee Lake); the table also holds the bf16 matmul and
 * rounding of nx_lowp_bf16_avx2.c. The AVX-512 tables above it override q8 with VNNI code.
 *
 * Owns: the avx2 q8 panel layouts and register tiles; the exactness argument of the two int8
 * tricks below. Entered only after the probe reports the avx2 level with OS YMM support.
 * Must not: change the per-output block order or arithmetic of nx_lowp.h (the bits are the
 * spec's), allocate per tile, or use threads.
 *
 * Exactness. vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16
 * with saturation; vpmaddwd by ones adds int16 pairs into int32 exactly. The activations qx are
 * the quantizer's bytes, |qx| <= 127 (round(x / d) with d = max|x| / 127; 0 for non-finite).
 *   Q8_0 (|qw| <= 128): u = |qw| (vpabsb: -128 -> 0x80 read unsigned, exact) against
 *     s = sign(qx, qw) (vpsignb: qx negated where qw < 0, exact as |qx| <= 127), so u * s =
 *     qw * qx and each pair is <= 2 * 128 * 127 = 32512 < 2^15: no saturation; vpmaddwd then
 *     sums four products per int32 lane, added per step into the block's int32 sum.
 *   The other types: the panels hold the unsigned code u = qw + off (nx_lowp.h), u <= umax
 *     (15 for Q4_*, 31 for Q5_*, 63 Q6_K, 7 Q3_K, 3 Q2_K), against the signed qx. A pair is
 *     <= 2 * umax * 127 < 2^15, and F consecutive steps (F = the largest power of two with
 *     F * 2 * umax * 127 < 2^15: 8, 4, 2, 8+, 8+) are summed in int16 without overflow before one
 *     vpmaddwd widens them; each part's int32 sum starts at -off * xsum (as VNNI's does), so the
 *     result is the exact isum. Then the spec's float epilogue, in the spec's order.
 */
#include "nx_q8a_avx2.h" /* the kernel, its layouts and the exactness argument above */

const nx_lowp_table nx_lowp_table_avx2 = {.matmul_bf16 = nx_matmul_bf16_avx2,
                                          .matmul_q8 = nx_matmul_q8_avx2,
                                          .round_bf16 = nx_bf16_round_n_avx2};
