/* amx_tdpbf16ps.c -- probe: what does AMX TDPBF16PS compute per output, compared with scalar
 * models built from float32 roundings? (docs/kernels.md, "bf16 attention": why there is no
 * bit-exact AMX variant of the bf16 contracts.)
 *
 *   gcc -O2 -mamx-tile -mamx-bf16 amx_tdpbf16ps.c -o /tmp/amx_probe -lquadmath -lm
 *   /tmp/amx_probe PAIRS EXP_RANGE      (e.g. 1 8, 2 2, 2 8, 16 4)
 *
 * One 16x16 float32 tile C += A (16 x PAIRS bf16 pairs) . B (PAIRS x 16 pair-dwords), 20000 times
 * with random bfloat16 operands of exponents within +-EXP_RANGE and random float32 C; prints how
 * many of the 5.12e6 outputs differ from each model (all with DAZ/FTZ, round to nearest even):
 *   chain-even / chain-odd   fmaf step per element, even (odd) element of each pair first
 *   pair-then-add            per pair: c = c + round(a0 b0 + a1 b1)
 *   tree-then-add            c + round-tree of the pairs' round(a0 b0 + a1 b1)
 *   exact-then-add           c + round(exact sum of all products)
 *   one-rounding             round(c + exact sum of all products)
 * Intel Xeon family 6 model 167: PAIRS=1 is pair-then-add exactly (0 differ, EXP_RANGE 8);
 * PAIRS=2 matches tree-then-add and exact-then-add at EXP_RANGE 2 (0 differ) but no model at 8.
 * Needs Linux's AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM). Owns nothing the package uses.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <quadmath.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float ftz(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
    memcpy(&v, &u, 4);
    return v;
}
static float step(float acc, float a, float b) { return ftz(fmaf(a, b, ftz(acc))); }
static uint64_t rs = 88172645463325252ull;
static uint64_t xr(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return rs;
}
static uint16_t rbf(int er) {
    uint32_t s = xr() & 1, e = (uint32_t)(127 + (int)(xr() % (uint64_t)(2 * er + 1)) - er);
    return (uint16_t)((s << 15) | (e << 7) | (xr() & 0x7f));
}

enum { CHAIN_EVEN, CHAIN_ODD, PAIR_ADD, TREE_ADD, EXACT_ADD, ONE_ROUND, NMODELS };
static const char *names[NMODELS] = {"chain-even", "chain-odd", "pair-then-add",
                                     "tree-then-add", "exact-then-add", "one-rounding"};

int main(int argc, char **argv) {
    const int K = argc > 1 ? atoi(argv[1]) : 1, er = argc > 2 ? atoi(argv[2]) : 8;
    if (K < 1 || K > 16) return 2;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        puts("no AMX permission");
        return 1;
    }
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = 64;    /* C: 16 x 16 float32 */
    cfg.rows[1] = 16, cfg.colsb[1] = 4 * K; /* A: 16 rows x K pairs */
    cfg.rows[2] = K, cfg.colsb[2] = 64;     /* B: K rows x 16 pair-dwords */
    /* the whole record as the asm's input (gcc 12's _tile_loadconfig declares 8 bytes of it, so
     * the stores above could be dropped: nxhpc/csrc/nx_amx.h) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    static uint16_t A[16][32], B[16][32];
    static float C[16][16], D[16][16];
    long bad[NMODELS] = {0}, n = 0;
    for (int it = 0; it < 20000; it++) {
        for (int m = 0; m < 16; m++)
            for (int k = 0; k < 2 * K; k++) A[m][k] = rbf(er);
        for (int k = 0; k < K; k++)
            for (int j = 0; j < 32; j++) B[k][j] = rbf(er);
        for (int m = 0; m < 16; m++)
            for (int j = 0; j < 16; j++) D[m][j] = C[m][j] = bf(rbf(er)) * (float)(xr() % 1000 + 1);
        _tile_loadd(0, D, 64);
        _tile_loadd(1, A, 64);
        _tile_loadd(2, B, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, D, 64);
        for (int m = 0; m < 16; m++)
            for (int j = 0; j < 16; j++, n++) {
                const float c = C[m][j];
                float mod[NMODELS], ev = c, od = c, pa = c, t[16];
                __float128 ex = 0;
                for (int k = 0; k < K; k++) {
                    const float a0 = bf(A[m][2 * k]), a1 = bf(A[m][2 * k + 1]);
                    const float b0 = bf(B[k][2 * j]), b1 = bf(B[k][2 * j + 1]);
                    ev = step(step(ev, a0, b0), a1, b1);
                    od = step(step(od, a1, b1), a0, b0);
                    t[k] = ftz((float)((double)a0 * b0 + (double)a1 * b1)); /* exact in double */
                    pa = ftz(pa + t[k]);
                    ex += (__float128)((double)a0 * b0) + (__float128)((double)a1 * b1);
                }
                for (int w = K; w > 1; w = (w + 1) / 2) {
                    for (int i = 0; i < w / 2; i++) t[i] = ftz(t[2 * i] + t[2 * i + 1]);
                    if (w & 1) t[w / 2] = t[w - 1];
                }
                mod[CHAIN_EVEN] = ev, mod[CHAIN_ODD] = od, mod[PAIR_ADD] = pa;
                mod[TREE_ADD] = ftz(c + t[0]);
                mod[EXACT_ADD] = ftz(c + ftz((float)ex));
                mod[ONE_ROUND] = ftz((float)((__float128)c + ex));
                for (int q = 0; q < NMODELS; q++) bad[q] += memcmp(&mod[q], &D[m][j], 4) != 0;
            }
    }
    _tile_release();
    printf("pairs=%d exponents +-%d, %ld outputs differing from:", K, er, n);
    for (int q = 0; q < NMODELS; q++) printf(" %s %ld", names[q], bad[q]);
    printf("\n");
    return 0;
}
