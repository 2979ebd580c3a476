/* nx_lowp.c -- low-precision matmuls: scalar specs (bf16, q8), the generic table and the dispatch
 * of the "lowp" family, and the blocked driver the SIMD variants share.
 *
 * Owns: the executable form of the contracts in nx_lowp.h (nx_matmul_bf16_generic,
 * nx_matmul_q8_generic), the q8 weight decoders of every type q8 takes (nx_q8w: signed codes,
 * part scales and mins), the lowp table list, and nx_lowp_blocked. Compiled with no ISA flags.
 * Weights decode through the traits table (nx_wtype.h) only.
 * Must not: use SIMD intrinsics (those live in nx_lowp_bf16_avx2.c / nx_lowp_avx512.c /
 * nx_lowp_avx512bf16.c), or
 * depend on the tile an output falls in.
 */
#include "nx_lowp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nx_ops.h" /* the swiglu of the gated calls */
#include "nx_q8_0.h"

NX_DEFINE_DISPATCH(nx_lowp, "lowp", NX_LOWP_SLOTS,
                   {[NX_ISA_GENERIC] = &nx_lowp_table_generic,
                    NX_X86_ONLY([NX_ISA_AVX2] = &nx_lowp_table_avx2,
                                [NX_ISA_AVXVNNI] = &nx_lowp_table_avxvnni,
                                [NX_ISA_AVX512] = &nx_lowp_table_avx512,
                                [NX_ISA_AVX512BF16] = &nx_lowp_table_avx512bf16,
                                [NX_ISA_AMX] = &nx_lowp_table_amx, )})

/* ------------------------------------------------------------------ bfloat16 rounding */

void nx_bf16_round_n_generic(const float *x /* IN */, uint16_t *out /* OUT */, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = nx_bf16_round(x[i]);
}

void nx_bf16_round_n(nx_isa isa, const float *x /* IN */, uint16_t *out /* OUT */, size_t n) {
    nx_lowp_get(isa)->round_bf16(x, out, n);
}

/* ------------------------------------------------------------------ bf16 spec */

static inline float nx_daz(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) == 0) u &= 0x80000000u; /* subnormal (or zero) -> zero of its sign */
    memcpy(&v, &u, 4);
    return v;
}

/* ftz_x86(fma(a, b, acc)) on daz'd inputs (nx_lowp.h): r = fmaf rounds with gradual underflow;
 * a subnormal r means the exact value is below 2^-126 - 2^-150, hence tiny after a 24-bit
 * rounding too: flushed. Only r = +-2^-126 is ambiguous (exact values in [2^-126 - 2^-150,
 * 2^-126), which fmaf rounds up, are tiny for x86 below 2^-126 - 2^-151): the same fma with one
 * factor and acc scaled by 2^24 (exact: no operand can be large when the sum is ~2^-126, so the
 * smaller factor and acc stay finite) rounds in the normal range, where it is the 24-bit
 * rounding with unbounded exponent itself; tiny iff that is below 2^-102. */
float nx_dpbf16_step(float acc, float a, float b) {
    a = nx_daz(a), b = nx_daz(b), acc = nx_daz(acc);
    const float r = fmaf(a, b, acc), ar = fabsf(r);
    if (!(ar <= 0x1p-126f)) return r;               /* normal, inf or NaN */
    if (ar < 0x1p-126f) return copysignf(0.0f, r); /* subnormal or zero: the zero of its sign */
    float sa = a, sb = b;
    if (fabsf(a) <= fabsf(b))
        sa = a * 0x1p24f;
    else
        sb = b * 0x1p24f;
    return fabsf(fmaf(sa, sb, acc * 0x1p24f)) < 0x1p-102f ? copysignf(0.0f, r) : r;
}

