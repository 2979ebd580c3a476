/* nx_attn_bf16.h -- `bf16` flash attention: Q K^T and P V on the bfloat16 dot (the per-pair step
 * of the `bf16` matmul, nx_lowp.h), softmax statistics in float32, float32 output.
 *
 * Owns: the arithmetic contract below, the "attn_bf16" dispatch family (one slot, one table per
 * ISA file: generic = the spec, nx_attn_bf16.c; avx2 = nx_attn_bf16_avx2.c and avx512bf16 =
 * nx_attn_bf16_avx512bf16.c, the steps as FMAs under MXCSR DAZ|FTZ, or as vdpbf16ps where that
 * is faster: nx_attn_bf16_dot below) and the scalar exp every variant evaluates. Must not:
 * depend on the head band, the query block or micro-block a row lands in, spawn threads, or
 * read outside the given arrays (callers validate shapes: nxhpc/_k_ops.pxi).
 *
 * Shapes and options are those of nx_attention_f32 (nx_ops.h): q [H, T, hd], k [KVH, T, hd], v
 * read from qkv [T, (H+2*KVH)*hd] at columns (H+KVH)*hd + g*hd, g = h / (H/KVH); mask [T] bytes
 * (nonzero = attend) or NULL; causal: query t attends keys j <= t; out [T, H*hd], rows [t0, t1)
 * (0 <= t0 <= t1 <= T: a band of query rows; every key j < T is still read) of the columns of
 * the heads [h0, h1) written.
 *
 * ---- contract (bit-identical: generic spec == AVX2 == AVX-512 BF16, every head band, every row
 *      split; AMX: the clause after it)
 * bf(), daz/ftz and step(acc, a, b) = ftz(fma(daz(a), daz(b), daz(acc))) are nx_lowp.h's (ftz
 * is x86's: tininess after rounding).
 * Per query head h (kv head g) and query row t, with P2 = ceil(hd/2) d-pairs (d >= hd reads 0):
 *   qb[d] = bf(q[h,t,d]), kb[j,d] = bf(k[g,j,d]), vb[j,d] = bf(v[g][j,d]); keys j >= T are 0.
 *   Keys are cut in tiles of 64: tile b = keys [64b, 64b+64). The tiles run for row t are
 *   b = 0 .. ceil(T/64)-1, or (causal) b = 0 .. floor(t/64): a run tile always runs all 64 keys.
 *   allowed(j) = j < T && (mask == NULL || mask[j]) && (!causal || j <= t).
 *   State: m = -inf, l = +0, O[d] = +0. For each run tile b in order, for jj = 0..63, j = 64b+jj:
 *     s_j = +0; for p = 0..P2-1: s_j = step(s_j, qb[2p+1], kb[j,2p+1]);
 *                                 s_j = step(s_j, qb[2p], kb[j,2p])
 *     x_j = allowed(j) ? s_j * c : -inf                    (one float32 product; c below)
 *     m_new = max(m, max_jj x_j);  m_use = m_new == -inf ? 0 : m_new
 *     alpha = E(m - m_use);        p_j = bf(E(x_j - m_use))  (one float32 subtraction each)
 *     sum  = tree(p): a_L = ((p_L + p_{L+16}) + p_{L+32}) + p_{L+48} for lanes L < 16, then
 *            a_L += a_{L+8} (L < 8), a_L += a_{L+4} (L < 4), a_L += a_{L+2} (L < 2), a_0 + a_1
 *     l = l * alpha + sum;  m = m_new                       (a product and a sum, not fused)
 *     O[d] = O[d] * alpha, then for i = 0..31: O[d] = step(O[d], p_{2i+1}, vb[64b+2i+1,d]);
 *                                              O[d] = step(O[d], p_{2i},   vb[64b+2i,d])
 *   out[t, h*hd+d] = l == 0 ? 0 : O[d] * (1.0f / l)       (every key excluded: zeros)
 *   The scores are in base 2: c = nx_attn_scale2(scale) = (float)((double)scale * log2 e),
 *   computed once per call by nx_attention_bf16 (the variants receive c as their `scale`).
 *   E(y) = nx_exp2_ of nx_vmath_ew.h, 2^y for the arguments here (y <= 0, -inf, NaN): clamp
 *   below at -160, f = y - floor(y) rounded toward -inf, a degree-4 polynomial in f by fmaf,
 *   times 2^floor(y) rounded once; |E(y) - 2^y| <= 2^-18 2^y + 2^-150, E(0) = 1 exactly,
 *   E(y) <= 1, E(-inf) = 0. nx_attn_exp below is its scalar form (same values, same bits).
 *   (Until 2026-12-05 the scores were x = s * scale and E was nx_exp, the f32 kernels' e^x:
 *   <= 2 ulp, 15 vector operations against 7. The weights are rounded to bfloat16 right
 *   after, so E's 2^-18 and c's rounding cost the bound below almost nothing; the AMX kernel
 *   ran 14% faster: docs/kernels.md.)
 *   E's value matters only through p = bf(E(...)) and through alpha. bf() flushes a subnormal
 *   to +0, so a variant may compute p's exponentials with FTZ set, or give an excluded key's
 *   lane +0 without evaluating E: the same p. The SIMD variants and AMX do, because each
 *   vector with an underflowing E otherwise costs a microcode assist on Intel cores (a row
 *   whose allowed scores spread over more than ~126, or a tile with excluded keys: up to 6x
 *   the kernel's time; docs/kernels.md). alpha is computed with the caller's MXCSR.
 *   A maximum is exact whatever its order (a zero's sign never changes a later result: E(+-0)
 *   = 1), so the micro-blocks may take it in any order; every other operation is in the order
 *   above. Rows never interact: a row's operations depend on t, T and the inputs only, never
 *   on the micro-block, query block or head band it lands in (a SIMD micro-block straddling a
 *   tile's first key runs that tile with its earlier rows' state left untouched).
 *   Non-finite input: the contract holds for finite q, k, v with finite scores; a non-finite v
 *   at any key j < T of a run tile reaches the rows that run the tile (0 * inf = NaN), even where
 *   that key is masked or after the row.
 *
 * ---- AMX clause (nx_attn_bf16_amx.c, the `amx` ISA): every operation above but the two dot
 * products, in the same order; s_j = the tdpbf16ps sum of qb . kb_j per 32-d chunk (chunks in
 * order, d >= hd zero) and O[d] = O[d] * alpha, then the tdpbf16ps sum of p_j vb[j,d] over the
 * tile's two 32-key halves in order, each instruction accumulating in float32 with DAZ/FTZ and
 * round to nearest in its own undocumented order (not the pair steps: benchmarks/probes/
 * amx_tdpbf16ps.c). Not the spec's bits. Promised: a row's operations depend only on t, T and
 * the data, so outputs are bit-identical across head bands and worker splits on one machine;
 * the error bound below holds; and each output is within (4u + 2 (e^(2 dx) - 1) + 4 gamma_{64 nt
 * + 8}) e^(2 delta) (1 + ...) sum_j w*_j |v_j| of the contract's (dx = 2 scale gamma_P max_j
 * sum_d |q_d k_jd| + 2 P 2^-126 scale: both sums within gamma of the exact one, plus flushes;
 * 2u: a weight's bfloat16 rounding may flip): tests/test_kernels_attn_bf16.py.
 *
 * ---- error bound vs float64 attention (ref: w*_j = softmax_j(scale * q.k_j) over allowed j,
 * ref = sum_j w*_j v_j, float64 arithmetic on the float32 inputs), for a row with >= 1 allowed key:
 *   u = 2^-8 (bfloat16 rounding), e = 2^-24, gamma_n = n e / (1 - n e), nt = tiles run,
 *   delta_j = scale ((2u + u^2) + gamma_P (1+u)^2) sum_d |q_d k_jd| (P = 2*P2 steps), plus
 *             gamma_2 (|s*_j| + that) (c's rounding and the product by c); delta = max over
 *             allowed j;
 *   R = max_j s*_j - min_j s*_j + 2 delta (the spread of the computed allowed scores);
 *   rho = (1+u) (1 + 2^-18)^(nt+1) (1+e)^(2nt) exp(2 e R) - 1
 *         (p's bfloat16 rounding, E's 2^-18, each rescale alpha and its float32 product, the
 *         subtractions x - m, |x - m| ln 2 <= R, and the rescales' m differences, which sum to
 *         <= R in the same units);
 *   eta = exp(delta) (1 + rho) (1 + gamma_{64 nt + 2 nt + 8}) - 1  (every weight, in O and in l:
 *         the bf16 dot chain runs 64 steps per tile, l one tree and one add per tile);
 *   |out - ref| <= ((2 eta + u (1 + eta)) / (1 - eta) + 2^-21) * sum_j w*_j |v_j|
 *                  + 64 nt 2^-124 (1 + max|v|)
 *   Why: every weight O and l see is w*_j Z (1 + eta_j), |eta_j| <= eta, with the same Z (E(0) = 1
 *   makes the running max's weight exactly 1, so l >= 1); normalising cancels Z; v's rounding
 *   adds u; the last product and reciprocal 2 e; the last term covers flushed subnormals (p
 *   below 2^-126, DAZ/FTZ of the dot steps). At scale = hd^-1/2 and unit-normal q, k (hd = 128)
 *   the delta term dominates: ~0.14 * sum w*|v|, a worst case; measured errors are 65-300x
 *   below it
 *   (tests/test_kernels_attn_bf16.py, docs/kernels.md).
 */
