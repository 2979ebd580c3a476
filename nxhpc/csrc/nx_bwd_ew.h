/* nx_bwd_ew.h -- the element-wise SIMD backward kernels written once for both vector widths
 * (nx_simd.h): swiglu_backward. Included exactly once by nx_bwd_avx2.c and by nx_bwd_avx512.c;
 * NXV_FN(nx_swiglu_bwd_f32) is nx_swiglu_bwd_f32_avx2 / _avx512 (declared in nx_bwd.h). The
 * loops are spelled with the intrinsics' own names (NXV_PS, NXV_LOADN, ...), so the 16-lane code
 * is exactly the hand-written AVX-512 code it replaced.
 * Must not: be included from generic files.
 */
#ifndef NX_BWD_EW_H
#define NX_BWD_EW_H

#include <stdint.h>

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

#endif
