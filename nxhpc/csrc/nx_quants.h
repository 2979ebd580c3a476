/* nx_quants.h -- GGML weight block types Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K:
 * block layouts and their dequantizers (decode whole blocks to float32).
 *
 * Owns: the nine block layouts (ggml's ggml-common.h, sizes pinned by _Static_assert) and the
 * decoding arithmetic of each type (the generic scalar functions in nx_quants.c are the spec).
 * The traits rows (name, geometry, spec) and the per-ISA dequantize entries of these types live
 * in the weight-type tables (nx_wtype.c, nx_wtype_ew.h for both SIMD widths): one authority for
 * dispatch. Must not: allocate, spawn threads, dispatch, or read/write outside [blocks, blocks +
 * nblocks*block_bytes) / [out, out + nblocks*block_elems) (callers validate sizes before C).
 *
 * Every dequantizer has the same signature; a band of blocks is a pointer offset plus a count:
 *   void nx_dequant_<type>_<isa>(const uint8_t *blocks, float *out, size_t nblocks);
 * `blocks` may be only byte-aligned (rows of GGUF data): float16 fields are read with memcpy.
 *
 * Arithmetic contract (all ISA levels bit-identical, and byte-identical to gguf-py's numpy
 * gguf.quants.dequantize, which is the reference). f16 fields are widened to float32 exactly;
 * integer codes are converted to float32 exactly; then per element, in this order, float32 ops:
 *   Q4_0, Q5_0:  v = d * (float)q                          q = code - 8 (Q4_0), code - 16 (Q5_0)
 *   Q4_1, Q5_1:  v = (d * (float)q) + m                    q = code (0..15 / 0..31)
 *   Q2_K:        v = ((d * sc) * (float)q) - (dmin * mn)   sc = scales[i] & 15, mn = scales[i] >> 4
 *   Q3_K:        v = (d * sc) * (float)q                   sc = 6-bit - 32, q = 3-bit - 4
 *   Q4_K, Q5_K:  v = ((d * sc) * (float)q) - (dmin * mn)   sc, mn 6-bit from the 12-byte packing
 *   Q6_K:        v = (d * sc) * (float)q                   sc = int8, q = 6-bit - 32
 * Every product above is EXACT in float32 (d, dmin, m have an 11-bit significand; codes and
 * scales add at most 12 more: 11+5 (Q*_0/Q*_1), 11+4+2 (Q2_K), 11+6+3 (Q3_K), 11+6+5 (Q4_K,
 * Q5_K), 11+7+5 (Q6_K) <= 23 bits; no overflow or underflow: |v| < 2^27, nonzero
 * |product| >= 2^-24). So the only rounding is the final "+ m" / "- dmin*mn" (none at all for
 * Q4_0, Q5_0, Q3_K, Q6_K, whose values are exact like Q8_0's), and a fused multiply-add would give the same finite result; the code still
 * keeps mul and add/sub separate (-std=c11 turns GCC's FMA contraction off; see the pragma in each
 * .c file). NaN: x86 returns the quieted first NaN operand of an op, so a NaN element carries the
 * quieted payload of the first NaN it meets in the op order above (d before m/dmin; e.g. Q2_K with
 * d and dmin both NaN gives d's payload). For "(d*q) + m", an addition the compiler may commute,
 * the code says so explicitly: v = isnan(d*q) ? d*q : d*q + m. That is numpy's result for every
 * array of >= 2 blocks; on an array of exactly ONE Q4_1/Q5_1 block with d and m both NaN, numpy's
 * broadcast loop picks m's payload instead (a numpy iteration detail; still NaN). Infinite
 * scales give +-inf, or NaN where a zero code/scale meets inf.
 *
 * For a matmul over these weights: the decoded float32 value of every element is the one above,
 * whatever the ISA and whichever band of blocks is decoded, so a matmul that packs its weight
 * panels with these functions computes on exactly gguf.quants.dequantize(w), and a weight and
 * its dequantization (this decoder's output, stored as float32) give bit-identical products.
 */
#ifndef NX_QUANTS_H
#define NX_QUANTS_H

#include <stddef.h>
#include <stdint.h>

#include "nx_cpu.h"

#include "nx_wtype.h" /* GGML type ids (NX_GGML_*) */

#define NX_QK_LEGACY 32     /* elements per Q4_0/Q4_1/Q5_0/Q5_1 block */
#define NX_QK_K 256         /* elements per K-quant super-block */
#define NX_K_SCALE_SIZE 12  /* Q4_K/Q5_K packed 6-bit scales and mins */

/* ---- block layouts (ggml-common.h). uint16_t fields are IEEE binary16 bits, little-endian. */

