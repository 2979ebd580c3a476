/* nx_wtype_avx512.c -- AVX-512 dequantize variants; exports nx_wtype_table_avx512.
 * Owns: this ISA's row of the wtype dispatch family. The loops are nx_wtype_ew.h at 16 lanes.
 * Must not: be entered unless nx_cpu_isa_supported(NX_ISA_AVX512) (dispatch: nx_wtype.c).
 * The table is nx_wtype_ew.h's (both widths): a new type's SIMD dequantize is one line there; a
 * type without one inherits AVX2's, then the spec.
 */
#include "nx_wtype_ew.h"
