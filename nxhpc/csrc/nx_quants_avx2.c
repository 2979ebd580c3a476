/* nx_quants_avx2.c -- AVX2 (+F16C) dequantizers of the nine GGML block types.
 *
 * Owns: the 8-lane steps of nx_quants_ew.h (the nine loops, written once for both widths): the
 * NaN-aware add (a blend), the fifth-bit merge (a variable shift) and the Q3_K / Q4_K scale
 * unpacking (byte shuffles of the 12 packed bytes). Entered only after the CPU probe reports
 * AVX2 + FMA + F16C + OS YMM. Must not: fuse multiply and add (fp-contract off below), or
 * read/write outside the blocks given.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#pragma STDC FP_CONTRACT OFF

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* lane l (0..7) = (qh >> (j0 + l)) & 1, shifted left by 4 */
static inline __m256i qh_bits16(uint32_t qh, int j0) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j0));
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)qh), idx),
                                         _mm256_set1_epi32(1));
    return _mm256_slli_epi32(bit, 4);
}
#define NXQ_OR_QH(v, qh, j0, k16) ((void)(k16), _mm256_or_si256(v, qh_bits16(qh, j0)))
#include "nx_quants_ew.h"

static inline nxv nxq_add_m(nxv dq, nxv m) {
    return _mm256_blendv_ps(_mm256_add_ps(dq, m), dq, _mm256_cmp_ps(dq, dq, _CMP_UNORD_Q));
}

/* 12 bytes at p into the low bytes of a vector (no read past the block). */
static inline __m128i ld12(const uint8_t *p) {
    uint8_t t[16] = {0};
    memcpy(t, p, 12);
    return _mm_loadu_si128((const __m128i *)t);
}

/* lanes 0..7 then 8..15 */
static inline void nxq_scales_q3(const uint8_t *sc /* IN 12 bytes */, float d, float dl[16]) {
    const __m128i b = ld12(sc);
    const __m256i lo8 = _mm256_cvtepu8_epi32(b);
    const __m256i h = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(b, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11,
                                                                            0, 0, 0, 0, 0, 0, 0, 0)));
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
    const __m256i h0 = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), m3);
    const __m256i h1 = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), m3);
    const __m256i c0 = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(lo8, m15), _mm256_slli_epi32(h0, 4)), k32);
    const __m256i c1 = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(lo8, 4), _mm256_slli_epi32(h1, 4)), k32);
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(dl, _mm256_mul_ps(dv, nxvi_cvt(c0)));
    _mm256_storeu_ps(dl + 8, _mm256_mul_ps(dv, nxvi_cvt(c1)));
}

/* dlml[0..8) the scales, dlml[8..16) the mins */
static inline void nxq_scales_k4(const uint8_t *p, float dlml[16]) {
    const __m128i b = ld12(p + 4);
    const __m128i p1 = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i p2 = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7));
    const __m256i m1 = _mm256_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15);
    const __m256i m2 = _mm256_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48);
    const __m256i sc = _mm256_or_si256(_mm256_and_si256(_mm256_cvtepu8_epi32(p1), m1),
                                       _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(p2), 2), m2));
    const __m256i mn1 = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(p1, p1)),
                                          _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    const __m256i mn2 = _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(p2, p2)), 2);
    const __m256i mn = _mm256_or_si256(_mm256_and_si256(mn1, m1), _mm256_and_si256(mn2, m2));
    _mm256_storeu_ps(dlml, _mm256_mul_ps(_mm256_set1_ps(ld_f16(p)), nxvi_cvt(sc)));
    _mm256_storeu_ps(dlml + 8, _mm256_mul_ps(_mm256_set1_ps(ld_f16(p + 2)), nxvi_cvt(mn)));
}
