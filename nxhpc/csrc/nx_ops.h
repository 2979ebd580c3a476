/* nx_ops.h -- the block's non-matmul forward kernels: RMSNorm(+modulation), LayerNorm(*mod),
 * qk-norm+RoPE, flash attention, SwiGLU, tanh-gated residual. Generic scalar functions are the
 * spec (nx_ops.c); AVX2+FMA and AVX-512 variants live in nx_ops_avx2.c / nx_ops_avx512.c (their
 * element-wise loops written once for both widths in nx_ops_ew.h), each file exporting one
 * dispatch table (nx_ops_table_<isa>). Callers (nxhpc/_k_ops.pxi) validate every shape before
 * entering; these functions trust their arguments.
 *
 * Numerics shared by every variant (so the variants agree bit for bit where stated):
 *  - rmsnorm / qknorm_rope: the sum of squares is accumulated in float64 (x*x is exact in float64)
 *    in 16 lanes, lane = element index % 16, combined by the fixed tree
 *    (l + l+8), (l + l+4), (l + l+2), (l0 + l1); then r = (float)(1 / sqrt(ss / n + eps)) in double.
 *    Row scaling is ((x * r) * w) [* mod] in float32, RoPE is (pe0*y0) + (pe1*y1), never fused.
 *    => generic, avx2 and avx512 are bit-identical for these two families.
 *  - layernorm_mod: see its declaration; float64 statistics in the same 16-lane order and tree,
 *    float32 scaling never fused => bit-identical across variants.
 *  - swiglu / gated_residual / norm_residual / attention: generic uses libm expf/tanhf; SIMD
 *    variants use the polynomials in their own file (exp <= 2 ulp, measured 1.01; tanh <= 2 ulp,
 *    measured 1.14; silu <= 8u relative, plus |x|*2^-148 absolute below x = -87.3 where
 *    exp(-|x|) is subnormal; checked over the float range in tests/test_kernels_ops.py) and FMAs,
 *    so they agree with generic to a tolerance, not bit for bit.
 *  - Band invariance: every output element's arithmetic is independent of the band bounds, so any
 *    split of a band gives bit-identical results within one variant.
 */
#ifndef NX_OPS_H
#define NX_OPS_H

#include <stdint.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"

/* The family's slots (nx_dispatch.h), in kernel_variants() order. */
#define NX_OPS_SLOTS(X)                                                                            \
    X(rmsnorm, void,                                                                               \
      (const float *x, const float *w, const float *mod, float *out, int64_t D, float eps,         \
       int64_t r0, int64_t r1))                                                                    \
    X(qknorm_rope, void,                                                                           \
      (const float *qkv, const float *q_w, const float *k_w, const float *pe, float *q_out,        \
       float *k_out, int64_t T, int64_t H, int64_t KVH, int64_t hd, float eps, int64_t h0,         \
       int64_t h1, int half))                                                                      \
    X(attention, int,                                                                              \
      (const float *q, const float *k, const float *qkv, const uint8_t *mask, float *out,          \
       int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t h0, int64_t h1,         \
       int64_t t0, int64_t t1, int causal))                                                        \
    X(swiglu, void, (const float *a, const float *b, float *out, int64_t i0, int64_t i1))          \
    X(gated_residual, int,                                                                         \
      (const float *resid, const float *y, const float *gate, float *out, int64_t D, int64_t r0,   \
       int64_t r1))                                                                                \
    X(norm_residual, int,                                                                          \
      (const float *y, const float *w, const float *resid, const float *gate, float *out,          \
       const float *w2, const float *mod2, float *h, int64_t D, float eps, int64_t r0, int64_t r1)) \
    X(vmath, void, (int which, const float *x, float *out, int64_t n))                             \
    X(layernorm_mod, void,                                                                         \
      (const float *x, const float *mod, float *out, int64_t D, float eps, int64_t r0,             \
       int64_t r1))

