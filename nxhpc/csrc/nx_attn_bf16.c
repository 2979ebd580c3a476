/* nx_attn_bf16.c -- the `bf16` attention's scalar spec (nx_attn_bf16.h), the generic table and the
 * dispatch of the "attn_bf16" family.
 *
 * Owns: the executable form of the contract, one row at a time, in its written order, and the
 * AVX-512 BF16 variant's choice of dot (nx_attn_bf16_dot: state and probe). Compiled
 * with no ISA flags (fmaf is libm's, correctly rounded). Must not: use SIMD intrinsics (those are
 * nx_attn_bf16_avx2.c's and nx_attn_bf16_avx512bf16.c's), or depend on the head band.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include "nx_attn_bf16.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nx_lowp.h"  /* nx_bf16_round, nx_dpbf16_step: the `bf16` matmul's rounding and step */
#include "nx_peak.h"  /* the fma_zmm / bf16_zmm loops that choose the avx512bf16 dot */
#include "nx_wtype.h" /* nx_bf16_to_f32 */

NX_DEFINE_DISPATCH(nx_attn_bf16, "attn_bf16", NX_ATTN_BF16_SLOTS,
                   {[NX_ISA_GENERIC] = &nx_attn_bf16_table_generic,
                    NX_X86_ONLY([NX_ISA_AVX2] = &nx_attn_bf16_table_avx2,
                                [NX_ISA_AVX512BF16] = &nx_attn_bf16_table_avx512bf16,
                                [NX_ISA_AMX] = &nx_attn_bf16_table_amx, )})

int nx_attention_bf16(nx_isa isa, const float *q, const float *k, const float *qkv,
                      const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH,
                      int64_t hd, float scale, int64_t h0, int64_t h1, int64_t t0, int64_t t1,
                      int causal) {
    /* the variants take the scores' base-2 factor c (the contract, nx_attn_bf16.h) */
    return nx_attn_bf16_get(isa)->attention_bf16(q, k, qkv, mask, out, T, H, KVH, hd,
                                                 nx_attn_scale2(scale), h0, h1, t0, t1, causal);
}

static inline float nx_bf(float v) { return nx_bf16_to_f32(nx_bf16_round(v)); }

/* ---- the AVX-512 BF16 variant's dot (nx_attn_bf16.h: nx_attn_bf16_dot). The state is one int
 * per process, written with relaxed atomics: two threads resolving AUTO at once both measure and
 * both store a valid choice (each gives the same bits). */
static int nx_ab_dot_state = NX_AB_DOT_AUTO;

static double nx_ab_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The faster dot by the peak loops' FLOP rates: fma_zmm (16 chains of vfmadd231ps) against
 * bf16_zmm (16 chains of vdpbf16ps), 4096 iterations each (~10-40 us), alternated 7 times after
 * a warm-up, the best time of each. (Only the order of the two rates matters: ~0.5x on the AMX
 * Xeon, ~2x on AMD Zen 4, so neither noise nor clock ramps decide it.) */
static int nx_ab_probe_dot(void) {
    if (!nx_peak_supported(NX_PEAK_FMA_ZMM) || !nx_peak_supported(NX_PEAK_BF16_ZMM))
        return NX_AB_DOT_FMA;
    const size_t iters = 4096;
    float fa[16], fb[16], facc[256];
    uint16_t ba[32], bb[32];
    float bacc[256];
    for (int i = 0; i < 16; i++) fa[i] = 1.0f, fb[i] = 0.5f;
    for (int i = 0; i < 32; i++) ba[i] = bb[i] = 0x3f80; /* bfloat16 1.0 */
    double tf = INFINITY, tb = INFINITY;
    for (int rep = 0; rep < 8; rep++) {
        for (int i = 0; i < 256; i++) facc[i] = bacc[i] = 1.0f;
        double t0 = nx_ab_now();
        nx_peak_run(NX_PEAK_FMA_ZMM, iters, fa, fb, facc);
        double t1 = nx_ab_now();
        nx_peak_run(NX_PEAK_BF16_ZMM, iters, ba, bb, bacc);
        double t2 = nx_ab_now();
        if (rep == 0) continue; /* warm-up */
        if (t1 - t0 < tf) tf = t1 - t0;
        if (t2 - t1 < tb) tb = t2 - t1;
    }
    const double rf = (double)nx_peak_get(NX_PEAK_FMA_ZMM)->ops_per_iter / tf;
    const double rb = (double)nx_peak_get(NX_PEAK_BF16_ZMM)->ops_per_iter / tb;
    return rb >= rf ? NX_AB_DOT_DP : NX_AB_DOT_FMA;
}

int nx_attn_bf16_dot(void) {
    int d = __atomic_load_n(&nx_ab_dot_state, __ATOMIC_RELAXED);
    if (d == NX_AB_DOT_AUTO) {
        d = nx_ab_probe_dot();
        __atomic_store_n(&nx_ab_dot_state, d, __ATOMIC_RELAXED);
    }
    return d;
}

