/* nx_bwd.h -- backward (vector-Jacobian) kernels of the block's nonlinearities: RMSNorm(+mod),
 * RoPE, qk-norm+RoPE, SwiGLU, tanh-gated residual, softmax attention. Generic scalar functions
 * (nx_bwd.c) are the spec; AVX-512 variants live in nx_bwd_avx512.c, AVX2+FMA variants of swiglu
 * and attention (where scalar code is far slower) in nx_bwd_avx2.c; each file exports one dispatch
 * table (nx_bwd_table_<isa>). Callers (nxhpc/_k_bwd.pxi)
 * validate every shape before entering; these functions trust their arguments.
 *
 * Numerics (what is bit-identical, and where variants may differ):
 *  - rmsnorm_backward / qknorm_rope_backward: every row is done in float64 from the float32
 *    inputs (sums in 16 lanes, lane = element index % 16, combined by the tree
 *    (l + l+8), (l + l+4), (l + l+2), (l0 + l1)); no FMA contraction; one rounding to float32 at
 *    the end => the result is correctly rounded up to a few float64 ulps, and every variant
 *    that exists is bit-identical to generic.
 *  - rope_backward: dx[2i+c] = pe[t,i,0,c]*dy[2i] + pe[t,i,1,c]*dy[2i+1] in float32, never fused:
 *    bit-identical across variants.
 *  - gated_residual_backward: tanh(gate) and sech^2(gate) are computed once per column in float64
 *    with libm in every variant; dy = dout * (float)tanh(gate) (one float32 product);
 *    the dgate partial sums dout*y in float64 in row order: bit-identical across variants.
 *  - swiglu_backward: generic uses libm expf; the SIMD variants a polynomial exp (<= 2 ulp);
 *    they agree to a tolerance, not bit for bit.
 *  - attention_backward: generic recomputes each softmax row and accumulates everything in
 *    float64 (the spec, slow); the SIMD variants are tiled float32 with a polynomial exp (the
 *    driver below); they agree to the tolerance derived in tests/test_kernels_bwd.py.
 *  - Band invariance: an element's arithmetic never depends on the band bounds (dx, dy, da, db,
 *    dq, dk, dv), so any split gives bit-identical results within one variant. Parameter
 *    gradients that reduce over the banded axis (dw, dmod, dgate, dq_w, dk_w) are written as the
 *    *partial* sum over the band (accumulated in float64 in ascending row order, rounded once);
 *    nx_sum_partials_f32 adds such partials in a fixed order.
 */
#ifndef NX_BWD_H
#define NX_BWD_H

#include <stdint.h>
#include <stdlib.h>
#include "nx_cpu.h"

#include "nx_dispatch.h"

/* The family's slots (nx_dispatch.h), in kernel_variants() order. */
#define NX_BWD_SLOTS(X)                                                                            \
    X(rmsnorm_backward, int,                                                                       \
      (const float *x, const float *w, const float *mod, const float *dy, float *dx, float *dw,    \
       float *dmod, int64_t D, float eps, int64_t r0, int64_t r1))                                 \
    X(rope_backward, void,                                                                         \
      (const float *dy, const float *pe, float *dx, int64_t T, int64_t hd, int64_t r0,             \
       int64_t r1))                                                                                \
    X(qknorm_rope_backward, int,                                                                   \
      (const float *qkv, const float *q_w, const float *k_w, const float *pe, const float *dq,     \
       const float *dk, float *dqkv, float *dq_w, float *dk_w, int64_t T, int64_t H, int64_t KVH,  \
       int64_t hd, float eps, int64_t h0, int64_t h1))                                             \
    X(swiglu_backward, void,                                                                       \
      (const float *a, const float *b, const float *dout, float *da, float *db, int64_t i0,        \
       int64_t i1))                                                                                \
    X(gated_residual_backward, int,                                                                \
      (const float *y, const float *gate, const float *dout, float *dresid, float *dy,             \
       float *dgate, int64_t D, int64_t r0, int64_t r1))                                           \
    X(attention_backward, int,                                                                     \
      (const float *q, const float *k, const float *v, const float *dout, const uint8_t *mask,     \
       float *dq, float *dk, float *dv, int64_t T, int64_t H, int64_t KVH, int64_t hd,             \
       float scale, int64_t g0, int64_t g1))

NX_DECLARE_FAMILY(nx_bwd, NX_BWD_SLOTS)
/* AVX-512 variants exist for every kernel except qknorm_rope_backward (whose cost is the float64
 * row arithmetic, not memory); AVX2 variants for swiglu and attention only (the others are
 * within 1.5x of generic, or bound by float64 arithmetic): the other slots inherit. */
