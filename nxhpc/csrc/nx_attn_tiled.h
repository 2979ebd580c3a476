/* nx_attn_tiled.h -- the tiled flash-attention driver shared by the SIMD attention variants
 * (included by nx_ops_avx2.c and nx_ops_avx512.c). It is always inlined into each variant's entry
 * point, so the micro-block call is resolved at compile time and inlined.
 *
 * Owns: packing K^T, the key-mask row, the loops over heads / query blocks (of the band
 * [q0, q1)) / key tiles, the final 1/l scaling and all scratch. For each query head h in
 * [h0, h1): K^T of its kv head is packed
 * once per kv head, tile-major (kt[tile][d][BC], keys past T zero); then for each block of <= QB
 * query rows and each key tile of BC keys, `micro` runs the tile for micro-blocks of <= BR rows;
 * finally each row is divided by its running sum l (zeros when l == 0: every key masked).
 * A variant supplies its sizes and
 *   micro(nr, q, hd, kt, S, scale, madd, ms, m, l, alpha, vt, W, nk, O, hdp): for rows r < nr
 *     (query vectors q + r*hd): S = q . kt (BR x BC scratch, 64-byte aligned), scores
 *     x = S*scale + madd[r*ms + j] (0 or -inf per key j of the tile; ms = 0: one row shared by
 *     all rows, ms = BC: a row each), online-softmax update of the running max m[r], sum l[r]
 *     and rescale alpha[r], and O[r] = O[r]*alpha[r] + P v (O rows hdp = hd rounded up to 16
 *     floats apart, 64-byte aligned; v rows of the tile at vt + j*W, j < nk).
 * Causal (query t sees keys j <= t): per micro-block of rows [f, f+nr), a tile of keys
 * [j0, j0+nk) is run as without causality if j0+nk-1 <= f (every key at or before every row),
 * not run if j0 > f+nr-1 (every key after every row; a query block stops at the first tile past
 * its last row), else (the diagonal) run with a per-row madd (key j0+jj gets -inf unless
 * j0+jj <= f+r, then the key mask's value) and only its first min(nk, f+nr-j0) v rows, so no
 * row reads a value after the micro-block's last row. With causal == 0 nothing changes.
 * Rows never interact, so each row's arithmetic is the same whatever micro-block or head band it
 * lands in. Scratch: T*hd (packed K^T) + T + QB*hdp + 2*BR*BC floats, once per call, plus
 * 3*NX_ATTN_MAX_QB floats of stack.
 * Must not: use ISA intrinsics (the micro-block owns all vector code). */
#ifndef NX_ATTN_TILED_H
#define NX_ATTN_TILED_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "nx_cpu.h"

typedef struct {
    int64_t br, bc, qb; /* rows per micro-block; keys per tile; rows per pass (% br == 0) */
    void (*micro)(int nr, const float *q, int64_t hd, const float *kt, float *S, float scale,
                  const float *madd, int64_t ms, float *m, float *l, float *alpha, const float *vt,
                  int64_t W, int64_t nk, float *O, int64_t hdp);
} nx_attn_tiling;

#define NX_ATTN_MAX_QB 256 /* largest qb of any variant (size of the per-row state arrays) */