NX_DECLARE_FAMILY(nx_ops, NX_OPS_SLOTS)
extern const nx_ops_table nx_ops_table_generic; /* nx_ops.c: every slot */
extern const nx_ops_table nx_ops_table_avx2;    /* nx_ops_avx2.c */
extern const nx_ops_table nx_ops_table_avx512;  /* nx_ops_avx512.c */

/* The variants nx_<slot>_f32_<isa> (isa: generic, avx2, avx512), declared from the slot list:
 * their parameters are the slot's; the dispatching nx_<slot>_f32(isa, ...) below documents them. */
#define NX_OPS_VARIANTS_(name, ret, params)                                                        \
    ret nx_##name##_f32_generic params;                                                            \
    ret nx_##name##_f32_avx2 params;                                                               \
    ret nx_##name##_f32_avx512 params;
NX_OPS_SLOTS(NX_OPS_VARIANTS_)
#undef NX_OPS_VARIANTS_

/* The variant table of one ISA file (every slot's nx_<slot>_f32_<isa>), from the slot list:
 * ``const nx_ops_table nx_ops_table_avx2 = NX_OPS_TABLE(avx2);``. */
#define NX_OPS_ENTRY_(name, isa) .name = nx_##name##_f32_##isa,
#define NX_OPS_ENTRY_generic(name, ret, params) NX_OPS_ENTRY_(name, generic)
#define NX_OPS_ENTRY_avx2(name, ret, params) NX_OPS_ENTRY_(name, avx2)
#define NX_OPS_ENTRY_avx512(name, ret, params) NX_OPS_ENTRY_(name, avx512)
#define NX_OPS_TABLE(isa) {NX_OPS_SLOTS(NX_OPS_ENTRY_##isa)}

/* ---- rmsnorm: out[r] := x[r] / sqrt(mean(x[r]^2) + eps) * w [* mod], rows [r0, r1) of [T, D].
 * out may equal x (in place). mod may be NULL. */
void nx_rmsnorm_f32(nx_isa isa,       /* the ISA to run (nx_cpu.h) */
                    const float *x,   /* IN  [T, D] */
                    const float *w,   /* IN  [D] */
                    const float *mod, /* IN  [D] or NULL */
                    float *out,       /* OUT [T, D], rows [r0, r1) */
                    int64_t D, float eps, int64_t r0, int64_t r1);

/* ---- qknorm_rope: per (token t, head j in [h0, h1) of the combined [q heads | k heads] index):
 * y = rmsnorm(qkv[t, j*hd:(j+1)*hd], w) with w = q_w (j < H) or k_w; then pair i (i < hd/2) of
 * the head is rotated by its 2x2 matrix pe[t,i] and written to q_out[j, t] or k_out[j-H, t]:
 *   half == 0 (adjacent pairs (2i, 2i+1), the DiT's):
 *     o[2i+r] = pe[t,i,r,0]*y[2i] + pe[t,i,r,1]*y[2i+1]
 *   half != 0 (pairs (i, i+hd/2), NEOX / HF rotate_half, Qwen3's; the same pe table):
 *     o[i] = pe[t,i,0,0]*y[i] + pe[t,i,0,1]*y[i+hd/2], o[i+hd/2] = pe[t,i,1,0]*y[i] + ...[1,1]*...
 * Each output is (p0*y0) + (p1*y1) in float32, never fused, y = (x * r) * w: bit-identical
 * across variants in both layouts (nx_qknorm_rope_pair / _half_pair below are the spec). */
void nx_qknorm_rope_f32(nx_isa isa,       /* the ISA to run (nx_cpu.h) */
                        const float *qkv, /* IN  [T, (H+2*KVH)*hd] */
                        const float *q_w, /* IN  [hd] */
                        const float *k_w, /* IN  [hd] */
                        const float *pe,  /* IN  [T, hd/2, 2, 2] */
                        float *q_out,     /* OUT [H, T, hd] */
                        float *k_out,     /* OUT [KVH, T, hd] */
                        int64_t T, int64_t H, int64_t KVH, int64_t hd, float eps, int64_t h0,
                        int64_t h1, int half);