/* value[j] = d * ((qs[j%16] >> 4*(j/16)) & 15) - 8) */
typedef struct { uint16_t d; uint8_t qs[16]; } nx_block_q4_0;
/* value[j] = d * ((qs[j%16] >> 4*(j/16)) & 15) + m */
typedef struct { uint16_t d, m; uint8_t qs[16]; } nx_block_q4_1;
/* code[j] = ((qs[j%16] >> 4*(j/16)) & 15) | (bit j of little-endian uint32 qh) << 4 */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } nx_block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } nx_block_q5_1;
/* element e = 128h + 32s + l (h<2, s<4, l<32): q = (qs[32h+l] >> 2s) & 3; scale index e/16 */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } nx_block_q2_K;
/* element e = 128h + 32s + l: low 2 bits (qs[32h+l] >> 2s) & 3; high bit (hmask[l] >> (4h+s)) & 1
 * (q = low - 4 when the high bit is 0); 16 6-bit scales: low 4 bits scales[i%8] >> 4*(i/8),
 * high 2 bits scales[8 + i%4] >> 2*(i/4); scale index e/16 */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } nx_block_q3_K;
/* element e = 64c + 32s + l (c<4, s<2, l<32): q = (qs[32c+l] >> 4s) & 15; sub-block j = e/32;
 * sc[j], mn[j]: j<4: scales[j] & 63, scales[j+4] & 63; j>=4: (scales[j+4] & 15) | (scales[j-4]
 * >> 6) << 4, (scales[j+4] >> 4) | (scales[j] >> 6) << 4 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } nx_block_q4_K;
/* as Q4_K, plus bit 4 of q = (qh[l] >> (2c+s)) & 1 */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } nx_block_q5_K;
/* element e = 128h + r (h<2, r<128): low 4 bits (ql[64h + r%64] >> 4*(r/64)) & 15, high 2 bits
 * (qh[32h + r%32] >> 2*(r/32)) & 3; q = code - 32; scale index e/16 (int8 scales) */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } nx_block_q6_K;

_Static_assert(sizeof(nx_block_q4_0) == 18, "block_q4_0 is 18 bytes");
_Static_assert(sizeof(nx_block_q4_1) == 20, "block_q4_1 is 20 bytes");
_Static_assert(sizeof(nx_block_q5_0) == 22, "block_q5_0 is 22 bytes");
_Static_assert(sizeof(nx_block_q5_1) == 24, "block_q5_1 is 24 bytes");
_Static_assert(sizeof(nx_block_q2_K) == 84, "block_q2_K is 84 bytes");
_Static_assert(sizeof(nx_block_q3_K) == 110, "block_q3_K is 110 bytes");
_Static_assert(sizeof(nx_block_q4_K) == 144, "block_q4_K is 144 bytes");
_Static_assert(sizeof(nx_block_q5_K) == 176, "block_q5_K is 176 bytes");
_Static_assert(sizeof(nx_block_q6_K) == 210, "block_q6_K is 210 bytes");
_Static_assert(offsetof(nx_block_q5_0, qs) == 6 && offsetof(nx_block_q5_1, qs) == 8, "q5 layout");
_Static_assert(offsetof(nx_block_q2_K, d) == 80 && offsetof(nx_block_q3_K, d) == 108, "K layout");
_Static_assert(offsetof(nx_block_q5_K, qs) == 48 && offsetof(nx_block_q6_K, d) == 208, "K layout");

/* ---- dequantizers: blocks [nblocks*block_bytes] -> out [nblocks*block_elems] float32, of the
 * nx_dequant_fn type (nx_wtype.h). The SIMD ones exist only in x86 builds. */
#define NX_DEQUANT_DECL(t, isa) \
    void nx_dequant_##t##_##isa(const uint8_t *blocks /* IN nblocks*block_bytes */, \
                                float *out /* OUT nblocks*block_elems */, size_t nblocks);
#define NX_DEQUANT_DECL3(t) NX_DEQUANT_DECL(t, generic) NX_DEQUANT_DECL(t, avx2) \
    NX_DEQUANT_DECL(t, avx512)
/* nx_dequant_q4_0_generic, nx_dequant_q4_0_avx2, nx_dequant_q4_0_avx512, ... nx_dequant_q6_K_avx512 */
NX_DEQUANT_DECL3(q4_0)
NX_DEQUANT_DECL3(q4_1)
NX_DEQUANT_DECL3(q5_0)
NX_DEQUANT_DECL3(q5_1)
NX_DEQUANT_DECL3(q2_K)
NX_DEQUANT_DECL3(q3_K)
NX_DEQUANT_DECL3(q4_K)
NX_DEQUANT_DECL3(q5_K)
NX_DEQUANT_DECL3(q6_K)
#undef NX_DEQUANT_DECL3
#undef NX_DEQUANT_DECL

#endif