int nx_attn_bf16_set_dot(int mode) {
    if (mode == NX_AB_DOT_DP && !nx_cpu_isa_supported(NX_ISA_AVX512BF16)) return -1;
    if (mode != NX_AB_DOT_AUTO && mode != NX_AB_DOT_FMA && mode != NX_AB_DOT_DP) return -1;
    __atomic_store_n(&nx_ab_dot_state, mode, __ATOMIC_RELAXED);
    return nx_attn_bf16_dot();
}

int nx_attention_bf16_generic(const float *q, const float *k, const float *qkv,
                              const uint8_t *mask, float *out, int64_t T, int64_t H, int64_t KVH,
                              int64_t hd, float scale, int64_t h0, int64_t h1, int64_t t0,
                              int64_t t1, int causal) {
    enum { BC = NX_ATTN_BF16_TILE };
    const int64_t W = (H + 2 * KVH) * hd, group = H / KVH, OW = H * hd;
    const int64_t hd2 = (hd + 1) / 2 * 2, ntiles = (T + BC - 1) / BC, Tp = ntiles * BC;
    /* bf() of one kv head's keys and values, zero-padded to Tp keys and hd2 dims (2 * Tp * hd2
     * floats), and of one query row (hd2) + its running output (hd) */
    float *kb = malloc(sizeof(float) * (size_t)(Tp * hd2));
    float *vb = malloc(sizeof(float) * (size_t)(Tp * hd2));
    float *qb = malloc(sizeof(float) * (size_t)hd2);
    float *O = malloc(sizeof(float) * (size_t)hd2);
    if (!kb || !vb || !qb || !O) {
        free(kb);
        free(vb);
        free(qb);
        free(O);
        return -1;
    }
    int64_t have = -1;
    for (int64_t h = h0; h < h1; h++) {
        const int64_t g = h / group;
        if (g != have) {
            const float *kg = k + g * T * hd, *vg = qkv + (H + KVH) * hd + g * hd;
            for (int64_t j = 0; j < Tp; j++)
                for (int64_t d = 0; d < hd2; d++) {
                    const int in = j < T && d < hd;
                    kb[j * hd2 + d] = in ? nx_bf(kg[j * hd + d]) : 0.0f;
                    vb[j * hd2 + d] = in ? nx_bf(vg[j * W + d]) : 0.0f;
                }
            have = g;
        }
        for (int64_t t = t0; t < t1; t++) {
            const float *qr = q + (h * T + t) * hd;
            for (int64_t d = 0; d < hd2; d++) qb[d] = d < hd ? nx_bf(qr[d]) : 0.0f;
            for (int64_t d = 0; d < hd; d++) O[d] = 0.0f;
            float m = -INFINITY, l = 0.0f;
            const int64_t nrun = causal ? t / BC + 1 : ntiles;
            for (int64_t b = 0; b < nrun; b++) {
                float x[BC], p[BC], a[16];
                float mx = -INFINITY;
                for (int jj = 0; jj < BC; jj++) {
                    const int64_t j = b * BC + jj;
                    const float *kr = kb + j * hd2;
                    float s = 0.0f;
                    for (int64_t d = 0; d < hd2; d += 2) {
                        s = nx_dpbf16_step(s, qb[d + 1], kr[d + 1]); /* odd element first */
                        s = nx_dpbf16_step(s, qb[d], kr[d]);
                    }
                    const int allowed = j < T && (!mask || mask[j]) && (!causal || j <= t);
                    x[jj] = allowed ? s * scale : -INFINITY;
                    mx = x[jj] > mx ? x[jj] : mx;
                }
                const float m_new = mx > m ? mx : m;
                const float m_use = m_new == -INFINITY ? 0.0f : m_new; /* all excluded so far */
                const float alpha = nx_attn_exp(m - m_use);
                for (int jj = 0; jj < BC; jj++) p[jj] = nx_bf(nx_attn_exp(x[jj] - m_use));
                for (int L = 0; L < 16; L++) a[L] = ((p[L] + p[L + 16]) + p[L + 32]) + p[L + 48];
                for (int L = 0; L < 8; L++) a[L] += a[L + 8];
                for (int L = 0; L < 4; L++) a[L] += a[L + 4];
                for (int L = 0; L < 2; L++) a[L] += a[L + 2];
                const float sum = a[0] + a[1];
                l = l * alpha + sum;
                m = m_new;
                const float *vt = vb + b * BC * hd2;
                for (int64_t d = 0; d < hd; d++) {
                    float o = O[d] * alpha;
                    for (int i = 0; i < BC / 2; i++) {
                        o = nx_dpbf16_step(o, p[2 * i + 1], vt[(2 * i + 1) * hd2 + d]);
                        o = nx_dpbf16_step(o, p[2 * i], vt[2 * i * hd2 + d]);
                    }
                    O[d] = o;
                }
            }
            nx_attn_out_row(out + t * OW + h * hd, O, l, hd);
        }
    }
    free(kb);
    free(vb);
    free(qb);
    free(O);
    return 0;
}

const nx_attn_bf16_table nx_attn_bf16_table_generic = {.attention_bf16 = nx_attention_bf16_generic};
