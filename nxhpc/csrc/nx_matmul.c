/* nx_matmul.c -- the matmul family: the scalar spec (any weight type), the cache-blocked driver
 * the SIMD variants share, the adaLN linear, and the dispatch (nx_dispatch.h).
 * Compiled with no ISA flags: runs on any CPU. Must not: use SIMD intrinsics (those live in
 * nx_matmul_avx2.c / nx_matmul_avx512.c), allocate per tile.
 */
#include "nx_matmul.h"
#include "nx_ops.h" /* the swiglu of the gated call */

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ dispatch */

NX_DEFINE_DISPATCH(
    nx_mm, "matmul", NX_MM_SLOTS,
    {[NX_ISA_GENERIC] = &nx_mm_table_generic,
     NX_X86_ONLY([NX_ISA_AVX2] = &nx_mm_table_avx2, [NX_ISA_AVX512] = &nx_mm_table_avx512, )})

static int nx_matmul_packer_generic(uint32_t type) {
    (void)type;
    return 0; /* the spec dequantizes whole rows; no panels */
}

const nx_mm_table nx_mm_table_generic = {.matmul = nx_matmul_generic,
                                         .matmul_packer = nx_matmul_packer_generic};

/* A call of `type` at `isa` (the type's dequantize at that ISA; row stride from K). */
static nx_mm_call nx_mm_make_call(nx_isa isa, const nx_wtype_traits *wt, uint32_t type,
                                  const float *x, const uint8_t *w, const float *bias, float *out,
                                  size_t T, size_t K, size_t N, size_t n0, size_t n1,
                                  unsigned flags) {
    const nx_mm_call c = {
        wt, nx_wtype_dequant(isa, type),         type, x, w, bias, out, T, K, N, n0,
        n1, K / wt->blck_elems * wt->blck_bytes, flags};
    return c;
}

int nx_matmul_ex(nx_isa isa, uint32_t type, const float *x, const uint8_t *w, const float *bias,
                 float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1, unsigned flags) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    const nx_mm_call c = nx_mm_make_call(isa, wt, type, x, w, bias, out, T, K, N, n0, n1, flags);
    if (T == 0 || n0 >= n1) return 0;
    return nx_mm_get(isa)->matmul(&c);
}

int nx_mm_glu_split(const nx_mm_call *c, int (*mm)(const nx_mm_call *)) {
    if (c->T == 0 || c->n0 >= c->n1) return 0;
    const size_t T = c->T, N = c->N, band = c->n1 - c->n0;
    const size_t chunk = band < NX_MM_GLU_CHUNK ? band : NX_MM_GLU_CHUNK;
    float *u = (float *)malloc(T * chunk * sizeof(float));
    if (!u) return -1;
    int rc = 0;
    for (size_t j0 = c->n0; j0 < c->n1 && rc == 0; j0 += chunk) {
        const size_t nb = c->n1 - j0 < chunk ? c->n1 - j0 : chunk;
        nx_mm_call g = *c;
        g.w_up = NULL, g.glu = NULL, g.bias = NULL, g.n0 = j0, g.n1 = j0 + nb;
        nx_mm_call up = g;
        up.w = c->w_up + j0 * c->rowbytes, up.out = u, up.N = nb, up.n0 = 0, up.n1 = nb;
        rc = mm(&g);
        if (rc == 0) rc = mm(&up);
        if (rc == 0)
            for (size_t t = 0; t < T; t++)
                c->glu(c->out + t * N + j0, u + t * nb, c->out + t * N + j0, 0, (int64_t)nb);
    }
    free(u);
    return rc;
}

int nx_matmul(nx_isa isa, uint32_t type, const float *x, const uint8_t *w, const float *bias,
              float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1) {
    return nx_matmul_ex(isa, type, x, w, bias, out, T, K, N, n0, n1, 0);
}

int nx_matmul_glu(nx_isa isa, uint32_t type, const float *x, const uint8_t *w, const uint8_t *w_up,
                  float *out, size_t T, size_t K, size_t N, size_t n0, size_t n1, unsigned flags) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    nx_mm_call c = nx_mm_make_call(isa, wt, type, x, w, NULL, out, T, K, N, n0, n1, flags);
    c.w_up = w_up, c.glu = nx_ops_get(isa)->swiglu;
    if (T == 0 || n0 >= n1) return 0;
    const nx_mm_table *t = nx_mm_get(isa); /* the spec runs plain calls only */
    return t->matmul == nx_matmul_generic ? nx_mm_glu_split(&c, t->matmul) : t->matmul(&c);
}

/* ------------------------------------------------------------------ the spec */

