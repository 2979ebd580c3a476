/* nx_quants_avx512.c -- AVX-512 (F/BW/VL/DQ) dequantizers of the nine GGML block types.
 *
 * Owns: the vector form of the decoding in nx_quants.c: 16 lanes = 16 consecutive output
 * elements, which in every layout share one scale (sub-blocks are 16 or 32 elements). Per-block
 * scales are computed with the same float32 products as the spec (scalar or lane-wise: IEEE ops
 * give the same bits), then each lane runs the spec's ops in the spec's order (mul, then add/sub
 * with the product as first operand). Entered only after the CPU probe reports AVX-512 + OS ZMM.
 * Must not: fuse multiply and add (fp-contract off below), or read/write outside the blocks given.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#pragma STDC FP_CONTRACT OFF

#include "nx_quants.h"

#include <immintrin.h>
#include <string.h>

static inline float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint32_t ld_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);   /* x86 is little-endian */
    return v;
}

/* 16 bytes -> 16 uint32 lanes */
static inline __m512i w16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

static inline __m512i srl(__m512i v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }

static inline __m512 cvt(__m512i v) { return _mm512_cvtepi32_ps(v); }

/* dq + m, except that a NaN dq is returned as is (the spec's explicit NaN rule, nx_quants.h) */
static inline __m512 add_m(__m512 dq, __m512 m) {
    return _mm512_mask_mov_ps(_mm512_add_ps(dq, m), _mm512_cmp_ps_mask(dq, dq, _CMP_UNORD_Q), dq);
}

/* ------------------------------------------------------------------ 32-element types */

void nx_dequant_q4_0_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15), k8 = _mm512_set1_epi32(8);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_0);
        float *o = out + b * NX_QK_LEGACY;
        const __m512 d = _mm512_set1_ps(ld_f16(p));
        const __m512i v = w16(p + 2);
        const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(v, m15), k8);
        const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), k8);
        _mm512_storeu_ps(o, _mm512_mul_ps(d, cvt(lo)));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(d, cvt(hi)));
    }
}

void nx_dequant_q4_1_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_1);
        float *o = out + b * NX_QK_LEGACY;
        const __m512 d = _mm512_set1_ps(ld_f16(p)), m = _mm512_set1_ps(ld_f16(p + 2));
        const __m512i v = w16(p + 4);
        const __m512 dlo = _mm512_mul_ps(d, cvt(_mm512_and_si512(v, m15)));
        const __m512 dhi = _mm512_mul_ps(d, cvt(_mm512_srli_epi32(v, 4)));
        _mm512_storeu_ps(o, add_m(dlo, m));
        _mm512_storeu_ps(o + 16, add_m(dhi, m));
    }
}

void nx_dequant_q5_0_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15), k16 = _mm512_set1_epi32(16);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_0);
        float *o = out + b * NX_QK_LEGACY;
        const __m512 d = _mm512_set1_ps(ld_f16(p));
        const uint32_t qh = ld_u32(p + 2);
        const __m512i v = w16(p + 6);
        __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_srli_epi32(v, 4);
        lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xffffu), lo, k16);
        hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, k16);
        _mm512_storeu_ps(o, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(lo, k16))));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(d, cvt(_mm512_sub_epi32(hi, k16))));
    }
}

void nx_dequant_q5_1_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15), k16 = _mm512_set1_epi32(16);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_1);
        float *o = out + b * NX_QK_LEGACY;
        const __m512 d = _mm512_set1_ps(ld_f16(p)), m = _mm512_set1_ps(ld_f16(p + 2));
        const uint32_t qh = ld_u32(p + 4);
        const __m512i v = w16(p + 8);
        __m512i lo = _mm512_and_si512(v, m15), hi = _mm512_srli_epi32(v, 4);
        lo = _mm512_mask_or_epi32(lo, (__mmask16)(qh & 0xffffu), lo, k16);
        hi = _mm512_mask_or_epi32(hi, (__mmask16)(qh >> 16), hi, k16);
        const __m512 dlo = _mm512_mul_ps(d, cvt(lo)), dhi = _mm512_mul_ps(d, cvt(hi));
        _mm512_storeu_ps(o, add_m(dlo, m));
        _mm512_storeu_ps(o + 16, add_m(dhi, m));
    }
}

