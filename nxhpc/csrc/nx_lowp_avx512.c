/* nx_lowp_avx512.c -- the avx512 table of the "lowp" family (AVX-512 F/BW/VL/DQ + VNNI, all part
 * of the avx512 ISA's required bits in nx_cpu.h): the `q8` matmul on every weight type q8 takes
 * (Q8_0, Q4_0 .. Q6_K: vpdpbusd micro-kernels, their activation and weight packers). bf16 has no
 * variant here (inherits the spec).
 *
 * Owns: the q8 panel layouts and the MR x NR register tiles; the SIMD decoding of each type's
 * codes; the exactness of the unsigned x signed trick (weights stored unsigned, u = qw + off, the
 * accumulator started at -off * sum(qx)). Entered only after the probe
 * reports the avx512 level (which includes VNNI) with OS ZMM support.
 * Must not: change the per-output block order or arithmetic of nx_lowp.h, allocate per tile,
 * or use threads.
 */
#include "nx_lowp.h"

#include <immintrin.h>
#include <string.h>

#include "nx_q8_0.h"
#include "nx_q8x_avx512.h"

/* ------------------------------------------------------------------ q8 matmul */

/* Tile, measured on this project's AMD Zen 4 host (same method as nx_lowp_avx512bf16.c; T=256,
 * (K, N) = (3840, 3840) / (10240, 3840) / (3840, 10240), GOP/s):
 *   MR x NR = 6 x 32: 12 int32 block accumulators + 12 float32 chain accumulators + 2 weight
 *     vectors + temporaries = 30 zmm: 338/335/342 with NC=128, KC=2048. 4 x 48: 332/331/336;
 *     3 x 64: 322/325/325; 5 x 32: 331/325/336; KC=1024 or 4096, NC=256: within 3%.
 *   Why not more: vpdpbusd zmm issues 1/cycle (467 GOP/s peak) and shares its pipes with
 *   vmulps/vfmadd. The contract's epilogue (one mul for s = dx*dw, one fma per accumulator and
 *   block; vcvtdq2ps runs on the add pipes, broadcasts on the load ports: both free) takes 2 of
 *   every 10 issue slots, a ceiling of ~373 GOP/s; the kernel reaches ~92% of it.
 *   jr_outer (B micro-panel in L1) measured the same or slower: the A-in-L1 order stays. */
#ifndef NX_Q8_MR
#define NX_Q8_MR 6
#endif
#ifndef NX_Q8_NV
#define NX_Q8_NV 2 /* zmm vectors per tile row */
#endif
#define NX_Q8_NR (16 * NX_Q8_NV)
#ifndef NX_Q8_KC
#define NX_Q8_KC 2048
#endif
#ifndef NX_Q8_NC
#define NX_Q8_NC 128
#endif
#ifndef NX_Q8_JR_OUTER
#define NX_Q8_JR_OUTER 0
#endif
#ifndef NX_Q8_MC
#define NX_Q8_MC 264
#endif
_Static_assert(NX_Q8_KC % 256 == 0, "KC must hold whole blocks of every type");
_Static_assert(NX_Q8_NC % NX_Q8_NR == 0, "NC must be a multiple of NR");
_Static_assert(NX_Q8_MC % NX_Q8_MR == 0, "MC must be a multiple of MR");
/* The two-part (16-element halves) types' tile: MR x 32 (their kernel also holds MR x 2 vectors
 * of part sums y, so fewer rows than Q8_0's 6). Measured on this project's Xeon (KVM, AVX-512
 * VNNI + AMX; T=256, K=N=3840, one thread, Q6_K / Q3_K as a fraction of Q8_0's q8): MR=3
 * 0.79/0.77, 4 0.83/0.82, 5 0.85/0.82, 6 0.84/0.82 (6 spills). */
#ifndef NX_Q8H_MR
#define NX_Q8H_MR 5
#endif
#ifndef NX_Q8H_MC
#define NX_Q8H_MC 260
#endif
_Static_assert(NX_Q8H_MC % NX_Q8H_MR == 0, "MC must be a multiple of MR");

/* Per 32-k group (one Q8_0 block):
 *   A micro-panel: int32 quads[8][MR] (qx bytes 4q..4q+3 of token r), float dx[MR],
 *                  int32 negc[MR] = -128 * sum_i qx[r, i]
 *   B micro-panel: uint32 quads[8][NR] (qw + 128, bytes 4q..4q+3 of column j), float dw[NR] */
