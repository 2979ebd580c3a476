/* nx_quants_avx2.c -- AVX2 (+F16C) dequantizers of the nine GGML block types.
 *
 * Owns: the 8-lane form of the decoding in nx_quants.c: 8 lanes = 8 consecutive output elements,
 * which always share one scale. Per-block scales use the spec's float32 products (scalar or
 * lane-wise: the same IEEE ops, the same bits); each lane runs the spec's ops in the spec's order
 * (mul, then add/sub with the product as first operand). Entered only after the CPU probe reports
 * AVX2 + FMA + F16C + OS YMM. Must not: fuse multiply and add (fp-contract off below), or
 * read/write outside the blocks given.
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

/* 8 bytes -> 8 uint32 lanes */
static inline __m256i w8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

static inline __m256i srl(__m256i v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }

static inline __m256 cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

/* dq + m, except that a NaN dq is returned as is (the spec's explicit NaN rule, nx_quants.h) */
static inline __m256 add_m(__m256 dq, __m256 m) {
    return _mm256_blendv_ps(_mm256_add_ps(dq, m), dq, _mm256_cmp_ps(dq, dq, _CMP_UNORD_Q));
}

/* lane l (0..7) = (qh >> (j0 + l)) & 1, shifted left by 4 */
static inline __m256i qh_bits16(uint32_t qh, int j0) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(j0));
    const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)qh), idx),
                                         _mm256_set1_epi32(1));
    return _mm256_slli_epi32(bit, 4);
}

/* ------------------------------------------------------------------ 32-element types */

void nx_dequant_q4_0_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15), k8 = _mm256_set1_epi32(8);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_0);
        float *o = out + b * NX_QK_LEGACY;
        const __m256 d = _mm256_set1_ps(ld_f16(p));
        for (int g = 0; g < 2; g++) {
            const __m256i v = w8(p + 2 + 8 * g);
            const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(v, m15), k8);
            const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(v, 4), k8);
            _mm256_storeu_ps(o + 8 * g, _mm256_mul_ps(d, cvt(lo)));
            _mm256_storeu_ps(o + 16 + 8 * g, _mm256_mul_ps(d, cvt(hi)));
        }
    }
}

void nx_dequant_q4_1_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_1);
        float *o = out + b * NX_QK_LEGACY;
        const __m256 d = _mm256_set1_ps(ld_f16(p)), m = _mm256_set1_ps(ld_f16(p + 2));
        for (int g = 0; g < 2; g++) {
            const __m256i v = w8(p + 4 + 8 * g);
            const __m256 dlo = _mm256_mul_ps(d, cvt(_mm256_and_si256(v, m15)));
            const __m256 dhi = _mm256_mul_ps(d, cvt(_mm256_srli_epi32(v, 4)));
            _mm256_storeu_ps(o + 8 * g, add_m(dlo, m));
            _mm256_storeu_ps(o + 16 + 8 * g, add_m(dhi, m));
        }
    }
}

void nx_dequant_q5_0_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15), k16 = _mm256_set1_epi32(16);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_0);
        float *o = out + b * NX_QK_LEGACY;
        const __m256 d = _mm256_set1_ps(ld_f16(p));
        const uint32_t qh = ld_u32(p + 2);
        for (int g = 0; g < 2; g++) {
            const __m256i v = w8(p + 6 + 8 * g);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), qh_bits16(qh, 8 * g));
            const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), qh_bits16(qh, 16 + 8 * g));
            _mm256_storeu_ps(o + 8 * g, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(lo, k16))));
            _mm256_storeu_ps(o + 16 + 8 * g, _mm256_mul_ps(d, cvt(_mm256_sub_epi32(hi, k16))));
        }
    }
}

void nx_dequant_q5_1_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_1);
        float *o = out + b * NX_QK_LEGACY;
        const __m256 d = _mm256_set1_ps(ld_f16(p)), m = _mm256_set1_ps(ld_f16(p + 2));
        const uint32_t qh = ld_u32(p + 4);
        for (int g = 0; g < 2; g++) {
            const __m256i v = w8(p + 8 + 8 * g);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m15), qh_bits16(qh, 8 * g));
            const __m256i hi = _mm256_or_si256(_mm256_srli_epi32(v, 4), qh_bits16(qh, 16 + 8 * g));
            const __m256 dlo = _mm256_mul_ps(d, cvt(lo)), dhi = _mm256_mul_ps(d, cvt(hi));
            _mm256_storeu_ps(o + 8 * g, add_m(dlo, m));
            _mm256_storeu_ps(o + 16 + 8 * g, add_m(dhi, m));
        }
    }
}