#ifndef NX_ATTN_BF16_H
#define NX_ATTN_BF16_H

#include <math.h>
#include <stdint.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"

#define NX_ATTN_BF16_SLOTS(X)                                                                      \
    X(attention_bf16, int,                                                                         \
      (const float *q, const float *k, const float *qkv, const uint8_t *mask, float *out,          \
       int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t h0, int64_t h1,         \
       int64_t t0, int64_t t1, int causal))
NX_DECLARE_FAMILY(nx_attn_bf16, NX_ATTN_BF16_SLOTS)
extern const nx_attn_bf16_table nx_attn_bf16_table_generic;    /* nx_attn_bf16.c */
extern const nx_attn_bf16_table nx_attn_bf16_table_avx2;       /* nx_attn_bf16_avx2.c */
extern const nx_attn_bf16_table nx_attn_bf16_table_avx512bf16; /* nx_attn_bf16_avx512bf16.c */
extern const nx_attn_bf16_table nx_attn_bf16_table_amx;        /* nx_attn_bf16_amx.c */

#define NX_ATTN_BF16_TILE 64 /* keys per tile: part of the contract (the sum tree, the rescales) */

/* The `bf16` attention at `isa` (the contract above). Returns 0, or -1 if scratch could not be
 * allocated (nothing written then). */
