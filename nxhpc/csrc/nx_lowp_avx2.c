/* nx_lowp_avx2.c -- the avx2 table of the "lowp" family (bf16 on float32 FMA chains:
 * nx_lowp_bf16_avx2.c). Owns only the table. */
#include "nx_lowp.h"

const nx_lowp_table nx_lowp_table_avx2 = {.matmul_bf16 = nx_matmul_bf16_avx2,
                                          .round_bf16 = nx_bf16_round_n_avx2};
