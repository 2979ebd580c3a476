"""Run layer 0 of a model from a downstream script and check it against the stored reference."""
import numpy as np

import nxhpc

with nxhpc.load_model("tiny") as model:          # built-in id, $NXHPC_MODELS/<id>, or a path
    x = model.blk_in(0)                          # block input  [T, D] float32
    t_emb, pe, mask = model.t_emb(), model.pe(), model.mask()
    out, timings = model.block(0).forward(x, t_emb, pe, mask=mask, workers=2)
    ref = model.ref_out(0)                       # float64 reference of the same block
    err = np.abs(out - ref).max() / np.abs(ref).max()
    print(f"layer 0: {out.shape} in {timings['block_us']} us, max error {err:.1e} of max|ref|")
    assert err < 1e-5
