/* nx_q8_0_avx2.c -- AVX2 (+ F16C) variant of the Q8_0 quantizer; exports nx_q8_0_table_avx2.
 * Byte-identical to the generic spec (nx_q8_0.c); blocks holding a NaN take the spec itself.
 * Entered only after the CPU probe reports the avx2 level with OS YMM support.
 *
 * Owns: the AVX2 form of round-half-away and of numpy's float32 -> int8 cast. Must not: change
 * the spec's d, 1/d or rounding (the q8 matmul's activation packer relies on these bytes).
 */
#include "nx_q8_0.h"

#include <immintrin.h>
#include <string.h>

/* round-half-away(v), then float32 -> int32 (INT32_MIN for non-finite, whose low byte is 0) as
 * int32 lanes: the spec's nx_round_q before its final byte cut. */
static inline __m256i nx_round_q8(__m256 v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, v);
    const __m256 f = _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(a, f), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 b = _mm256_add_ps(f, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
    b = _mm256_or_ps(b, _mm256_and_ps(sign, v));
    return _mm256_cvttps_epi32(b);
}

void nx_q8_0_quantize_avx2(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lowbyte = _mm256_set1_epi32(0xff);
    for (size_t blk = 0; blk < nblocks; blk++) {
        const float *xb = x + blk * NX_QK8_0;
        uint8_t *ob = out + blk * NX_Q8_0_BLOCK_BYTES;
        __m256 v[4], m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        if (_mm256_movemask_ps(nan)) { /* NaN propagation rules: the spec handles it */
            nx_q8_0_quantize_generic(xb, ob, 1);
            continue;
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float amax = _mm_cvtss_f32(h); /* exact in any order (no NaN here) */
        const float d = amax / 127.0f;
        const float id = (d == 0.0f) ? 0.0f : 1.0f / d;
        const uint16_t dh = (uint16_t)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(ob, &dh, 2);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = _mm256_and_si256(nx_round_q8(_mm256_mul_ps(v[i], vid)), lowbyte);
        /* low bytes 0..255: the unsigned packs keep them; then undo the lane interleave */
        const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]),
                                              _mm256_packus_epi32(q[2], q[3]));
        const __m256i o = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(ob + 2), o);
    }
}

const nx_q8_0_table nx_q8_0_table_avx2 = {.q8_0_quantize = nx_q8_0_quantize_avx2};
