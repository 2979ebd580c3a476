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
 * variant here, X(TYPE, name) -> [NX_GGML_TYPE] = nx_dequant_<name>_<isa>. F32 has none (the spec
 * is a memcpy): it inherits generic. */
#define NX_WTYPE_SIMD_TYPES(X)                                                                     \
    X(F16, f16) X(BF16, bf16) X(Q8_0, q8_0) X(Q4_0, q4_0) X(Q4_1, q4_1) X(Q5_0, q5_0)            \
    X(Q5_1, q5_1) X(Q2_K, q2_K) X(Q3_K, q3_K) X(Q4_K, q4_K) X(Q5_K, q5_K) X(Q6_K, q6_K)
#define NX_WTYPE_ROW_(T, t) [NX_GGML_##T] = NXV_FN(nx_dequant_##t),
const nx_wtype_table NXV_FN(nx_wtype_table) = {.dequant = {NX_WTYPE_SIMD_TYPES(NX_WTYPE_ROW_)}};
#undef NX_WTYPE_ROW_

#endif
