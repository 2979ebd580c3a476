/* nx_q8_0.h -- the Q8_0 quantizer (float32 -> ggml Q8_0 blocks) and the Q8_0 names kept for
 * callers written before the weight-type seam.
 *
 * Owns the quantizer's contract and its dispatch family ("q8_0"). The Q8_0 block layout, its
 * dequantize and its matmul are a weight type like any other (nx_wtype.h, nx_matmul.h); the
 * nx_q8_0_* wrappers below only name them. Must not: allocate, spawn threads, or read/write
 * outside the ranges given.
 */
#ifndef NX_Q8_0_H
#define NX_Q8_0_H

#include <stddef.h>
#include <stdint.h>

#include "nx_cpu.h"
#include "nx_dispatch.h"
#include "nx_matmul.h"
#include "nx_wtype.h"

/* Bytes of one Q8_0 block: a float16 scale and 32 int8 codes. */
#define NX_Q8_0_BLOCK_BYTES 34

/* ---- quantize: x[nblocks*32] -> nblocks Q8_0 blocks, byte-identical to gguf / ggml reference:
 *   amax = max |x| (NaN if any x is NaN); d = amax / 127; id = d == 0 ? 0 : 1/d  (float32)
 *   q = round-half-away(x * id), converted like numpy's float32->int8 cast (non-finite -> 0)
 *   stored d = float16(d) with round-to-nearest-even.                                        */
void nx_q8_0_quantize(nx_isa isa, const float *x /* IN [nblocks*32] */,
                      uint8_t *out /* OUT [nblocks*34] */, size_t nblocks);
void nx_q8_0_quantize_generic(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks);
void nx_q8_0_quantize_avx2(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks);
void nx_q8_0_quantize_avx512(const float *x /* IN */, uint8_t *out /* OUT */, size_t nblocks);

/* ---- the activation scale of the `q8` matmul (nx_lowp.h): the quantizer's float32 d of one
 * block, before its float16 rounding, with blocks too small for a normal d flushed:
 *   amax = max |x| (NaN if any x is NaN); d = amax / 127 (float32);
 *   returns 0 when d < 2^-126 (amax < 127 * 2^-126, ~1.5e-36: the block contributes 0), else d.
 * The quantized bytes q = round(x * (1/d)) already use this d; keeping it in float32 (not the
 * stored float16) gives the q8 matmul float32's whole range: a float16 d is inf for amax >=
 * 127 * 65504 (~8.3e6) and 0 for amax < ~7.6e-6. Scalar on purpose: it is the spec of both the
 * generic matmul and the VNNI activation packer, and costs one pass over x per token. */
static inline float nx_q8_0_act_scale(const float *xb /* IN [32] */) {
    float amax = 0.0f;
    for (int i = 0; i < NX_QK8_0; i++) {
        const float a = xb[i] < 0.0f ? -xb[i] : xb[i];
        if (a != a) return a; /* NaN: propagates as the quantizer's d does */
        if (a > amax) amax = a;
    }
    const float d = amax / 127.0f;
    return d < 0x1p-126f ? 0.0f : d;
}

#define NX_Q8_0_SLOTS(X) X(q8_0_quantize, void, (const float *x, uint8_t *out, size_t nblocks))
NX_DECLARE_FAMILY(nx_q8_0, NX_Q8_0_SLOTS)
extern const nx_q8_0_table nx_q8_0_table_generic; /* nx_q8_0.c */
extern const nx_q8_0_table nx_q8_0_table_avx2;    /* nx_q8_0_avx2.c */
extern const nx_q8_0_table nx_q8_0_table_avx512;  /* nx_q8_0_avx512.c */

#endif
