"""One whole ``generate`` at 512x512 on real-dimension slices: prompt -> features -> 8 steps ->
pixels -> PNG, seconds per stage, and the per-stage torch bfloat16 pieces of ZImagePipeline.

Models (random weights, generated once; real widths, fewer layers):
- text encoder: the 2-block Qwen3-4B slice of ``bench_text_encoder`` (D=2560, 32/8 heads of
  128, FFN 9728, every matrix Q8_0, vocab 4096; $NXHPC_MODELS/bench-qwen3-4b-2l). The features
  are ``hidden_states[-2]``: nxhpc runs 1 of the 2 blocks, transformers runs both;
- denoiser: built-in ``zimage-dit-2l`` (Z-Image dims: D=3840, 30 heads of 128, FFN 10240,
  cap_dim 2560; 2 main layers + 2 noise and 2 context refiners; layers Q8_0, the rest BF16);
- autoencoder: the FLUX decoder at its real widths as ``bench_vae`` writes it (128/256/512/512,
  16 latent channels), bfloat16-representable values in a BF16 ``ae.safetensors``.

Run: 512x512 (1024 image tokens) with a 100-token caption (the templated prompt, as
``bench_text_encoder`` builds it), seed 0, 8 steps (every step timed: nothing extrapolated
within the run), 2 workers / 2 torch threads, one round each (a run is minutes):
- nxhpc ``generate`` (``python -m nxhpc.generate`` in a child process: its own peak RSS; the
  child only wraps ``nxhpc.load_text_encoder`` and ``nxhpc.dit.sampler.sample`` to read the
  encoder's and the denoiser's ``last_timings`` and keep the final latents; the command's
  behaviour is unchanged) at each precision of ``NXHPC_BENCH_GEN_PRECISIONS`` (default
  ``f32,q8``; q8 decodes in bf16, as generate does);
- torch bfloat16: the pieces ZImagePipeline calls, in the same order on the same weights (as the
  ``gguf`` package decodes them): transformers' ``Qwen3Model`` (the token ids from nxhpc's
  tokenizer of the file; ``hidden_states[-2]``), diffusers' ``ZImageTransformer2DModel`` for
  each step (the same flow-matching Euler update and sigmas), diffusers' ``AutoencoderKL``
  decode; all three resident at once as in the pipeline (``NXHPC_BENCH_GEN_TORCH=0`` skips it).

Per stage (``extra_info``): seconds of open, encode, each step, decode, total (encode to pixels:
the models' opening or loading is left out on both sides, but for nxhpc's text encoder, which
``generate`` opens, runs and closes inside ``encode_s``); the main-layer
seconds of encode and of each step (nxhpc: ``last_timings``; torch: forward hooks), and from
them the extrapolation to the full models -- stage - layers + N x seconds per layer, N = 35
text-encoder blocks (``hidden_states[-2]`` of Qwen3-4B's 36) and 30 DiT layers (the refiners,
embedders and final layer are the real model's already) -- stated as extrapolated; peak RSS
(nxhpc: the child's VmHWM and its largest worker's ``getrusage`` peak; torch: VmHWM reset
before the run, with the three models resident); load average before / after.

Checked after timing: every PNG written, 512x512, not flat; the final latents of every run
against nxhpc f32 (relative max error; q8 within ``Q8_BOUND``; negative controls: another
seed's noise and the f32 latents mirrored are far outside it), and the PNGs' distance in
levels. A table is printed and written to ``.benchmarks/bench_generate.md``.

Run: ``python -m pytest benchmarks/bench_generate.py --benchmark-only -s`` (generates ~2 GB of
models on first use; a few minutes per case on 2 shared cores).
"""
import io
import json
import math
import os
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from _bench_util import children, err_cell, peak_rss_mb, record, reset_peak_rss, summary_fixture