extern const nx_bwd_table nx_bwd_table_generic; /* nx_bwd.c */
extern const nx_bwd_table nx_bwd_table_avx2;    /* nx_bwd_avx2.c */
extern const nx_bwd_table nx_bwd_table_avx512;  /* nx_bwd_avx512.c */

/* ---- rmsnorm_backward. Forward: y[r] = x[r] * inv_r * w [* mod], inv_r = 1/sqrt(mean(x[r]^2)+eps).
 * For rows r in [r0, r1), with g = dy*w[*mod] and xhat = x*inv:
 *   dx[r]  := inv_r * (g - xhat * mean(g * xhat))
 *   dw     := sum_r dy[r] * xhat[r] [* mod]     (partial over the band; dw may be NULL)
 *   dmod   := sum_r dy[r] * xhat[r] * w         (partial over the band; dmod may be NULL, and is
 *                                               ignored when mod is NULL)
 * dx may equal x or dy. Returns 0, or -1 if the scratch (2*D doubles) could not be allocated. */
int nx_rmsnorm_bwd_f32(nx_isa isa,       /* the ISA to run (nx_cpu.h) */
                       const float *x,   /* IN  [T, D] */
                       const float *w,   /* IN  [D] */
                       const float *mod, /* IN  [D] or NULL */
                       const float *dy,  /* IN  [T, D] */
                       float *dx,        /* OUT [T, D], rows [r0, r1) */
                       float *dw,        /* OUT [D] or NULL */
                       float *dmod,      /* OUT [D] or NULL */
                       int64_t D, float eps, int64_t r0, int64_t r1);
int nx_rmsnorm_bwd_f32_generic(const float *x, const float *w, const float *mod, const float *dy,
                               float *dx, float *dw, float *dmod, int64_t D, float eps, int64_t r0,
                               int64_t r1);
int nx_rmsnorm_bwd_f32_avx512(const float *x, const float *w, const float *mod, const float *dy,
                              float *dx, float *dw, float *dmod, int64_t D, float eps, int64_t r0,
                              int64_t r1);

/* ---- rope_backward: rows r in [r0, r1) of dy viewed as [R, hd] with token t = r % T:
 * dx[r, 2i+c] := pe[t,i,0,c]*dy[r,2i] + pe[t,i,1,c]*dy[r,2i+1] (the transposed rotation).
 * dx may equal dy. */
void nx_rope_bwd_f32(nx_isa isa, const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                     int64_t r0, int64_t r1);
void nx_rope_bwd_f32_generic(const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                             int64_t r0, int64_t r1);
void nx_rope_bwd_f32_avx512(const float *dy, const float *pe, float *dx, int64_t T, int64_t hd,
                            int64_t r0, int64_t r1);

/* ---- qknorm_rope_backward: for heads j in [h0, h1) of the combined [q heads | k heads] index
 * and every token t, with x = qkv[t, j*hd:(j+1)*hd], w = q_w (j < H) or k_w, upstream
 * d = dq[j, t] (j < H) or dk[j-H, t]:  gr = rope_backward(d), g = gr*w, xhat = x*inv,
 *   dqkv[t, j*hd:(j+1)*hd] := inv * (g - xhat * mean(g*xhat))
 *   dq_w := sum over (q heads in band, t) of gr*xhat;  dk_w likewise over k heads (partials;
 *   either may be NULL). v columns of dqkv are not written.
 * Returns 0, or -1 if the scratch (3*hd doubles) could not be allocated. */
int nx_qknorm_rope_bwd_f32(nx_isa isa,       /* the ISA to run (nx_cpu.h) */
                           const float *qkv, /* IN  [T, (H+2*KVH)*hd] */
                           const float *q_w, /* IN  [hd] */
                           const float *k_w, /* IN  [hd] */
                           const float *pe,  /* IN  [T, hd/2, 2, 2] */
                           const float *dq,  /* IN  [H, T, hd] */
                           const float *dk,  /* IN  [KVH, T, hd] */
                           float *dqkv,      /* OUT [T, (H+2*KVH)*hd], q/k columns of the band */
                           float *dq_w,      /* OUT [hd] or NULL */
                           float *dk_w,      /* OUT [hd] or NULL */
                           int64_t T, int64_t H, int64_t KVH, int64_t hd, float eps, int64_t h0,
                           int64_t h1);
