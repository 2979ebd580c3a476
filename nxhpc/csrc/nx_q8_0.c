/* nx_q8_0.c -- Q8_0 family: the generic (scalar) variants, which are the spec, and the dispatch.
 *
 * Owns: float16 conversion in software, the quantizer/dequantizer bit-for-bit equal to the gguf
 * package (ggml reference), the matmul's scalar spec (two-level fmaf sum per output), the
 * cache-blocked driver the SIMD matmuls share, the adaLN linear, and the choice of variant per
 * ISA level. Compiled with no ISA flags: runs on any x86-64 (or other) CPU.
 * Must not: use SIMD intrinsics (those live in nx_q8_0_avx2.c / nx_q8_0_avx512.c).
 */
#include "nx_q8_0.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ float16 <-> float32 */

uint16_t nx_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sgn = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {                       /* inf or NaN (NaN: quieted, top payload kept) */
        if (ax == 0x7f800000u) return (uint16_t)(sgn | 0x7c00u);
        return (uint16_t)(sgn | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) return (uint16_t)(sgn | 0x7c00u);   /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                        /* below 2^-14: half subnormal or zero */
        if (ax <= 0x33000000u) return (uint16_t)sgn;          /* <= 2^-25: ties-to-even -> 0 */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;                 /* value / 2^-24 = m >> shift, shift in 14..24 */
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sgn | h);
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;    /* carry may bump the exponent */
    return (uint16_t)(sgn | h);
}

