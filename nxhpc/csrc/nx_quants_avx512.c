/* nx_quants_avx512.c -- AVX-512 (F/BW/VL/DQ) dequantizers of the nine GGML block types.
 *
 * Owns: the 16-lane steps of nx_quants_ew.h (the nine loops, written once for both widths): the
 * NaN-aware add, the fifth-bit merge (a mask OR) and the Q3_K / Q4_K scale unpacking (one
 * permute per vector). Entered only after the CPU probe reports AVX-512 + OS ZMM.
 * Must not: fuse multiply and add (fp-contract off below), or read/write outside the blocks given.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#pragma STDC FP_CONTRACT OFF

/* the fifth bits: a mask OR of 16 into the lanes whose bit of qh is set */
#define NXQ_OR_QH(v, qh, j0, k16) _mm512_mask_or_epi32(v, (__mmask16)((qh) >> (j0)), v, k16)
#include "nx_quants_ew.h"
#include "nx_kscales_avx512.h"

static inline nxv nxq_add_m(nxv dq, nxv m) { return nx_add_m16(dq, m); }

/* the Q3_K scales (nx_kscales_avx512.h, shared with the AMX packer) */
static inline void nxq_scales_q3(const uint8_t *sc /* IN 12 bytes */, float d, float dl[16]) {
    _mm512_storeu_ps(dl, nx_q3k_scales16(sc, d));
}

/* lanes 0..7 the scales, 8..15 the mins (nx_kscales_avx512.h, shared with the AMX packer) */
static inline void nxq_scales_k4(const uint8_t *p, float dlml[16]) {
    _mm512_storeu_ps(dlml, nx_k4_scales16(p));
}
