/* nx_wtype_ew.h -- the SIMD dequantize variants written once for both vector widths (nx_simd.h),
 * and the ISA's dequantize table (the nine block types' variants are nx_quants_ew.h's).
 * Included exactly once by nx_wtype_avx2.c and by nx_wtype_avx512.c; NXV_FN(nx_dequant_f16) is
 * nx_dequant_f16_avx2 / _avx512 (declared in nx_wtype.h). Each is bit-identical to its generic
 * spec (nx_wtype.c): whole vectors here, the tail by the spec itself.
 * Must not: be included from generic files.
 */
#ifndef NX_WTYPE_EW_H
#define NX_WTYPE_EW_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "nx_quants.h" /* the Q4_0 .. Q6_K variants (nx_quants_<isa>.c) */
#include "nx_simd.h"
#include "nx_wtype.h"

void NXV_FN(nx_dequant_f16)(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    size_t i = 0;
    for (; i + NXV_W <= n; i += NXV_W) nxv_storeu(out + i, nxv_load_f16(blocks + 2 * i));
    if (i < n) nx_dequant_f16_generic(blocks + 2 * i, out + i, n - i);
}

void NXV_FN(nx_dequant_bf16)(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    size_t i = 0;
    for (; i + NXV_W <= n; i += NXV_W) nxv_storeu(out + i, nxv_load_bf16(blocks + 2 * i));
    if (i < n) nx_dequant_bf16_generic(blocks + 2 * i, out + i, n - i);
}

/* d * q per block; d widened by F16C (quiets an sNaN scale, which the product quiets anyway). */
void NXV_FN(nx_dequant_q8_0)(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    for (size_t blk = 0; blk < n; blk++) {
        const uint8_t *b = blocks + blk * sizeof(nx_block_q8_0);
        uint16_t dh;
        memcpy(&dh, b, 2);
        const nxv d = nxv_set1(_cvtsh_ss(dh));
        for (int j = 0; j < NX_QK8_0; j += NXV_W)
            nxv_storeu(out + blk * NX_QK8_0 + j, nxv_load_q8(b + 2 + j, d));
    }
}

/* This ISA's row of the wtype dispatch family (nx_wtype_table_avx2 / _avx512): every type with a
 * variant here. F32 has none (the spec is a memcpy): it inherits generic. */
const nx_wtype_table NXV_FN(nx_wtype_table) = {.dequant = {
                                                   [NX_GGML_F16] = NXV_FN(nx_dequant_f16),
                                                   [NX_GGML_BF16] = NXV_FN(nx_dequant_bf16),
                                                   [NX_GGML_Q8_0] = NXV_FN(nx_dequant_q8_0),
                                                   [NX_GGML_Q4_0] = NXV_FN(nx_dequant_q4_0),
                                                   [NX_GGML_Q4_1] = NXV_FN(nx_dequant_q4_1),
                                                   [NX_GGML_Q5_0] = NXV_FN(nx_dequant_q5_0),
                                                   [NX_GGML_Q5_1] = NXV_FN(nx_dequant_q5_1),
                                                   [NX_GGML_Q2_K] = NXV_FN(nx_dequant_q2_K),
                                                   [NX_GGML_Q3_K] = NXV_FN(nx_dequant_q3_K),
                                                   [NX_GGML_Q4_K] = NXV_FN(nx_dequant_q4_K),
                                                   [NX_GGML_Q5_K] = NXV_FN(nx_dequant_q5_K),
                                                   [NX_GGML_Q6_K] = NXV_FN(nx_dequant_q6_K),
                                               }};

#endif
