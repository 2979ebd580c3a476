/* nx_kscales_avx512.h -- the sub-block scales (and mins) of one Q4_K / Q5_K / Q3_K block as one
 * float32 vector, and the + m of the types with a min, shared by the AVX-512 dequantizer
 * (nx_quants_avx512.c) and the AMX bf16 weight packer (nx_lowp_amx.c), which must decode
 * identically.
 *
 * Owns: nothing of a contract; only the spec's decoding (nx_quants.c). Q4_K / Q5_K: lane j < 8 =
 * d * sc_j, lane 8 + j = dmin * mn_j, each one float32 product of the block's f16 d / dmin and
 * its 6-bit codes (j < 4: sc = s[j] & 63, mn = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) |
 * (s[j-4] >> 6) << 4, mn = (s[j+4] >> 4) | (s[j] >> 6) << 4, s = the 12 bytes at p + 4). Q3_K:
 * lane i = d * (scode_i - 32), scode_i = ((sc[i%8] >> 4*(i/8)) & 15) | ((sc[8 + i%4] >> 2*(i/4))
 * & 3) << 4, sc = the 12 bytes of scales.
 * Include only from files compiled with the avx512 flags (F/BW/VL/DQ, F16C). Must not read
 * beyond the bytes named (the 12 scale bytes, d, dmin).
 */
#ifndef NX_KSCALES_AVX512_H
#define NX_KSCALES_AVX512_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* One permute per source byte vector: lane value = ((s[i1] >> sh1) & m1) | ((s[i2] >> 2) & m2),
 * which spells the rule above. */
static inline __m512 nx_k4_scales16(const uint8_t *p /* IN block */) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x0fff, p + 4)); /* no overread */
    const __m512i i1 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m512i s1 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i m1 =
        _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i i2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const __m512i m2 = _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
    const __m512i v = _mm512_or_si512(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(i1, b), s1), m1),
        _mm512_and_si512(_mm512_srli_epi32(_mm512_permutexvar_epi32(i2, b), 2), m2));
    uint16_t d, dmin;
    memcpy(&d, p, 2);
    memcpy(&dmin, p + 2, 2);
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(d)),
                                         _mm256_set1_ps(_cvtsh_ss(dmin)), 1);
    return _mm512_mul_ps(dd, _mm512_cvtepi32_ps(v));
}

/* dq + m with the spec's NaN rule (nx_quants.h): a NaN dq is returned as is (Q4_1, Q5_1). */
static inline __m512 nx_add_m16(__m512 dq, __m512 m) {
    return _mm512_mask_mov_ps(_mm512_add_ps(dq, m), _mm512_cmp_ps_mask(dq, dq, _CMP_UNORD_Q), dq);
}

/* Q3_K: the 16 products d * (scode_i - 32) (reads exactly the 12 bytes at sc). */
static inline __m512 nx_q3k_scales16(const uint8_t *sc /* IN 12 bytes */, float d) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x0fff, sc)); /* no overread */
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
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(code));
}

#endif
