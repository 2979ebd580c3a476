/* nx_wtype_avx2.c -- AVX2 (+F16C) dequantize variants; exports nx_wtype_table_avx2.
 * Owns: this ISA's row of the wtype dispatch family. The loops are nx_wtype_ew.h at 8 lanes.
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX2) (dispatch: nx_wtype.c).
 * A new type's AVX2 dequantize is one more line in the table (nx_wtype.h, "Adding a weight type").
 */
#include "nx_quants.h" /* Q4_0 .. Q6_K variants (nx_quants_avx2.c) */
#include "nx_wtype_ew.h"

/* F32 has no variant (the spec is a memcpy): it inherits generic. */
const nx_wtype_table nx_wtype_table_avx2 = {.dequant = {
                                                [NX_GGML_F16] = nx_dequant_f16_avx2,
                                                [NX_GGML_BF16] = nx_dequant_bf16_avx2,
                                                [NX_GGML_Q8_0] = nx_dequant_q8_0_avx2,
                                                [NX_GGML_Q4_0] = nx_dequant_q4_0_avx2,
                                                [NX_GGML_Q4_1] = nx_dequant_q4_1_avx2,
                                                [NX_GGML_Q5_0] = nx_dequant_q5_0_avx2,
                                                [NX_GGML_Q5_1] = nx_dequant_q5_1_avx2,
                                                [NX_GGML_Q2_K] = nx_dequant_q2_K_avx2,
                                                [NX_GGML_Q3_K] = nx_dequant_q3_K_avx2,
                                                [NX_GGML_Q4_K] = nx_dequant_q4_K_avx2,
                                                [NX_GGML_Q5_K] = nx_dequant_q5_K_avx2,
                                                [NX_GGML_Q6_K] = nx_dequant_q6_K_avx2,
                                            }};