DIT = "zimage-dit-2l"
PX = int(os.environ.get("NXHPC_BENCH_GEN_PX", "512"))
STEPS = int(os.environ.get("NXHPC_BENCH_GEN_STEPS", "8"))
PRECISIONS = os.environ.get("NXHPC_BENCH_GEN_PRECISIONS", "f32,q8").split(",")
TORCH = os.environ.get("NXHPC_BENCH_GEN_TORCH", "1") != "0"
CAPTION = 100                         # caption tokens after the chat template
SEED = 0
WORKERS = 2
TE_FULL = 35                          # Qwen3-4B: hidden_states[-2] runs 35 of its 36 blocks
DIT_FULL = 30                         # Z-Image: 30 main layers
Q8_BOUND = 0.1                        # q8 latents vs f32 after 8 steps: max |diff| / max |f32|
RESULTS: dict = {}
ARRAYS: dict = {}                     # per result: the final latents and the PNG's pixels
_TITLE = (f"bench_generate: {PX}x{PX} ({(PX // 16) ** 2} image tokens), caption {CAPTION} "
          f"tokens, {STEPS} steps, {WORKERS} workers / threads; slices: Qwen3-4B dims 2 blocks, "
          f"{DIT}, FLUX decoder real widths")
_HEAD = ("| backend | encode s (35 blocks, extrap.) | step s: first, mean of rest (30 layers, "
         "extrap.) | decode s | total s (full models, extrap.) | peak RSS MB | "
         "latents rel. err vs nxhpc f32 | PNG max / mean levels vs nxhpc f32 | load before / after |")


def _row(key, r) -> list:
    steps = r["step_s"]
    full = r["step_full_s"]
    rest = (sum(steps[1:]) / (len(steps) - 1)) if len(steps) > 1 else math.nan
    rest_full = (sum(full[1:]) / (len(full) - 1)) if len(full) > 1 else math.nan
    rss = f"{r['peak_rss_mb']:.0f}"
    if r.get("worker_peak_rss_mb"):
        rss += f" (workers {r['worker_peak_rss_mb']:.0f})"
    return [key[0], f"{r['encode_s']:.2f} ({r['encode_full_s']:.1f})",
            f"{steps[0]:.2f}, {rest:.2f} ({full[0]:.1f}, {rest_full:.1f})",
            f"{r['decode_s']:.2f}", f"{r['total_s']:.1f} ({r['total_full_s']:.0f})", rss,
            err_cell(r.get("latents_rel_err_vs_nxhpc_f32"), ".1e"),
            "" if "png_max_levels_vs_nxhpc_f32" not in r else
            f"{r['png_max_levels_vs_nxhpc_f32']} / {r['png_mean_levels_vs_nxhpc_f32']:.2f}",
            f"{r['load_before']:.1f} / {r['load_after']:.1f}"]


_summary = summary_fixture(RESULTS, "bench_generate", _TITLE, _HEAD, _row)
GROUP = f"generate {PX}x{PX} {STEPS} steps (real-dimension slices)"


def _extrapolate(r: dict) -> dict:
    """Fill the full-model figures from the measured stage and layer seconds: a stage less its
    layers plus N x its seconds per layer (N = 35 encoder blocks, 30 DiT layers)."""
    r["encode_full_s"] = r["encode_s"] - r["te_layers_s"] + TE_FULL * r["te_s_per_layer"]
    r["step_full_s"] = [s - lay + DIT_FULL * lay / r["dit_layers_run"]
                        for s, lay in zip(r["step_s"], r["step_layers_s"])]
    r["total_full_s"] = (r["total_s"] - r["encode_s"] + r["encode_full_s"]
                         - sum(r["step_s"]) + sum(r["step_full_s"]))
    return r


