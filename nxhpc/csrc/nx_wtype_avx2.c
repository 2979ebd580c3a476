/* nx_wtype_avx2.c -- AVX2 (+F16C) dequantize variants; exports nx_wtype_table_avx2.
 * Owns: this ISA's row of the wtype dispatch family. The loops are nx_wtype_ew.h at 8 lanes.
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX2) (dispatch: nx_wtype.c).
 * The table is nx_wtype_ew.h's (both widths): a new type's SIMD dequantize is one line there.
 */
#include "nx_wtype_ew.h"
