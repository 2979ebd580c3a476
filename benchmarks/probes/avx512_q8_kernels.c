/* avx512_q8_kernels.c -- probe: how close is each AVX-512 VNNI `q8` micro-kernel to the bound its
 * epilogue sets? The five micro-kernels of nxhpc/csrc/nx_lowp_avx512.c (this file includes that
 * translation unit: the same code, the same flags), each run alone on packed panels that stay in
 * L1, against `vnni_zmm` (`python -m nxhpc.runtime.peak`: chains of vpdpbusd, register-only).
 *
 *   gcc -O3 -std=c11 -fno-math-errno -fno-trapping-math -fwrapv -mavx512f -mavx512bw -mavx512vl \
 *       -mavx512dq -mavx512vnni -mavx2 -mfma -mf16c -Inxhpc/csrc \
 *       benchmarks/probes/avx512_q8_kernels.c -o /tmp/avx512_q8_kernels && /tmp/avx512_q8_kernels
 *
 * The bound (the tile comment of nx_lowp_avx512.c, whose count docs/kernels.md's "On VNNI the gaps
 * to Q8_0" also makes with the conversions counted): per 32-value group and output vector a
 * kernel issues 8 vpdpbusd and its epilogue's multiplies and FMAs, which share vpdpbusd's two
 * pipes on AMD Zen 4 (the conversions and broadcasts do not): Q8_0 / Q4_0 / Q5_0 one mul and one
 * fma (8 of every 10 slots are products: a bound of 0.80 of the peak), a type with a min one fma
 * more (0.73), the 16-value halves (Q6_K, Q3_K) a mul and two fmas (0.73), Q2_K two fmas more
 * (0.62). Printed: GOP/s, the fraction of the `vnni_zmm` given on the command line (or none),
 * and that fraction over the bound.
 *
 * AMD EPYC Zen 4, family 25 model 17, KVM (2026-12-07, two runs, `vnni_zmm` 456.6-465.6 GOP/s
 * that session, 456.6 given): Q8_0 361.7-365.5 GOP/s (0.99-1.00 of its bound at 456.6), Q4_0 /
 * Q5_0 361.4-361.6 (0.99), the min types 326.8-329.9 (0.98-0.99), Q6_K / Q3_K 333.3-334.4
 * (1.00-1.01), Q2_K 281.9-282.7 (1.00-1.01): each kernel runs at its epilogue's bound, so only
 * fewer float operations per vpdpbusd can make it faster (benchmarks/README.md, "AMD EPYC Zen 4").
 * Owns nothing the package uses; must not be built by setup.py (it is not under nxhpc/csrc).
 * The kernels' drivers are not linked: the stubs below stand in for what the file calls.
 */
#define _GNU_SOURCE
#include "nx_lowp_avx512.c"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* stand-ins for what the translation unit's packers and entry point call (not the kernels) */
void nx_q8_0_quantize_avx512(const float *x, uint8_t *out, size_t nb) { (void)x, (void)out, (void)nb; }
int nx_lowp_blocked(const nx_lowp_tiling *tl, const nx_mm_call *c) { (void)tl, (void)c; return 0; }

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

typedef void (*kern_fn)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int, int);
static const struct {
    const char *name, *types;
    kern_fn fn;
    int mr;
    size_t ag, bg;
    double bound; /* products over all vpdpbusd-pipe instructions, per group and output vector */
} kernels[] = {
    {"q8_0", "Q8_0", nx_q8_kern, NX_Q8_MR, NX_Q8_AG, NX_Q8_BG, 8.0 / 10},
    {"1_0", "Q4_0 Q5_0", nx_q8x_kern_1_0, NX_Q8_MR, NX_Q8X_AG(NX_Q8_MR), NX_Q8X_BG(1, 0, NX_Q8_NR),
     8.0 / 10},
    {"1_1", "Q4_1 Q5_1 Q4_K Q5_K", nx_q8x_kern_1_1, NX_Q8_MR, NX_Q8X_AG(NX_Q8_MR),
     NX_Q8X_BG(1, 1, NX_Q8_NR), 8.0 / 11},
    {"2_0", "Q6_K Q3_K", nx_q8x_kern_2_0, NX_Q8H_MR, NX_Q8X_AG(NX_Q8H_MR),
     NX_Q8X_BG(2, 0, NX_Q8_NR), 8.0 / 11},
    {"2_1", "Q2_K", nx_q8x_kern_2_1, NX_Q8H_MR, NX_Q8X_AG(NX_Q8H_MR), NX_Q8X_BG(2, 1, NX_Q8_NR),
     8.0 / 13},
};

/* called through a volatile pointer, as the blocked driver calls it: not inlined into the loop */
static kern_fn volatile kern;

static void run(int k, size_t ng, double peak) {
    const int mr = kernels[k].mr;
    const size_t ag = kernels[k].ag, bg = kernels[k].bg, reps = 2000000 / ng;
    uint8_t *A = aligned_alloc(64, ng * ag + 64), *B = aligned_alloc(64, ng * bg + 64);
    /* codes 0..15 and small activations, unit scales: every sum finite whatever the fields */
    for (size_t i = 0; i < ng * ag; i++) A[i] = (uint8_t)((i * 7) & 15);
    for (size_t i = 0; i < ng * bg; i++) B[i] = (uint8_t)((i * 13) & 15);
    for (size_t g = 0; g < ng; g++) {
        float *fa = (float *)(A + g * ag), *fb = (float *)(B + g * bg);
        for (size_t i = 8 * (size_t)mr; i < ag / 4; i++) fa[i] = 1.0f;
        for (size_t i = 8 * NX_Q8_NR; i < bg / 4; i++) fb[i] = 1.0f;
    }
    kern = kernels[k].fn;
    float C[NX_Q8X_MRMAX * NX_Q8_NR];
    double best = 1e9;
    for (int t = 0; t < 5; t++) {
        const double t0 = now();
        for (size_t r = 0; r < reps; r++) kern(ng, A, B, C, NX_Q8_NR, mr, NX_Q8_NR, r == 0);
        const double dt = now() - t0;
        if (dt < best) best = dt;
    }
    const double gops = (double)reps * ng * 32 * mr * NX_Q8_NR * 2 / best * 1e-9;
    printf("q8 micro-kernel %-4s (%-19s) %dx%d, %2zu groups a call: %6.1f GOP/s", kernels[k].name,
           kernels[k].types, mr, NX_Q8_NR, ng, gops);
    if (peak > 0)
        printf(", %.2f of vnni_zmm, bound %.2f: %.2f of it", gops / peak, kernels[k].bound,
               gops / peak / kernels[k].bound);
    printf(" (%g)\n", (double)C[0]);
    free(A);
    free(B);
}

int main(int argc, char **argv) {
    const double peak = argc > 1 ? atof(argv[1]) : 0.0; /* vnni_zmm GOP/s, one core */
    for (int k = 0; k < (int)(sizeof kernels / sizeof kernels[0]); k++) run(k, 32, peak);
    return 0;
}