#define NX_Q8_AG (10 * NX_Q8_MR * 4)
#define NX_Q8_BG (9 * NX_Q8_NR * 4)

static void nx_q8_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t rows,
                         uint8_t *Ap /* OUT */, void *scratch) {
    const size_t nb = K / NX_QK8_0;
    uint8_t *q = (uint8_t *)scratch; /* one quantized row: nb * 34 bytes */
    for (size_t r = 0; r < NX_Q8_MR; r++) {
        if (r < rows) nx_q8_0_quantize_avx512(x + (t0 + r) * K, q, nb);
        for (size_t b = 0; b < nb; b++) {
            int32_t *g = (int32_t *)(Ap + b * NX_Q8_AG);
            if (r >= rows) {
                for (int i = 0; i < 8; i++) g[i * NX_Q8_MR + r] = 0;
                g[8 * NX_Q8_MR + r] = 0; /* dx = +0.0f */
                g[9 * NX_Q8_MR + r] = 0;
                continue;
            }
            const uint8_t *blk = q + b * NX_Q8_0_BLOCK_BYTES;
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m512i s16 = _mm512_cvtepi8_epi16(qs);
            const int32_t sum =
                _mm512_reduce_add_epi32(_mm512_madd_epi16(s16, _mm512_set1_epi16(1)));
            int32_t quad[8];
            _mm256_storeu_si256((__m256i *)quad, qs);
            for (int i = 0; i < 8; i++) g[i * NX_Q8_MR + r] = quad[i];
            const float dx = nx_q8x_act_scale(x + (t0 + r) * K + b * NX_QK8_0); /* = the spec's */
            memcpy(&g[8 * NX_Q8_MR + r], &dx, 4);
            g[9 * NX_Q8_MR + r] = -128 * sum;
        }
    }
}

static void nx_q8_pack_b(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0, size_t kc,
                         uint8_t *Bp /* OUT */, void *scratch) {
    (void)scratch;
    const uint8_t *w = c->w;
    const size_t rowbytes = c->rowbytes;
    const size_t b0 = k0 / NX_QK8_0, nb = kc / NX_QK8_0;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int v = 0; v < NX_Q8_NV; v++) {
        const size_t c0 = (size_t)v * 16;
        const int nv = c0 >= ncols ? 0 : (ncols - c0 >= 16 ? 16 : (int)(ncols - c0));
        for (size_t b = 0; b < nb; b++) {
            uint8_t *g = Bp + b * NX_Q8_BG;
            float *dw = (float *)(g + 8 * NX_Q8_NR * 4) + c0;
            __m256i in[16];
            for (int j = 0; j < 16; j++) {
                if (j < nv) {
                    const uint8_t *blk =
                        w + (j0 + c0 + j) * rowbytes + (b0 + b) * NX_Q8_0_BLOCK_BYTES;
                    uint16_t dh;
                    memcpy(&dh, blk, 2);
                    dw[j] = _cvtsh_ss(dh);
                    in[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), flip);
                } else {
                    dw[j] = 0.0f;
                    in[j] = _mm256_setzero_si256();
                }
            }
            __m512i out[8];
            nx_tr16x8(in, out);
            for (int q = 0; q < 8; q++)
                _mm512_store_si512((__m512i *)(g + (q * NX_Q8_NR + c0) * 4), out[q]);
        }
    }
}