int nx_qknorm_rope_bwd_f32_generic(const float *qkv, const float *q_w, const float *k_w,
                                   const float *pe, const float *dq, const float *dk, float *dqkv,
                                   float *dq_w, float *dk_w, int64_t T, int64_t H, int64_t KVH,
                                   int64_t hd, float eps, int64_t h0, int64_t h1);

/* ---- swiglu_backward: forward out = silu(a) * b. For flat i in [i0, i1):
 *   da[i] := dout[i] * b[i] * silu'(a[i]),  db[i] := dout[i] * silu(a[i])
 * with s = sigmoid(a), silu' = s * (1 + a*(1 - s)); evaluated from e = exp(-|a|) without
 * overflow (a is clamped to +-FLT_MAX inside silu' and below -FLT_MAX inside silu, so +-inf give the
 * limits silu' = 1, 0 and silu = inf, -0, as the forward).
 * da may equal a, b or dout; db may equal a, b or dout (never each other). */
void nx_swiglu_bwd_f32(nx_isa isa, const float *a, const float *b, const float *dout, float *da,
                       float *db, int64_t i0, int64_t i1);
void nx_swiglu_bwd_f32_generic(const float *a, const float *b, const float *dout, float *da,
                               float *db, int64_t i0, int64_t i1);
void nx_swiglu_bwd_f32_avx512(const float *a, const float *b, const float *dout, float *da,
                              float *db, int64_t i0, int64_t i1);
void nx_swiglu_bwd_f32_avx2(const float *a, const float *b, const float *dout, float *da, float *db,
                            int64_t i0, int64_t i1);

/* ---- gated_residual_backward: forward out = resid + tanh(gate) * y (gate per column).
 * For rows r in [r0, r1):  dy[r] := dout[r] * tanh(gate);  dresid[r] := dout[r] (if not NULL);
 *   dgate := sech^2(gate) * sum_r dout[r] * y[r]   (partial over the band; may be NULL).
 * dy may equal dout or y. Returns 0, or -1 if the scratch (3*D doubles) could not be allocated. */
int nx_gated_residual_bwd_f32(nx_isa isa,        /* the ISA to run (nx_cpu.h) */
                              const float *y,    /* IN  [T, D] */
                              const float *gate, /* IN  [D] */
                              const float *dout, /* IN  [T, D] */
                              float *dresid,     /* OUT [T, D] or NULL */
                              float *dy,         /* OUT [T, D] */
                              float *dgate,      /* OUT [D] or NULL */
                              int64_t D, int64_t r0, int64_t r1);
int nx_gated_residual_bwd_f32_generic(const float *y, const float *gate, const float *dout,
                                      float *dresid, float *dy, float *dgate, int64_t D, int64_t r0,
                                      int64_t r1);
int nx_gated_residual_bwd_f32_avx512(const float *y, const float *gate, const float *dout,
                                     float *dresid, float *dy, float *dgate, int64_t D, int64_t r0,
                                     int64_t r1);

/* ---- attention_backward, plain layouts: q, dout, dq [H, T, hd]; k, v, dk, dv [KVH, T, hd].
 * Forward o[h,t] = sum_j P[h,t,j] v[g,j], P = softmax_j(scale * q[h,t].k[g,j], masked j
 * excluded), g = h / (H/KVH). For kv heads g in [g0, g1) and their query heads h:
 *   dP = dO V^T, dS = P * (dP - rowsum(dP * P)),
 *   dq[h] := scale * dS K,  dk[g] := scale * sum_h dS^T Q,  dv[g] := sum_h P^T dO.
 * mask: [T] bytes over keys, nonzero = attend, or NULL; a query whose keys are all masked has
 * zero gradient. Softmax rows are recomputed (no T^2 storage). Returns 0, or -1 if scratch
 * could not be allocated (outputs of the band are then unspecified). */
int nx_attention_bwd_f32(nx_isa isa, const float *q, const float *k, const float *v,
                         const float *dout, const uint8_t *mask, float *dq, float *dk, float *dv,
                         int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                         int64_t g1);
int nx_attention_bwd_f32_generic(const float *q, const float *k, const float *v, const float *dout,
                                 const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                                 int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                                 int64_t g1);
int nx_attention_bwd_f32_avx512(const float *q, const float *k, const float *v, const float *dout,
                                const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                                int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                                int64_t g1);
int nx_attention_bwd_f32_avx2(const float *q, const float *k, const float *v, const float *dout,
                              const uint8_t *mask, float *dq, float *dk, float *dv, int64_t T,
                              int64_t H, int64_t KVH, int64_t hd, float scale, int64_t g0,
                              int64_t g1);