/* Per column n: dequantize row n once with the type's generic spec (exact), then the two-level
 * sum for NX_MM_DOT_ROWS tokens at a time, then the bias. */
int nx_matmul_generic(const nx_mm_call *c) {
    const size_t T = c->T, K = c->K, N = c->N;
    const size_t nb = K / c->wt->blck_elems;
    float *wrow = NULL;
    if (K > 0 && !(wrow = (float *)malloc(K * sizeof(float)))) return -1;
    for (size_t n = c->n0; n < c->n1; n++) {
        if (K > 0) c->wt->dequant(c->w + n * c->rowbytes, wrow, nb);
        for (size_t t = 0; t < T; t += NX_MM_DOT_ROWS) {
            const size_t rows = T - t < NX_MM_DOT_ROWS ? T - t : NX_MM_DOT_ROWS;
            nx_mm_dot_rows(c->x + t * K, K, rows, wrow, K, c->out + t * N + n, N);
        }
        if (c->bias)
            for (size_t t = 0; t < T; t++) c->out[t * N + n] = c->out[t * N + n] + c->bias[n];
    }
    free(wrow);
    return 0;
}

/* ------------------------------------------------------------------ blocked driver (SIMD) */

/* Tokens [t0, t0+mc) of x (all K) into Ap: micro-panel i (MR tokens) at Ap + i*K*MR, element
 * [k*MR + r] = x[t0 + i*MR + r, k]; rows past mc are zero. */
