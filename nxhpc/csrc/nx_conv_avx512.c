/* nx_conv_avx512.c -- AVX-512 variants of the convolutional kernels (nx_conv_ew.h at 16 lanes);
 * exports nx_conv_table_avx512 (the slots it leaves NULL inherit avx2's, then the spec).
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX512) (dispatch: nx_conv.c). */
#include "nx_conv.h"
#include "nx_conv_ew.h"

const nx_conv_table nx_conv_table_avx512 = {.gn_partials = nx_gn_partials_f32_avx512,
                                            .affine_act = nx_affine_act_f32_avx512,
                                            .im2col3x3 = nx_im2col3x3_f32_avx512,
                                            .add = nx_add_f32_avx512};