/* ---- out[c] := (float) sum_{b = 0..n-1, ascending} (double) partials[b, c], c in [0, D). */
void nx_sum_partials_f32(const float *partials, float *out, int64_t n, int64_t D);

/* ---- The tiled float32 attention-backward driver shared by the SIMD variants. Compiled only
 * where NX_BWD_TILED_DRIVER is defined (nx_bwd_avx512.c, nx_bwd_avx2.c); always inlined, so the
 * micro-kernel calls through the constant tiling struct are resolved and inlined.
 *
 * Per kv head g: K^T and V^T packed tile-major (kt[tile][d][bc], keys past T zero); dK^T, dV^T
 * accumulated in the same packed form and unpacked at the end. Query rows go in blocks of qb
 * (zero-padded to whole micro-blocks of br rows):
 *   phase 1, per key tile, per micro-block: S = Q K^T and dP = dO V^T into row scratch [qb][Tp];
 *   phase 2, per row: P = softmax(S*scale + mask) (one row max, exp, times 1/l), Delta = sum P dP,
 *            dS = scale * P * (dP - Delta) written over dP; rows whose keys are all masked: 0;
 *   phase 3, per key tile, per micro-block: dK^T += Q^T dS, dV^T += dO^T P, dQ += dS K.
 * Key tiles are the outer loop so a tile's K/V/dK/dV stays in L2 while every micro-block of the
 * query block uses it. A variant supplies (all for br rows; S/P rows ld floats apart, aligned):
 *   qk(X, hd, YT, S, ld):        S[r, 0:bc] = sum_d X[r, d] YT[d, 0:bc]   (X rows hd apart)
 *   outer(X, hd, P, ld, ZT):     ZT[d, 0:bc] += sum_r X[r, d] P[r, 0:bc]
 *   pv(P, ld, Y, hd, nk, O, hdp): O[r, 0:hd] += sum_{j<nk} P[r, j] Y[j, 0:hd] (O rows hdp apart)
 *   softmax_ds(S, dP, madd, Tp, scale): phase 2 for one row.
 * Scratch: 4*Tp*hd + Tp + 2*qb*Tp + qb*(hdp + 2*hd) floats: O(T) per query row, never T^2.
 * Row arithmetic does not depend on the band; dk/dv sum the group's query heads and rows in
 * ascending order. Returns 0, or -1 when scratch cannot be allocated. */
#ifdef NX_BWD_TILED_DRIVER
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t br, bc, qb,
        hd_align; /* rows per micro-block, keys per tile, rows per block (% br == 0),
                                      hdp = hd rounded up to hd_align */
    void (*qk)(const float *X, int64_t hd, const float *YT, float *S, int64_t ld);
    void (*outer)(const float *X, int64_t hd, const float *P, int64_t ld, float *ZT);
    void (*pv)(const float *P, int64_t ld, const float *Y, int64_t hd, int64_t nk, float *O,
               int64_t hdp);
    void (*softmax_ds)(float *S, float *dP, const float *madd, int64_t Tp, float scale);
} nx_attn_bwd_tiling;