static void nx_mm_pack_a(const float *x /* IN */, size_t K, size_t t0, size_t mc, size_t MR,
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

/* One mc x nc block of call c (tokens from the packed block Ap, columns [jc, jc + nc)) into o
 * (the block's first output; row r at o + r * ldo), then the bias. */
static void nx_mm_block(const nx_mm_tiling *tl, nx_mm_pack_fn pack, const nx_mm_call *c,
                        const float *Ap, float *Bp, size_t mc, size_t jc, size_t nc, float *o,
                        size_t ldo) {
    const size_t K = c->K, MR = tl->mr, NR = tl->nr, KC = tl->kc, E = c->wt->blck_elems;
    for (size_t pc = 0; pc < K; pc += KC) {
        const size_t kc = nx_min(K - pc, KC); /* a multiple of E: K and KC are */
        pack(c, jc, nc, pc / E, kc / E, Bp);
        for (size_t ir = 0; ir < mc; ir += MR) {
            const int mr = (int)nx_min(mc - ir, MR);
            const float *A = Ap + (ir / MR) * K * MR + pc * MR;
            for (size_t jr = 0; jr < nc; jr += NR) {
                const int nr = (int)nx_min(nc - jr, NR);
                const float *B = Bp + (jr / NR) * kc * NR;
                for (size_t s0 = 0; s0 < kc; s0 += NX_MM_CHAIN)
                    tl->kern(mr, nr, nx_min(kc - s0, NX_MM_CHAIN), A + s0 * MR, B + s0 * NR,
                             o + ir * ldo + jr, ldo, pc + s0 == 0);
            }
        }
    }
    if (c->bias) /* after the two-level sum: one float32 add, as the spec */
        for (size_t t = 0; t < mc; t++)
            for (size_t n = 0; n < nc; n++) o[t * ldo + n] = o[t * ldo + n] + c->bias[jc + n];
}

int nx_matmul_blocked(const nx_mm_tiling *tl, const nx_mm_call *c) {
    const size_t T = c->T, K = c->K, N = c->N, n0 = c->n0, n1 = c->n1;
    const float *x = c->x;
    float *out = c->out;
    if (nx_mm_trivial(c)) return 0;
    const size_t MR = tl->mr, NR = tl->nr, KC = tl->kc, NC = tl->nc, MC = tl->mc;
    nx_mm_pack_fn pack = (c->flags & NX_MM_DEQUANT_PACK) ? NULL : tl->pack_fused[c->type];
    if (!pack) pack = tl->pack_rows;
    const size_t mc_max = T < MC ? (T + MR - 1) / MR * MR : MC;
    const size_t nc_max = n1 - n0 < NC ? (n1 - n0 + NR - 1) / NR * NR : NC;
    const size_t kc_max = nx_min(K, KC);
    /* the gated call (nx_mm_call's w_up): per block the up projection into U, then the gate into
     * out, then glu over the block's rows, with one packed x */
    const int gated = c->w_up != NULL;
    nx_mm_call cu = *c;
    cu.w = c->w_up;
    float *Ap = (float *)aligned_alloc(64, (mc_max * K * sizeof(float) + 63) / 64 * 64);
    float *Bp = (float *)aligned_alloc(64, (nc_max * kc_max * sizeof(float) + 63) / 64 * 64);
    float *U = gated ? (float *)malloc(mc_max * nc_max * sizeof(float)) : NULL;
    /* an implicit x (c->a_rows): one micro-panel's rows at a time, made in L2, packed at once */
    float *xr = c->a_rows ? (float *)malloc(MR * K * sizeof(float)) : NULL;
    if (!Ap || !Bp || (gated && !U) || (c->a_rows && !xr)) {
        free(xr);
        free(U);
        free(Ap);
        free(Bp);
        return -1;
    }
    for (size_t ic = 0; ic < T; ic += MC) {
        const size_t mc = nx_min(T - ic, MC);
        if (xr)
            for (size_t ir = 0; ir < mc; ir += MR) {
                const size_t rows = nx_min(mc - ir, MR);
                c->a_rows(c->a_ctx, ic + ir, rows, xr);
                nx_mm_pack_a(xr, K, 0, rows, MR, Ap + ir * K);
            }
        else
            nx_mm_pack_a(x, K, ic, mc, MR, Ap);
        for (size_t jc = n0; jc < n1; jc += NC) {
            const size_t nc = nx_min(n1 - jc, NC);
            float *o = out + ic * N + jc;
            if (gated) nx_mm_block(tl, pack, &cu, Ap, Bp, mc, jc, nc, U, nc);
            nx_mm_block(tl, pack, c, Ap, Bp, mc, jc, nc, o, N);
            if (gated)
                for (size_t t = 0; t < mc; t++)
                    c->glu(o + t * N, U + t * nc, o + t * N, 0, (int64_t)nc);
        }
    }
    free(xr);
    free(U);
    free(Ap);
    free(Bp);
    return 0;
}

int nx_mm_run_rows(nx_mm_call *c, int (*mm)(const nx_mm_call *), int blocked,
                   nx_mm_rows_fn a_rows, const void *a_ctx) {
    if (c->T == 0 || c->n0 >= c->n1) return 0;
    if (blocked) { /* the blocked driver packs the rows as they come */
        c->x = NULL, c->a_rows = a_rows, c->a_ctx = a_ctx;
        return mm(c);
    }
    /* a spec reads x whole: chunks of rows made in turn (each row's sum is its own) */
    const size_t T = c->T, K = c->K, N = c->N;
    const size_t chunk = nx_min(T, NX_MM_ROWS_CHUNK);
    float *xb = (float *)malloc((chunk * K + 1) * sizeof(float)); /* K may be 0 */
    if (!xb) return -1;
    float *out = c->out;
    int rc = 0;
    for (size_t t0 = 0; t0 < T && rc == 0; t0 += chunk) {
        const size_t rows = nx_min(T - t0, chunk);
        a_rows(a_ctx, t0, rows, xb);
        c->x = xb, c->T = rows, c->out = out + t0 * N;
        rc = mm(c);
    }
    free(xb);
    return rc;
}

int nx_matmul_rows(nx_isa isa, uint32_t type, nx_mm_rows_fn a_rows, const void *a_ctx,
                   const uint8_t *w, const float *bias, float *out, size_t T, size_t K, size_t N,
                   size_t n0, size_t n1) {
    const nx_wtype_traits *wt = nx_wtype(type);
    if (!wt) return -2;
    const nx_mm_table *t = nx_mm_get(isa);
    nx_mm_call c = nx_mm_make_call(isa, wt, type, NULL, w, bias, out, T, K, N, n0, n1, 0);
    return nx_mm_run_rows(&c, t->matmul, t->matmul != nx_matmul_generic, a_rows, a_ctx);
}

int nx_matmul_packer(nx_isa isa, uint32_t type) {
    return nx_wtype(type) ? nx_mm_get(isa)->matmul_packer(type) : -1;
}

/* ------------------------------------------------------------------ adaLN linear */

static inline float nx_silu(float t) { return t / (1.0f + expf(-t)); }

int nx_adaln_linear(nx_isa isa, uint32_t type, const float *t_emb /* IN [K] */,
                    const uint8_t *w /* IN */, const float *bias /* IN [N] or NULL */,
                    float *out /* OUT [N] */, size_t K, size_t N, int silu_input) {
    if (!nx_wtype(type)) return -2;
    float *u = NULL;
    if (K > 0) {
        if (!(u = (float *)malloc(K * sizeof(float)))) return -1;
        for (size_t k = 0; k < K; k++) u[k] = silu_input ? nx_silu(t_emb[k]) : t_emb[k];
    }
    const int rc = nx_matmul(isa, type, u, w, bias, out, 1, K, N, 0, N);
    free(u);
    return rc;
}
