/* nx_dispatch.c -- the registry of kernel families (what kernel_variants() walks), the one ISA
 * resolver every family's tables go through, and their one-time resolution at import.
 * Owns: the list below; a new family is one line. Must not: dispatch anything itself.
 */
#include "nx_dispatch.h"

#include "nx_attn_bf16.h"
#include "nx_bwd.h"
#include "nx_conv.h"
#include "nx_lowp.h"
#include "nx_matmul.h"
#include "nx_ops.h"
#include "nx_q8_0.h"
#include "nx_wtype.h"

const nx_family_info *const nx_families[] = {
    &nx_ops_family,   &nx_bwd_family,  &nx_mm_family,
    &nx_wtype_family, &nx_q8_0_family, &nx_lowp_family, &nx_conv_family, &nx_attn_bf16_family,
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

void nx_dispatch_resolve(int nslots, const nx_slot_fn *const tables[NX_ISA_COUNT],
                         nx_slot_fn *resolved /* OUT */, unsigned char *from /* OUT */) {
    for (int i = 0; i < NX_ISA_COUNT; i++) {
        nx_isa chain[NX_ISA_COUNT + 1]; /* i -> parent -> ... -> GENERIC */
        chain[0] = (nx_isa)i;
        for (int d = 1; d <= NX_ISA_COUNT; d++) chain[d] = nx_isa_parent(chain[d - 1]);
        chain[NX_ISA_COUNT] = NX_ISA_GENERIC;
        for (int s = 0; s < nslots; s++) {
            resolved[i * nslots + s] = 0;
            from[i * nslots + s] = (unsigned char)NX_ISA_COUNT;
            for (int d = 0; d <= NX_ISA_COUNT; d++) {
                const nx_slot_fn *t = tables[chain[d]];
                if (t && t[s]) {
                    resolved[i * nslots + s] = t[s];
                    from[i * nslots + s] = (unsigned char)chain[d];
                    break;
                }
                if (chain[d] == NX_ISA_GENERIC) break;
            }
        }
    }
}
