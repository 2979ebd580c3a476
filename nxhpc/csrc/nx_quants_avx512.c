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

static inline nxv nxq_add_m(nxv dq, nxv m) {
    return _mm512_mask_mov_ps(_mm512_add_ps(dq, m), _mm512_cmp_ps_mask(dq, dq, _CMP_UNORD_Q), dq);
}

/* lane i: low 4 bits (sc[i%8] >> 4*(i/8)) & 15, high 2 bits (sc[8 + i%4] >> 2*(i/4)) & 3 */
static inline void nxq_scales_q3(const uint8_t *sc /* IN 12 bytes */, float d, float dl[16]) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x0fff, sc));   /* no overread */
    const __m512i ilo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i slo = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i ihi = _mm512_setr_epi32(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11);
    const __m512i shi = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(ilo, b), slo),
                                        _mm512_set1_epi32(15));
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(ihi, b), shi),
                                        _mm512_set1_epi32(3));
    const __m512i code = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)),
                                          _mm512_set1_epi32(32));
    _mm512_storeu_ps(dl, _mm512_mul_ps(_mm512_set1_ps(d), nxvi_cvt(code)));
}

/* lanes 0..7 the scales, 8..15 the mins (nx_kscales_avx512.h, shared with the AMX packer) */
static inline void nxq_scales_k4(const uint8_t *p, float dlml[16]) {
    _mm512_storeu_ps(dlml, nx_k4_scales16(p));
}