int nx_matmul_bf16_generic(const nx_mm_call *c) {
    const nx_wtype_traits *wt = c->wt;
    const float *x = c->x, *bias = c->bias;
    const uint8_t *w = c->w;
    float *out = c->out;
    const size_t T = c->T, K = c->K, N = c->N, n0 = c->n0, n1 = c->n1, rowbytes = c->rowbytes;
    if (!wt) return -2;
    if (T == 0 || n0 >= n1) return 0;
    const size_t K32 = (K + 31) / 32 * 32;
    float *xb = (float *)malloc((T * K32 + 1) * sizeof(float)); /* bf(x) as float32 values */
    float *wf = (float *)malloc((K32 + 1) * sizeof(float));     /* one dequantized row */
    if (!xb || !wf) {
        free(xb);
        free(wf);
        return -1;
    }
    for (size_t t = 0; t < T; t++)
        for (size_t k = 0; k < K32; k++)
            xb[t * K32 + k] = k < K ? nx_bf16_to_f32(nx_bf16_round(x[t * K + k])) : 0.0f;
    for (size_t n = n0; n < n1; n++) {
        if (K > 0) wt->dequant(w + n * rowbytes, wf, K / wt->blck_elems); /* the spec, exact */
        for (size_t k = 0; k < K32; k++)
            wf[k] = k < K ? nx_bf16_to_f32(nx_bf16_round(wf[k])) : 0.0f;
        for (size_t t = 0; t < T; t++) {
            const float *xr = xb + t * K32;
            float acc = 0.0f;
            for (size_t k = 0; k < K32; k += 2) {
                acc = nx_dpbf16_step(acc, xr[k + 1], wf[k + 1]); /* odd element first */
                acc = nx_dpbf16_step(acc, xr[k], wf[k]);
            }
            out[t * N + n] = bias ? acc + bias[n] : acc;
        }
    }
    free(xb);
    free(wf);
    return 0;
}

/* ------------------------------------------------------------------ q8 weight decoders */

static inline float nx_ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return nx_f16_to_f32(h);
}

static inline uint32_t nx_ld_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Signed codes qw[e] of one block (the element order of nx_quants.h). */
static void nx_q8w_codes_q8_0(const uint8_t *p, int8_t *qw) { memcpy(qw, p + 2, 32); }