/* ------------------------------------------------------------------ K-quants (256 elements) */

void nx_dequant_q2_K_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m3 = _mm512_set1_epi32(3), m15 = _mm512_set1_epi32(15);
    float dl[16] __attribute__((aligned(64))), ml[16] __attribute__((aligned(64)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q2_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        const __m512i sc = w16(p);
        _mm512_store_ps(dl, _mm512_mul_ps(_mm512_set1_ps(ld_f16(p + 80)),
                                          cvt(_mm512_and_si512(sc, m15))));
        _mm512_store_ps(ml, _mm512_mul_ps(_mm512_set1_ps(ld_f16(p + 82)),
                                          cvt(_mm512_srli_epi32(sc, 4))));
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) {
                const __m512i qv = w16(qs + 32 * h + 16 * half);
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + half;
                    const __m512i q = _mm512_and_si512(srl(qv, 2 * s), m3);
                    const __m512 dq = _mm512_mul_ps(_mm512_set1_ps(dl[i]), cvt(q));
                    _mm512_storeu_ps(o + 128 * h + 32 * s + 16 * half,
                                     _mm512_sub_ps(dq, _mm512_set1_ps(ml[i])));
                }
            }
    }
}

/* Q3_K: dl[i] = d * (scode_i - 32) for the 16 sub-blocks, lane i: low 4 bits
 * (sc[i%8] >> 4*(i/8)) & 15, high 2 bits (sc[8 + i%4] >> 2*(i/4)) & 3 (the spec's rule). */
static inline void scales_q3(const uint8_t *sc /* IN 12 bytes */, float d, float dl[16]) {
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
    _mm512_storeu_ps(dl, _mm512_mul_ps(_mm512_set1_ps(d), cvt(code)));
}

void nx_dequant_q3_K_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m3 = _mm512_set1_epi32(3), m1 = _mm512_set1_epi32(1), k4 = _mm512_set1_epi32(4);
    float dl[16] __attribute__((aligned(64)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q3_K);
        const uint8_t *hm = p, *qs = p + 32, *sc = p + 96;
        float *o = out + b * NX_QK_K;
        scales_q3(sc, ld_f16(p + 108), dl);
        const __m512i hw0 = w16(hm), hw1 = w16(hm + 16);
        for (int h = 0; h < 2; h++)
            for (int half = 0; half < 2; half++) {
                const __m512i qv = w16(qs + 32 * h + 16 * half), hw = half ? hw1 : hw0;
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + half;
                    const __m512i lo = _mm512_and_si512(srl(qv, 2 * s), m3);
                    const __m512i hi = _mm512_and_si512(srl(hw, 4 * h + s), m1);
                    const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 2)), k4);
                    _mm512_storeu_ps(o + 128 * h + 32 * s + 16 * half,
                                     _mm512_mul_ps(_mm512_set1_ps(dl[i]), cvt(q)));
                }
            }
    }
}

/* Q4_K/Q5_K: dl[j] = d * sc[j], ml[j] = dmin * mn[j] for the 8 sub-blocks (as the spec), in one
 * vector: lanes 0..7 the scales, 8..15 the mins. Lane value = ((s[i1] >> sh1) & m1) |
 * ((s[i2] >> 2) & m2), which spells the spec's rule: j < 4: sc = s[j] & 63, mn = s[j+4] & 63;
 * j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, mn = (s[j+4] >> 4) | (s[j] >> 6) << 4. */
static inline void scales_k4(const uint8_t *p, float dlml[16]) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x0fff, p + 4));   /* no overread */
    const __m512i i1 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const __m512i s1 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i m1 = _mm512_setr_epi32(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15);
    const __m512i i2 = _mm512_setr_epi32(0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const __m512i m2 = _mm512_setr_epi32(0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48);
    const __m512i v = _mm512_or_si512(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(i1, b), s1), m1),
        _mm512_and_si512(_mm512_srli_epi32(_mm512_permutexvar_epi32(i2, b), 2), m2));
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(ld_f16(p)), _mm256_set1_ps(ld_f16(p + 2)), 1);
    _mm512_storeu_ps(dlml, _mm512_mul_ps(dd, cvt(v)));
}