NX_INLINE int nx_attention_bwd_tiled(const nx_attn_bwd_tiling *tl, const float *q, const float *k,
                                     const float *v, const float *dout, const uint8_t *mask,
                                     float *dq, float *dk, float *dv, int64_t T, int64_t H,
                                     int64_t KVH, int64_t hd, float scale, int64_t g0, int64_t g1) {
    const int64_t BR = tl->br, BC = tl->bc, QB = tl->qb, group = H / KVH;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hdp = (hd + tl->hd_align - 1) / tl->hd_align * tl->hd_align;
    const int64_t nTH = (Tp * hd + 15) / 16 * 16, nQH = (QB * hd + 15) / 16 * 16;
    /* every piece a multiple of 16 floats, so each starts 64-byte aligned */
    const size_t total = (size_t)(4 * nTH + (Tp + 15) / 16 * 16 + 2 * QB * Tp + QB * hdp + 2 * nQH);
    float *buf = aligned_alloc(64, ((total + 15) / 16 * 16) * sizeof(float));
    if (!buf) return -1;
    float *kt = buf, *vt = kt + nTH, *dkt = vt + nTH, *dvt = dkt + nTH;
    float *madd = dvt + nTH, *S = madd + (Tp + 15) / 16 * 16, *dP = S + QB * Tp;
    float *dQ = dP + QB * Tp, *Qb = dQ + QB * hdp, *dOb = Qb + nQH;
    for (int64_t j = 0; j < Tp; j++) madd[j] = (j >= T || (mask && !mask[j])) ? -INFINITY : 0.0f;
    for (int64_t g = g0; g < g1; g++) {
        const float *kg = k + g * T * hd, *vg = v + g * T * hd;
        for (int64_t tile = 0; tile < ntiles; tile++) /* pack K^T, V^T tile-major */
            for (int64_t jj = 0; jj < BC; jj++) {
                const int64_t j = tile * BC + jj;
                float *ok = kt + tile * hd * BC + jj, *ov = vt + tile * hd * BC + jj;
                for (int64_t d = 0; d < hd; d++) {
                    ok[d * BC] = j < T ? kg[j * hd + d] : 0.0f;
                    ov[d * BC] = j < T ? vg[j * hd + d] : 0.0f;
                }
            }
        memset(dkt, 0, sizeof(float) * (size_t)(2 * nTH));
        for (int64_t h = g * group; h < (g + 1) * group; h++) {
            for (int64_t t0 = 0; t0 < T; t0 += QB) {
                const int64_t nq = T - t0 < QB ? T - t0 : QB;
                const int64_t nqp = (nq + BR - 1) / BR * BR;
                memcpy(Qb, q + (h * T + t0) * hd, sizeof(float) * (size_t)(nq * hd));
                memcpy(dOb, dout + (h * T + t0) * hd, sizeof(float) * (size_t)(nq * hd));
                memset(Qb + nq * hd, 0, sizeof(float) * (size_t)((nqp - nq) * hd));
                memset(dOb + nq * hd, 0, sizeof(float) * (size_t)((nqp - nq) * hd));
                memset(dQ, 0, sizeof(float) * (size_t)(nqp * hdp));
                for (int64_t tile = 0; tile < ntiles; tile++) /* phase 1 */
                    for (int64_t r0 = 0; r0 < nqp; r0 += BR) {
                        tl->qk(Qb + r0 * hd, hd, kt + tile * hd * BC, S + r0 * Tp + tile * BC, Tp);
                        tl->qk(dOb + r0 * hd, hd, vt + tile * hd * BC, dP + r0 * Tp + tile * BC,
                               Tp);
                    }
                for (int64_t r = 0; r < nq; r++) /* phase 2 */
                    tl->softmax_ds(S + r * Tp, dP + r * Tp, madd, Tp, scale);
                memset(S + nq * Tp, 0, sizeof(float) * (size_t)((nqp - nq) * Tp));
                memset(dP + nq * Tp, 0, sizeof(float) * (size_t)((nqp - nq) * Tp));
                for (int64_t tile = 0; tile < ntiles; tile++) { /* phase 3 */
                    const int64_t j0 = tile * BC, nk = T - j0 < BC ? T - j0 : BC;
                    for (int64_t r0 = 0; r0 < nqp; r0 += BR) {
                        const float *dSr = dP + r0 * Tp + j0, *Pr = S + r0 * Tp + j0;
                        tl->outer(Qb + r0 * hd, hd, dSr, Tp, dkt + tile * hd * BC);
                        tl->outer(dOb + r0 * hd, hd, Pr, Tp, dvt + tile * hd * BC);
                        tl->pv(dSr, Tp, kg + j0 * hd, hd, nk, dQ + r0 * hdp, hdp);
                    }
                }
                for (int64_t r = 0; r < nq; r++)
                    memcpy(dq + (h * T + t0 + r) * hd, dQ + r * hdp, sizeof(float) * (size_t)hd);
            }
        }
        for (int64_t j = 0; j < T; j++) { /* unpack dK^T, dV^T */
            const float *a = dkt + (j / BC) * hd * BC + (j % BC),
                        *b = dvt + (j / BC) * hd * BC + (j % BC);
            float *oa = dk + (g * T + j) * hd, *ob = dv + (g * T + j) * hd;
            for (int64_t d = 0; d < hd; d++) {
                oa[d] = a[d * BC];
                ob[d] = b[d * BC];
            }
        }
    }
    free(buf);
    return 0;
}
#endif /* NX_BWD_TILED_DRIVER */

/* RMSNorm backward: round the band's float64 parameter-gradient sums (aw = dw, am = dmod, one
 * allocation starting at aw) to the float32 outputs that were asked for, then free them. */
static inline void nx_rmsnorm_bwd_finish(double *aw, const double *am, float *dw /* OUT or NULL */,
                                         float *dmod /* OUT or NULL */, int64_t D) {
    if (dw)
        for (int64_t i = 0; i < D; i++) dw[i] = (float)aw[i];
    if (dmod)
        for (int64_t i = 0; i < D; i++) dmod[i] = (float)am[i];
    free(aw);
}

#endif
