"""Latents -> pixels with the FLUX autoencoder's decoder at its real widths: nxhpc vs diffusers.

Model: FLUX / Z-Image's decoder shape (16 latent channels, blocks 128/256/512/512, 3 ResNets a
level, GroupNorm 32 groups eps 1e-6, one single-head mid attention), random weights
(``nxhpc.models.vae_files.draw_vae_tensor``: conv weights N(0, 1/fan_in), norms 1 + N(0, 0.04))
**rounded to bfloat16**, written once per run to a temporary BFL-layout ``ae.safetensors`` as
F32 and as BF16 (the two files hold the same values: one float32 reference grades both).

Sizes: 512x512 (latents 16x64x64) and a 64x64 probe (latents 16x8x8, where the slow torch
bfloat16 runs by default); 1024x1024 only with ``NXHPC_BENCH_VAE_1024=1`` (nxhpc's arena --
the step program's buffers, :func:`arena_bytes` -- is 2.67 GiB there, 0.67 GiB at 512x512;
plus the 0.2 GB of mapped weights; diffusers float32 needs a few GiB more).
``NXHPC_BENCH_VAE_PX=512`` picks the sizes.
Backends, 2 workers / 2 torch threads, in one run, one group per size:
- nxhpc ``f32`` on the F32 file and on the BF16 file (bf16 weights widened in the matmul);
  ``bf16`` (activations rounded to bfloat16 in every convolution: AVX-512 BF16, or float32
  FMAs on bfloat16 values with AVX2; ~36 GFLOP/s at 64x64 on a loaded Zen 3). On a CPU
  without AVX2 it runs the scalar spec (~0.3 GFLOP/s: about 2 h at 512x512) and is left out
  unless ``NXHPC_BENCH_VAE_BF16=1`` (then timed one round; try ``NXHPC_BENCH_VAE_PX=64``);
- diffusers' ``AutoencoderKL`` (weights read from the F32 file through diffusers' own
  ``convert_ldm_vae_checkpoint``) in torch float32, and in bfloat16 at sizes above 64x64 only
  with ``NXHPC_BENCH_VAE_TORCH_BF16=1`` (on a CPU without AVX-512 BF16 torch's bfloat16
  convolutions run at 0.2-4 GFLOP/s here: hours at 512x512).

``extra_info``: seconds per decode, the first call (untimed, every backend has one: nxhpc's
includes the pool's fork and the arena's first touch), GFLOP/s (:func:`decoder_gflop`), peak RSS
(Linux VmHWM, reset before each backend's first call, with VmRSS at the reset beside it: the
imported libraries, torch's model; nxhpc: the parent and its largest worker -- the arena is
shared memory counted in each process that touched it, the mapped weights too), the arena's
size, the 1-min load average, and the distance of the pixels to torch float32 (max abs, and
relative to max|torch f32|; checked after timing: nxhpc f32 within 1e-4). A table is printed at
the end and written to ``.benchmarks/bench_vae.md``.

Run: ``python -m pytest benchmarks/bench_vae.py --benchmark-only -s`` (~13 min on 2 shared cores
before torch's warm-up call, a little more since; ~1.5 GB RAM peak at 512x512).
"""
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from _bench_util import bench_stats, children, lowp_is_scalar, peak_fields, reset_peak_rss
from nxhpc.runtime.memory import peak_rss_mb
from nxhpc.models.vae_files import VaeSpec, draw_vae_tensor
from nxhpc.vae.config import VaeConfig
from nxhpc.vae.model import GN_CHUNK, Program, VaeDecoder, forward

SPEC = VaeSpec(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
               seed=17)
CFG = SPEC.config()
PROBE_PX = 64                         # the small size every backend runs at (torch bf16 too)
PX = [int(p) for p in os.environ.get("NXHPC_BENCH_VAE_PX", f"{PROBE_PX},512").split(",")]
if os.environ.get("NXHPC_BENCH_VAE_1024") and 1024 not in PX:
    PX.append(1024)
WORKERS = 2
NX_BF16 = bool(os.environ.get("NXHPC_BENCH_VAE_BF16")) or not lowp_is_scalar()
TORCH_BF16_ALL = bool(os.environ.get("NXHPC_BENCH_VAE_TORCH_BF16"))
LOAD_START = os.getloadavg()[0]        # the cores are shared: every figure notes the load
F32_BOUND = 1e-4                      # nxhpc f32 vs torch f32, same weights (tests/test_vae.py)
RESULTS: dict = {}