/* ---- attention: for query heads h in [h0, h1), kv head g = h / (H / KVH), and query rows t in
 * [t0, t1) (0 <= t0 <= t1 <= T; every key j < T is still read):
 * out[t, h*hd:(h+1)*hd] = sum_j softmax_j(scale * q[h,t].k[g,j], masked j excluded) * v_g[j]
 * with v_g[j] = qkv[j, (H+KVH)*hd + g*hd : ... + hd]. mask: [T] bytes, nonzero = attend, or NULL.
 * causal != 0: query t attends keys j <= t only (and, of those, the unmasked ones); causal == 0
 * is the full attention, with exactly the arithmetic it had before the option existed.
 * A query whose keys are all masked gets zeros. Flash-style: keys in tiles with an online softmax;
 * scratch is O(T*hd) (one packed copy of K^T per kv head) + O(tile*hd), never O(T^2).
 * Causal in the SIMD driver (nx_attn_tiled.h): key tiles after a micro-block's last row are not
 * run; a tile holding keys after some of its rows (the diagonal) runs with a per-row key mask, so
 * an excluded key enters a row exactly as a masked key does (score -inf, weight exactly 0). A
 * row's arithmetic still depends on nothing but t, T and the variant, so results stay
 * bit-identical for every head band and query band; the generic spec never visits keys j > t
 * at all.
 * Returns 0, or -1 if scratch could not be allocated (nothing written then). */
int nx_attention_f32(nx_isa isa,          /* the ISA to run (nx_cpu.h) */
                     const float *q,      /* IN  [H, T, hd] */
                     const float *k,      /* IN  [KVH, T, hd] */
                     const float *qkv,    /* IN  [T, (H+2*KVH)*hd] (v part read) */
                     const uint8_t *mask, /* IN  [T] or NULL */
                     float *out, /* OUT [T, H*hd]: rows [t0, t1), columns of heads [h0, h1) */
                     int64_t T, int64_t H, int64_t KVH, int64_t hd, float scale, int64_t h0,
                     int64_t h1, int64_t t0, int64_t t1, int causal);

/* ---- swiglu: out[i] := silu(a[i]) * b[i] for flat i in [i0, i1); silu(x) = x / (1 + exp(-x)),
 * evaluated as (x < 0 ? x*e : x) / (1 + e) with e = exp(-|x|) (no overflow; silu(-inf) = -0).
 * out may equal a or b. */
void nx_swiglu_f32(nx_isa isa, const float *a, const float *b, float *out, int64_t i0, int64_t i1);

/* ---- gated_residual: out[r, c] := resid[r, c] + tanh(gate[c]) * y[r, c], rows [r0, r1).
 * out may equal resid (or y). Returns 0, or -1 if the D-float scratch could not be allocated. */
int nx_gated_residual_f32(nx_isa isa,         /* the ISA to run (nx_cpu.h) */
                          const float *resid, /* IN  [T, D] */
                          const float *y,     /* IN  [T, D] */
                          const float *gate,  /* IN  [D] */
                          float *out,         /* OUT [T, D] */
                          int64_t D, int64_t r0, int64_t r1);

/* ---- norm_residual: a block's residual tail, one row at a time, rows [r0, r1):
 *   out[r] := resid[r] + tanh(gate) * rmsnorm(y[r], w), and where w2 is given
 *   h[r] := rmsnorm(out[r], w2) [* mod2] (the next norm of the block).
 * The bits of the variant's rmsnorm(y, w) (no mod) into a float32 row, its gated_residual of
 * that row and its rmsnorm(out, w2, mod2), with one pass over each row instead of five (the
 * normalized y never reaches memory; y is left as it was). out may equal resid or y; h must
 * overlap nothing else. Returns 0, or -1 if the D-float scratch could not be allocated. */