int nx_attention_bf16(nx_isa isa, const float *q /* IN [H, T, hd] */,
                      const float *k /* IN [KVH, T, hd] */,
                      const float *qkv /* IN [T, (H+2*KVH)*hd] (v part read) */,
                      const uint8_t *mask /* IN [T] or NULL */,
                      float *out /* OUT [T, H*hd], rows [t0, t1), columns of heads [h0, h1) */,
                      int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t h0,
                      int64_t h1, int64_t t0, int64_t t1, int causal);
/* The AVX-512 BF16 variant has two micro-kernels with the same bits (the contract's steps either
 * way): NX_AB_DOT_FMA runs each step as a vfmadd231ps on bfloat16-valued float32 under MXCSR
 * DAZ|FTZ, NX_AB_DOT_DP a pair's two steps as one vdpbf16ps (which is those two steps: DAZ, FTZ,
 * odd element first). Which is faster is the CPU's: vdpbf16ps retires half the float32 FMA's
 * multiply-adds per cycle on the AMX Xeon (family 6 model 167) and twice them on AMD Zen 4.
 * nx_attn_bf16_dot() is the choice in force: the one set by nx_attn_bf16_set_dot, or, while
 * none is (NX_AB_DOT_AUTO), the faster by the peak loops fma_zmm / bf16_zmm (nx_peak.h: the
 * FLOP rates timed once per process, a fraction of a millisecond; ties go to vdpbf16ps, half
 * the instructions). Without AVX-512 BF16 it is NX_AB_DOT_FMA (the kernel is then never run).
 * nx_attn_bf16_set_dot(mode) sets it (AUTO: measure again); returns the choice in force, or -1
 * (nothing changed) for an unknown mode or NX_AB_DOT_DP on a CPU without AVX-512 BF16 (under
 * NXHPC_DISABLE_SIMD, AUTO resolves to FMA; DP may still be set for an explicit ISA request).
 * The choice is process-wide (workers forked after it inherit it) and never changes a result's
 * bits. */
enum { NX_AB_DOT_AUTO = 0, NX_AB_DOT_FMA = 1, NX_AB_DOT_DP = 2 };
int nx_attn_bf16_dot(void);
int nx_attn_bf16_set_dot(int mode);

/* The variants (reached through the tables) take c = nx_attn_scale2(scale) as their `scale`. */
int nx_attention_bf16_generic(const float *q, const float *k, const float *qkv,
                              const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH,
                              int64_t hd, float scale, int64_t h0, int64_t h1, int64_t t0,
                              int64_t t1, int causal);
int nx_attention_bf16_amx(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                          float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                          int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal);
int nx_attention_bf16_avx2(const float *q, const float *k, const float *qkv, const uint8_t *mask,
                           float *out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale,
                           int64_t h0, int64_t h1, int64_t t0, int64_t t1, int causal);
