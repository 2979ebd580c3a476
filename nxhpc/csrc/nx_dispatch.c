/* nx_dispatch.c -- the registry of kernel families (what kernel_variants() walks) and their
 * one-time table resolution at import.
 * Owns: the list below; a new family is one line. Must not: dispatch anything itself.
 */
#include "nx_dispatch.h"

#include "nx_bwd.h"
#include "nx_lowp.h"
#include "nx_matmul.h"
#include "nx_ops.h"
#include "nx_q8_0.h"
#include "nx_wtype.h"

const nx_family_info *const nx_families[] = {
    &nx_ops_family,   &nx_bwd_family,  &nx_mm_family,
    &nx_wtype_family, &nx_q8_0_family, &nx_lowp_family,
};
const int nx_nfamilies = (int)(sizeof nx_families / sizeof nx_families[0]);

void nx_dispatch_init(void) {
    (void)nx_cpu_features();
    for (int f = 0; f < nx_nfamilies; f++)
        for (int s = 0; s < nx_families[f]->nslots; s++) {
            (void)nx_families[f]->slot_name(s);
            (void)nx_families[f]->variant(s, NX_ISA_GENERIC);
        }
}