static void nx_q8w_codes_q4(const uint8_t *qs, int off, int8_t *qw) {
    for (int j = 0; j < 32; j++) qw[j] = (int8_t)(((qs[j % 16] >> (4 * (j / 16))) & 15) - off);
}
static void nx_q8w_codes_q5(const uint8_t *qs, uint32_t qh, int off, int8_t *qw) {
    for (int j = 0; j < 32; j++)
        qw[j] = (int8_t)((int)(((qs[j % 16] >> (4 * (j / 16))) & 15) | ((qh >> j) & 1u) << 4) - off);
}
static void nx_q8w_codes_q4_0(const uint8_t *p, int8_t *qw) { nx_q8w_codes_q4(p + 2, 8, qw); }
static void nx_q8w_codes_q4_1(const uint8_t *p, int8_t *qw) { nx_q8w_codes_q4(p + 4, 0, qw); }
static void nx_q8w_codes_q5_0(const uint8_t *p, int8_t *qw) {
    nx_q8w_codes_q5(p + 6, nx_ld_u32(p + 2), 16, qw);
}
static void nx_q8w_codes_q5_1(const uint8_t *p, int8_t *qw) {
    nx_q8w_codes_q5(p + 8, nx_ld_u32(p + 4), 0, qw);
}
static void nx_q8w_codes_q2_K(const uint8_t *p, int8_t *qw) {
    const uint8_t *qs = p + 16;
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32;
        qw[e] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
    }
}
static void nx_q8w_codes_q3_K(const uint8_t *p, int8_t *qw) {
    const uint8_t *hm = p, *qs = p + 32;
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, s = (e / 32) % 4, l = e % 32;
        const int lo = (qs[32 * h + l] >> (2 * s)) & 3, hi = (hm[l] >> (4 * h + s)) & 1;
        qw[e] = (int8_t)(lo - ((hi ^ 1) << 2));
    }
}
static void nx_q8w_codes_q4_K(const uint8_t *p, int8_t *qw) {
    const uint8_t *qs = p + 16;
    for (int e = 0; e < 256; e++) {
        const int c = e / 64, s = (e / 32) % 2, l = e % 32;
        qw[e] = (int8_t)((qs[32 * c + l] >> (4 * s)) & 15);
    }
}
static void nx_q8w_codes_q5_K(const uint8_t *p, int8_t *qw) {
    const uint8_t *qh = p + 16, *qs = p + 48;
    for (int e = 0; e < 256; e++) {
        const int c = e / 64, s = (e / 32) % 2, l = e % 32;
        qw[e] = (int8_t)(((qs[32 * c + l] >> (4 * s)) & 15) | ((qh[l] >> (e / 32)) & 1) << 4);
    }
}
static void nx_q8w_codes_q6_K(const uint8_t *p, int8_t *qw) {
    const uint8_t *ql = p, *qh = p + 128;
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, r = e % 128;
        const int code = ((ql[64 * h + r % 64] >> (4 * (r / 64))) & 15) |
                         ((qh[32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4;
        qw[e] = (int8_t)(code - 32);
    }
}

/* Scales sw[i] and mins mw[i] of one block, i = 32-group * halves + part (nx_lowp.h). */
static void nx_q8w_scales_d(const uint8_t *p, float *sw, float *mw) {
    (void)mw;
    sw[0] = nx_ld_f16(p);
}
static void nx_q8w_scales_dm(const uint8_t *p, float *sw, float *mw) {
    sw[0] = nx_ld_f16(p);
    mw[0] = nx_ld_f16(p + 2);
}
static void nx_q8w_scales_q2_K(const uint8_t *p, float *sw, float *mw) {
    const float d = nx_ld_f16(p + 80), dmin = nx_ld_f16(p + 82);
    for (int i = 0; i < 16; i++) {
        sw[i] = d * (float)(p[i] & 15);
        mw[i] = -(dmin * (float)(p[i] >> 4));
    }
}
static void nx_q8w_scales_q3_K(const uint8_t *p, float *sw, float *mw) {
    (void)mw;
    const uint8_t *sc = p + 96;
    const float d = nx_ld_f16(p + 108);
    for (int i = 0; i < 16; i++) {
        const int code = ((sc[i % 8] >> (4 * (i / 8))) & 15) | ((sc[8 + i % 4] >> (2 * (i / 4))) & 3)
                                                                   << 4;
        sw[i] = d * (float)(code - 32);
    }
}
static void nx_q8w_scales_k4(const uint8_t *p, float *sw, float *mw) { /* Q4_K, Q5_K */
    const uint8_t *s = p + 4;
    const float d = nx_ld_f16(p), dmin = nx_ld_f16(p + 2);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        if (j < 4) {
            sc = s[j] & 63;
            mn = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
            mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        }
        sw[j] = d * (float)sc;
        mw[j] = -(dmin * (float)mn);
    }
}
static void nx_q8w_scales_q6_K(const uint8_t *p, float *sw, float *mw) {
    (void)mw;
    const float d = nx_ld_f16(p + 208);
    for (int i = 0; i < 16; i++) sw[i] = d * (float)(int8_t)p[192 + i];
}

#define NX_Q8W_ROW(T, E, H, M, OFF, codes, scales)                                                \
    [NX_GGML_##T] = {E, H, M, OFF, nx_q8w_codes_##codes, nx_q8w_scales_##scales}
static const nx_q8w_type nx_q8w_types[NX_GGML_TYPE_COUNT] = {
    NX_Q8W_ROW(Q8_0, 32, 1, 0, 128, q8_0, d),  NX_Q8W_ROW(Q4_0, 32, 1, 0, 8, q4_0, d),
    NX_Q8W_ROW(Q5_0, 32, 1, 0, 16, q5_0, d),   NX_Q8W_ROW(Q4_1, 32, 1, 1, 0, q4_1, dm),
    NX_Q8W_ROW(Q5_1, 32, 1, 1, 0, q5_1, dm),   NX_Q8W_ROW(Q2_K, 256, 2, 1, 0, q2_K, q2_K),
    NX_Q8W_ROW(Q3_K, 256, 2, 0, 4, q3_K, q3_K), NX_Q8W_ROW(Q4_K, 256, 1, 1, 0, q4_K, k4),
    NX_Q8W_ROW(Q5_K, 256, 1, 1, 0, q5_K, k4),  NX_Q8W_ROW(Q6_K, 256, 2, 0, 32, q6_K, q6_K),
};

const nx_q8w_type *nx_q8w(uint32_t type) {
    return type < NX_GGML_TYPE_COUNT && nx_q8w_types[type].elems ? &nx_q8w_types[type] : NULL;
}

/* ------------------------------------------------------------------ q8 spec */

int nx_matmul_q8_generic(const nx_mm_call *c) {
    const float *x = c->x, *bias = c->bias;
    const uint8_t *w = c->w;
    float *out = c->out;
    const size_t T = c->T, K = c->K, N = c->N, n0 = c->n0, n1 = c->n1;
    const nx_q8w_type *qt = nx_q8w(c->type);
    if (!qt) return -2;
    if (T == 0 || n0 >= n1) return 0;
    const size_t nb = K / NX_QK8_0, xrow = nb * NX_Q8_0_BLOCK_BYTES;
    const size_t H = (size_t)qt->halves, P = 32 / H, nblk = K / qt->elems;
    const size_t spb = qt->elems / 32 * H, bb = c->wt->blck_bytes;
    uint8_t *xq = (uint8_t *)malloc(T * xrow + 1);
    float *dx = (float *)malloc((T * nb + 1) * sizeof(float)); /* float32 activation scales */
    int8_t *qw = (int8_t *)malloc(K + 1);                       /* one row's signed codes */
    float *sw = (float *)malloc((nb * H + 1) * sizeof(float)); /* its scales and mins */
    float *mw = (float *)malloc((nb * H + 1) * sizeof(float));
    if (!xq || !dx || !qw || !sw || !mw) {
        free(xq);
        free(dx);
        free(qw);
        free(sw);
        free(mw);
        return -1;
    }
    if (nb > 0) nx_q8_0_quantize_generic(x, xq, T * nb); /* rows are consecutive blocks */
    for (size_t i = 0; i < T * nb; i++) dx[i] = nx_q8_0_act_scale(x + i * NX_QK8_0);
    for (size_t n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * c->rowbytes;
        for (size_t i = 0; i < nblk; i++) {
            qt->codes(wr + i * bb, qw + i * qt->elems);
            qt->scales(wr + i * bb, sw + i * spb, mw + i * spb);
        }
        for (size_t t = 0; t < T; t++) {
            const uint8_t *xr = xq + t * xrow;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                const int8_t *xb = (const int8_t *)(xr + b * NX_Q8_0_BLOCK_BYTES + 2);
                const int8_t *wb = qw + b * NX_QK8_0;
                const float d = dx[t * nb + b];
                int32_t isum[2] = {0, 0}, xsum[2] = {0, 0};
                for (size_t h = 0; h < H; h++)
                    for (size_t i = h * P; i < (h + 1) * P; i++) {
                        isum[h] += (int32_t)xb[i] * wb[i];
                        xsum[h] += xb[i];
                    }
                if (H == 1) {
                    const float s = d * sw[b]; /* one rounding */
                    acc = fmaf((float)isum[0], s, acc);
                } else {
                    float y = (float)isum[0] * sw[2 * b]; /* one rounding */
                    y = fmaf((float)isum[1], sw[2 * b + 1], y);
                    acc = fmaf(y, d, acc);
                }
                if (qt->has_min)
                    for (size_t h = 0; h < H; h++) {
                        const float a = d * (float)xsum[h]; /* one rounding */
                        acc = fmaf(a, mw[b * H + h], acc);
                    }
            }
            out[t * N + n] = bias ? acc + bias[n] : acc;
        }
    }
    free(xq);
    free(dx);
    free(qw);
    free(sw);
    free(mw);
    return 0;
}

/* ------------------------------------------------------------------ blocked driver */

static inline size_t nx_min(size_t a, size_t b) { return a < b ? a : b; }

static void *nx_alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64 + 64); }