int nx_norm_residual_f32(nx_isa isa,         /* the ISA to run (nx_cpu.h) */
                         const float *y,     /* IN  [T, D] */
                         const float *w,     /* IN  [D] */
                         const float *resid, /* IN  [T, D] */
                         const float *gate,  /* IN  [D] */
                         float *out,         /* OUT [T, D] */
                         const float *w2,    /* IN  [D] or NULL (no h) */
                         const float *mod2,  /* IN  [D] or NULL */
                         float *h,           /* OUT [T, D] (with w2) */
                         int64_t D, float eps, int64_t r0, int64_t r1);

/* ---- layernorm_mod: out[r] := (x[r] - mean_r) / sqrt(var_r + eps) * mod, rows [r0, r1) of
 * [T, D] (LayerNorm without affine, population variance, times a per-column modulation).
 * Arithmetic, the same in every variant (bit-identical):
 *   mean = (sum_i x_i) / D, var = (sum_i (x_i - mean)^2) / D in float64: each sum over 16 lanes
 *     (lane = i % 16) combined by the fixed tree (l + l+8), (l + l+4), (l + l+2), (l0 + l1);
 *     x_i - mean and its square are separate float64 operations (never fused);
 *   r = (float)(1 / sqrt(var + (double)eps));
 *   out_i = ((float)((double)x_i - mean) * r) * mod_i: the difference rounded once to float32,
 *     then two float32 products, never fused.
 * out may equal x (in place: a row's statistics are complete before it is written). */
void nx_layernorm_mod_f32(nx_isa isa,       /* the ISA to run (nx_cpu.h) */
                          const float *x,   /* IN  [T, D] */
                          const float *mod, /* IN  [D] */
                          float *out,       /* OUT [T, D], rows [r0, r1) */
                          int64_t D, float eps, int64_t r0, int64_t r1);

/* ---- element-wise exp / tanh of the variant (test hook for the SIMD polynomials):
 * out[i] := exp(x[i]) (which = 0), tanh(x[i]) (which = 1) or the float32 attention's exp
 * (which = 2: nx_exp_nosub, exp's bits; libm's expf in the generic variant), i in [0, n). */
void nx_vmath_f32(nx_isa isa, int which, const float *x, float *out, int64_t n);

/* One RoPE pair of qk-norm + RoPE, scalar: y = (x * inv) * w for the pair's two values, then the
 * 2x2 rotation from pe ([hd/2][2][2] per token). The generic kernel is this loop; the SIMD
 * variants use it for their tails, so every variant gives the same bits. i is even. */
static inline void nx_qknorm_rope_pair(const float *xr /* IN */, float inv,
                                       const float *wt /* IN */, const float *p /* IN */,
                                       float *o /* OUT */, int64_t i) {
    const float y0 = (xr[i] * inv) * wt[i];
    const float y1 = (xr[i + 1] * inv) * wt[i + 1];
    o[i] = p[2 * i] * y0 + p[2 * i + 1] * y1;
    o[i + 1] = p[2 * i + 2] * y0 + p[2 * i + 3] * y1;
}

/* One rotate-half pair (i, i + h) of qk-norm + RoPE, h = hd/2, i < h: the same steps, pair i's
 * matrix at p + 4*i. The generic kernel is this loop; the SIMD variants use it for their tails. */
static inline void nx_qknorm_rope_half_pair(const float *xr /* IN */, float inv,
                                            const float *wt /* IN */, const float *p /* IN */,
                                            float *o /* OUT */, int64_t i, int64_t h) {
    const float y0 = (xr[i] * inv) * wt[i];
    const float y1 = (xr[i + h] * inv) * wt[i + h];
    o[i] = p[4 * i] * y0 + p[4 * i + 1] * y1;
    o[i + h] = p[4 * i + 2] * y0 + p[4 * i + 3] * y1;
}

#endif