/* ------------------------------------------------------------------ K-quants (256 elements) */

void nx_dequant_q2_K_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m3 = _mm256_set1_epi32(3), m15 = _mm256_set1_epi32(15);
    float dl[16] __attribute__((aligned(32))), ml[16] __attribute__((aligned(32)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q2_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        const __m256 d = _mm256_set1_ps(ld_f16(p + 80)), dmin = _mm256_set1_ps(ld_f16(p + 82));
        for (int g = 0; g < 2; g++) {
            const __m256i sc = w8(p + 8 * g);
            _mm256_store_ps(dl + 8 * g, _mm256_mul_ps(d, cvt(_mm256_and_si256(sc, m15))));
            _mm256_store_ps(ml + 8 * g, _mm256_mul_ps(dmin, cvt(_mm256_srli_epi32(sc, 4))));
        }
        for (int h = 0; h < 2; h++)
            for (int g = 0; g < 4; g++) {          /* 8-byte groups of qs[32h .. 32h+32) */
                const __m256i qv = w8(qs + 32 * h + 8 * g);
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + g / 2;
                    const __m256i q = _mm256_and_si256(srl(qv, 2 * s), m3);
                    const __m256 dq = _mm256_mul_ps(_mm256_set1_ps(dl[i]), cvt(q));
                    _mm256_storeu_ps(o + 128 * h + 32 * s + 8 * g,
                                     _mm256_sub_ps(dq, _mm256_set1_ps(ml[i])));
                }
            }
    }
}

/* 12 bytes at p into the low bytes of a vector (no read past the block). */
static inline __m128i ld12(const uint8_t *p) {
    uint8_t t[16] = {0};
    memcpy(t, p, 12);
    return _mm_loadu_si128((const __m128i *)t);
}

/* Q3_K: dl[i] = d * (scode_i - 32), scode_i = ((sc[i%8] >> 4*(i/8)) & 15)
 * | ((sc[8 + i%4] >> 2*(i/4)) & 3) << 4 (the spec's rule); lanes 0..7 then 8..15. */
static inline void scales_q3(const uint8_t *sc /* IN 12 bytes */, float d, float dl[16]) {
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
    _mm256_storeu_ps(dl, _mm256_mul_ps(dv, cvt(c0)));
    _mm256_storeu_ps(dl + 8, _mm256_mul_ps(dv, cvt(c1)));
}

void nx_dequant_q3_K_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m3 = _mm256_set1_epi32(3), m1 = _mm256_set1_epi32(1), k4 = _mm256_set1_epi32(4);
    float dl[16] __attribute__((aligned(32)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q3_K);
        const uint8_t *hm = p, *qs = p + 32, *sc = p + 96;
        float *o = out + b * NX_QK_K;
        scales_q3(sc, ld_f16(p + 108), dl);
        for (int g = 0; g < 4; g++) {
            const __m256i hw = w8(hm + 8 * g);
            for (int h = 0; h < 2; h++) {
                const __m256i qv = w8(qs + 32 * h + 8 * g);
                for (int s = 0; s < 4; s++) {
                    const int i = 8 * h + 2 * s + g / 2;
                    const __m256i lo = _mm256_and_si256(srl(qv, 2 * s), m3);
                    const __m256i hi = _mm256_and_si256(srl(hw, 4 * h + s), m1);
                    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 2)), k4);
                    _mm256_storeu_ps(o + 128 * h + 32 * s + 8 * g,
                                     _mm256_mul_ps(_mm256_set1_ps(dl[i]), cvt(q)));
                }
            }
        }
    }
}

/* Q4_K/Q5_K: dl[j] = d * sc[j], ml[j] = dmin * mn[j] (the spec's rule, nx_quants.c), as
 * ((s[i1] >> sh1) & m1) | ((s[i2] >> 2) & m2) per lane: j < 4: sc = s[j] & 63, mn = s[j+4] & 63;
 * j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4, mn = (s[j+4] >> 4) | (s[j] >> 6) << 4. */