/* C[0:mr, 0:nr] := the block chain over ng groups, continued from C unless first. */
static void nx_q8_kern(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr,
                       int nr, int first) {
    __mmask16 m[NX_Q8_NV];
    for (int v = 0; v < NX_Q8_NV; v++) {
        const int left = nr - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    }
    __m512 f[NX_Q8_MR][NX_Q8_NV];
    for (int r = 0; r < NX_Q8_MR; r++)
        for (int v = 0; v < NX_Q8_NV; v++)
            f[r][v] = (!first && r < mr) ? _mm512_maskz_loadu_ps(m[v], C + r * ldc + 16 * v)
                                         : _mm512_setzero_ps();
    for (size_t gi = 0; gi < ng; gi++) {
        const int32_t *a = (const int32_t *)(A + gi * NX_Q8_AG);
        const uint8_t *b = B + gi * NX_Q8_BG;
        __m512i s[NX_Q8_MR][NX_Q8_NV];
        for (int r = 0; r < NX_Q8_MR; r++)
            for (int v = 0; v < NX_Q8_NV; v++) s[r][v] = _mm512_set1_epi32(a[9 * NX_Q8_MR + r]);
        for (int q = 0; q < 8; q++) {
            __m512i bv[NX_Q8_NV];
            for (int v = 0; v < NX_Q8_NV; v++)
                bv[v] = _mm512_load_si512((const __m512i *)(b + (q * NX_Q8_NR + 16 * v) * 4));
            for (int r = 0; r < NX_Q8_MR; r++) {
                const __m512i av = _mm512_set1_epi32(a[q * NX_Q8_MR + r]);
                for (int v = 0; v < NX_Q8_NV; v++)
                    s[r][v] = _mm512_dpbusd_epi32(s[r][v], bv[v], av);
            }
        }
        const float *dx = (const float *)(a + 8 * NX_Q8_MR);
        const float *dwp = (const float *)(b + 8 * NX_Q8_NR * 4);
        for (int r = 0; r < NX_Q8_MR; r++) {
            const __m512 d = _mm512_set1_ps(dx[r]);
            for (int v = 0; v < NX_Q8_NV; v++)
                f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]),
                                          _mm512_mul_ps(_mm512_load_ps(dwp + 16 * v), d), f[r][v]);
        }
    }
    for (int r = 0; r < NX_Q8_MR; r++)
        if (r < mr)
            for (int v = 0; v < NX_Q8_NV; v++)
                _mm512_mask_storeu_ps(C + r * ldc + 16 * v, m[v], f[r][v]);
}

/* ------------------------------------------------------------------ q8 on Q4_0 .. Q6_K weights
 * One micro-kernel per shape (nx_lowp.h: H parts per 32-group, with or without a min), the same
 * group loop as Q8_0's (6 x 32 tile for H = 1, 5 x 32 for H = 2); the per-type work is all in the
 * B packer (codes to unsigned bytes, the spec's scales into the panel), so the inner loop is
 * Q8_0's plus the shape's epilogue: per 32-group and output, Q8_0 / Q4_0 / Q5_0 take cvt + mul +
 * fma, the min types one more fma, H = 2 two cvt + mul + 2 fma (+ 2 fma for Q2_K's mins). Those
 * share the vector pipes with vpdpbusd (8 per group and output), which sets each shape's speed
 * relative to Q8_0's.
 *   A micro-panel group: int32 quads[8][MR], float dx[MR], int32 init[2][MR] (-off * xsum of
 *     each part), float ax[2][MR] (dx * (float)xsum of each part; the min term's product).
 *     H = 1: part 0 is the whole 32 (init[1], ax[1] unused).
 *   B micro-panel group: uint32 quads[8][NR] (u = qw + off), float sw[H][NR], float mw[H][NR]
 *     (types with a min). */
#define NX_Q8X_AG(MR) (13 * (MR) * 4)
#define NX_Q8X_MRMAX 6 /* the largest MR of these kernels */

static inline __attribute__((always_inline)) void
nx_q8x_pack_a_t(const float *x /* IN */, size_t K, size_t t0, size_t rows, uint8_t *Ap /* OUT */,
                void *scratch, const int off, const int H, const int MR) {
    const size_t nb = K / NX_QK8_0;
    uint8_t *q = (uint8_t *)scratch; /* one quantized row: nb * 34 bytes */
    for (int r = 0; r < MR; r++) {
        if ((size_t)r < rows) nx_q8_0_quantize_avx512(x + (t0 + r) * K, q, nb);
        for (size_t b = 0; b < nb; b++) {
            int32_t *g = (int32_t *)(Ap + b * NX_Q8X_AG(MR));
            if ((size_t)r >= rows) {
                for (int i = 0; i < 13; i++) g[i * MR + r] = 0; /* float fields +0.0f */
                continue;
            }
            const uint8_t *blk = q + b * NX_Q8_0_BLOCK_BYTES;
            int32_t quad[8];
            memcpy(quad, blk + 2, 32);
            for (int i = 0; i < 8; i++) g[i * MR + r] = quad[i];
            const float dx = nx_q8x_act_scale(x + (t0 + r) * K + b * NX_QK8_0);
            memcpy(&g[8 * MR + r], &dx, 4);
            const __m512i s16 =
                _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2))),
                                  _mm512_set1_epi16(1)); /* pair sums, lanes 0-7: elements 0-15 */
            int32_t xs[2];
            if (H == 1) {
                xs[0] = _mm512_reduce_add_epi32(s16);
                xs[1] = 0;
            } else {
                xs[0] = _mm512_mask_reduce_add_epi32((__mmask16)0x00ff, s16);
                xs[1] = _mm512_mask_reduce_add_epi32((__mmask16)0xff00, s16);
            }
            for (int h = 0; h < 2; h++) {
                const float ax = dx * (float)xs[h]; /* one rounding, as the spec */
                g[(9 + h) * MR + r] = -off * xs[h];
                memcpy(&g[(11 + h) * MR + r], &ax, 4);
            }
        }
    }
}

