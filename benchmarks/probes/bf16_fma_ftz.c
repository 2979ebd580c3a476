/* bf16_fma_ftz.c -- probe: is vfmadd231ps under MXCSR DAZ|FTZ exactly the bf16 dot step of
 * nxhpc/csrc/nx_lowp.h, step(acc, a, b) = ftz(fmaf(daz(a), daz(b), daz(acc)))? (The bf16
 * attention's AVX-512 kernel, nxhpc/csrc/nx_attn_bf16_avx512bf16.c, relies on it.)
 *
 *   gcc -O2 -mavx512f -mfma bf16_fma_ftz.c -o /tmp/bf16_fma_ftz -lm && /tmp/bf16_fma_ftz
 *
 * Cases: bfloat16 a, b (8-bit significands, as the kernel's operands) and float32 acc: products
 * near 2^-126, cancellation to tiny results, subnormal accumulators (DAZ), normal range; and
 * the tininess point (a result that rounds up to 2^-126 from below must stay 2^-126: tininess
 * after rounding). Intel Xeon family 6 model 167: 0 of 3.2e7 differ, tininess after rounding.
 * Owns nothing the package uses; must not be built by setup.py (it is not under nxhpc/csrc).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static float daz(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&v, &u, 4);
    return v;
}
static float step(float acc, float a, float b) { return daz(fmaf(daz(a), daz(b), daz(acc))); }
static uint64_t rs = 88172645463325252ull;
static uint64_t xr(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}
/* a random value of biased exponent e0 +- er with `bits` significand bits (7: bfloat16) */
static float rnd(int e0, int er, int bits) {
    int e = e0 + (int)(xr() % (uint64_t)(2 * er + 1)) - er;
    uint32_t s = (uint32_t)(xr() & 1), m = (uint32_t)(xr() & ((1u << bits) - 1)) << (23 - bits);
    uint32_t u = (s << 31) | ((uint32_t)(e < 0 ? 0 : e) << 23) | m;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static __m512 fma_daz_ftz(__m512 a, __m512 b, __m512 c) {
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u);
    __asm__ volatile("" : "+v"(a), "+v"(b), "+v"(c));
    __m512 r = _mm512_fmadd_ps(a, b, c);
    __asm__ volatile("" : "+v"(r));
    _mm_setcsr(old);
    return r;
}

int main(void) {
    long n = 0, bad = 0;
    for (int it = 0; it < 2000000; it++) {
        float A[16], B[16], C[16], R[16];
        for (int i = 0; i < 16; i++) {
            switch (xr() % 4) {
            case 0: A[i] = rnd(63, 2, 7), B[i] = rnd(63, 2, 7), C[i] = rnd(2, 3, 23); break;
            case 1:
                A[i] = rnd(63, 8, 7), B[i] = -rnd(63, 8, 7), C[i] = rnd(1, 2, 23);
                if (xr() & 1) C[i] = -(A[i] * B[i]);
                break;
            case 2: A[i] = rnd(60, 6, 7), B[i] = rnd(60, 6, 7), C[i] = rnd(0, 1, 23); break;
            default: A[i] = rnd(127, 20, 7), B[i] = rnd(127, 20, 7), C[i] = rnd(127, 30, 23);
            }
            if (xr() % 8 == 0) A[i] = (xr() & 1) ? 0.0f : -0.0f;
        }
        _mm512_storeu_ps(R, fma_daz_ftz(_mm512_loadu_ps(A), _mm512_loadu_ps(B), _mm512_loadu_ps(C)));
        for (int i = 0; i < 16; i++, n++) {
            const float w = step(C[i], A[i], B[i]);
            if (memcmp(&w, &R[i], 4)) bad++;
        }
    }
    /* tininess: 2^-126 - 2^-151 rounds to 2^-126 (normal): kept after rounding, 0 before */
    float A[16], B[16], C[16], R[16];
    for (int i = 0; i < 16; i++) A[i] = ldexpf(1, -76), B[i] = -ldexpf(1, -75), C[i] = ldexpf(1, -126);
    _mm512_storeu_ps(R, fma_daz_ftz(_mm512_loadu_ps(A), _mm512_loadu_ps(B), _mm512_loadu_ps(C)));
    printf("random: %ld of %ld differ from step(); 2^-126 - 2^-151 -> %a (step: %a): tininess %s"
           " rounding\n", bad, n, R[0], step(C[0], A[0], B[0]),
           R[0] == ldexpf(1, -126) ? "after" : "before");
    return bad != 0;
}
