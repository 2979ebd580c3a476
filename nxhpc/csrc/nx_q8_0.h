/* nx_q8_0.h -- the Q8_0 kernel family: quantize, dequantize, Q8_0 x float32 matmul, adaLN linear.
 *
 * Owns the Q8_0 block layout (ggml's block_q8_0: float16 scale d, then 32 int8 q; value = d*q) and
 * the arithmetic contract of every kernel in the family. Must not: allocate per tile, spawn threads,
 * or read/write outside the ranges given (callers validate shapes before entering C).
 *
 * Arithmetic contract of the matmul (all ISA levels, bit-identical):
 *   w[n, k] = d[n, k/32] * q[n, k]      exact in float32 (11-bit times 8-bit significand)
 *   out[t, n] = two-level sum over k: K is cut into chunks c of NX_Q8_0_CHAIN (=128) steps at
 *               absolute offsets 0, 128, 256, ...; inside a chunk one float32 fused-multiply-add
 *               chain from +0:  p_c = fmaf(x[t, k], w[n, k], p_c);  then, in chunk order,
 *               acc = p_0;  acc = acc + p_c  (one float32 add per later chunk).
 * Why two levels: a single K-long chain has a worst-case error growing with K (and measured 2.2x
 * the max error of OpenBLAS's float32 sgemm at K=768); 128-step chunks bound the chain length
 * at the cost of one C-tile load/add/store per 128 k-steps (~2% at K=3840).
 * The order does not depend on n0/n1, on the tile a column or token falls in, or on T, so any
 * split of the work into column bands / token batches gives bit-identical output. The generic
 * (scalar) variant is the spec (nx_q8_0_dot_rows below); SIMD variants run the same order in vector lanes.
 */
#ifndef NX_Q8_0_H
#define NX_Q8_0_H

#include <stddef.h>
#include <stdint.h>
#include <math.h>

#include "nx_cpu.h"

#define NX_QK8_0 32          /* values per block */
#define NX_Q8_0_BLOCK_BYTES 34
#define NX_Q8_0_CHAIN 128    /* k-steps per fmaf chain in the matmul's two-level sum */

/* ggml's block_q8_0. Rows of GGUF data are arrays of these; the base address of a row may be
 * only byte-aligned, so kernels read `d` with memcpy. */
typedef struct {
    uint16_t d;              /* float16 scale (IEEE binary16 bits, little-endian) */
    int8_t qs[NX_QK8_0];     /* quants */
} nx_block_q8_0;
_Static_assert(sizeof(nx_block_q8_0) == NX_Q8_0_BLOCK_BYTES, "nx_block_q8_0 must be 34 bytes");

/* Scalar float16 <-> float32 conversions (round-to-nearest-even, subnormals, inf, NaN quieted),
 * bit-identical to x86 F16C (vcvtps2ph with RNE / vcvtph2ps). */
uint16_t nx_f32_to_f16(float f);
float nx_f16_to_f32(uint16_t h);

/* ---- quantize: x[nblocks*32] -> nblocks Q8_0 blocks, byte-identical to gguf / ggml reference:
 *   amax = max |x| (NaN if any x is NaN); d = amax / 127; id = d == 0 ? 0 : 1/d  (float32)
 *   q = round-half-away(x * id), converted like numpy's float32->int8 cast (non-finite -> 0)
 *   stored d = float16(d) with round-to-nearest-even.                                        */
void nx_q8_0_quantize(nx_isa isa, const float *x /* IN [nblocks*32] */,
                      uint8_t *out /* OUT [nblocks*34] */, size_t nblocks);
void nx_q8_0_quantize_generic(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks);
void nx_q8_0_quantize_avx512(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks);

/* ---- dequantize: value = float32(d) * q, byte-identical to gguf.quants.dequantize. */
void nx_q8_0_dequantize(nx_isa isa, const uint8_t *w /* IN [nblocks*34] */,
                        float *out /* OUT [nblocks*32] */, size_t nblocks);
void nx_q8_0_dequantize_generic(const uint8_t *w /* IN */, float *out /* OUT */, size_t nblocks);
void nx_q8_0_dequantize_avx512(const uint8_t *w /* IN */, float *out /* OUT */, size_t nblocks);

/* Which level quantize/dequantize run for a requested level (no AVX2 variant: falls back). */
nx_isa nx_q8_0_convert_level(nx_isa isa);
/* Which level the matmul runs for a requested level. */
nx_isa nx_q8_0_matmul_level(nx_isa isa);

/* ---- matmul: out[t, n] for t in [0, T), n in [n0, n1) (see the contract above).
 * x: [T, K] row-major float32; w: [N, K/32] blocks, row stride K/32*34 bytes; out: [T, N].
 * K % 32 == 0, 0 <= n0 <= n1 <= N. Columns outside [n0, n1) are not touched.
 * Returns 0, or -1 when scratch memory could not be allocated (out is then unspecified in the band). */
int nx_q8_0_matmul(nx_isa isa, const float *x /* IN [T*K] */, const uint8_t *w /* IN [N*K/32*34] */,
                   float *out /* OUT [T*N] */, size_t T, size_t K, size_t N, size_t n0, size_t n1);
int nx_q8_0_matmul_generic(const float *x /* IN */, const uint8_t *w /* IN */, float *out /* OUT */,
                           size_t T, size_t K, size_t N, size_t n0, size_t n1);
int nx_q8_0_matmul_avx2(const float *x /* IN */, const uint8_t *w /* IN */, float *out /* OUT */,
                        size_t T, size_t K, size_t N, size_t n0, size_t n1);