float nx_f16_to_f32(uint16_t h) {
    uint32_t sgn = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        if (m == 0) {
            bits = sgn;
        } else {                                   /* subnormal: normalise */
            uint32_t s = 0;
            while (!(m & 0x400u)) { m <<= 1; s++; }
            bits = sgn | ((113u - s) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        bits = sgn | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u);   /* NaN quieted */
    } else {
        bits = sgn | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------ quantize / dequantize */

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
            if (a != a) {                          /* numpy's max propagates NaN */
                if (!have_nan) { amax = a; have_nan = 1; }
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

void nx_q8_0_dequantize_generic(const uint8_t *w /* IN */, float *out /* OUT */, size_t nblocks) {
    for (size_t blk = 0; blk < nblocks; blk++) {
        const uint8_t *b = w + blk * NX_Q8_0_BLOCK_BYTES;
        uint16_t dh;
        memcpy(&dh, b, 2);
        float d = nx_f16_to_f32(dh);
        for (int i = 0; i < NX_QK8_0; i++) out[blk * NX_QK8_0 + i] = (float)(int8_t)b[2 + i] * d;
    }
}

nx_isa nx_q8_0_convert_level(nx_isa isa) {
    return isa >= NX_ISA_AVX512 ? NX_ISA_AVX512 : NX_ISA_GENERIC;
}

void nx_q8_0_quantize(nx_isa isa, const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks) {
    NX_X86_ONLY(if (nx_q8_0_convert_level(isa) == NX_ISA_AVX512) {
        nx_q8_0_quantize_avx512(x, out, nblocks);
        return;
    })
    nx_q8_0_quantize_generic(x, out, nblocks);
}

void nx_q8_0_dequantize(nx_isa isa, const uint8_t *w /* IN */, float *out /* OUT */, size_t nblocks) {
    NX_X86_ONLY(if (nx_q8_0_convert_level(isa) == NX_ISA_AVX512) {
        nx_q8_0_dequantize_avx512(w, out, nblocks);
        return;
    })
    nx_q8_0_dequantize_generic(w, out, nblocks);
}

/* ------------------------------------------------------------------ matmul (the spec) */

int nx_q8_0_matmul_generic(const float *x /* IN [T*K] */, const uint8_t *w /* IN [N rows] */,
                           float *out /* OUT [T*N] */, size_t T, size_t K, size_t N,
                           size_t n0, size_t n1) {
    if (T == 0 || n0 >= n1) return 0;
    const size_t nb = K / NX_QK8_0, rowbytes = nb * NX_Q8_0_BLOCK_BYTES;
    float *wrow = NULL;
    if (K > 0 && !(wrow = (float *)malloc(K * sizeof(float)))) return -1;
    for (size_t n = n0; n < n1; n++) {
        if (K > 0) nx_q8_0_dequantize_generic(w + n * rowbytes, wrow, nb);   /* exact: d*q */
        for (size_t t = 0; t < T; t += NX_Q8_0_DOT_ROWS) {
            const size_t rows = T - t < NX_Q8_0_DOT_ROWS ? T - t : NX_Q8_0_DOT_ROWS;
            nx_q8_0_dot_rows(x + t * K, K, rows, wrow, K, out + t * N + n, N);
        }
    }
    free(wrow);
    return 0;
}

/* ------------------------------------------------------------------ blocked driver (SIMD) */

/* Tokens [t0, t0+mc) of x (all K) into Ap: micro-panel i (MR tokens) at Ap + i*K*MR, element
 * [k*MR + r] = x[t0 + i*MR + r, k]; rows past mc are zero. */
static void nx_q8_0_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t mc, size_t MR,
                           float *Ap /* OUT */) {
    for (size_t i = 0; i * MR < mc; i++) {
        float *dst = Ap + i * K * MR;
        for (size_t r = 0; r < MR; r++) {
            const size_t t = i * MR + r;
            if (t < mc) {
                const float *src = x + (t0 + t) * K;
                for (size_t k = 0; k < K; k++) dst[k * MR + r] = src[k];
            } else {
                for (size_t k = 0; k < K; k++) dst[k * MR + r] = 0.0f;
            }
        }
    }
}

static inline size_t nx_min(size_t a, size_t b) { return a < b ? a : b; }

int nx_q8_0_matmul_blocked(const nx_q8_0_tiling *tl, const float *x /* IN [T*K] */,
                           const uint8_t *w /* IN */, float *out /* OUT [T*N] */, size_t T,
                           size_t K, size_t N, size_t n0, size_t n1) {
    if (T == 0 || n0 >= n1) return 0;
    if (K == 0) {                                   /* the empty sum is +0 */
        for (size_t t = 0; t < T; t++) memset(out + t * N + n0, 0, (n1 - n0) * sizeof(float));
        return 0;
    }
    const size_t MR = tl->mr, NR = tl->nr, KC = tl->kc, NC = tl->nc, MC = tl->mc;
    const size_t rowbytes = K / NX_QK8_0 * NX_Q8_0_BLOCK_BYTES;
    const size_t mc_max = T < MC ? (T + MR - 1) / MR * MR : MC;
    const size_t nc_max = n1 - n0 < NC ? (n1 - n0 + NR - 1) / NR * NR : NC;
    const size_t kc_max = nx_min(K, KC);
    float *Ap = (float *)aligned_alloc(64, (mc_max * K * sizeof(float) + 63) / 64 * 64);
    float *Bp = (float *)aligned_alloc(64, (nc_max * kc_max * sizeof(float) + 63) / 64 * 64);
    if (!Ap || !Bp) {
        free(Ap);
        free(Bp);
        return -1;
    }
    for (size_t ic = 0; ic < T; ic += MC) {
        const size_t mc = nx_min(T - ic, MC);
        nx_q8_0_pack_a(x, K, ic, mc, MR, Ap);
        for (size_t jc = n0; jc < n1; jc += NC) {
            const size_t nc = nx_min(n1 - jc, NC);
            for (size_t pc = 0; pc < K; pc += KC) {
                const size_t kc = nx_min(K - pc, KC);
                tl->pack_b(w, rowbytes, jc, nc, pc / NX_QK8_0, kc / NX_QK8_0, Bp);
                for (size_t ir = 0; ir < mc; ir += MR) {
                    const int mr = (int)nx_min(mc - ir, MR);
                    const float *A = Ap + (ir / MR) * K * MR + pc * MR;
                    for (size_t jr = 0; jr < nc; jr += NR) {
                        const int nr = (int)nx_min(nc - jr, NR);
                        const float *B = Bp + (jr / NR) * kc * NR;
                        for (size_t s0 = 0; s0 < kc; s0 += NX_Q8_0_CHAIN)
                            tl->kern(mr, nr, nx_min(kc - s0, NX_Q8_0_CHAIN), A + s0 * MR,
                                     B + s0 * NR, out + (ic + ir) * N + jc + jr, N, pc + s0 == 0);
                    }
                }
            }
        }
    }
    free(Ap);
    free(Bp);
    return 0;
}

nx_isa nx_q8_0_matmul_level(nx_isa isa) {
    if (isa >= NX_ISA_AVX512) return NX_ISA_AVX512;
    if (isa >= NX_ISA_AVX2) return NX_ISA_AVX2;
    return NX_ISA_GENERIC;
}

int nx_q8_0_matmul(nx_isa isa, const float *x /* IN */, const uint8_t *w /* IN */,
                   float *out /* OUT */, size_t T, size_t K, size_t N, size_t n0, size_t n1) {
    switch (nx_q8_0_matmul_level(isa)) {
    NX_X86_ONLY(case NX_ISA_AVX512: return nx_q8_0_matmul_avx512(x, w, out, T, K, N, n0, n1);
                case NX_ISA_AVX2: return nx_q8_0_matmul_avx2(x, w, out, T, K, N, n0, n1);)
    default: return nx_q8_0_matmul_generic(x, w, out, T, K, N, n0, n1);
    }
}

/* ------------------------------------------------------------------ adaLN linear */

static inline float nx_silu(float t) { return t / (1.0f + expf(-t)); }

/* The adaLN input u = silu(t_emb) or t_emb, in a fresh buffer (caller frees); NULL when K == 0
 * (nothing to read) or on allocation failure (*rc = -1). */
static float *nx_adaln_input(const float *t_emb /* IN [K] */, size_t K, int silu_input, int *rc) {
    *rc = 0;
    if (K == 0) return NULL;
    float *u = (float *)malloc(K * sizeof(float));
    if (!u) {
        *rc = -1;
        return NULL;
    }
    for (size_t k = 0; k < K; k++) u[k] = silu_input ? nx_silu(t_emb[k]) : t_emb[k];
    return u;
}

int nx_adaln_linear_f32(const float *t_emb /* IN [K] */, const float *w /* IN [N*K] */,
                        const float *bias /* IN [N] or NULL */, float *out /* OUT [N] */,
                        size_t K, size_t N, int silu_input) {
    int rc;
    float *u = nx_adaln_input(t_emb, K, silu_input, &rc);
    if (rc) return rc;
    for (size_t n = 0; n < N; n++) {           /* the matmul's order: same bits as Q8_0 storage */
        float acc;
        nx_q8_0_dot_rows(u, K, 1, w + n * K, K, &acc, 1);
        out[n] = bias ? acc + bias[n] : acc;
    }
    free(u);
    return 0;
}

int nx_adaln_linear_q8_0(nx_isa isa, const float *t_emb /* IN [K] */, const uint8_t *w /* IN */,
                         const float *bias /* IN [N] or NULL */, float *out /* OUT [N] */,
                         size_t K, size_t N, int silu_input) {
    int rc;
    float *u = nx_adaln_input(t_emb, K, silu_input, &rc);
    if (rc) return rc;
    rc = nx_q8_0_matmul(isa, u, w, out, 1, K, N, 0, N);
    if (rc == 0 && bias)
        for (size_t n = 0; n < N; n++) out[n] = out[n] + bias[n];
    free(u);
    return rc;
}
