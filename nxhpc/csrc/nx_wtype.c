/* nx_wtype.c -- the weight-type traits table, the dequantize specs (generic, scalar) and the
 * dispatch of the dequantize family over the per-ISA tables.
 * Owns: float16 conversion in software, one traits row per type. Must not: use SIMD intrinsics
 * (compiled with no ISA flags; the variants live in nx_wtype_<isa>.c).
 */
#include "nx_wtype.h"
#include "nx_quants.h" /* the nine Q4_0 .. Q6_K block layouts and specs */

#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------ float16 <-> float32 */

uint16_t nx_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sgn = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { /* inf or NaN (NaN: quieted, top payload kept) */
        if (ax == 0x7f800000u) return (uint16_t)(sgn | 0x7c00u);
        return (uint16_t)(sgn | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x477ff000u) return (uint16_t)(sgn | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                  /* below 2^-14: subnormal or 0 */
        if (ax <= 0x33000000u) return (uint16_t)sgn;         /* <= 2^-25: ties-to-even -> 0 */
        uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* value / 2^-24 = m >> shift, shift in 14..24 */
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sgn | h);
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* carry may bump the exponent */
    return (uint16_t)(sgn | h);
}

float nx_f16_to_f32(uint16_t h) {
    uint32_t sgn = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        if (m == 0) {
            bits = sgn;
        } else { /* subnormal: normalise */
            uint32_t s = 0;
            while (!(m & 0x400u)) {
                m <<= 1;
                s++;
            }
            bits = sgn | ((113u - s) << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        bits = sgn | 0x7f800000u | (m << 13); /* inf, or NaN with its payload and quiet bit */
    } else {
        bits = sgn | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------ dequantize specs */

void nx_dequant_f32_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    memcpy(out, blocks, n * sizeof(float));
}

void nx_dequant_f16_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, blocks + 2 * i, 2);
        out[i] = nx_f16_to_f32(h);
    }
}

void nx_dequant_bf16_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, blocks + 2 * i, 2);
        out[i] = nx_bf16_to_f32(h);
    }
}

void nx_dequant_q8_0_generic(const uint8_t *blocks /* IN */, float *out /* OUT */, size_t n) {
    for (size_t blk = 0; blk < n; blk++) {
        const uint8_t *b = blocks + blk * sizeof(nx_block_q8_0);
        uint16_t dh;
        memcpy(&dh, b, 2);
        const float d = nx_f16_to_f32(dh);
        for (int i = 0; i < NX_QK8_0; i++) out[blk * NX_QK8_0 + i] = (float)(int8_t)b[2 + i] * d;
    }
}

/* ------------------------------------------------------------------ the traits table */

/* One row per weight type: {name, values per block, bytes per block, generic dequantize}. */
const nx_wtype_traits nx_wtype_traits_table[NX_GGML_TYPE_COUNT] = {
    [NX_GGML_F32] = {"F32", 1, sizeof(nx_block_f32), nx_dequant_f32_generic},
    [NX_GGML_F16] = {"F16", 1, sizeof(nx_block_f16), nx_dequant_f16_generic},
    [NX_GGML_Q8_0] = {"Q8_0", NX_QK8_0, sizeof(nx_block_q8_0), nx_dequant_q8_0_generic},
    [NX_GGML_BF16] = {"BF16", 1, sizeof(nx_block_bf16), nx_dequant_bf16_generic},
    [NX_GGML_Q4_0] = {"Q4_0", NX_QK_LEGACY, sizeof(nx_block_q4_0), nx_dequant_q4_0_generic},
    [NX_GGML_Q4_1] = {"Q4_1", NX_QK_LEGACY, sizeof(nx_block_q4_1), nx_dequant_q4_1_generic},
    [NX_GGML_Q5_0] = {"Q5_0", NX_QK_LEGACY, sizeof(nx_block_q5_0), nx_dequant_q5_0_generic},
    [NX_GGML_Q5_1] = {"Q5_1", NX_QK_LEGACY, sizeof(nx_block_q5_1), nx_dequant_q5_1_generic},
    [NX_GGML_Q2_K] = {"Q2_K", NX_QK_K, sizeof(nx_block_q2_K), nx_dequant_q2_K_generic},
    [NX_GGML_Q3_K] = {"Q3_K", NX_QK_K, sizeof(nx_block_q3_K), nx_dequant_q3_K_generic},
    [NX_GGML_Q4_K] = {"Q4_K", NX_QK_K, sizeof(nx_block_q4_K), nx_dequant_q4_K_generic},
    [NX_GGML_Q5_K] = {"Q5_K", NX_QK_K, sizeof(nx_block_q5_K), nx_dequant_q5_K_generic},
    [NX_GGML_Q6_K] = {"Q6_K", NX_QK_K, sizeof(nx_block_q6_K), nx_dequant_q6_K_generic},
};

const nx_wtype_traits *nx_wtype(uint32_t ggml_type) {
    if (ggml_type >= NX_GGML_TYPE_COUNT) return NULL;
    const nx_wtype_traits *t = &nx_wtype_traits_table[ggml_type];
    return t->dequant && t->blck_elems >= 1 && t->blck_elems <= NX_WTYPE_MAX_BLOCK &&
                   NX_WTYPE_MAX_BLOCK % t->blck_elems == 0
               ? t
               : NULL;
}