int nx_q8_0_matmul_avx512(const float *x /* IN */, const uint8_t *w /* IN */, float *out /* OUT */,
                          size_t T, size_t K, size_t N, size_t n0, size_t n1);

/* ---- the cache-blocked driver shared by the SIMD matmul variants (BLIS loop order):
 *   for each block of mc <= MC tokens: pack x rows into MR-row micro-panels (Ap, all of K)
 *     for each block of nc <= NC columns in [n0, n1):
 *       for each k-block of kc <= KC steps: pack_b dequantizes w into NR-column panels (Bp)
 *         for each MR x NR tile and each NX_Q8_0_CHAIN-step chunk of the k-block: kern.
 * A variant supplies its tile sizes and two functions:
 *   pack_b(w, rowbytes, j0, nc, b0, kb, Bp): columns [j0, j0+nc) x Q8_0 blocks [b0, b0+kb) of w
 *     into Bp, panel p (NR columns) at Bp + p*kc*NR, element [k*NR + j] = w[j0 + NR*p + j,
 *     32*b0 + k] (kc = 32*kb); columns past nc are zero.
 *   kern(mr, nr, kc, A, B, C, ldc, first): one chunk (kc <= NX_Q8_0_CHAIN) of the contract's
 *     two-level sum for C[0:mr, 0:nr] (ldc floats per row): p = fma chain from +0 over
 *     A[k*MR + r] * B[k*NR + j]; C = first ? p : C + p.  Rows >= mr of A are zero padding.
 * The chunk order per output depends only on K, never on the tile an output falls in, so the
 * blocking keeps the contract (and every band / batch split) bit for bit. */
typedef struct {
    size_t mr, nr, kc, nc, mc;   /* MR x NR register tile; KC % NX_Q8_0_CHAIN == 0, NC % NR == 0,
                                  * MC % MR == 0 */
    void (*pack_b)(const uint8_t *w, size_t rowbytes, size_t j0, size_t nc, size_t b0, size_t kb,
                   float *Bp);
    void (*kern)(int mr, int nr, size_t kc, const float *A, const float *B, float *C, size_t ldc,
                 int first);
} nx_q8_0_tiling;

/* Runs the driver above; same arguments and return value as nx_q8_0_matmul. Scratch: one packed
 * activation block (MC*K floats) and one weight panel (NC*KC floats), 64-byte aligned, allocated
 * once per call. */
int nx_q8_0_matmul_blocked(const nx_q8_0_tiling *tl, const float *x /* IN [T*K] */,
                           const uint8_t *w /* IN */, float *out /* OUT [T*N] */, size_t T,
                           size_t K, size_t N, size_t n0, size_t n1);

/* ---- adaLN linear: out[n] = sum_k w[n,k] * u[k] (+ bias[n]), u = silu(t_emb) or t_emb
 * (silu in float32: t / (1 + expf(-t))). Both storages run the matmul's contract (nx_q8_0_dot_rows),
 * then one float32 add of the bias, so a Q8_0 weight and its (exact) float32
 * dequantization give bit-identical output at every ISA level.
 * float32 weight [N, K]: scalar fmaf loop (generic at every level; N*K is small).
 * Q8_0 weight [N, K/32*34]: u times w through nx_q8_0_matmul (T = 1) at `isa`, then + bias.
 * bias may be NULL. Returns 0, or -1 on allocation failure. */
int nx_adaln_linear_f32(const float *t_emb /* IN [K] */, const float *w /* IN [N*K] */,
                        const float *bias /* IN [N] or NULL */, float *out /* OUT [N] */,
                        size_t K, size_t N, int silu_input);
int nx_adaln_linear_q8_0(nx_isa isa, const float *t_emb /* IN [K] */, const uint8_t *w /* IN */,
                         const float *bias /* IN [N] or NULL */, float *out /* OUT [N] */,
                         size_t K, size_t N, int silu_input);

/* The matmul's per-output arithmetic (see the contract above), scalar -- the spec every variant
 * reproduces bit for bit: for each of nrows (<= NX_Q8_0_DOT_ROWS) rows a_r = a + r*lda,
 * out[r*ldo] = chunks of NX_Q8_0_CHAIN fmaf steps from +0 over a_r[k]*b[k], chunk sums added in
 * order. Rows are independent chains; running several at once only lets their fmaf calls overlap. */
#define NX_Q8_0_DOT_ROWS 4
static inline void nx_q8_0_dot_rows(const float *a /* IN [nrows][lda] */, size_t lda, size_t nrows,
                                    const float *b /* IN [K] */, size_t K,
                                    float *out /* OUT [nrows][ldo] */, size_t ldo) {
    float acc[NX_Q8_0_DOT_ROWS] = {0.0f};
    for (size_t c0 = 0; c0 < K; c0 += NX_Q8_0_CHAIN) {
        const size_t c1 = K - c0 < NX_Q8_0_CHAIN ? K : c0 + NX_Q8_0_CHAIN;
        float p[NX_Q8_0_DOT_ROWS] = {0.0f};
        for (size_t k = c0; k < c1; k++)
            for (size_t r = 0; r < nrows; r++) p[r] = fmaf(a[r * lda + k], b[k], p[r]);
        for (size_t r = 0; r < nrows; r++) acc[r] = c0 == 0 ? p[r] : acc[r] + p[r];
    }
    for (size_t r = 0; r < nrows; r++) out[r * ldo] = acc[r];
}

#endif
