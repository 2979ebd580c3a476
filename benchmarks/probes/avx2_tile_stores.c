/* avx2_tile_stores.c -- probe: what do the AVX2 tiles' output moves cost? A loop of masked
 * 256-bit stores (vmaskmovps, all lanes on) against plain ones (vmovups) and masked loads, each
 * to one of 64 L1-resident rows; and the q8 micro-kernels of nxhpc/csrc/nx_q8a_avx2.h (each of
 * the entry table's eight) run alone on packed panels that stay in L1 (set against `python -m
 * nxhpc.runtime.peak`'s `i8_ymm`, the instruction mix of the kernel's inner loop, register-only).
 *
 *   gcc -O3 -std=c11 -mavx2 -mfma -mf16c -Inxhpc/csrc benchmarks/probes/avx2_tile_stores.c \
 *       -o /tmp/avx2_tile_stores && /tmp/avx2_tile_stores
 *
 * AMD EPYC Zen 3, family 25 model 1, KVM (2026-12-06, three runs on a host with other tenants,
 * the first beside another job): masked store 4.2-7.1 ns, plain store 0.4-0.7 ns, masked load +
 * add 0.9-1.2 ns a step; the Q4_0 micro-kernel alone 168-235 GOP/s at 32 groups a call (165-221 at
 * 8), where the whole matmul at T=256, K=N=3840 (bench_lowp) ran ~185 and `i8_ymm` was ~300-330.
 * All eight kernels, set against the instructions each needs: benchmarks/probes/q8_kernel_ops.py,
 * which builds and runs this probe (docs/kernels.md).
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

/* the kernels of nx_q8a_avx2.h's entry table, with the panel fields each reads (H parts a group,
 * M: a min) and the largest unsigned code of its types (the sign trick's Q8_0: signed codes) */
typedef void (*kern_fn)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int, int);
static const struct {
    const char *name, *types;
    kern_fn fn;
    int H, M, umax;
} kernels[] = {
    {"sgn", "Q8_0", nx_q8a_kern_sgn, 1, 0, -1},
    {"f8", "Q4_0", nx_q8a_kern_f8, 1, 0, 15},
    {"f8m", "Q4_1 Q4_K", nx_q8a_kern_f8m, 1, 1, 15},
    {"f4", "Q5_0", nx_q8a_kern_f4, 1, 0, 31},
    {"f4m", "Q5_1 Q5_K", nx_q8a_kern_f4m, 1, 1, 31},
    {"h2f2", "Q6_K", nx_q8a_kern_h2f2, 2, 0, 63},
    {"h2f4", "Q3_K", nx_q8a_kern_h2f4, 2, 0, 7},
    {"h2f4m", "Q2_K", nx_q8a_kern_h2f4m, 2, 1, 3},
};

/* called through a volatile pointer, as the blocked driver calls it: not inlined into the loop */
static kern_fn volatile kern;

static void kernel(int k, size_t ng) {
    const int H = kernels[k].H, M = kernels[k].M, umax = kernels[k].umax;
    const size_t bg = NX_Q8A_BG(H, M), reps = 2000000 / ng;
    uint8_t *A = aligned_alloc(64, ng * NX_Q8A_AG + 64), *B = aligned_alloc(64, ng * bg + 64);
    for (size_t i = 0; i < ng * NX_Q8A_AG; i++) A[i] = (uint8_t)(i * 7);
    for (size_t i = 0; i < ng * bg; i++)
        B[i] = umax < 0 ? (uint8_t)(i * 13) : (uint8_t)((i * 13) % (size_t)(umax + 1));
    for (size_t g = 0; g < ng; g++) { /* unit scales: finite sums */
        float *fa = (float *)(A + g * NX_Q8A_AG), *fb = (float *)(B + g * bg + 8 * NX_Q8A_NR * 4);
        for (int i = 8 * NX_Q8A_MR; i < 13 * NX_Q8A_MR; i++) fa[i] = 1.0f;
        for (int i = 0; i < H * (1 + M) * NX_Q8A_NR; i++) fb[i] = 1.0f;
    }
    kern = kernels[k].fn;
    float C[NX_Q8A_MR * NX_Q8A_NR];
    double best = 1e9;
    for (int t = 0; t < 5; t++) {
        const double t0 = now();
        for (size_t r = 0; r < reps; r++)
            kern(ng, A, B, C, NX_Q8A_NR, NX_Q8A_MR, NX_Q8A_NR, r == 0);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    printf("q8 micro-kernel %-5s (%-9s), %2zu groups a call, L1-resident panels: %6.1f GOP/s "
           "(%g)\n",
           kernels[k].name, kernels[k].types, ng,
           (double)reps * ng * 32 * NX_Q8A_MR * NX_Q8A_NR * 2 / best * 1e-9, (double)C[0]);
    free(A);
    free(B);
}

int main(void) {
    stores();
    for (int k = 0; k < (int)(sizeof kernels / sizeof kernels[0]); k++) kernel(k, 32);
    kernel(1, 8);
    return 0;
}
