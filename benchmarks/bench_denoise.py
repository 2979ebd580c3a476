"""One whole transformer call at real Z-Image dimensions: nxhpc vs diffusers eager (float32, bf16).

Model: built-in ``zimage-dit-2l`` (D=3840, 30x128 heads, FFN 10240, cap_dim 2560, 2 main layers
+ 2+2 refiners; ComfyUI-GGUF types: layers Q8_0, refiners and embedders BF16, generated on
first use under $NXHPC_MODELS, 1.8 GB). Inputs: 512x512 (64x64 latents = 1024 image tokens) and
1024x1024 (128x128 latents = 4096 image tokens), a 100-token caption, t = 0.5. nxhpc runs with
2 workers, per precision (``f32``, ``bf16``, ``q8``; ``NXHPC_BENCH_PRECISIONS`` picks, and
``q8:bf16`` is q8 with ``q8_float_weights="bf16"``: the BF16 refiners as stored rather than on
their Q8_0 copies); diffusers'
``ZImageTransformer2DModel`` (same config, the same weights as decoded by
the ``gguf`` package) runs in torch eager float32 and bfloat16 at 2 threads, in the same run,
same group per token count.

Reported per benchmark (``extra_info``): seconds per main layer, the extrapolated seconds of a
30-layer step (everything but the main layers + 30 x one layer; the table also shows 8 of them,
an image's steps without its text encoding and decoding: bench_generate has those; the timed
nxhpc calls follow an untimed one with the same caption, so they reuse its refined caption
rows as a sampler's steps after the first do -- ``Denoiser.reuse_caption``, docs/denoiser.md --
while diffusers runs its caption path every call), the
segments, nxhpc's main
layers stage by stage (``layer_s_<stage>``: seconds per layer) and against their limit on this
machine (``nxhpc.dit.roofline``, peaks measured in the same session: ``frac_<stage>`` = the
stage's projection / attention work at the peak of the unit it runs on over its time,
``x_limit`` = a layer's time over its limit on this run's units, ``x_machine_limit`` over its
limit on the machine's fastest units -- also for diffusers; the limits count the useful rows,
image + caption tokens, not the padding of each to a multiple of 32 that both run), peak RSS
(Linux VmHWM, reset before each backend; nxhpc: parent and largest worker -- mapped weight
pages are shared and counted in each; the denoiser is closed before diffusers runs, so none
of its pages count in diffusers'), and the output's distance to diffusers float32. Both sides'
figures are those of the faster of two timed calls (by the whole call's time; ``s_call`` is the
median); nxhpc's runs come first: run after diffusers', they find the denoiser closed.
A table of all of it is printed at the end of the module (and written to
``.benchmarks/bench_denoise.md``).

Run: ``python -m pytest benchmarks/bench_denoise.py --benchmark-only`` (about 2 GB of weights,
~10 GB RAM peak for diffusers float32). Quick: ``NXHPC_BENCH_DENOISER=tiny-dit`` and/or
``NXHPC_BENCH_TOKENS=1024``. The Q4_K_M file: ``NXHPC_BENCH_DENOISER=zimage-dit-2l-q4km`` (the
same weights in the ComfyUI Q4_K_M layout: main layers Q4_K / Q5_K qkv / Q6_K w2, the rest as
above; 1.7 GB, ~2.5 min to generate).
"""
import math
import os

import numpy as np
import pytest

from _bench_util import (bench_stats, children, err_cell, model_as, peak_of, peak_rss_mb,
                         record, reset_peak_rss, rss_cell, run_timed_layers, summary_fixture)
from nxhpc.models.registry import open_denoiser

MODEL = os.environ.get("NXHPC_BENCH_DENOISER", "zimage-dit-2l")
TOKENS = [int(t) for t in os.environ.get("NXHPC_BENCH_TOKENS", "1024,4096").split(",")]
PRECISIONS = os.environ.get("NXHPC_BENCH_PRECISIONS", "f32,bf16,q8").split(",")
CAPTION = 100
WORKERS = 2
STEP_LAYERS = 30
IMAGE_STEPS = 8          # the Turbo sampler's steps: an image's denoiser calls
RESULTS: dict = {}
_TITLE = f"bench_denoise: {MODEL}, {WORKERS} workers / threads, caption {CAPTION}"
_HEAD = ("| backend | image tokens | rows | s / layer | s / 30-layer step (extrap.) | "
         "8-step image, steps only (extrap.) | x limit / x machine limit (layer) | peak RSS MB | "
         "rel. err vs diffusers f32 |")


