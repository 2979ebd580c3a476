/* nx_q8_0_avx512.c -- AVX-512 (F/BW/VL/DQ) variant of the Q8_0 quantizer; exports
 * nx_q8_0_table_avx512. Byte-identical to the generic spec (nx_q8_0.c); blocks holding a NaN take
 * the spec itself. Entered only after the CPU probe reports AVX-512 + OS ZMM support.
 * (Q8_0 dequantize and matmul: nx_wtype_avx512.c, nx_matmul_avx512.c.)
 */
#include "nx_q8_0.h"

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

/* round-half-away(v), then float32 -> int32 (INT32_MIN for non-finite) -> low byte. */
static inline __m128i nx_round_q16(__m512 v) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    __m512 a = _mm512_andnot_ps(sign, v);
    __m512 f = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_sub_ps(a, f), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    __m512 b = _mm512_mask_add_ps(f, up, f, _mm512_set1_ps(1.0f));
    b = _mm512_or_ps(b, _mm512_and_ps(sign, v));
    return _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(b));
}

void nx_q8_0_quantize_avx512(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (size_t blk = 0; blk < nblocks; blk++) {
        const float *xb = x + blk * NX_QK8_0;
        uint8_t *ob = out + blk * NX_Q8_0_BLOCK_BYTES;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        __mmask16 nan =
            _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
        if (nan) { /* NaN propagation rules: the spec handles it */
            nx_q8_0_quantize_generic(xb, ob, 1);
            continue;
        }
        __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float id = (d == 0.0f) ? 0.0f : 1.0f / d;
        uint16_t dh = (uint16_t)_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        memcpy(ob, &dh, 2);
        __m512 vid = _mm512_set1_ps(id);
        _mm_storeu_si128((__m128i *)(ob + 2), nx_round_q16(_mm512_mul_ps(v0, vid)));
        _mm_storeu_si128((__m128i *)(ob + 18), nx_round_q16(_mm512_mul_ps(v1, vid)));
    }
}

const nx_q8_0_table nx_q8_0_table_avx512 = {.q8_0_quantize = nx_q8_0_quantize_avx512};