/* One mc x nc block of call c at tokens [ic, ic + mc), columns [jc, jc + nc): every k-block's
 * weight panels packed and run against the packed A block Ap, into o (the block's first
 * output; row r at o + r * ldo), then the bias. */
static void nx_lowp_block(const nx_lowp_tiling *tl, const nx_mm_call *c, const uint8_t *Ap,
                          size_t a_panel, uint8_t *Bp, size_t b_panel, void *bs, float *Cp,
                          size_t n_jr, size_t mc, size_t jc, size_t nc, float *o, size_t ldo) {
    const size_t MR = tl->mr, NR = tl->nr, KC = tl->kc, K = c->K;
    for (size_t pc = 0; pc < K; pc += KC) {
        const size_t kc = nx_min(K - pc, KC), ng = (kc + 31) / 32;
        for (size_t jr = 0; jr < nc; jr += NR)
            tl->pack_b(c, jc + jr, nx_min(nc - jr, NR), pc, kc, Bp + jr / NR * b_panel, bs);
        const uint8_t *A0 = Ap + pc / 32 * tl->a_group;
        if (tl->kern_cp) {
            const int last = pc + KC >= K;
            for (size_t ir = 0; ir < mc; ir += MR)
                for (size_t jr = 0; jr < nc; jr += NR) {
                    const size_t tile = ir / MR * n_jr + jr / NR;
                    float *ct = Cp ? Cp + tile * MR * NR : NULL;
                    /* the next tile's outputs, if it is a whole one: (ir, jr + NR), else the
                     * first of the next token rows */
                    const size_t ni = jr + NR < nc ? ir : ir + MR, nj = jr + NR < nc ? jr + NR : 0;
                    const float *next =
                        last && ni + MR <= mc && nj + NR <= nc ? o + ni * ldo + nj : NULL;
                    tl->kern_cp(ng, A0 + ir / MR * a_panel, Bp + jr / NR * b_panel, ct,
                                o + ir * ldo + jr, ldo, (int)nx_min(mc - ir, MR),
                                (int)nx_min(nc - jr, NR), pc == 0, last, next,
                                last && c->bias ? c->bias + jc + jr : NULL);
                }
        } else if (tl->jr_outer) {
            for (size_t jr = 0; jr < nc; jr += NR)
                for (size_t ir = 0; ir < mc; ir += MR)
                    tl->kern(ng, A0 + ir / MR * a_panel, Bp + jr / NR * b_panel, o + ir * ldo + jr,
                             ldo, (int)nx_min(mc - ir, MR), (int)nx_min(nc - jr, NR), pc == 0);
        } else {
            for (size_t ir = 0; ir < mc; ir += MR)
                for (size_t jr = 0; jr < nc; jr += NR)
                    tl->kern(ng, A0 + ir / MR * a_panel, Bp + jr / NR * b_panel, o + ir * ldo + jr,
                             ldo, (int)nx_min(mc - ir, MR), (int)nx_min(nc - jr, NR), pc == 0);
        }
    }
    if (c->bias && !tl->kern_cp) /* kern_cp adds it as it writes the outputs */
        for (size_t t = 0; t < mc; t++)
            for (size_t n = 0; n < nc; n++) o[t * ldo + n] = o[t * ldo + n] + c->bias[jc + n];
}

