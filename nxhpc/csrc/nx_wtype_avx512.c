/* nx_wtype_avx512.c -- AVX-512 dequantize variants; exports nx_wtype_table_avx512.
 * Owns: this ISA's row of the wtype dispatch family. The loops are nx_wtype_ew.h at 16 lanes.
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX512) (dispatch: nx_wtype.c).
 * A new type's AVX-512 dequantize is one more line in the table (nx_wtype.h, "Adding a weight
 * type"); a type without one inherits AVX2's, then the spec.
 */
#include "nx_quants.h" /* Q4_0 .. Q6_K variants (nx_quants_avx512.c) */
#include "nx_wtype_ew.h"

const nx_wtype_table nx_wtype_table_avx512 = {.dequant = {
                                                  [NX_GGML_F16] = nx_dequant_f16_avx512,
                                                  [NX_GGML_BF16] = nx_dequant_bf16_avx512,
                                                  [NX_GGML_Q8_0] = nx_dequant_q8_0_avx512,
                                                  [NX_GGML_Q4_0] = nx_dequant_q4_0_avx512,
                                                  [NX_GGML_Q4_1] = nx_dequant_q4_1_avx512,
                                                  [NX_GGML_Q5_0] = nx_dequant_q5_0_avx512,
                                                  [NX_GGML_Q5_1] = nx_dequant_q5_1_avx512,
                                                  [NX_GGML_Q2_K] = nx_dequant_q2_K_avx512,
                                                  [NX_GGML_Q3_K] = nx_dequant_q3_K_avx512,
                                                  [NX_GGML_Q4_K] = nx_dequant_q4_K_avx512,
                                                  [NX_GGML_Q5_K] = nx_dequant_q5_K_avx512,
                                                  [NX_GGML_Q6_K] = nx_dequant_q6_K_avx512,
                                              }};
