"""The whole block at Z-Image size (built-in ``zimage-1l``: D=3840, 30x128 heads, FFN 10240,
T=256): nxhpc with 2 workers in both spawn modes, next to a PyTorch eager run of diffusers'
``ZImageTransformerBlock`` on the same input and dequantized weights with 2 threads.

Run: ``python -m pytest benchmarks/bench_block.py --benchmark-only`` (generates the model on
first use under $NXHPC_MODELS, ~1 GB). Set ``NXHPC_BENCH_MODEL=mid`` for a quick run.
Correctness is checked after timing (vs the model's float64 reference output).
"""
import os

import numpy as np
import pytest

from nxhpc.models import open_model
from nxhpc.dit.reference import dequantize_layer
from _bench_util import bench_stats

MODEL = os.environ.get("NXHPC_BENCH_MODEL", "zimage-1l")
WORKERS = 2


@pytest.fixture(scope="module")
def setup():
    model = open_model(MODEL)
    cfg = model.config
    x, pe, t, mask = model.blk_in(0), model.pe(), model.t_emb(), model.mask()
    T = x.shape[0]
    flops = 2 * T * cfg.dim * (cfg.qkv_width + cfg.dim + 3 * cfg.ffn_dim) + 4 * T * T * cfg.dim
    yield model, x, pe, t, mask, flops
    model.close()


def _check(out, model):
    ref = model.ref_out(0)
    err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
    assert err <= 1e-5, err
    return err


@pytest.mark.parametrize("spawn", ["pool", "stage"])
def test_block_nxhpc(benchmark, setup, spawn):
    model, x, pe, t, mask, flops = setup
    benchmark.group = f"block {MODEL} T={x.shape[0]} workers/threads={WORKERS}"
    with model.block(0) as blk:        # pool: workers forked once, reused across rounds
        out, timings = benchmark.pedantic(
            lambda: blk.forward(x, t, pe, mask=mask, workers=WORKERS, spawn=spawn),
            rounds=3, warmup_rounds=1)
    s = bench_stats(benchmark).median
    benchmark.extra_info.update(gflops=flops / s / 1e9, **{k: v for k, v in timings.items()})
    benchmark.extra_info["max_err_rel_to_max_ref"] = _check(out, model)


def test_block_torch_eager(benchmark, setup):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from nxhpc.dit.oracle import diffusers_block
    model, x, pe, t, mask, flops = setup
    cfg = model.config
    torch.set_num_threads(WORKERS)
    blk = diffusers_block(cfg, dequantize_layer(model.layer_weights(0)))
    freqs = torch.complex(torch.from_numpy(pe[..., 0, 0].copy()),
                          torch.from_numpy(pe[..., 1, 0].copy()))
    xm = torch.from_numpy(x)[None]
    mm = torch.from_numpy(mask)[None] if mask is not None else None
    tt = torch.from_numpy(t)[None]

    def run():
        with torch.no_grad():
            return blk(xm, mm, freqs[None], tt)[0].numpy()

    benchmark.group = f"block {MODEL} T={x.shape[0]} workers/threads={WORKERS}"
    out = benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    benchmark.extra_info["gflops"] = flops / bench_stats(benchmark).median / 1e9
    benchmark.extra_info["max_err_rel_to_max_ref"] = _check(out, model)
