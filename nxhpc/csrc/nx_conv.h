/* nx_conv.h -- the convolutional network's non-matmul kernels (the FLUX autoencoder's decoder):
 * GroupNorm in three band-able steps (per-chunk statistics, per-channel coefficients, the affine
 * map with an optional SiLU), the im2col panel of a 3x3 convolution (padding 1, optionally
 * reading through a nearest x2 upsampling), the nearest x2 upsampling itself and the residual
 * add. Generic scalar functions are the spec (nx_conv.c); the AVX2 / AVX-512 files fill the
 * slots that pay (the GroupNorm partials, the affine + SiLU map, im2col and the add, written
 * once for both widths in nx_conv_ew.h); the rest inherit the spec at every ISA. Callers
 * (nxhpc/_k_conv.pxi) validate every shape first.
 *
 * Layout: activations are channels-last rows, x[p, c] = x[(y * W + x) * C + c] for the P = H * W
 * pixels of an H x W image with C channels. A 3x3 convolution is then a plain matmul of the
 * im2col panel [pixels, C * 9] with the weight as stored, [C_out, C_in, 3, 3] = [C_out, C * 9]
 * (column c * 9 + ky * 3 + kx), and a 1x1 convolution is the matmul of x itself.
 *
 * Numerics (what is bit-identical):
 *  - gn_partials: per chunk k of `chunk` rows (the last one shorter) and group g (channels
 *    [g*C/G, (g+1)*C/G)): mean_kg = (sum over rows, channels of x in float64) / n_kg, then
 *    M2_kg = sum (x - mean_kg)^2 in float64. Each channel's sums run over the rows in order (one
 *    float64 chain per channel), the group's channel sums are added in channel order; x - mean
 *    and its square are separate operations. The chunking is fixed by the caller, never by the
 *    band, so the partials are bit-identical for any band split and every ISA (the SIMD variants
 *    run several channels' chains a vector, each with the spec's operations).
 *  - gn_coeffs: chunks merged in order k = 0, 1, ... (Chan et al.: n = na + nb, d = mb - ma,
 *    m = ma + d * (nb / n), M2 = M2a + M2b + d * d * (na * nb / n)), var = M2 / n (population),
 *    r = 1 / sqrt(var + eps); scale[c] = (float)(gamma[c] * r), shift[c] = (float)(beta[c] -
 *    m * (gamma[c] * r)), all in float64, rounded once each. Generic only.
 *  - affine_act: y = (x * scale[c]) + shift[c] in float32, never fused (bit-identical across
 *    ISAs); with silu, out = silu(y) = (y < 0 ? y*e : y) / (1 + e), e = exp(-|y|): libm expf in
 *    generic, the vector exp polynomial (nx_vmath_ew.h) in the SIMD variants, so silu agrees
 *    with generic to a tolerance (<= 8u relative, as swiglu), not bit for bit.
 *  - im2col3x3, upsample2x: copies and zeros only: bit-exact everywhere.
 *  - add: one float32 add per element: bit-exact everywhere.
 *  - Band invariance: no output element depends on the band bounds.
 */
#ifndef NX_CONV_H
#define NX_CONV_H

#include <stdint.h>
#include <stdlib.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"

/* The family's slots (nx_dispatch.h), in kernel_variants() order. */
#define NX_CONV_SLOTS(X)                                                                           \
    X(gn_partials, int,                                                                            \
      (const float *x, int64_t P, int64_t C, int64_t G, int64_t chunk, double *part, int64_t k0,   \
       int64_t k1))                                                                                \
    X(gn_coeffs, void,                                                                             \
      (const double *part, int64_t P, int64_t C, int64_t G, int64_t chunk, const float *gamma,     \
       const float *beta, float eps, float *scale, float *shift))                                  \
    X(affine_act, void,                                                                            \
      (const float *x, const float *scale, const float *shift, float *out, int64_t C, int silu,    \
       int64_t r0, int64_t r1))                                                                    \
    X(im2col3x3, void,                                                                             \
      (const float *x, int64_t H, int64_t W, int64_t C, int up, float *panel, int64_t p0,          \
       int64_t p1))                                                                                \
    X(upsample2x, void,                                                                            \
      (const float *x, int64_t H, int64_t W, int64_t C, float *out, int64_t p0, int64_t p1))      \
    X(add, void, (const float *a, const float *b, float *out, int64_t i0, int64_t i1))

