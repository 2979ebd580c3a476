/* nx_q8_0.c -- the Q8_0 quantizer: the generic (scalar) spec and the family's dispatch.
 *
 * Owns: the quantizer bit-for-bit equal to the gguf package (ggml reference). Compiled with no
 * ISA flags: runs on any CPU. Must not: use SIMD intrinsics (the AVX2 and AVX-512 variants live in
 * nx_q8_0_avx2.c, nx_q8_0_avx512.c).
 */
#include "nx_q8_0.h"

#include <math.h>
#include <string.h>

NX_DEFINE_DISPATCH(nx_q8_0, "q8_0", NX_Q8_0_SLOTS,
                   {[NX_ISA_GENERIC] = &nx_q8_0_table_generic,
                    NX_X86_ONLY([NX_ISA_AVX2] = &nx_q8_0_table_avx2,
                                [NX_ISA_AVX512] = &nx_q8_0_table_avx512, )})

void nx_q8_0_quantize(nx_isa isa, const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    nx_q8_0_get(isa)->q8_0_quantize(x, out, nblocks);
}

/* ------------------------------------------------------------------ quantize */

/* round-half-away-from-zero of v, then numpy's float32 -> int8 cast (via int32; NaN, inf and
 * |v| >= 2^31 give INT32_MIN whose low byte is 0; in-range values wrap modulo 256). */
static inline uint8_t nx_round_q(float v) {
    float a = fabsf(v);
    if (!(a < 2147483648.0f)) return 0;
    float f = floorf(a);
    float b = f + ((a - f) >= 0.5f ? 1.0f : 0.0f);
    int64_t i = (int64_t)b;
    if (v < 0.0f) i = -i;
    return (uint8_t)((uint64_t)i & 0xffu);
}

void nx_q8_0_quantize_generic(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    for (size_t blk = 0; blk < nblocks; blk++) {
        const float *xb = x + blk * NX_QK8_0;
        uint8_t *ob = out + blk * NX_Q8_0_BLOCK_BYTES;
        float amax = 0.0f;
        int have_nan = 0;
        for (int i = 0; i < NX_QK8_0; i++) {
            float a = fabsf(xb[i]);
            if (a != a) { /* numpy's max propagates NaN */
                if (!have_nan) {
                    amax = a;
                    have_nan = 1;
                }
            } else if (!have_nan && a > amax) {
                amax = a;
            }
        }
        float d = amax / 127.0f;
        float id = (d == 0.0f) ? 0.0f : 1.0f / d;
        uint16_t dh = nx_f32_to_f16(d);
        memcpy(ob, &dh, 2);
        for (int i = 0; i < NX_QK8_0; i++) ob[2 + i] = nx_round_q(xb[i] * id);
    }
}

const nx_q8_0_table nx_q8_0_table_generic = {.q8_0_quantize = nx_q8_0_quantize_generic};