int nx_lowp_blocked(const nx_lowp_tiling *tl, const nx_mm_call *c) {
    const float *x = c->x;
    float *out = c->out;
    const size_t T = c->T, K = c->K, N = c->N, n0 = c->n0, n1 = c->n1;
    if (nx_mm_trivial(c)) return 0;
    const size_t MR = tl->mr, NR = tl->nr, KC = tl->kc, NC = tl->nc, MC = tl->mc;
    const size_t G = (K + 31) / 32; /* 32-k groups of all of K */
    /* token blocks: as few as blocks of up to MC * 9/8 need, of equal size (rounded up to MR):
     * each block decodes the whole weight panel again, so a short tail block (T=4128 at MC
     * 1024: 32 tokens) would pay a full decode for little work. The blocking never changes a
     * bit. AMX Xeon, one thread, the zimage-1l-q4km file's w1 (Q4_K, N=10240), T=2100 (3 -> 2
     * blocks), three alternating runs: 1038-1090 -> 1059-1168 GOP/s. */
    const size_t nblk = (T + MC + MC / 8 - 1) / (MC + MC / 8);
    const size_t MCB = ((T + nblk - 1) / nblk + MR - 1) / MR * MR;
    const size_t mc_max = nx_min(T, MCB), nc_max = nx_min(n1 - n0, NC), kc_max = nx_min(K, KC);
    const size_t a_panel = G * tl->a_group;                  /* bytes of one A micro-panel */
    const size_t b_panel = (kc_max + 31) / 32 * tl->b_group; /* bytes of one B micro-panel */
    /* The gated call (nx_mm_call's w_up): per block the up projection into U (mc x nc, L2-sized
     * at MC tokens), then the gate into out, then glu over the block's rows; one packed A for
     * both. */
    const int gated = c->w_up != NULL;
    nx_mm_call cu = *c;
    cu.w = c->w_up;
    uint8_t *Ap = (uint8_t *)nx_alloc64((mc_max + MR - 1) / MR * a_panel);
    uint8_t *Bp = (uint8_t *)nx_alloc64((nc_max + NR - 1) / NR * b_panel);
    void *as = tl->a_scratch ? nx_alloc64(tl->a_scratch) : NULL;
    void *bs = tl->b_scratch ? nx_alloc64(tl->b_scratch) : NULL;
    const size_t n_jr = (nc_max + NR - 1) / NR; /* tiles per row of the packed C block */
    const int cp = tl->kern_cp && K > KC;       /* one k-block: straight to C */
    float *Cp = cp ? (float *)nx_alloc64((mc_max + MR - 1) / MR * n_jr * MR * NR * sizeof(float))
                   : NULL;
    float *U = gated ? (float *)nx_alloc64(mc_max * nc_max * sizeof(float)) : NULL;
    /* an implicit x: one micro-panel's rows at a time, materialized in L2 and packed at once */
    float *xr = c->a_rows ? (float *)nx_alloc64(MR * K * sizeof(float)) : NULL;
    if (!Ap || !Bp || (tl->a_scratch && !as) || (tl->b_scratch && !bs) || (cp && !Cp) ||
        (gated && !U) || (c->a_rows && !xr)) {
        free(xr);
        free(U);
        free(Cp);
        free(Ap);
        free(Bp);
        free(as);
        free(bs);
        return -1;
    }
    for (size_t ic = 0; ic < T; ic += MCB) {
        const size_t mc = nx_min(T - ic, MCB);
        for (size_t ir = 0; ir < mc; ir += MR) {
            const size_t rows = nx_min(mc - ir, MR);
            if (xr) {
                c->a_rows(c->a_ctx, ic + ir, rows, xr);
                tl->pack_a(xr, K, 0, rows, Ap + ir / MR * a_panel, as);
            } else {
                tl->pack_a(x, K, ic + ir, rows, Ap + ir / MR * a_panel, as);
            }
        }
        for (size_t jc = n0; jc < n1; jc += NC) {
            const size_t nc = nx_min(n1 - jc, NC);
            float *o = out + ic * N + jc;
            if (gated)
                nx_lowp_block(tl, &cu, Ap, a_panel, Bp, b_panel, bs, Cp, n_jr, mc, jc, nc, U, nc);
            nx_lowp_block(tl, c, Ap, a_panel, Bp, b_panel, bs, Cp, n_jr, mc, jc, nc, o, N);
            if (gated)
                for (size_t t = 0; t < mc; t++)
                    c->glu(o + t * N, U + t * nc, o + t * N, 0, (int64_t)nc);
        }
    }
    free(xr);
    free(U);
    free(Cp);
    free(Ap);
    free(Bp);
    free(as);
    free(bs);
    return 0;
}