NX_DECLARE_FAMILY(nx_conv, NX_CONV_SLOTS)

/* gn_partials' chunk loop, shared by the spec and the SIMD variants, which supply the two
 * per-row steps: sum_row(xr, NULL, acc, C): acc[c] += (double)xr[c]; dev_row(xr, mc, acc, C):
 * acc[c] += d * d, d = (double)xr[c] - mc[c] (the product and the sum two roundings), each
 * channel's chain over the chunk's rows in order. The group steps are scalar, in channel order:
 * each group's mean (its channel sums / n) into partials[(k * G + g) * 2] and mc[c], then its
 * sum of squared deviations into partials[(k * G + g) * 2 + 1]. Returns 0, -1 if out of
 * memory. Always inlined, so the row steps are resolved at compile time. */
typedef void (*nx_gn_row_fn)(const float *xr, const double *mc, double *acc, int64_t C);

/* The two row steps of the spec, scalar, over channels [c0, C) (the SIMD variants' tails). */
static inline void nx_gn_sum_cols(const float *xr, double *acc, int64_t c0, int64_t C) {
    for (int64_t c = c0; c < C; c++) acc[c] += (double)xr[c];
}

static inline void nx_gn_dev_cols(const float *xr, const double *mc, double *acc, int64_t c0,
                                  int64_t C) {
    for (int64_t c = c0; c < C; c++) {
        const double d = (double)xr[c] - mc[c];
        const double d2 = d * d;
        acc[c] += d2;
    }
}

NX_INLINE int nx_gn_partials_chunks(const float *x, int64_t P, int64_t C, int64_t G,
                                   int64_t chunk, double *part, int64_t k0, int64_t k1,
                                   nx_gn_row_fn sum_row, nx_gn_row_fn dev_row) {
    const int64_t cpg = C / G;
    double *acc = malloc(sizeof(double) * (size_t)(2 * C)); /* per-channel sums, then means */
    if (!acc) return -1;
    double *mc = acc + C;
    for (int64_t k = k0; k < k1; k++) {
        const int64_t r0 = k * chunk, r1 = r0 + chunk < P ? r0 + chunk : P;
        const double n = (double)((r1 - r0) * cpg);
        double *pk = part + k * G * 2;
        for (int64_t c = 0; c < C; c++) acc[c] = 0.0;
        for (int64_t r = r0; r < r1; r++) sum_row(x + r * C, NULL, acc, C);
        for (int64_t g = 0; g < G; g++) {
            double s = 0.0;
            for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) s += acc[c];
            const double mean = s / n;
            for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) mc[c] = mean;
            pk[g * 2] = mean;
        }
        for (int64_t c = 0; c < C; c++) acc[c] = 0.0;
        for (int64_t r = r0; r < r1; r++) dev_row(x + r * C, mc, acc, C);
        for (int64_t g = 0; g < G; g++) {
            double s = 0.0;
            for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) s += acc[c];
            pk[g * 2 + 1] = s;
        }
    }
    free(acc);
    return 0;
}

extern const nx_conv_table nx_conv_table_generic; /* nx_conv.c: every slot */
extern const nx_conv_table nx_conv_table_avx2;    /* nx_conv_avx2.c */
extern const nx_conv_table nx_conv_table_avx512;  /* nx_conv_avx512.c */

/* The variants nx_<slot>_f32_<isa> (declared for every slot; only some are defined). */
#define NX_CONV_VARIANTS_(name, ret, params)                                                       \
    ret nx_##name##_f32_generic params;                                                            \
    ret nx_##name##_f32_avx2 params;                                                               \
    ret nx_##name##_f32_avx512 params;
NX_CONV_SLOTS(NX_CONV_VARIANTS_)
#undef NX_CONV_VARIANTS_

/* ---- gn_partials: for chunks k in [k0, k1) of `chunk` rows of x [P, C] (chunk k = rows
 * [k*chunk, min((k+1)*chunk, P))) and groups g < G (C % G == 0):
 * part[(k*G + g)*2 + 0] = mean of the chunk's group, part[... + 1] = sum of squared deviations
 * from it (see the numerics above). Returns 0, or -1 if its 2*C-double scratch could not be
 * allocated (nothing written then). */
int nx_gn_partials_f32(nx_isa isa, const float *x /* IN [P, C] */, int64_t P, int64_t C,
                       int64_t G, int64_t chunk, double *part /* OUT [nchunks, G, 2] */,
                       int64_t k0, int64_t k1);

