/* avx2_tile_stores.c -- probe: what do the AVX2 tiles' output moves cost? A loop of masked
 * 256-bit stores (vmaskmovps, all lanes on) against plain ones (vmovups) and masked loads, each
 * to one of 64 L1-resident rows; and the q8 micro-kernel of nxhpc/csrc/nx_q8a_avx2.h (Q4_0's,
 * F = 8) run alone on packed panels that stay in L1 (set against `python -m nxhpc.runtime.peak`'s
 * `i8_ymm`, the instruction mix of the kernel's inner loop, register-only).
 *
 *   gcc -O3 -std=c11 -mavx2 -mfma -mf16c -Inxhpc/csrc benchmarks/probes/avx2_tile_stores.c \
 *       -o /tmp/avx2_tile_stores && /tmp/avx2_tile_stores
 *
 * AMD EPYC Zen 3, family 25 model 1, KVM (2026-12-06, three runs on a host with other tenants,
 * the first beside another job): masked store 4.2-7.1 ns, plain store 0.4-0.7 ns, masked load +
 * add 0.9-1.2 ns a step; the micro-kernel alone 168-235 GOP/s at 32 groups a call (165-221 at
 * 8), where the whole matmul at T=256, K=N=3840 (bench_lowp) ran ~185 and `i8_ymm` was ~300-330.
 * Owns nothing the package uses; must not be built by setup.py (it is not under nxhpc/csrc).
 * The kernel's packers are not linked: the stubs below stand in for what they call.
 */
#define _GNU_SOURCE
#include "nx_q8a_avx2.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* stand-ins for what the header's packers and entry point call (not used by the kernel) */
void nx_q8_0_quantize_avx2(const float *x, uint8_t *q, size_t nb) { (void)x, (void)q, (void)nb; }
const nx_q8w_type *nx_q8w(uint32_t t) { (void)t; return NULL; }
int nx_lowp_blocked(const nx_lowp_tiling *tl, const nx_mm_call *c) { (void)tl, (void)c; return 0; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float rows[64 * 16] __attribute__((aligned(64)));

static void stores(void) {
    const __m256i m = _mm256_set1_epi32(-1);
    const __m256 v = _mm256_set1_ps(1.0f);
    const size_t n = 50000000;
    double t0 = now();
    for (size_t i = 0; i < n; i++) {
        float *p = rows + (i & 63) * 16;
        __asm__("" : "+r"(p));
        _mm256_maskstore_ps(p, m, v);
    }
    const double a = now() - t0;
    t0 = now();
    for (size_t i = 0; i < n; i++) {
        float *p = rows + (i & 63) * 16;
        __asm__("" : "+r"(p));
        _mm256_storeu_ps(p, v);
    }
    const double b = now() - t0;
    __m256 s = _mm256_setzero_ps();
    t0 = now();
    for (size_t i = 0; i < n; i++) {
        float *p = rows + (i & 63) * 16;
        __asm__("" : "+r"(p));
        s = _mm256_add_ps(s, _mm256_maskload_ps(p, m));
        __asm__("" : "+x"(s));
    }
    const double c = now() - t0;
    printf("masked store %.2f ns, plain store %.2f ns, masked load + add %.2f ns a step (%g)\n",
           a / n * 1e9, b / n * 1e9, c / n * 1e9, (double)_mm256_cvtss_f32(s));
}

/* called through a volatile pointer, as the blocked driver calls it: not inlined into the loop */
static void (*volatile kern)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int,
                             int) = nx_q8a_kern_f8;

static void kernel(size_t ng) {
    const size_t bg = NX_Q8A_BG(1, 0), reps = 2000000 / ng;
    uint8_t *A = aligned_alloc(64, ng * NX_Q8A_AG + 64), *B = aligned_alloc(64, ng * bg + 64);
    for (size_t i = 0; i < ng * NX_Q8A_AG; i++) A[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < ng * bg; i++) B[i] = (uint8_t)((i * 13) & 15);
    for (size_t g = 0; g < ng; g++) { /* unit scales: finite sums */
        float *fa = (float *)(A + g * NX_Q8A_AG), *fb = (float *)(B + g * bg + 8 * NX_Q8A_NR * 4);
        for (int i = 8 * NX_Q8A_MR; i < 13 * NX_Q8A_MR; i++) fa[i] = 1.0f;
        for (int i = 0; i < NX_Q8A_NR; i++) fb[i] = 1.0f;
    }
    float C[NX_Q8A_MR * NX_Q8A_NR];
    double best = 1e9;
    for (int t = 0; t < 5; t++) {
        const double t0 = now();
        for (size_t r = 0; r < reps; r++)
            kern(ng, A, B, C, NX_Q8A_NR, NX_Q8A_MR, NX_Q8A_NR, r == 0);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("q8 micro-kernel (Q4_0), %zu groups a call, L1-resident panels: %.1f GOP/s (%g)\n", ng,
           (double)reps * ng * 32 * NX_Q8A_MR * NX_Q8A_NR * 2 / best * 1e-9, (double)C[0]);
    free(A);
    free(B);
}

int main(void) {
    stores();
    kernel(32);
    kernel(8);
    return 0;
}