#define NX_Q8X_PACK_A(OFF, H, MR)                                                                  \
    static void nx_q8x_pack_a_##OFF##_##H(const float *x, size_t K, size_t t0, size_t rows,        \
                                          uint8_t *Ap, void *scratch) {                            \
        nx_q8x_pack_a_t(x, K, t0, rows, Ap, scratch, OFF, H, MR);                                  \
    }
NX_Q8X_PACK_A(8, 1, NX_Q8_MR)
NX_Q8X_PACK_A(16, 1, NX_Q8_MR)
NX_Q8X_PACK_A(0, 1, NX_Q8_MR)
NX_Q8X_PACK_A(32, 2, NX_Q8H_MR)
NX_Q8X_PACK_A(4, 2, NX_Q8H_MR)
NX_Q8X_PACK_A(0, 2, NX_Q8H_MR)

#define NX_Q8X_PACK_B(T, t, E, H, M, OFF, D, D32, S)                                               \
    static void nx_q8x_pack_b_##t(const nx_mm_call *c, size_t j0, size_t ncols, size_t k0,         \
                                  size_t kc, uint8_t *Bp, void *scratch) {                         \
        (void)scratch;                                                                             \
        nx_q8x_pack_b_t(c, j0, ncols, k0, kc, Bp, NX_Q8_NV, E, H, M, 0, D, D32, nx_s_##S);         \
    }
NX_Q8X_TYPES(NX_Q8X_PACK_B)
#undef NX_Q8X_PACK_B

/* C[0:mr, 0:nr] := the chain over ng groups (each: H parts, each an isum term and, with a min,
 * a min term), continued from C unless first. */
static inline __attribute__((always_inline)) void
nx_q8x_kern_t(size_t ng, const uint8_t *A, const uint8_t *B, float *C, size_t ldc, int mr, int nr,
              int first, const int H, const int M, const int MR) {
    __mmask16 m[NX_Q8_NV];
    for (int v = 0; v < NX_Q8_NV; v++) {
        const int left = nr - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
    }
    __m512 f[NX_Q8X_MRMAX][NX_Q8_NV]; /* fixed sizes (not VLAs): kept in registers */
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NX_Q8_NV; v++)
            f[r][v] = (!first && r < mr) ? _mm512_maskz_loadu_ps(m[v], C + r * ldc + 16 * v)
                                         : _mm512_setzero_ps();
    const size_t BG = NX_Q8X_BG(H, M, NX_Q8_NR);
    for (size_t gi = 0; gi < ng; gi++) {
        const int32_t *a = (const int32_t *)(A + gi * NX_Q8X_AG(MR));
        const uint8_t *b = B + gi * BG;
        const float *dx = (const float *)(a + 8 * MR);
        const float *sw = (const float *)(b + 8 * NX_Q8_NR * 4);
        __m512 y[NX_Q8X_MRMAX][NX_Q8_NV]; /* H = 2: the group's scaled part sums */
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            __m512i s[NX_Q8X_MRMAX][NX_Q8_NV];
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NX_Q8_NV; v++)
                    s[r][v] = _mm512_set1_epi32(a[(9 + h) * MR + r]);
#pragma GCC unroll 8
            for (int q = h * 8 / H; q < (h + 1) * 8 / H; q++) {
                __m512i bv[NX_Q8_NV];
                for (int v = 0; v < NX_Q8_NV; v++)
                    bv[v] = _mm512_load_si512((const __m512i *)(b + (q * NX_Q8_NR + 16 * v) * 4));
                for (int r = 0; r < MR; r++) {
                    const __m512i av = _mm512_set1_epi32(a[q * MR + r]);
                    for (int v = 0; v < NX_Q8_NV; v++)
                        s[r][v] = _mm512_dpbusd_epi32(s[r][v], bv[v], av);
                }
            }
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NX_Q8_NV; v++) {
                    const __m512 swv = _mm512_load_ps(sw + h * NX_Q8_NR + 16 * v);
                    const __m512 is = _mm512_cvtepi32_ps(s[r][v]);
                    if (H == 1) /* acc = fmaf((float)isum, dx*sw, acc) */
                        f[r][v] = _mm512_fmadd_ps(is, _mm512_mul_ps(swv, _mm512_set1_ps(dx[r])),
                                                  f[r][v]);
                    else if (h == 0) /* y = (float)isum_0 * sw_0 */
                        y[r][v] = _mm512_mul_ps(is, swv);
                    else /* y = fmaf((float)isum_1, sw_1, y) */
                        y[r][v] = _mm512_fmadd_ps(is, swv, y[r][v]);
                }
        }
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < NX_Q8_NV; v++) {
                if (H == 2) /* acc = fmaf(y, dx, acc) */
                    f[r][v] = _mm512_fmadd_ps(y[r][v], _mm512_set1_ps(dx[r]), f[r][v]);
                if (M) /* acc = fmaf(dx * (float)xsum_h, mw_h, acc), h = 0 .. H-1 */
                    for (int h = 0; h < H; h++)
                        f[r][v] = _mm512_fmadd_ps(
                            _mm512_set1_ps(((const float *)(a + (11 + h) * MR))[r]),
                            _mm512_load_ps(sw + (H + h) * NX_Q8_NR + 16 * v), f[r][v]);
            }
    }
    for (int r = 0; r < MR; r++)
        if (r < mr)
            for (int v = 0; v < NX_Q8_NV; v++)
                _mm512_mask_storeu_ps(C + r * ldc + 16 * v, m[v], f[r][v]);
}