def _side(tokens: int) -> int:
    s = int(round(math.sqrt(tokens)))
    assert s * s == tokens, f"image tokens {tokens} must be a square"
    return 2 * s                              # latents side: 2x2 patches


@pytest.fixture(scope="module")
def den():
    d = open_denoiser(MODEL, workers=WORKERS)
    yield d
    d.close()


@pytest.fixture(scope="module")
def inputs(den):
    cfg = den.config
    rng = np.random.default_rng(0)
    cap = rng.standard_normal((CAPTION, cfg.cap_dim)).astype(np.float32)
    return {T: (rng.standard_normal((cfg.in_channels, _side(T), _side(T))).astype(np.float32),
                0.5, cap) for T in TOKENS}


def _row(key, r) -> list:
    x = "/".join("" if r.get(k) is None else f"{r[k]:.2f}" for k in ("x_limit", "x_machine_limit"))
    return [*key, r.get("rows", ""), f"{r['s_per_layer']:.3f}", f"{r['s_per_30_layer_step']:.1f}",
            f"{IMAGE_STEPS * r['s_per_30_layer_step']:.0f}", x, rss_cell(r),
            err_cell(r.get("rel_err_vs_diffusers_f32"), ".2e")]


def _useful_rows(den, lat, cap) -> int:
    """The rows a call's main layers must compute: image tokens + caption tokens (the
    padding of each to a multiple of 32 is not counted as work in the limits)."""
    p = den.config.patch
    return (lat.shape[1] // p) * (lat.shape[2] // p) + cap.shape[0]


def _machine_limit(cfg, rows: int) -> float | None:
    """One main layer at ``rows`` tokens at the machine's fastest units (nxhpc.dit.roofline)."""
    from nxhpc.dit.config import block_view
    from nxhpc.dit.roofline import block_limit_s, machine_kinds
    return block_limit_s(block_view(cfg), rows, machine_kinds(peak_of), peak_of, WORKERS)


_summary = summary_fixture(RESULTS, "bench_denoise", _TITLE, _HEAD, _row)


# ----------------------------------------------------------------------------- nxhpc

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_denoise_nxhpc(benchmark, den, inputs, tokens, precision):
    cfg = den.config
    lat, t, cap = inputs[tokens]
    benchmark.group = f"denoise {MODEL} image tokens={tokens} caption={CAPTION}"
    prec, _, floats = precision.partition(":")  # "q8:bf16": q8 with q8_float_weights="bf16"
    den.precision = prec                      # read by every call (Denoiser.precision)
    den.q8_float_weights = floats or "int8"
    reset_peak_rss(["self", *children()])     # the workers too: one pool serves every precision
    den.forward(lat, t, cap)                  # the layout's engine: fork + arena (not timed)
    rounds: list[tuple[dict, dict]] = []      # each timed call's timings: the fastest is used

    def call():
        o = den.forward(lat, t, cap)
        rounds.append((dict(den.last_timings), dict(den.last_stage_timings["layers"])))
        return o
    out = benchmark.pedantic(call, rounds=2, warmup_rounds=0)
    tm, st = min(rounds, key=lambda r: r[0]["us_total"])
    mem = den.memory()
    s = den.session(lat.shape[1], lat.shape[2], cap.shape[0])
    per_layer = tm["us_layers"] / cfg.n_layers / 1e6
    r = {"rows": s.Np + s.Lp, "useful_rows": _useful_rows(den, lat, cap), "s_per_layer": per_layer,
         "s_per_30_layer_step": (tm["us_total"] - tm["us_layers"]) / 1e6 + STEP_LAYERS * per_layer,
         "s_call": bench_stats(benchmark).median, **tm, **mem, "output": out}
    # the main layers' stages (seconds per layer) and each against its limit on this machine
    from nxhpc.dit.config import block_view
    from nxhpc.dit.roofline import report_fields
    r.update({f"layer_s_{k[3:]}": v / cfg.n_layers / 1e6 for k, v in st.items()
              if k.startswith("us_")})
    # the limit counts the useful rows (image + caption tokens), not the padding to 32 the
    # kernels also run (as diffusers does: its padded rows are its own cost too)
    r.update(report_fields(st, block_view(cfg), r["useful_rows"], prec, WORKERS,
                           layers=cfg.n_layers, rate=peak_of))
    for k in ("limit_us", "machine_limit_us"):      # the main layers' -> one layer's, in s
        if r[k] is not None:
            r[k.replace("_us", "_s_per_layer")] = r[k] / 1e6 / cfg.n_layers
    benchmark.extra_info["precision"] = precision
    record(benchmark, RESULTS, (f"nxhpc {precision}", tokens), r)
    assert np.isfinite(out).all()


# ----------------------------------------------------------------------------- diffusers

def _diffusers_model(den, torch):
    """diffusers' ZImageTransformer2DModel (float32) holding the GGUF's weights as decoded by
    the ``gguf`` package, filled one tensor at a time (no second copy of the model)."""
    import gguf

    from nxhpc.dit.config import strip_prefix
    from nxhpc.dit.oracle import diffusers_zimage, zimage_from_canonical
    cfg = den.config
    model = diffusers_zimage(cfg, None, torch.float32)
    params = dict(model.named_parameters())
    filled = set()
    r = gguf.GGUFReader(str(den.gguf.path), "r")
    for tinfo in r.tensors:
        name = strip_prefix(tinfo.name)
        if name == "norm_final.weight":
            continue
        shape = tuple(int(d) for d in reversed([int(x) for x in tinfo.shape]))
        a = np.asarray(gguf.quants.dequantize(np.asarray(tinfo.data), tinfo.tensor_type),
                       dtype=np.float32).reshape(shape)
        for k, v in zimage_from_canonical({name: a}, cfg, torch.float32).items():
            with torch.no_grad():
                params[k].copy_(v.reshape(params[k].shape))
            filled.add(k)
    missing = set(params) - filled
    assert not missing, f"diffusers parameters not filled from the GGUF: {sorted(missing)[:5]}"
    return model.eval()


@pytest.fixture(scope="module")
def torch_model(den, inputs):
    """diffusers' model, and what its runs need of nxhpc's denoiser (config, rows); the
    denoiser is closed here (the nxhpc runs come first), so its mapped weights, arena and
    workers are not in diffusers' peak RSS."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    torch.set_num_threads(WORKERS)
    rows = {T: _useful_rows(den, lat, cap) for T, (lat, _, cap) in inputs.items()}
    cfg = den.config
    model = _diffusers_model(den, torch)
    den.close()
    return {"model": model, "dtype": torch.float32, "config": cfg, "useful_rows": rows}


def _run_diffusers(benchmark, torch_model, inputs, tokens, dtype_name):
    import torch

    from nxhpc.dit.oracle import run_diffusers_zimage
    model = model_as(torch_model, getattr(torch, dtype_name))
    lat, t, cap = inputs[tokens]
    benchmark.group = f"denoise {MODEL} image tokens={tokens} caption={CAPTION}"
    n = torch_model["config"].n_layers
    out, total, layer_s = run_timed_layers(
        benchmark, model.layers, lambda: run_diffusers_zimage(model, lat, t, cap), n, rounds=2)
    per_layer = layer_s / n
    r = {"s_per_layer": per_layer,
         "s_per_30_layer_step": (total - layer_s) + STEP_LAYERS * per_layer,
         "s_call": total, "peak_rss_mb": peak_rss_mb(), "output": out}
    lim = _machine_limit(torch_model["config"], torch_model["useful_rows"][tokens])
    r["x_machine_limit"] = per_layer / lim if lim else None
    ref = RESULTS.get(("diffusers float32", tokens), {}).get("output")
    if dtype_name == "float32":
        ref = out
        for p in PRECISIONS:
            nx = RESULTS.get((f"nxhpc {p}", tokens))
            if nx is not None:
                nx["rel_err_vs_diffusers_f32"] = float(np.abs(nx["output"] - out).max()
                                                       / np.abs(out).max())
    if ref is not None:
        r["rel_err_vs_diffusers_f32"] = float(np.abs(out - ref).max() / np.abs(ref).max())
    record(benchmark, RESULTS, (f"diffusers {dtype_name}", tokens), r)
    assert np.isfinite(out).all()
    return r


@pytest.mark.parametrize("tokens", TOKENS)
def test_denoise_torch_float32(benchmark, torch_model, inputs, tokens):
    _run_diffusers(benchmark, torch_model, inputs, tokens, "float32")
    nx = RESULTS.get(("nxhpc f32", tokens))
    if nx is not None:
        # float32 both sides, same weights: the rest is diffusers' float32 sinusoid and RoPE
        # table and summation order (~1e-5 of max|out| at these widths)
        assert nx["rel_err_vs_diffusers_f32"] <= 1e-3, nx["rel_err_vs_diffusers_f32"]


@pytest.mark.parametrize("tokens", TOKENS)
def test_denoise_torch_bfloat16(benchmark, torch_model, inputs, tokens):
    _run_diffusers(benchmark, torch_model, inputs, tokens, "bfloat16")
