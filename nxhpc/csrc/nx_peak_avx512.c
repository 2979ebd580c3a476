/* nx_peak_avx512.c -- the fma_zmm and vnni_zmm peak loops (nx_peak.h): 16 independent zmm chains
 * of vfmadd213ps / vpdpbusd.
 *
 * Owns: those loops. Entered only after the probe reports the avx512 level (which includes
 * AVX512_VNNI, nx_cpu.h; nx_peak_supported). Must not: touch memory inside the loops.
 */
#include "nx_peak.h"

#include <immintrin.h>

#define NX_R16(M)                                                                                  \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)

void nx_peak_fma_zmm_avx512(size_t iters, const void *a /* IN [16] f32 */,
                            const void *b /* IN [16] f32 */, void *acc /* INOUT [16][16] f32 */) {
    const __m512 va = _mm512_loadu_ps(a), vb = _mm512_loadu_ps(b);
    float *c = (float *)acc;
#define NX_LD_(i) __m512 c##i = _mm512_loadu_ps(c + 16 * (i));
#define NX_STEP_(i) c##i = _mm512_fmadd_ps(c##i, va, vb);
#define NX_ST_(i) _mm512_storeu_ps(c + 16 * (i), c##i);
    NX_R16(NX_LD_)
    for (size_t it = 0; it < iters; it++) {
        NX_R16(NX_STEP_)
    }
    NX_R16(NX_ST_)
#undef NX_LD_
#undef NX_STEP_
#undef NX_ST_
}

void nx_peak_vnni_zmm_avx512(size_t iters, const void *a /* IN [64] u8 */,
                             const void *b /* IN [64] s8 */, void *acc /* INOUT [16][16] i32 */) {
    const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
    int32_t *c = (int32_t *)acc;
#define NX_LD_(i) __m512i c##i = _mm512_loadu_si512(c + 16 * (i));
#define NX_STEP_(i) c##i = _mm512_dpbusd_epi32(c##i, va, vb);
#define NX_ST_(i) _mm512_storeu_si512(c + 16 * (i), c##i);
    NX_R16(NX_LD_)
    for (size_t it = 0; it < iters; it++) {
        NX_R16(NX_STEP_)
    }
    NX_R16(NX_ST_)
#undef NX_LD_
#undef NX_STEP_
#undef NX_ST_
}