static inline void scales_k4(const uint8_t *p, float dl[8], float ml[8]) {
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
    _mm256_storeu_ps(dl, _mm256_mul_ps(_mm256_set1_ps(ld_f16(p)), cvt(sc)));
    _mm256_storeu_ps(ml, _mm256_mul_ps(_mm256_set1_ps(ld_f16(p + 2)), cvt(mn)));
}

void nx_dequant_q4_K_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q4_K), *qs = p + 16;
        float *o = out + b * NX_QK_K;
        float dl[8] __attribute__((aligned(32))), ml[8] __attribute__((aligned(32)));
        scales_k4(p, dl, ml);
        for (int c = 0; c < 4; c++) {
            const __m256 d0 = _mm256_set1_ps(dl[2 * c]), m0 = _mm256_set1_ps(ml[2 * c]);
            const __m256 d1 = _mm256_set1_ps(dl[2 * c + 1]), m1 = _mm256_set1_ps(ml[2 * c + 1]);
            for (int g = 0; g < 4; g++) {
                const __m256i qv = w8(qs + 32 * c + 8 * g);
                const __m256 lo = _mm256_mul_ps(d0, cvt(_mm256_and_si256(qv, m15)));
                const __m256 hi = _mm256_mul_ps(d1, cvt(_mm256_srli_epi32(qv, 4)));
                _mm256_storeu_ps(o + 64 * c + 8 * g, _mm256_sub_ps(lo, m0));
                _mm256_storeu_ps(o + 64 * c + 32 + 8 * g, _mm256_sub_ps(hi, m1));
            }
        }
    }
}

void nx_dequant_q5_K_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q5_K), *qh = p + 16, *qs = p + 48;
        float *o = out + b * NX_QK_K;
        float dl[8] __attribute__((aligned(32))), ml[8] __attribute__((aligned(32)));
        scales_k4(p, dl, ml);
        for (int c = 0; c < 4; c++) {
            const __m256 d0 = _mm256_set1_ps(dl[2 * c]), m0 = _mm256_set1_ps(ml[2 * c]);
            const __m256 d1 = _mm256_set1_ps(dl[2 * c + 1]), m1 = _mm256_set1_ps(ml[2 * c + 1]);
            for (int g = 0; g < 4; g++) {
                const __m256i qv = w8(qs + 32 * c + 8 * g), hw = w8(qh + 8 * g);
                const __m256i h0 = _mm256_slli_epi32(_mm256_and_si256(srl(hw, 2 * c), one), 4);
                const __m256i h1 = _mm256_slli_epi32(_mm256_and_si256(srl(hw, 2 * c + 1), one), 4);
                const __m256i q0 = _mm256_or_si256(_mm256_and_si256(qv, m15), h0);
                const __m256i q1 = _mm256_or_si256(_mm256_srli_epi32(qv, 4), h1);
                const __m256 lo = _mm256_mul_ps(d0, cvt(q0)), hi = _mm256_mul_ps(d1, cvt(q1));
                _mm256_storeu_ps(o + 64 * c + 8 * g, _mm256_sub_ps(lo, m0));
                _mm256_storeu_ps(o + 64 * c + 32 + 8 * g, _mm256_sub_ps(hi, m1));
            }
        }
    }
}

void nx_dequant_q6_K_avx2(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t nblocks) {
    const __m256i m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3), k32 = _mm256_set1_epi32(32);
    float dl[16] __attribute__((aligned(32)));
    for (size_t b = 0; b < nblocks; b++) {
        const uint8_t *p = blocks + b * sizeof(nx_block_q6_K), *ql = p, *qh = p + 128;
        float *o = out + b * NX_QK_K;
        const __m256 d = _mm256_set1_ps(ld_f16(p + 208));
        for (int g = 0; g < 2; g++) {
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + 8 * g)));
            _mm256_store_ps(dl + 8 * g, _mm256_mul_ps(d, cvt(sc)));
        }
        for (int h = 0; h < 2; h++)
            for (int r0 = 0; r0 < 128; r0 += 8) {
                const __m256i lo = _mm256_and_si256(srl(w8(ql + 64 * h + r0 % 64), 4 * (r0 / 64)), m15);
                const __m256i hi = _mm256_and_si256(srl(w8(qh + 32 * h + r0 % 32), 2 * (r0 / 32)), m3);
                const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), k32);
                _mm256_storeu_ps(o + 128 * h + r0,
                                 _mm256_mul_ps(_mm256_set1_ps(dl[8 * h + r0 / 16]), cvt(q)));
            }
    }
}
