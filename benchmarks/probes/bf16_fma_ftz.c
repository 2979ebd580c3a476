/* bf16_fma_ftz.c -- probe: are vfmadd231ps under MXCSR DAZ|FTZ and vdpbf16ps exactly the bf16
 * dot step of nxhpc/csrc/nx_lowp.h, step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc))) with
 * x86's ftz (the zero of the result's sign where the exact value, rounded to 24 bits with an
 * unbounded exponent, is below 2^-126)? (The bf16 kernels of nx_lowp_bf16_avx2.c,
 * nx_lowp_avx512bf16.c, nx_attn_bf16_avx2.c and nx_attn_bf16_avx512bf16.c rely on it.)
 *
 *   gcc -O2 -mavx512f -mavx512bf16 -mfma bf16_fma_ftz.c -o /tmp/bf16_fma_ftz -lm && /tmp/bf16_fma_ftz
 *
 * Cases: bfloat16 a, b (8-bit significands, as the kernels' operands) and float32 acc: (1) mixed
 * ranges (products near 2^-126, cancellation to tiny results, subnormal accumulators: DAZ,
 * normal range); (2) acc within a few ulp above 2^-126 or up to 2^-124 and |a b| around
 * 2^-153..2^-148, so that the exact sums fill the interval (2^-126 - 2^-150, 2^-126 - 2^-151)
 * where the scalar spec (below, as nx_dpbf16_step) flushes and a gradual-underflow fmaf whose
 * subnormals are then flushed (the contract's first statement, `old`) keeps 2^-126. vdpbf16ps
 * gets each pair as (a, b) in the odd element and (0, 0) in the even one: two steps.
 * Intel Xeon family 6 model 167 (2026-12-02): 0 of 4.8e7 differ for either instruction, 2.1e4
 * of them in the interval (old differs there). Owns nothing the package uses; must not be
 * built by setup.py (it is not under nxhpc/csrc).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uint32_t u_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float daz(float v) { return (u_of(v) & 0x7f800000u) ? v : f_of(u_of(v) & 0x80000000u); }
/* the contract's first statement (a negative control) */
static float old_step(float acc, float a, float b) { return daz(fmaf(daz(a), daz(b), daz(acc))); }
/* the spec (nx_lowp.c, nx_dpbf16_step) */
static float step(float acc, float a, float b) {
    a = daz(a), b = daz(b), acc = daz(acc);
    const float r = fmaf(a, b, acc), ar = fabsf(r);
    if (!(ar <= 0x1p-126f)) return r;
    if (ar < 0x1p-126f) return copysignf(0.0f, r);
    float sa = a, sb = b;
    if (fabsf(a) <= fabsf(b))
        sa = a * 0x1p24f;
    else
        sb = b * 0x1p24f;
    return fabsf(fmaf(sa, sb, acc * 0x1p24f)) < 0x1p-102f ? copysignf(0.0f, r) : r;
}
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
    return f_of((s << 31) | ((uint32_t)(e < 0 ? 0 : e > 254 ? 254 : e) << 23) | m);
}
static void one_case(float *a, float *b, float *c) {
    switch (xr() % 6) {
    case 0: *a = rnd(63, 2, 7), *b = rnd(63, 2, 7), *c = rnd(2, 3, 23); break;
    case 1:
        *a = rnd(63, 8, 7), *b = -rnd(63, 8, 7), *c = rnd(1, 2, 23);
        if (xr() & 1) *c = -(*a * *b);
        break;
    case 2: *a = rnd(60, 6, 7), *b = rnd(60, 6, 7), *c = rnd(0, 1, 23); break;
    case 3: *a = rnd(127, 20, 7), *b = rnd(127, 20, 7), *c = rnd(127, 30, 23); break;
    default: { /* the interval: acc just above 2^-126, |a b| ~ 2^-153 .. 2^-148 */
        const uint32_t s = (uint32_t)(xr() & 1);
        *c = (xr() & 1) ? f_of((s << 31) | (1u << 23) | (uint32_t)(xr() % 8))
                        : f_of((s << 31) | ((uint32_t)(1 + xr() % 3) << 23) | (uint32_t)(xr() & 0x7fffff));
        const int e1 = 97 + (int)(xr() % 40), et = -153 + (int)(xr() % 6);
        *a = rnd(e1, 0, 7), *b = rnd(et - (e1 - 127) + 127, 0, 7);
    }
    }
    if (xr() % 16 == 0) *a = (xr() & 1) ? 0.0f : -0.0f;
}

int main(void) {
    const unsigned csr = _mm_getcsr();
    long n = 0, bad_fma = 0, bad_dp = 0, interval = 0, old_dp = 0;
    for (int it = 0; it < 3000000; it++) {
        float A[16], B[16], C[16], P[32], Q[32], R[16], D[16];
        for (int i = 0; i < 16; i++) {
            one_case(&A[i], &B[i], &C[i]);
            P[2 * i + 1] = A[i], Q[2 * i + 1] = B[i], P[2 * i] = Q[2 * i] = 0.0f;
        }
        __m512 x = _mm512_loadu_ps(A), y = _mm512_loadu_ps(B), z = _mm512_loadu_ps(C);
        _mm_setcsr(csr | 0x8040u);
        __asm__ volatile("" : "+v"(x), "+v"(y), "+v"(z));
        __m512 r = _mm512_fmadd_ps(x, y, z);
        __asm__ volatile("" : "+v"(r));
        _mm_setcsr(csr);
        _mm512_storeu_ps(R, r);
        const __m512bh pa = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(P + 16), _mm512_loadu_ps(P));
        const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(Q + 16), _mm512_loadu_ps(Q));
        _mm512_storeu_ps(D, _mm512_dpbf16_ps(_mm512_loadu_ps(C), pa, pb));
        for (int i = 0; i < 16; i++, n++) {
            const float s1 = step(C[i], A[i], B[i]), o1 = old_step(C[i], A[i], B[i]);
            const float s2 = step(s1, 0.0f, 0.0f), o2 = old_step(o1, 0.0f, 0.0f);
            interval += u_of(s1) != u_of(o1);
            bad_fma += u_of(R[i]) != u_of(s1);
            bad_dp += u_of(D[i]) != u_of(s2);
            old_dp += u_of(D[i]) != u_of(o2);
        }
    }
    printf("%ld steps, %ld in the interval (old statement differs): vfmadd231ps DAZ|FTZ %ld differ"
           " from step(), vdpbf16ps %ld (from the old statement: %ld)\n",
           n, interval, bad_fma, bad_dp, old_dp);
    return bad_fma != 0 || bad_dp != 0;
}
