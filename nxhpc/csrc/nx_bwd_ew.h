/* nx_bwd_ew.h -- the element-wise SIMD backward kernels written once for both vector widths
 * (nx_simd.h): swiglu_backward, and the row phase of the tiled attention backward (softmax
 * and dS, nx_attn_bwd_tiling.softmax_ds). Included exactly once by nx_bwd_avx2.c and by
 * nx_bwd_avx512.c;
 * NXV_FN(nx_swiglu_bwd_f32) is nx_swiglu_bwd_f32_avx2 / _avx512 (declared in nx_bwd.h). The
 * loops are spelled with the intrinsics' own names (NXV_PS, NXV_LOADN, ...), so the 16-lane code
 * is exactly the hand-written AVX-512 code it replaced.
 * Must not: be included from generic files.
 */
#ifndef NX_BWD_EW_H
#define NX_BWD_EW_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "nx_bwd.h"
#include "nx_simd.h"

/* silu and silu' from one e = exp(-|x|) and d = 1 / (1 + e): silu = xc * sigmoid, with
 * sigmoid = d (x >= 0) or e*d. This is deliberately not the forward's nx_silu16 / nx_silu8
 * ((x or x*e) / (1 + e), one division): the two round differently, and this kernel's
 * results (tolerance-checked against the spec, not bit-matched to the forward) are kept as
 * they are. It also clamps +inf to FLT_MAX inside silu', which the forward does not need. */
void NXV_FN(nx_swiglu_bwd_f32)(const float *a, const float *b, const float *dout, float *da,
                               float *db, int64_t i0, int64_t i1) {
    const nxv big = NXV_PS(set1)(3.4028234663852886e38f),
              nbig = NXV_PS(set1)(-3.4028234663852886e38f);
    const nxv one = NXV_PS(set1)(1.0f), sign = NXV_PS(set1)(-0.0f);
    for (int64_t i = i0; i < i1; i += NXV_W) {
        nxv_mask m = NXV_MASKN(i1 - i);
        nxv av = NXV_LOADN(a + i, m), bv = NXV_LOADN(b + i, m);
        nxv g = NXV_LOADN(dout + i, m);
        nxv xc = NXV_PS(max)(nbig, av); /* -inf -> -FLT_MAX; NaN kept (second operand) */
        nxv x = NXV_PS(min)(big, xc);   /* +inf -> FLT_MAX only inside silu' */
        nxv e = NXV_EXP(NXV_PS(or)(x, sign));
        nxv d = NXV_PS(div)(one, NXV_PS(add)(one, e));
        nxv ed = NXV_PS(mul)(e, d);
        nxv_pred pos = NXV_CMP(x, NXV_PS(setzero)(), _CMP_GE_OQ);
        nxv s = NXV_SELECT(pos, ed, d);  /* sigmoid */
        nxv sc = NXV_SELECT(pos, d, ed); /* 1 - sigmoid */
        nxv silu = NXV_PS(mul)(xc, s);
        nxv dsilu = NXV_PS(mul)(s, NXV_PS(add)(one, NXV_PS(mul)(x, sc)));
        nxv vda = NXV_PS(mul)(NXV_PS(mul)(g, bv), dsilu);
        nxv vdb = NXV_PS(mul)(g, silu);
        NXV_STOREN(da + i, m, vda);
        NXV_STOREN(db + i, m, vdb);
    }
}

/* Phase 2 of the tiled attention backward for one query row: S (scores, in) -> P (out, in
 * place); dP -> scale*dS. Named as the tiling tables of nx_bwd_<isa>.c name it. */
#if NXV_W == 16
#define NXB_SOFTMAX_DS nx_b_softmax_ds
#else
#define NXB_SOFTMAX_DS nx_b2_softmax_ds
#endif
static inline void NXB_SOFTMAX_DS(float *S, float *dP, const float *madd, int64_t Tp, float scale) {
    const nxv sc = NXV_PS(set1)(scale);
    nxv mx = NXV_PS(set1)(-INFINITY);
    for (int64_t j = 0; j < Tp; j += NXV_W) {
        nxv x = NXV_PS(fmadd)(NXV_PS(load)(S + j), sc, NXV_PS(load)(madd + j));
        NXV_PS(store)(S + j, x);
        mx = NXV_PS(max)(mx, x);
    }
    const float m = NXV_HMAX(mx);
    if (m == -INFINITY) { /* every key masked: the output row is constant, no gradient */
        memset(S, 0, sizeof(float) * (size_t)Tp);
        memset(dP, 0, sizeof(float) * (size_t)Tp);
        return;
    }
    const nxv vm = NXV_PS(set1)(m);
    nxv l = NXV_PS(setzero)();
    for (int64_t j = 0; j < Tp; j += NXV_W) {
        nxv p = NXV_EXP(NXV_PS(sub)(NXV_PS(load)(S + j), vm));
        NXV_PS(store)(S + j, p);
        l = NXV_PS(add)(l, p);
    }
    const nxv inv = NXV_PS(set1)(1.0f / NXV_HSUM(l));
    nxv dl = NXV_PS(setzero)();
    for (int64_t j = 0; j < Tp; j += NXV_W) {
        nxv p = NXV_PS(mul)(NXV_PS(load)(S + j), inv);
        NXV_PS(store)(S + j, p);
        dl = NXV_PS(fmadd)(p, NXV_PS(load)(dP + j), dl);
    }
    const nxv delta = NXV_PS(set1)(NXV_HSUM(dl));
    for (int64_t j = 0; j < Tp; j += NXV_W) {
        nxv p = NXV_PS(mul)(NXV_PS(load)(S + j), sc);
        NXV_PS(store)(dP + j, NXV_PS(mul)(p, NXV_PS(sub)(NXV_PS(load)(dP + j), delta)));
    }
}

#endif