/* ---- gn_coeffs: the per-channel affine map of GroupNorm from every chunk's partials
 * (nchunks = ceil(P / chunk)): out = x * scale[c] + shift[c] normalizes group g(c) and applies
 * gamma, beta. */
void nx_gn_coeffs_f32(nx_isa isa, const double *part /* IN [nchunks, G, 2] */, int64_t P,
                      int64_t C, int64_t G, int64_t chunk, const float *gamma /* IN [C] */,
                      const float *beta /* IN [C] */, float eps, float *scale /* OUT [C] */,
                      float *shift /* OUT [C] */);

/* ---- affine_act: out[r, c] := act((x[r, c] * scale[c]) + shift[c]), rows [r0, r1) of [P, C];
 * act = silu if silu != 0, else the identity. out may equal x. */
void nx_affine_act_f32(nx_isa isa, const float *x /* IN [P, C] */, const float *scale /* IN [C] */,
                       const float *shift /* IN [C] */, float *out /* OUT [P, C] */, int64_t C,
                       int silu, int64_t r0, int64_t r1);

/* ---- im2col3x3: the panel of a 3x3 convolution (stride 1, padding 1) of the image x [H*W, C],
 * read through a nearest x2 upsampling if up != 0 (output grid Ho x Wo = (H << up) x (W << up)),
 * for output pixels p in [p0, p1) of that grid (yo = p / Wo, xo = p % Wo):
 *   panel[(p - p0) * 9C + c * 9 + ky * 3 + kx] = u(yo + ky - 1, xo + kx - 1)[c], ky, kx < 3,
 * where u(y, x) = x[((y >> up) * W + (x >> up)) * C + c] inside the grid and 0 outside it. */
void nx_im2col3x3_f32(nx_isa isa, const float *x /* IN [H*W, C] */, int64_t H, int64_t W,
                      int64_t C, int up, float *panel /* OUT [p1-p0, 9C] */, int64_t p0,
                      int64_t p1);

/* ---- conv3x3 (float32, nx_matmul) and conv3x3_bf16 (nx_lowp's bf16 matmul): the matmul of the
 * im2col rows above for output pixels [p0, p1) with the weight w [N rows of 9C values of GGML
 * type `type`], + bias [N] or NULL:
 *   out[p, n] = (panel row of p) . w_n (the matmul's contract) [+ bias[n]], n < N,
 * out [pixels, N] (rows outside [p0, p1) untouched). No panel is materialized: the rows are made
 * by im2col3x3 at `isa` as the matmul's packer asks for them (nx_matmul_rows,
 * nx_matmul_bf16_rows), so one call covers a whole band, its weight panels decoded once per
 * token block of the driver instead of once per im2col panel. Bits: im2col3x3 (exact) then the
 * matmul at `isa`, i.e. those of every panel split. Returns the matmul's codes. */
int nx_conv3x3_f32(nx_isa isa, uint32_t type, const float *x /* IN [H*W, C] */, int64_t H,
                   int64_t W, int64_t C, int up, const uint8_t *w /* IN [N rows] */,
                   const float *bias /* IN [N] or NULL */, float *out /* OUT [pixels, N] */,
                   int64_t N, int64_t p0, int64_t p1);
int nx_conv3x3_bf16(nx_isa isa, uint32_t type, const float *x /* IN [H*W, C] */, int64_t H,
                    int64_t W, int64_t C, int up, const uint8_t *w /* IN [N rows] */,
                    const float *bias /* IN [N] or NULL */, float *out /* OUT [pixels, N] */,
                    int64_t N, int64_t p0, int64_t p1, unsigned flags);

/* ---- upsample2x: nearest x2 upsampling, out pixel p of the (2H) x (2W) grid, p in [p0, p1):
 * out[p, :] = x[((yo / 2) * W + xo / 2), :] (yo = p / 2W, xo = p % 2W). */
void nx_upsample2x_f32(nx_isa isa, const float *x /* IN [H*W, C] */, int64_t H, int64_t W,
                       int64_t C, float *out /* OUT [4*H*W, C] */, int64_t p0, int64_t p1);

/* ---- add: out[i] := a[i] + b[i], flat i in [i0, i1). out may equal a or b. */
void nx_add_f32(nx_isa isa, const float *a, const float *b, float *out, int64_t i0, int64_t i1);

#endif
