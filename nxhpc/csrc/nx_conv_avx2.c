/* nx_conv_avx2.c -- AVX2 variants of the convolutional kernels (nx_conv_ew.h at 8 lanes); exports
 * nx_conv_table_avx2 (the slots it leaves NULL inherit the generic spec).
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX2) (dispatch: nx_conv.c). */
#include "nx_conv.h"
#include "nx_conv_ew.h"

const nx_conv_table nx_conv_table_avx2 = {.gn_partials = nx_gn_partials_f32_avx2,
                                          .affine_act = nx_affine_act_f32_avx2,
                                          .im2col3x3 = nx_im2col3x3_f32_avx2,
                                          .add = nx_add_f32_avx2};