def decoder_gflop(cfg: VaeConfig, h: int, w: int) -> float:
    """Multiply-adds x 2 of the decoder on latents h x w, counted from the config: every
    convolution k x k from c_in to c_out on an H x W output is 2 k^2 c_in c_out H W (conv_in,
    each ResNet's two 3x3 and its 1x1 shortcut where the width changes, each upsampler's 3x3 on
    the doubled grid, conv_out); the mid attention over P = h w positions of width C is four
    linears (q, k, v, out: 4 x 2 P C^2) and q k^T plus p v (2 x 2 P^2 C). GroupNorm, SiLU,
    softmax, biases and the residual adds (O(P C) each, < 0.1 %) are not counted."""
    def conv(k: int, cin: int, cout: int, H: int, W: int) -> int:
        return 2 * k * k * cin * cout * H * W

    top = cfg.up_channels[0]
    H, W = h, w
    f = conv(3, cfg.latent_channels, top, H, W)
    f += 2 * 2 * conv(3, top, top, H, W)                 # mid: two ResNets of equal width
    if cfg.mid_attention:
        P = H * W
        f += 4 * 2 * P * top * top + 2 * 2 * P * P * top
    for i, cout in enumerate(cfg.up_channels):
        cin = cfg.level_in_channels(i)
        for j in range(cfg.layers_per_block + 1):
            c0 = cin if j == 0 else cout
            f += conv(3, c0, cout, H, W) + conv(3, cout, cout, H, W)
            if c0 != cout:
                f += conv(1, c0, cout, H, W)
        if i < cfg.levels - 1:
            H, W = 2 * H, 2 * W
            f += conv(3, cout, cout, H, W)
    f += conv(3, cfg.up_channels[-1], cfg.out_channels, H, W)
    return f / 1e9


def _program_gflop(h: int, w: int) -> float:
    """The same count read off the step program nxhpc runs (a check that the two walk the
    same network)."""
    prog = Program(CFG, GN_CHUNK)
    forward(prog, h, w)
    f = 0
    for kind, m, p in prog.steps:
        if kind == "conv3x3":
            f += 2 * 9 * m * p[5] * p[6]                 # m output pixels, c_in, c_out
        elif kind == "conv1x1":
            f += 2 * m * p[4] * p[5]
        elif kind == "attention":
            f += 2 * 2 * p[1] * p[1] * p[2]
    return f / 1e9


def arena_bytes(h: int, w: int) -> int:
    """Bytes of the buffers nxhpc's decoder holds for latents h x w (its arena with workers):
    the sizes its step program records (float32; the GroupNorm partials float64)."""
    prog = Program(CFG, GN_CHUNK)
    forward(prog, h, w)
    return sum(n * (8 if b == "part" else 4) for b, n in prog.sizes.items())


def _group(px: int) -> str:
    return f"vae decode {px}x{px} (latents {CFG.latent_channels}x{px // 8}x{px // 8})"