#define NX_Q8X_KERN(H, M, MR)                                                                      \
    static void nx_q8x_kern_##H##_##M(size_t ng, const uint8_t *A, const uint8_t *B, float *C,     \
                                      size_t ldc, int mr, int nr, int first) {                     \
        nx_q8x_kern_t(ng, A, B, C, ldc, mr, nr, first, H, M, MR);                                  \
    }
NX_Q8X_KERN(1, 0, NX_Q8_MR)
NX_Q8X_KERN(1, 1, NX_Q8_MR)
NX_Q8X_KERN(2, 0, NX_Q8H_MR)
NX_Q8X_KERN(2, 1, NX_Q8H_MR)

int nx_matmul_q8_avx512(const nx_mm_call *c) {
    typedef void (*pack_a_fn)(const float *, size_t, size_t, size_t, uint8_t *, void *);
    typedef void (*pack_b_fn)(const nx_mm_call *, size_t, size_t, size_t, size_t, uint8_t *, void *);
    typedef void (*kern_fn)(size_t, const uint8_t *, const uint8_t *, float *, size_t, int, int, int);
    pack_a_fn pa;
    pack_b_fn pb;
    kern_fn kn;
    size_t bg, mr, mc;
    switch (c->type) {
#define NX_Q8X_CASE(T, t, E, H, M, OFF, D, D32, S)                                                 \
    case NX_GGML_##T:                                                                              \
        pa = nx_q8x_pack_a_##OFF##_##H, pb = nx_q8x_pack_b_##t, kn = nx_q8x_kern_##H##_##M;        \
        bg = NX_Q8X_BG(H, M, NX_Q8_NR);                                                            \
        mr = H == 1 ? NX_Q8_MR : NX_Q8H_MR, mc = H == 1 ? NX_Q8_MC : NX_Q8H_MC;                    \
        break;
        NX_Q8X_TYPES(NX_Q8X_CASE)
#undef NX_Q8X_CASE
    case NX_GGML_Q8_0: {
        const nx_lowp_tiling tl = {
            NX_Q8_MR,   NX_Q8_NR,       NX_Q8_KC,     NX_Q8_NC,
            NX_Q8_MC,   NX_Q8_AG,       NX_Q8_BG,     c->K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES + 64,
            0,          NX_Q8_JR_OUTER, nx_q8_pack_a, nx_q8_pack_b,
            nx_q8_kern,
        };
        return nx_lowp_blocked(&tl, c);
    }
    default:
        return -2;
    }
    const nx_lowp_tiling tl = {
        mr, NX_Q8_NR, NX_Q8_KC, NX_Q8_NC, mc, NX_Q8X_AG(mr), bg,
        c->K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES + 64, 0, NX_Q8_JR_OUTER, pa, pb, kn,
    };
    return nx_lowp_blocked(&tl, c);
}

const nx_lowp_table nx_lowp_table_avx512 = {.matmul_q8 = nx_matmul_q8_avx512};