# ----------------------------------------------------------------------------- the models

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(text encoder .gguf, denoiser .gguf, autoencoder ae.safetensors); the autoencoder is
    written to a temporary folder and removed at the end."""
    from bench_text_encoder import _file as te_file
    from nxhpc.models.registry import ensure_builtin, models_dir
    from nxhpc.models.vae_files import draw_vae_tensor
    from bench_vae import SPEC
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    te = te_file()
    dit = ensure_builtin(DIT, models_dir()) / "model.gguf"
    vae = tmp_path_factory.mktemp("bench-gen") / "ae.safetensors"
    save_file({n: torch.from_numpy(draw_vae_tensor(SPEC, i, n, s)).to(torch.bfloat16)
               .contiguous() for i, (n, s) in enumerate(SPEC.shapes().items())}, str(vae))
    yield te, dit, vae
    vae.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def prompt(models):
    from bench_text_encoder import _prompt
    from nxhpc.qwen3.encoder import TextEncoder
    te = TextEncoder(models[0], workers=1)
    try:
        p = _prompt(te, CAPTION)
        ids = te.tokenize(p)
        assert len(ids) == CAPTION, len(ids)
        return p, ids
    finally:
        te.close()


# ----------------------------------------------------------------------------- nxhpc

def _child(argv: list[str], latents_out: str) -> None:
    """In the child process: ``nxhpc.generate.main(argv)`` with the encoder's and denoiser's
    ``last_timings`` read after each call and the final latents saved; prints one JSON line
    (the report, the timings)."""
    import nxhpc
    import nxhpc.dit.sampler as sampler
    from nxhpc import generate
    seen: dict = {"te": [], "steps": []}
    load = nxhpc.load_text_encoder

    def load_text_encoder(*a, **k):
        enc = load(*a, **k)
        seen["te"].append(enc)
        return enc
    sample = sampler.sample

    def timed_sample(den, cap, x0, **kw):
        user = kw.get("on_step")

        def on_step(i, n, s):
            seen["steps"].append(dict(den.last_timings))
            if user is not None:
                user(i, n, s)
        kw["on_step"] = on_step
        x = sample(den, cap, x0, **kw)
        np.save(latents_out, x)
        return x
    nxhpc.load_text_encoder, sampler.sample = load_text_encoder, timed_sample
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = generate.main(argv)
    report = json.loads(buf.getvalue())
    print(json.dumps({"rc": rc, "report": report, "te": dict(seen["te"][0].last_timings),
                      "steps": seen["steps"]}))


def _spawn(argv: list[str], latents_out: Path) -> dict:
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import bench_generate as b; "
            "b._child(sys.argv[1:-1], sys.argv[-1])")
    p = subprocess.run([sys.executable, "-c", code, *map(str, argv), str(latents_out)],
                       capture_output=True, text=True, timeout=3600,
                       cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _png(path: Path) -> np.ndarray:
    from PIL import Image
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_generate_nxhpc(benchmark, models, prompt, tmp_path, precision):
    benchmark.group = GROUP
    te, dit, vae = models
    out, lat = tmp_path / f"{precision}.png", tmp_path / f"{precision}.npy"
    argv = ["--prompt", prompt[0], "--model", dit, "--text-encoder", te, "--vae", vae,
            "--height", PX, "--width", PX, "--steps", STEPS, "--seed", SEED,
            "--precision", precision, "--workers", WORKERS, "--out", out, "--no-progress",
            "--json"]
    load0 = os.getloadavg()[0]
    res = benchmark.pedantic(lambda: _spawn(argv, lat), rounds=1, warmup_rounds=0)
    rep, tm = res["report"], res["te"]
    assert res["rc"] == 0 and len(res["steps"]) == STEPS
    r = {"open_s": rep["open_s"], "encode_s": rep["encode_s"], "step_s": rep["step_s"][0],
         # the models' opening is its own column: torch's total leaves its loading out too
         "decode_s": rep["decode_s"], "total_s": rep["total_s"] - rep["open_s"],
         "te_layers_s": tm["us_layers"] / 1e6, "te_layers_run": 1,
         "te_s_per_layer": tm["us_layers"] / 1e6, "caption_tokens": CAPTION,
         "step_layers_s": [s["us_layers"] / 1e6 for s in res["steps"]], "dit_layers_run": 2,
         "step_segments_us": res["steps"], "te_timings_us": tm,
         "peak_rss_mb": rep["peak_rss_mb"], "worker_peak_rss_mb": rep["worker_peak_rss_mb"],
         "arena_mb": rep.get("arena_mb"), "load_before": load0,
         "load_after": os.getloadavg()[0], "precision": precision}
    key = (f"nxhpc {precision}", PX)
    ARRAYS[key] = {"latents": np.load(lat), "png": _png(out)}
    record(benchmark, RESULTS, key, _extrapolate(r))
    # correctness, after timing
    png = ARRAYS[key]["png"]
    assert png.shape == (PX, PX, 3) and png.std() > 5, png.std()
    assert np.isfinite(ARRAYS[key]["latents"]).all()
    _grade(benchmark, key)


def _grade(benchmark, key) -> None:
    """Latents (and PNG) of every run against nxhpc f32, once it has run; q8 within Q8_BOUND.
    Negative controls, so the bound is not vacuous: another seed's initial noise and the f32
    latents mirrored left-right are both far outside it."""
    ref = ARRAYS.get(("nxhpc f32", PX), {}).get("latents")
    if ref is None:
        return
    scale = float(np.abs(ref).max())

    def rel(x) -> float:
        return float(np.abs(x - ref).max()) / scale
    from nxhpc.dit.sampler import initial_noise
    assert rel(initial_noise(SEED + 1, ref.shape)) > 4 * Q8_BOUND
    assert rel(ref[:, :, ::-1]) > 4 * Q8_BOUND
    for k, r in RESULTS.items():
        r["latents_rel_err_vs_nxhpc_f32"] = rel(ARRAYS[k]["latents"])
        r["png_max_levels_vs_nxhpc_f32"] = int(np.abs(
            ARRAYS[k]["png"].astype(int) - ARRAYS[("nxhpc f32", PX)]["png"]).max())
        r["png_mean_levels_vs_nxhpc_f32"] = float(np.abs(
            ARRAYS[k]["png"].astype(int) - ARRAYS[("nxhpc f32", PX)]["png"]).mean())
    if key in RESULTS:
        benchmark.extra_info.update({k: v for k, v in RESULTS[key].items() if "_vs_" in k})
    q8 = RESULTS.get(("nxhpc q8", PX))
    if q8 is not None:
        assert q8["latents_rel_err_vs_nxhpc_f32"] <= Q8_BOUND, q8["latents_rel_err_vs_nxhpc_f32"]


# ----------------------------------------------------------------------------- torch

@pytest.fixture(scope="module")
def torch_pieces(models):
    """The three ZImagePipeline pieces in torch bfloat16 holding the files' weights (each
    tensor decoded by the ``gguf`` package / read from the safetensors, one at a time)."""
    if not TORCH:
        pytest.skip("NXHPC_BENCH_GEN_TORCH=0")
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import gguf
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
    from safetensors.torch import load_file
    from transformers import Qwen3Model

    from bench_vae import CFG as VCFG
    from nxhpc.dit.config import strip_prefix
    from nxhpc.dit.oracle import zimage_from_canonical
    from nxhpc.models.registry import BUILTINS
    from nxhpc.qwen3.config import layer_names
    from nxhpc.qwen3.encoder import TextEncoder
    from nxhpc.qwen3.oracle import HF_NAMES, transformers_config
    from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel
    torch.set_num_threads(WORKERS)
    bf = torch.bfloat16
    te_path, dit_path, vae_path = models

    def tensors(path):
        for t in gguf.GGUFReader(str(path), "r").tensors:
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            yield t.name, np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                     dtype=np.float32).reshape(shape)

    t0 = time.perf_counter()
    enc = TextEncoder(te_path, workers=1)
    tcfg = enc.config
    enc.close()
    hc = transformers_config(tcfg)
    hc._attn_implementation = "eager"
    te = Qwen3Model(hc).to(bf).eval()
    params = dict(te.named_parameters())
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
    for i in range(tcfg.n_layers):
        names.update({n: f"layers.{i}.{HF_NAMES[k]}.weight" for k, n in layer_names(i).items()})
    filled = set()
    with torch.no_grad():
        for name, a in tensors(te_path):
            params[names[name]].copy_(torch.from_numpy(a.copy()))
            filled.add(names[name])
    assert filled == set(params), sorted(set(params) - filled)[:5]

    dcfg = BUILTINS[DIT].config()
    dit = ZImageTransformer2DModel(**dcfg.diffusers_kwargs()).to(bf)
    for m in dit.modules():                            # one eps everywhere (as the oracle)
        if type(m).__name__ == "RMSNorm" and m.eps != dcfg.norm_eps:
            m.eps = dcfg.norm_eps
    params = dict(dit.named_parameters())
    filled = set()
    with torch.no_grad():
        for name, a in tensors(dit_path):
            name = strip_prefix(name)
            if name == "norm_final.weight":
                continue
            for k, v in zimage_from_canonical({name: a}, dcfg, torch.float32).items():
                params[k].copy_(v.reshape(params[k].shape))
                filled.add(k)
    assert filled == set(params), sorted(set(params) - filled)[:5]
    dit.eval()

    n = VCFG.levels
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                        up_block_types=("UpDecoderBlock2D",) * n,
                        block_out_channels=VCFG.block_out_channels,
                        layers_per_block=VCFG.layers_per_block,
                        latent_channels=VCFG.latent_channels, norm_num_groups=VCFG.norm_num_groups,
                        use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=True, scaling_factor=VCFG.scaling_factor,
                        shift_factor=VCFG.shift_factor)
    vae.encoder = None
    conv = convert_ldm_vae_checkpoint(load_file(str(vae_path)), dict(vae.config))
    params = dict(vae.named_parameters())
    assert set(conv) == set(params), sorted(set(conv) ^ set(params))[:5]
    with torch.no_grad():
        for k, v in conv.items():
            params[k].copy_(v.reshape(params[k].shape))
    vae = vae.to(bf).eval()
    return {"te": te, "dit": dit, "vae": vae, "vcfg": VCFG, "dcfg": dcfg,
            "load_s": time.perf_counter() - t0}


def test_generate_torch_bfloat16(benchmark, torch_pieces, prompt):
    import torch

    from _bench_util import layer_timer
    from nxhpc.dit.sampler import euler_sample, initial_noise, latent_shape
    from nxhpc.vae.image import to_uint8
    benchmark.group = GROUP
    tp = torch_pieces
    te, dit, vae, vcfg, dcfg = tp["te"], tp["dit"], tp["vae"], tp["vcfg"], tp["dcfg"]
    ids = prompt[1]
    x0 = initial_noise(SEED, latent_shape(PX, PX, dcfg.in_channels, vcfg.upscale, dcfg.patch))
    seen: dict = {}

    def run():
        t0 = time.perf_counter()
        spans, hooks = layer_timer(te.layers)
        with torch.no_grad():
            hs = te(torch.as_tensor([ids]), output_hidden_states=True).hidden_states
        cap = hs[-2][0].float()
        for h in hooks:
            h.remove()
        t1 = time.perf_counter()
        seen["te_layers_s"], seen["te_layers_run"] = sum(spans), len(spans)
        dspans, hooks = layer_timer(dit.layers)
        step_s, step_layers = [], []

        def model(x, t):
            k = len(dspans)
            with torch.no_grad():
                out = dit([torch.from_numpy(x).to(torch.bfloat16)[:, None]],
                          torch.tensor([t], dtype=torch.float32), [cap.to(torch.bfloat16)],
                          return_dict=False)[0][0][:, 0]
            step_layers.append(sum(dspans[k:]))
            return out.float().numpy()
        x = euler_sample(model, x0, steps=STEPS, on_step=lambda i, n, s: step_s.append(s))
        for h in hooks:
            h.remove()
        t2 = time.perf_counter()
        with torch.no_grad():
            z = torch.from_numpy(x)[None] / vcfg.scaling_factor + vcfg.shift_factor
            pix = vae.decode(z.to(torch.bfloat16)).sample[0].float().numpy()
        img = to_uint8(pix)
        t3 = time.perf_counter()
        seen.update(encode_s=t1 - t0, step_s=step_s, step_layers_s=step_layers,
                    decode_s=t3 - t2, total_s=t3 - t0)
        seen["arrays"] = {"latents": x, "png": img}
        return x
    load0 = os.getloadavg()[0]
    reset_peak_rss()
    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    key = ("torch bfloat16 (pipeline pieces)", PX)
    ARRAYS[key] = seen.pop("arrays")
    r = {"open_s": tp["load_s"], **seen, "te_s_per_layer": seen["te_layers_s"] / seen["te_layers_run"],
         "dit_layers_run": len(dit.layers), "caption_tokens": len(ids),
         "peak_rss_mb": peak_rss_mb(), "worker_peak_rss_mb": None,
         "load_before": load0, "load_after": os.getloadavg()[0]}
    record(benchmark, RESULTS, key, _extrapolate(r))
    assert np.isfinite(ARRAYS[key]["latents"]).all() and ARRAYS[key]["png"].shape == (PX, PX, 3)
    _grade(benchmark, key)
    assert children() == []                     # torch ran in this process only