int nx_attention_bf16_avx512bf16(const float *q, const float *k, const float *qkv,
                                 const uint8_t *mask, float *out, int64_t T, int64_t H,
                                 int64_t KVH, int64_t hd, float scale, int64_t h0, int64_t h1,
                                 int64_t t0, int64_t t1, int causal);

/* c: the base-2 factor of the scores, scale * log2 e rounded once to float32 (the product in
 * double: scale is a float32, log2 e to 53 bits). */
static inline float nx_attn_scale2(float scale) {
    return (float)((double)scale * 1.4426950408889634);
}

/* The key mask per tile of BC <= 64 keys: bit jj of tmask[b] set when key b*BC + jj exists
 * (< T) and is allowed (mask NULL, or mask[key] != 0); ntiles = ceil(T / BC). The SIMD
 * variants skip a tile's masked keys by these bits. */
static inline void nx_attn_tile_masks(const uint8_t *mask, int64_t T, int64_t BC, int64_t ntiles,
                                      uint64_t *tmask /* OUT [ntiles] */) {
    for (int64_t b = 0; b < ntiles; b++) {
        uint64_t bits = 0;
        for (int64_t jj = 0; jj < BC; jj++) {
            const int64_t j = b * BC + jj;
            if (j < T && (!mask || mask[j])) bits |= (uint64_t)1 << jj;
        }
        tmask[b] = bits;
    }
}

/* The contract's last step for one query row: o[d] := O[d] * (1 / l) for d < hd, or zeros
 * when l == 0 (the row had no allowed key). Used by the generic spec, AVX2 and AVX-512 BF16. */
static inline void nx_attn_out_row(float *o /* OUT [hd] */, const float *O, float l, int64_t hd) {
    if (l == 0.0f) {
        for (int64_t d = 0; d < hd; d++) o[d] = 0.0f;
    } else {
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < hd; d++) o[d] = O[d] * inv;
    }
}

/* The row masks of one micro-block for one key tile: rows f .. f+nr-1 (nr <= 32), the tile's
 * keys from j0, `tile` its bits from nx_attn_tile_masks. rmask[r] := the keys row f+r runs (with
 * `causal`, only keys <= f+r; 0 for a row the tile starts after); returns the set of rows that
 * run the tile (bit r). Used by the AVX2 and AVX-512 BF16 drivers. */
static inline unsigned nx_attn_row_masks(int causal, int64_t j0, int64_t f, int nr, uint64_t tile,
                                         uint64_t *rmask /* OUT [nr] */) {
    unsigned act = nr >= 32 ? ~0u : (1u << nr) - 1u;
    for (int r = 0; r < nr; r++) {
        const int64_t n = f + r - j0 + 1; /* causal: keys [j0, j0 + n) of the tile */
        const int run = !causal || n > 0;
        if (!run) act &= ~(1u << r);
        rmask[r] = !run      ? 0
                   : !causal ? tile
                             : tile & (n >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1));
    }
    return act;
}

/* E(y) = 2^y: the scalar form of nx_exp2_16 / nx_exp2_8 (nx_vmath_ew.h), for the contract's
 * arguments (y <= 0, -inf, NaN: a score minus the running max, or the old max minus the new):
 * the clamp keeps NaN like max_ps (its second operand); y - floorf(y) rounded toward -inf is
 * VREDUCEPS's value (-floor(y) >= |y|, so f + n and y - (f + n) are exact: the rounding error);
 * fmaf is the vector FMA; ldexpf rounds p * 2^floor(y) once like scalef (floor in [-160, 0]).
 * Used by the generic spec; the SIMD variants call nx_exp2_16 / nx_exp2_8. */
static inline float nx_attn_exp(float y) {
    if (y != y) return y + y;      /* NaN (its payload is not part of the contract) */
    y = -160.0f > y ? -160.0f : y; /* max_ps(-160, y): y unless -160 > y */
    const float n = floorf(y);
    float f = y - n; /* rounded to nearest; VREDUCEPS rounds it down: */
    if (y - (f + n) < 0.0f) f = nextafterf(f, -INFINITY); /* it rounded up (Fast2Sum: exact) */
    float p = 0x1.bc31dap-7f;
    p = fmaf(p, f, 0x1.aa3fcap-5f);
    p = fmaf(p, f, 0x1.ee5884p-3f);
    p = fmaf(p, f, 0x1.62d51cp-1f);
    p = fmaf(p, f, 1.0f);
    return ldexpf(p, (int)n);
}

#endif