/* ------------------------------------------------------------------ tables and entry points */

const nx_lowp_table nx_lowp_table_generic = {.matmul_bf16 = nx_matmul_bf16_generic,
                                             .matmul_q8 = nx_matmul_q8_generic,
                                             .round_bf16 = nx_bf16_round_n_generic};

static nx_mm_call nx_lowp_call(nx_isa isa, const nx_wtype_traits *wt, uint32_t type, const float *x,
                               const uint8_t *w, const float *bias, float *out, size_t T, size_t K,
                               size_t N, size_t n0, size_t n1) {
    nx_mm_call c = {wt, nx_wtype_dequant(isa, type),         type, x, w, bias, out, T, K, N, n0,
                    n1, K / wt->blck_elems * wt->blck_bytes, 0};
    return c;
}

int nx_matmul_bf16(nx_isa isa, uint32_t type, const float *x /* IN */, const uint8_t *w /* IN */,
                   const float *bias /* IN */, float *out /* OUT */, size_t T, size_t K, size_t N,
                   size_t n0, size_t n1, unsigned flags) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    nx_mm_call c = nx_lowp_call(isa, wt, type, x, w, bias, out, T, K, N, n0, n1);
    c.flags = flags;
    return nx_lowp_get(isa)->matmul_bf16(&c);
}