void nx_dequant_q4_K_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        float dlml[16] __attribute__((aligned(64)));
        scales_k4(p, dlml);
        const float *dl = dlml, *ml = dlml + 8;
        for (int c = 0; c < 4; c++) {
            const __m512 d0 = _mm512_set1_ps(dl[2 * c]), m0 = _mm512_set1_ps(ml[2 * c]);
            const __m512 d1 = _mm512_set1_ps(dl[2 * c + 1]), m1 = _mm512_set1_ps(ml[2 * c + 1]);
            for (int half = 0; half < 2; half++) {
                const __m512i qv = w16(qs + 32 * c + 16 * half);
                const __m512 lo = _mm512_mul_ps(d0, cvt(_mm512_and_si512(qv, m15)));
                const __m512 hi = _mm512_mul_ps(d1, cvt(_mm512_srli_epi32(qv, 4)));
                _mm512_storeu_ps(o + 64 * c + 16 * half, _mm512_sub_ps(lo, m0));
                _mm512_storeu_ps(o + 64 * c + 32 + 16 * half, _mm512_sub_ps(hi, m1));
            }
        }
    }
}

void nx_dequant_q5_K_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15), m1 = _mm512_set1_epi32(1);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_K), *qh = p + 16, *qs = p + 48;
        float *o = out + b * NX_QK_K;
        float dlml[16] __attribute__((aligned(64)));
        scales_k4(p, dlml);
        const float *dl = dlml, *ml = dlml + 8;
        const __m512i hw0 = w16(qh), hw1 = w16(qh + 16);
        for (int c = 0; c < 4; c++) {
            const __m512 d0 = _mm512_set1_ps(dl[2 * c]), m0 = _mm512_set1_ps(ml[2 * c]);
            const __m512 d1 = _mm512_set1_ps(dl[2 * c + 1]), mm1 = _mm512_set1_ps(ml[2 * c + 1]);
            for (int half = 0; half < 2; half++) {
                const __m512i qv = w16(qs + 32 * c + 16 * half), hw = half ? hw1 : hw0;
                const __m512i h0 = _mm512_slli_epi32(_mm512_and_si512(srl(hw, 2 * c), m1), 4);
                const __m512i h1 = _mm512_slli_epi32(_mm512_and_si512(srl(hw, 2 * c + 1), m1), 4);
                const __m512i q0 = _mm512_or_si512(_mm512_and_si512(qv, m15), h0);
                const __m512i q1 = _mm512_or_si512(_mm512_srli_epi32(qv, 4), h1);
                const __m512 lo = _mm512_mul_ps(d0, cvt(q0)), hi = _mm512_mul_ps(d1, cvt(q1));
                _mm512_storeu_ps(o + 64 * c + 16 * half, _mm512_sub_ps(lo, m0));
                _mm512_storeu_ps(o + 64 * c + 32 + 16 * half, _mm512_sub_ps(hi, mm1));
            }
        }
    }
}

void nx_dequant_q6_K_avx512(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m512i m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3), k32 = _mm512_set1_epi32(32);
    float dl[16] __attribute__((aligned(64)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q6_K), *ql = p, *qh = p + 128;
        float *o = out + b * NX_QK_K;
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)));
        _mm512_store_ps(dl, _mm512_mul_ps(_mm512_set1_ps(ld_f16(p + 208)), cvt(sc)));
        for (int h = 0; h < 2; h++)
            for (int r0 = 0; r0 < 128; r0 += 16) {
                const __m512i lo = _mm512_and_si512(srl(w16(ql + 64 * h + r0 % 64), 4 * (r0 / 64)), m15);
                const __m512i hi = _mm512_and_si512(srl(w16(qh + 32 * h + r0 % 32), 2 * (r0 / 32)), m3);
                const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), k32);
                _mm512_storeu_ps(o + 128 * h + r0,
                                 _mm512_mul_ps(_mm512_set1_ps(dl[8 * h + r0 / 16]), cvt(q)));
            }
    }
}
