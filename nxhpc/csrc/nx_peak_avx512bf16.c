/* nx_peak_avx512bf16.c -- the bf16_zmm peak loop (nx_peak.h): 16 independent vdpbf16ps zmm
 * chains.
 *
 * Owns: that loop. Entered only after the probe reports the avx512bf16 level
 * (nx_peak_supported). Must not: touch memory inside the loop.
 */
#include "nx_peak.h"

#include <immintrin.h>

#define NX_R16(M)                                                                                  \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)

void nx_peak_bf16_zmm_avx512bf16(size_t iters, const void *a /* IN [32] bf16 */,
                                 const void *b /* IN [32] bf16 */,
                                 void *acc /* INOUT [16][16] f32 */) {
    const __m512bh va = (__m512bh)_mm512_loadu_si512(a), vb = (__m512bh)_mm512_loadu_si512(b);
    float *c = (float *)acc;
#define NX_LD_(i) __m512 c##i = _mm512_loadu_ps(c + 16 * (i));
#define NX_STEP_(i) c##i = _mm512_dpbf16_ps(c##i, va, vb);
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