def _rounds(px: int) -> int:
    return 3 if px <= 128 else 1


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The F32 and BF16 ``ae.safetensors`` (BFL layout, decoder tensors only, 198 / 99 MB), the
    same bfloat16-representable values in both; removed at the end of the module."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("bench-vae")
    tensors = {}
    for i, (name, shape) in enumerate(SPEC.shapes().items()):
        t = torch.from_numpy(draw_vae_tensor(SPEC, i, name, shape)).to(torch.bfloat16)
        tensors[name] = t
    out = {}
    for dtype, tdt in (("BF16", torch.bfloat16), ("F32", torch.float32)):
        out[dtype] = d / dtype / "ae.safetensors"
        out[dtype].parent.mkdir()
        save_file({k: v.to(tdt).contiguous() for k, v in tensors.items()}, str(out[dtype]))
    del tensors
    yield out
    for f in out.values():                        # 300 MB: not left behind in the temp dir
        f.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def latents():
    for px in PX + [1024]:          # the config's count and nxhpc's program: the same network
        h = px // 8
        assert math.isclose(decoder_gflop(CFG, h, h), _program_gflop(h, h), rel_tol=1e-12)
    return {px: np.random.default_rng([17, px]).standard_normal(
        (CFG.latent_channels, px // 8, px // 8)).astype(np.float32) for px in PX}


@pytest.fixture(scope="module", autouse=True)
def _summary(request):
    yield
    if not RESULTS:
        return
    head = ("| backend | weights | px | s / decode | first call s | GFLOP/s | of peak | "
            "peak RSS MB (at start) | max abs err vs torch f32 | rel. err | load |")
    lines = [f"bench_vae: FLUX VAE decoder {list(CFG.block_out_channels)}, random weights, "
             f"{WORKERS} workers / threads; 1-min load average {LOAD_START:.1f} at the start, "
             f"{os.getloadavg()[0]:.1f} at the end",
             "", head, "|" + "---|" * 11]
    for (name, wt, px), r in sorted(RESULTS.items(), key=lambda kv: (kv[0][2], kv[0][:2])):
        rss = f"{r.get('peak_rss_mb') or 0:.0f} ({r.get('rss_at_start_mb') or 0:.0f})"
        if r.get("worker_peak_rss_mb"):
            rss += f" (workers {r['worker_peak_rss_mb']:.0f})"
        first = r.get("s_first_call")
        err, rel = r.get("max_abs_err_vs_torch_f32"), r.get("rel_err_vs_torch_f32")
        lines.append(f"| {name} | {wt} | {px} | {r['s_decode']:.2f} | "
                     f"{'' if first is None else format(first, '.2f')} | {r['gflops']:.1f} | "
                     f"{_of_peak(r)} | {rss} | {'' if err is None else format(err, '.1e')} | "
                     f"{'' if rel is None else format(rel, '.1e')} | {r['load_avg']:.1f} |")
    lines.append("")
    lines += [f"decoder GFLOP at {p}x{p}: {decoder_gflop(CFG, p // 8, p // 8):.0f}; nxhpc arena "
              f"{arena_bytes(p // 8, p // 8) / 2**30:.2f} GiB" for p in (512, 1024)]
    text = "\n".join(lines)
    out = Path(".benchmarks")
    out.mkdir(exist_ok=True)
    (out / "bench_vae.md").write_text(text + "\n")
    (out / "bench_vae.json").write_text(json.dumps(
        {f"{k[0]} {k[1]}@{k[2]}": {a: b for a, b in v.items() if a != "output"}
         for k, v in RESULTS.items()}, indent=1, default=float))
    cap = request.config.pluginmanager.get_plugin("capturemanager")
    with cap.global_and_fixture_disabled() if cap is not None else open(os.devnull):
        print("\n" + text, flush=True)


def _of_peak(r: dict) -> str:
    """``0.41 fma_ymm``: GFLOP/s over the workers' peak of the unit it runs on (blank where
    no unit of its precision runs here: torch bfloat16 without one)."""
    return f"{r['frac_of_peak']:.2f} {r['peak_kind']}" if "frac_of_peak" in r else ""


def _grade(px: int) -> None:
    """Fill the distance to torch float32 of every result at ``px`` (whichever ran first)."""
    ref = RESULTS.get(("torch float32", "F32", px), {}).get("output")
    if ref is None:
        return
    scale = float(np.abs(ref).max())
    for (n, w, p), r in RESULTS.items():
        if p == px and "output" in r:
            e = float(np.abs(r["output"] - ref).max())
            r["max_abs_err_vs_torch_f32"], r["rel_err_vs_torch_f32"] = e, e / scale


# ----------------------------------------------------------------------------- nxhpc

NX_CASES = [("f32", "F32"), ("f32", "BF16")] + ([("bf16", "BF16")] if NX_BF16 else [])


@pytest.mark.parametrize("precision,weights", NX_CASES, ids=[f"{p}-{w}" for p, w in NX_CASES])
@pytest.mark.parametrize("px", PX)
def test_vae_nxhpc(benchmark, files, latents, px, precision, weights):
    benchmark.group = _group(px)
    z = latents[px]
    with VaeDecoder(files[weights], workers=WORKERS, precision=precision) as vae:
        reset_peak_rss()
        start = peak_rss_mb(field="VmRSS")
        t0 = time.perf_counter()
        vae.decode(z)                             # fork + arena + first touch (not in stats)
        first = time.perf_counter() - t0
        slow = precision != "f32" and lowp_is_scalar()
        out = benchmark.pedantic(lambda: vae.decode(z), rounds=1 if slow else _rounds(px),
                                 warmup_rounds=0)
        kids = [peak_rss_mb(p) or 0 for p in children()]
        parent = peak_rss_mb()
    s = bench_stats(benchmark).median
    if math.isnan(s):                             # --benchmark-disable: the one call counts
        s = first
    g = decoder_gflop(CFG, px // 8, px // 8) / s
    import nxhpc                                  # the unit its convolutions' matmul runs on
    variant = nxhpc.kernel_variants()["matmul" if precision == "f32" else "matmul_bf16"]
    r = {"px": px, "s_decode": s, "s_first_call": first,
         "gflops": g, **peak_fields(g, precision, variant, workers=WORKERS),
         "peak_rss_mb": parent, "rss_at_start_mb": start,
         "worker_peak_rss_mb": max(kids, default=None),
         "arena_mb": arena_bytes(px // 8, px // 8) / 1e6, "load_avg": os.getloadavg()[0],
         "output": out}
    RESULTS[(f"nxhpc {precision}", weights, px)] = r
    _grade(px)
    benchmark.extra_info.update({k: v for k, v in r.items() if k != "output"})
    assert out.shape == (3, px, px) and np.isfinite(out).all()


# ----------------------------------------------------------------------------- diffusers

@pytest.fixture(scope="module")
def torch_model(files):
    """diffusers' ``AutoencoderKL`` (FLUX config) in float32 holding the F32 file's decoder
    as diffusers' own LDM converter reads it (the encoder dropped: decode never uses it)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file
    torch.set_num_threads(WORKERS)
    n = CFG.levels
    model = AutoencoderKL(in_channels=3, out_channels=3,
                          down_block_types=("DownEncoderBlock2D",) * n,
                          up_block_types=("UpDecoderBlock2D",) * n,
                          block_out_channels=CFG.block_out_channels,
                          layers_per_block=CFG.layers_per_block,
                          latent_channels=CFG.latent_channels,
                          norm_num_groups=CFG.norm_num_groups, use_quant_conv=False,
                          use_post_quant_conv=False, mid_block_add_attention=True,
                          scaling_factor=CFG.scaling_factor, shift_factor=CFG.shift_factor)
    model.encoder = None
    conv = convert_ldm_vae_checkpoint(load_file(str(files["F32"])), dict(model.config))
    params = dict(model.named_parameters())
    assert set(conv) == set(params), sorted(set(conv) ^ set(params))[:5]
    with torch.no_grad():
        for k, v in conv.items():
            params[k].copy_(v.reshape(params[k].shape))
    return {"model": model.eval(), "dtype": torch.float32}


def _run_torch(benchmark, torch_model, latents, px, dtype_name):
    import torch
    tm = torch_model
    dtype = getattr(torch, dtype_name)
    if tm["dtype"] != dtype:                      # in place: the float32 copy is not kept
        tm["model"].to(dtype)
        tm["dtype"] = dtype
    model = tm["model"]
    benchmark.group = _group(px)
    z = torch.from_numpy(latents[px])[None]

    def call():
        with torch.no_grad():
            x = (z / CFG.scaling_factor + CFG.shift_factor).to(dtype)
            return model.decode(x).sample[0].float().numpy()
    reset_peak_rss()
    start = peak_rss_mb(field="VmRSS")
    t0 = time.perf_counter()
    call()                                        # untimed, as nxhpc's first call; output dropped
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = benchmark.pedantic(call, rounds=_rounds(px) if dtype_name == "float32" else 1,
                             warmup_rounds=0)
    wall = time.perf_counter() - t0
    s = bench_stats(benchmark).median
    if math.isnan(s):
        s = wall
    g = decoder_gflop(CFG, px // 8, px // 8) / s
    r = {"px": px, "s_decode": s, "s_first_call": first, "gflops": g,
         **peak_fields(g, "f32" if dtype_name == "float32" else "bf16", workers=WORKERS),
         "peak_rss_mb": peak_rss_mb(), "rss_at_start_mb": start,
         "load_avg": os.getloadavg()[0],
         "output": out}
    RESULTS[(f"torch {dtype_name}", "F32" if dtype_name == "float32" else "F32, cast", px)] = r
    benchmark.extra_info.update({k: v for k, v in r.items() if k != "output"})
    assert out.shape == (3, px, px) and np.isfinite(out).all()
    return r


@pytest.mark.parametrize("px", PX)
def test_vae_torch_float32(benchmark, torch_model, latents, px):
    r = _run_torch(benchmark, torch_model, latents, px, "float32")
    ref = r["output"]
    # not vacuous: the picture varies (a mirrored copy is far outside the bound)
    assert np.abs(ref[:, ::-1] - ref).max() > 100 * F32_BOUND * np.abs(ref).max()
    _grade(px)
    benchmark.extra_info.update(max_abs_err_vs_torch_f32=0.0, rel_err_vs_torch_f32=0.0)
    for (name, wt, p), other in RESULTS.items():
        if p == px and name == "nxhpc f32":    # float32 on both sides, the same weights
            assert other["rel_err_vs_torch_f32"] <= F32_BOUND, (wt, other["rel_err_vs_torch_f32"])


@pytest.mark.parametrize("px", PX)
def test_vae_torch_bfloat16(benchmark, torch_model, latents, px):
    if px > PROBE_PX and not TORCH_BF16_ALL:
        pytest.skip(f"torch bfloat16 above {PROBE_PX}x{PROBE_PX} takes hours without AVX-512 "
                    f"BF16: NXHPC_BENCH_VAE_TORCH_BF16=1 runs it")
    _run_torch(benchmark, torch_model, latents, px, "bfloat16")
    _grade(px)
