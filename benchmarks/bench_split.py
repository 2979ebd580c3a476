"""How the DiT's projections split over workers: by token rows (the default from 256 rows a
worker) against by output columns, side by side, in whole denoiser calls.

Model: built-in ``zimage-dit-2l-q4km`` (Z-Image dims, 2 main layers Q4_K / Q5_K / Q6_K, BF16
refiners; ``NXHPC_BENCH_DENOISER`` picks another). Inputs: 512x512 and 1024x1024 latents
(``NXHPC_BENCH_TOKENS``: image tokens, default ``1024,4096``), a 100-token caption, t = 0.5,
2 workers, ``NXHPC_BENCH_PRECISIONS`` (default ``bf16``). One group per token count and
precision; the two ways differ only in :data:`nxhpc.nn.stages.PROJ_ROWS_PER_WORKER` (read by
the parent at every call, so one open denoiser serves both, its workers forked once), and the
benchmark checks after timing that both give the same output bits.

``extra_info`` (medians over the ``NXHPC_BENCH_ROUNDS`` rounds, default 5): seconds per main
layer, the noise refiner's seconds, the four projections' wall seconds in a call's last main
layer (``Engine.last_split``), and each projection's extent (``T`` by rows).

Run: ``OPENBLAS_NUM_THREADS=1 python -m pytest benchmarks/bench_split.py --benchmark-only``
(about 2 minutes at the defaults on the 2-core AMX Xeon; a quick look: ``NXHPC_BENCH_DENOISER=
tiny-dit NXHPC_BENCH_TOKENS=1024``).
"""
import os

import numpy as np
import pytest

from _bench_util import bench_stats
from nxhpc.models.registry import open_denoiser
from nxhpc.nn import stages

MODEL = os.environ.get("NXHPC_BENCH_DENOISER", "zimage-dit-2l-q4km")
TOKENS = [int(t) for t in os.environ.get("NXHPC_BENCH_TOKENS", "1024,4096").split(",")]
PRECISIONS = os.environ.get("NXHPC_BENCH_PRECISIONS", "bf16").split(",")
WORKERS = 2
PROJECTIONS = ("qkv", "out_proj", "w13", "w2")
SPLITS = {"rows": stages.PROJ_ROWS_PER_WORKER, "columns": 10 ** 9}
ROUNDS = int(os.environ.get("NXHPC_BENCH_ROUNDS", "5"))
OUTPUTS: dict = {}


@pytest.fixture(scope="module")
def den():
    d = open_denoiser(MODEL, workers=WORKERS)
    yield d
    d.close()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("split", list(SPLITS))
def test_split(benchmark, den, monkeypatch, tokens, precision, split):
    side = 2 * int(round(tokens ** 0.5))
    assert (side // 2) ** 2 == tokens, f"image tokens {tokens} must be a square"
    rng = np.random.default_rng(0)
    cfg = den.config
    lat = rng.standard_normal((cfg.in_channels, side, side)).astype(np.float32)
    cap = rng.standard_normal((100, cfg.cap_dim)).astype(np.float32)
    benchmark.group = f"projection split: {MODEL}, image tokens={tokens}, {precision}"
    monkeypatch.setattr(stages, "PROJ_ROWS_PER_WORKER", SPLITS[split])
    den.precision = precision
    den.forward(lat, 0.5, cap)                   # the layout's engine; the caption rows kept
    layout = den.session(side, side, cap.shape[0])
    rounds: list[tuple[dict, dict]] = []         # per round: segment timings, last layer's split

    def call():
        r = den.forward(lat, 0.5, cap)
        rounds.append((dict(den.last_timings),
                       {s.name: s for s in layout.engine.last_split}))
        return r

    out = benchmark.pedantic(call, rounds=ROUNDS, warmup_rounds=0)
    sp = rounds[-1][1]
    med = lambda f: float(np.median([f(tm, ss) for tm, ss in rounds]))   # noqa: E731
    ei = benchmark.extra_info
    ei.update({"split": split, "precision": precision, "rows": int(sp["norm1"].extent),
               "s_per_layer": med(lambda tm, ss: tm["us_layers"] / cfg.n_layers / 1e6),
               "s_noise_refiner": med(lambda tm, ss: tm["us_noise_refiner"] / 1e6),
               "s_call_median": bench_stats(benchmark).median})
    for name in PROJECTIONS:                     # the last main layer's stage, median of rounds
        ei[f"{name}_s"] = med(lambda tm, ss: ss[name].wall / 1e9)
        ei[f"{name}_extent"] = int(sp[name].extent)
    # the extent each way gives: the token rows, or the qkv projection's output columns (a
    # small model can have as many columns as rows: both ways are then told apart by neither)
    by_rows = split == "rows" and stages.proj_by_rows(ei["rows"], WORKERS)
    assert sp["qkv"].extent == (ei["rows"] if by_rows else cfg.block.qkv_width)
    key = (tokens, precision)
    if key in OUTPUTS:                           # the other split ran first: the same bits
        assert np.array_equal(OUTPUTS.pop(key).view(np.uint32), out.view(np.uint32))
    else:
        OUTPUTS[key] = out
