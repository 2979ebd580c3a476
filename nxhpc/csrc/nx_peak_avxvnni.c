/* nx_peak_avxvnni.c -- the vnni_ymm peak loop (nx_peak.h): 12 independent ymm chains of VEX
 * vpdpbusd (AVX-VNNI: the int8 dot of the avxvnni q8 kernel).
 *
 * Owns: that loop. Entered only after the probe reports the avxvnni level
 * (nx_peak_supported). Must not: touch memory inside the loop, or use AVX-512 instructions.
 */
#include "nx_peak.h"

#include <immintrin.h>

#define NX_R12(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)

void nx_peak_vnni_ymm_avxvnni(size_t iters, const void *a /* IN [32] u8 */,
                              const void *b /* IN [32] s8 */, void *acc /* INOUT [12][8] i32 */) {
    const __m256i va = _mm256_loadu_si256((const __m256i *)a);
    const __m256i vb = _mm256_loadu_si256((const __m256i *)b);
    int32_t *c = (int32_t *)acc;
#define NX_LD_(i) __m256i c##i = _mm256_loadu_si256((const __m256i *)(c + 8 * (i)));
#define NX_STEP_(i) c##i = _mm256_dpbusd_avx_epi32(c##i, va, vb);
#define NX_ST_(i) _mm256_storeu_si256((__m256i *)(c + 8 * (i)), c##i);
    NX_R12(NX_LD_)
    for (size_t it = 0; it < iters; it++) {
        NX_R12(NX_STEP_)
    }
    NX_R12(NX_ST_)
#undef NX_LD_
#undef NX_STEP_
#undef NX_ST_
}