/* ------------------------------------------------------------------ dispatch (family "wtype") */

static const nx_wtype_table *const nx_wtype_tables[NX_ISA_COUNT] = {
    NX_X86_ONLY([NX_ISA_AVX2] = &nx_wtype_table_avx2, [NX_ISA_AVX512] = &nx_wtype_table_avx512, )};

static nx_wtype_table nx_wtype_resolved[NX_ISA_COUNT];
static unsigned char nx_wtype_from[NX_ISA_COUNT][NX_GGML_TYPE_COUNT];
static char nx_wtype_names[NX_GGML_TYPE_COUNT][32];
static int nx_wtype_done;

/* The shared resolver (nx_dispatch.h) over the ISA tables, with the traits table's specs as the
 * GENERIC table: per ISA and type, the first variant on the chain isa -> parent -> ... -> the
 * spec. Ids without a traits row resolve to nothing. */
static void nx_wtype_resolve(void) {
    static nx_wtype_table generic;
    const nx_slot_fn *tables[NX_ISA_COUNT];
    nx_slot_fn flat[NX_ISA_COUNT][NX_GGML_TYPE_COUNT];
    for (uint32_t t = 0; t < NX_GGML_TYPE_COUNT; t++) {
        generic.dequant[t] = nx_wtype(t) ? nx_wtype_traits_table[t].dequant : NULL;
        if (nx_wtype(t))
            snprintf(nx_wtype_names[t], sizeof nx_wtype_names[t], "dequantize[%s]",
                     nx_wtype_traits_table[t].name);
    }
    for (int i = 0; i < NX_ISA_COUNT; i++)
        tables[i] = i == NX_ISA_GENERIC ? generic.slot_
                                        : (nx_wtype_tables[i] ? nx_wtype_tables[i]->slot_ : NULL);
    nx_dispatch_resolve(NX_GGML_TYPE_COUNT, tables, &flat[0][0], &nx_wtype_from[0][0]);
    for (int i = 0; i < NX_ISA_COUNT; i++)
        for (uint32_t t = 0; t < NX_GGML_TYPE_COUNT; t++) {
            if (!nx_wtype(t)) { /* a SIMD table never gives a type the traits table lacks */
                flat[i][t] = NULL;
                nx_wtype_from[i][t] = (unsigned char)NX_ISA_COUNT;
            }
            nx_wtype_resolved[i].slot_[t] = flat[i][t];
        }
    nx_wtype_done = 1;
}

nx_dequant_fn nx_wtype_dequant(nx_isa isa, uint32_t type) {
    if (!nx_wtype_done) nx_wtype_resolve();
    if ((int)isa < 0 || (int)isa >= NX_ISA_COUNT || type >= NX_GGML_TYPE_COUNT) return NULL;
    return nx_wtype_resolved[isa].dequant[type];
}

nx_isa nx_wtype_variant(uint32_t type, nx_isa isa) {
    if (!nx_wtype_done) nx_wtype_resolve();
    if ((int)isa < 0 || (int)isa >= NX_ISA_COUNT || type >= NX_GGML_TYPE_COUNT) return NX_ISA_COUNT;
    return (nx_isa)nx_wtype_from[isa][type];
}

int nx_dequantize(nx_isa isa, uint32_t type, const uint8_t *w /* IN */, float *out /* OUT */,
                  size_t nblocks) {
    nx_dequant_fn f = nx_wtype_dequant(isa, type);
    if (!f) return -2;
    if (nblocks) f(w, out, nblocks);
    return 0;
}

int nx_embed_rows(nx_isa isa, uint32_t type, const uint8_t *w /* IN */, size_t rowbytes,
                  const void *ids /* IN */, int id_bytes, float *out /* OUT */, size_t K, size_t r0,
                  size_t r1) {
    nx_dequant_fn f = nx_wtype_dequant(isa, type);
    if (!f) return -2;
    const size_t nblocks = K / nx_wtype_traits_table[type].blck_elems;
    for (size_t i = r0; i < r1; i++) {
        int64_t id; /* memcpy: ids may come from any buffer, aligned or not */
        if (id_bytes == 4) {
            int32_t v;
            memcpy(&v, (const uint8_t *)ids + 4 * i, 4);
            id = v;
        } else {
            memcpy(&id, (const uint8_t *)ids + 8 * i, 8);
        }
        if (nblocks) f(w + (size_t)id * rowbytes, out + i * K, nblocks);
    }
    return 0;
}

/* kernel_variants(): slot t = GGML type t, named "dequantize[<TYPE>]"; unsupported ids have no
 * name (NULL) and are skipped. */
static const char *nx_wtype_slot_name(int slot) {
    if (!nx_wtype_done) nx_wtype_resolve();
    return slot >= 0 && slot < NX_GGML_TYPE_COUNT && nx_wtype_names[slot][0] ? nx_wtype_names[slot]
                                                                             : NULL;
}

static nx_isa nx_wtype_slot_variant(int slot, nx_isa isa) {
    return slot < 0 ? NX_ISA_COUNT : nx_wtype_variant((uint32_t)slot, isa);
}

const nx_family_info nx_wtype_family = {"wtype", NX_GGML_TYPE_COUNT, nx_wtype_slot_name,
                                        nx_wtype_slot_variant};