/* Same arguments and return value as nx_attention_f32 (nx_ops.h) after the isa. */
NX_INLINE int nx_attention_tiled(const nx_attn_tiling *tl, const float *q, const float *k,
                                 const float *qkv, const uint8_t *mask, float *out, int64_t T,
                                 int64_t H, int64_t KVH, int64_t hd, float scale, int64_t h0,
                                 int64_t h1, int64_t q0, int64_t q1, int causal) {
    const int64_t BR = tl->br, BC = tl->bc, QB = tl->qb;
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    const int64_t hdp = (hd + 15) / 16 * 16;
    /* sizes rounded up to 16 floats: aligned_alloc wants a multiple of the alignment */
    float *kt = aligned_alloc(64, (size_t)((Tp * hd + 15) / 16 * 16) * sizeof(float));
    float *madd = aligned_alloc(64, (size_t)((Tp + 15) / 16 * 16) * sizeof(float));
    float *O = aligned_alloc(64, (size_t)(QB * hdp) * sizeof(float)); /* running outputs */
    float *S = aligned_alloc(64, (size_t)((BR * BC + 15) / 16 * 16) * sizeof(float));
    /* per-row key mask of a diagonal tile (causal only; BC is a multiple of 16, rows aligned) */
    float *dmadd = aligned_alloc(64, (size_t)((BR * BC + 15) / 16 * 16) * sizeof(float));
    /* running max, sum and rescale per query row: local arrays, so the compiler knows they alias
     * no other buffer (heap copies measured 8% slower for AVX2) */
    float m[NX_ATTN_MAX_QB], l[NX_ATTN_MAX_QB], alpha[NX_ATTN_MAX_QB];
    if (!kt || !madd || !O || !S || !dmadd) {
        free(kt);
        free(madd);
        free(O);
        free(S);
        free(dmadd);
        return -1;
    }
    for (int64_t j = 0; j < Tp; j++) madd[j] = (j >= T || (mask && !mask[j])) ? -INFINITY : 0.0f;
    int64_t packed = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != packed) { /* K^T packed tile-major; zero keys past T (masked by madd) */
            const float *kg = k + g * T * hd;
            for (int64_t tile = 0; tile < ntiles; tile++) {
                float *dst = kt + tile * hd * BC;
                for (int64_t jj = 0; jj < BC; jj++) {
                    const int64_t j = tile * BC + jj;
                    for (int64_t d = 0; d < hd; d++)
                        dst[d * BC + jj] = j < T ? kg[j * hd + d] : 0.0f;
                }
            }
            packed = g;
        }
        const float *qh = q + h * T * hd;
        const float *vh = qkv + (H + KVH) * hd + g * hd;
        for (int64_t t0 = q0; t0 < q1; t0 += QB) { /* the query rows [q0, q1) */
            const int64_t nq = q1 - t0 < QB ? q1 - t0 : QB;
            for (int64_t r = 0; r < nq; r++) {
                m[r] = -INFINITY;
                l[r] = 0.0f;
            }
            memset(O, 0, (size_t)(nq * hdp) * sizeof(float));
            for (int64_t tile = 0; tile < ntiles; tile++) {
                const int64_t j0 = tile * BC;
                if (causal && j0 > t0 + nq - 1) break; /* every later key is after every row */
                const int64_t nk = T - j0 < BC ? T - j0 : BC;
                for (int64_t r0 = 0; r0 < nq; r0 += BR) {
                    const int nr = (int)(nq - r0 < BR ? nq - r0 : BR);
                    const int64_t first = t0 + r0, last = first + nr - 1; /* query rows */
                    const float *ma = madd + j0;
                    int64_t ms = 0, nv = nk;
                    if (causal && j0 + nk - 1 > first) { /* some key after some row */
                        if (j0 > last) continue;         /* every key after every row */
                        for (int r = 0; r < nr; r++)
                            for (int64_t jj = 0; jj < BC; jj++)
                                dmadd[r * BC + jj] =
                                    j0 + jj <= first + r ? madd[j0 + jj] : -INFINITY;
                        ma = dmadd;
                        ms = BC;
                        nv = last - j0 + 1 < nk ? last - j0 + 1 : nk;
                    }
                    tl->micro(nr, qh + first * hd, hd, kt + tile * hd * BC, S, scale, ma, ms,
                              m + r0, l + r0, alpha + r0, vh + j0 * W, W, nv, O + r0 * hdp, hdp);
                }
            }
            for (int64_t r = 0; r < nq; r++) {
                float *o = out + (t0 + r) * OW + h * hd;
                const float *src = O + r * hdp;
                if (l[r] == 0.0f) {
                    for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
                } else {
                    const float inv = 1.0f / l[r];
                    for (int64_t d = 0; d < hd; d++) o[d] = src[d] * inv;
                }
            }
        }
    }
    free(kt);
    free(madd);
    free(O);
    free(S);
    free(dmadd);
    return 0;
}

#endif