/* The gated call at `isa` on the lowp slot `mm` (its table function; the generic spec runs plain
 * calls only, so it goes through nx_mm_glu_split). */
static int nx_lowp_glu(nx_isa isa, nx_mm_call *c, const uint8_t *w_up,
                       int (*mm)(const nx_mm_call *), int (*spec)(const nx_mm_call *)) {
    c->w_up = w_up, c->glu = nx_ops_get(isa)->swiglu; /* c's bias is NULL */
    return mm == spec ? nx_mm_glu_split(c, mm) : mm(c);
}

int nx_matmul_bf16_rows(nx_isa isa, uint32_t type, nx_mm_rows_fn a_rows, const void *a_ctx,
                        const uint8_t *w /* IN */, const float *bias /* IN */,
                        float *out /* OUT */, size_t T, size_t K, size_t N, size_t n0, size_t n1,
                        unsigned flags) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    int (*mm)(const nx_mm_call *) = nx_lowp_get(isa)->matmul_bf16;
    nx_mm_call c = nx_lowp_call(isa, wt, type, NULL, w, bias, out, T, K, N, n0, n1);
    c.flags = flags;
    return nx_mm_run_rows(&c, mm, mm != nx_matmul_bf16_generic, a_rows, a_ctx);
}

int nx_matmul_bf16_glu(nx_isa isa, uint32_t type, const float *x /* IN */,
                       const uint8_t *w /* IN */, const uint8_t *w_up /* IN */,
                       float *out /* OUT */, size_t T, size_t K, size_t N, size_t n0, size_t n1,
                       unsigned flags) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    nx_mm_call c = nx_lowp_call(isa, wt, type, x, w, NULL, out, T, K, N, n0, n1);
    c.flags = flags;
    return nx_lowp_glu(isa, &c, w_up, nx_lowp_get(isa)->matmul_bf16, nx_matmul_bf16_generic);
}

int nx_matmul_q8_glu(nx_isa isa, uint32_t type, const float *x /* IN */, const uint8_t *w /* IN */,
                     const uint8_t *w_up /* IN */, float *out /* OUT */, size_t T, size_t K,
                     size_t N, size_t n0, size_t n1) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt || !nx_q8w(type)) return -2;
    nx_mm_call c = nx_lowp_call(isa, wt, type, x, w, NULL, out, T, K, N, n0, n1);
    return nx_lowp_glu(isa, &c, w_up, nx_lowp_get(isa)->matmul_q8, nx_matmul_q8_generic);
}

int nx_matmul_q8(nx_isa isa, uint32_t type, const float *x /* IN */, const uint8_t *w /* IN */,
                 const float *bias /* IN */, float *out /* OUT */, size_t T, size_t K, size_t N,
                 size_t n0, size_t n1) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt || !nx_q8w(type)) return -2;
    const nx_mm_call c = nx_lowp_call(isa, wt, type, x, w, bias, out, T, K, N, n0, n1);
    return nx_lowp_get(isa)->matmul_q8(&c);
}
