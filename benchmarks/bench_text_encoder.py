"""Prompt -> caption features at Qwen3-4B's real dimensions: nxhpc vs transformers' Qwen3.

Model: a generated 2-block slice of Qwen3-4B (D=2560, 32 query / 8 kv heads of 128, FFN 9728,
RMSNorm eps 1e-6, RoPE base 1e6) in llama.cpp's layout, every matrix Q8_0 (the embedding too),
norms F32; the vocab is shrunk to 4096 ids (the tiny vocab's 582 tokens padded with unused
ones: the embedding gather costs the same per token whatever the vocab). Cached under
$NXHPC_MODELS/bench-qwen3-4b-2l (226 MB). ``hidden_states[-2]`` of a 2-block file runs 1 block
(nxhpc) / transformers runs both and its layers are timed by hooks; each side is extrapolated
to Qwen3-4B's 35 blocks: ``s_35_layers = (total - blocks) + 35 x s_per_layer``.

Prompts: 100 and 512 tokens after the chat template (the 512 one is truncated, as diffusers
does). Backends, 2 workers / 2 torch threads, in one run, one group per token count:
- nxhpc ``f32`` (exactly decoded weights, float32 FMA), ``q8`` (Q8_0 x Q8_0 dot products:
  AVX-512 VNNI, AVX-VNNI or AVX2 kernels) and ``bf16`` (AVX-512 BF16, or float32 FMAs on
  bfloat16 values with AVX2). On a CPU without AVX2 both run the scalar spec (about 60 s per
  block at 100 tokens): ``bf16`` is then left out unless ``NXHPC_BENCH_TE_BF16=1``, and each
  is timed one round (``f32`` three);
- transformers' ``Qwen3Model`` (eager attention) in torch bfloat16 and float32 on the same
  weights as decoded by the ``gguf`` package.

``extra_info``: n_tokens, seconds per block, the extrapolated seconds, GFLOP/s of one block
(with ``frac_of_peak``: over 2 cores' peak of the unit its projections run on, and
``frac_of_machine_peak`` where the machine has a faster one; ``_bench_util.peak_fields``),
peak RSS (Linux VmHWM, reset before each backend; nxhpc: the parent and its largest worker --
mapped weight pages are shared and counted in each; the encoder is closed before torch runs,
so none of its pages count in torch's), and the distance of the features to
transformers float32 (checked after timing). A table is printed at the end and written to
``.benchmarks/bench_text_encoder.md``.

Run: ``python -m pytest benchmarks/bench_text_encoder.py --benchmark-only`` (~3 GB RAM peak).
"""
import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest

from _bench_util import (bench_stats, children, err_cell, lowp_is_scalar, model_as, peak_fields,
                         peak_rss_mb, record, reset_peak_rss, rss_cell, run_timed_layers,
                         summary_fixture)
from nxhpc import _kernels as K
from nxhpc.formats.gguf_io import LazyTensor
from nxhpc.models.qwen3_files import write_qwen3_gguf
from nxhpc.models.registry import models_dir
from nxhpc.qwen3.config import Qwen3Config, layer_names
from nxhpc.qwen3.encoder import MAX_TOKENS, TextEncoder
from nxhpc.qwen3.tokenizer import tiny_vocab, vocab_metadata

CFG = Qwen3Config(vocab=4096, dim=2560, n_layers=2, n_heads=32, n_kv_heads=8, head_dim=128,
                  ffn=9728, eps=1e-6, rope_theta=1e6, context_length=40960)
LAYERS_RUN = 35                       # Qwen3-4B: hidden_states[-2] runs 35 of 36 blocks
TOKENS = [int(t) for t in os.environ.get("NXHPC_BENCH_TE_TOKENS", "100,512").split(",")]
WORKERS = 2
PRECISIONS = ["f32", "q8"] + (["bf16"] if os.environ.get("NXHPC_BENCH_TE_BF16")
                              or not lowp_is_scalar() else [])
RESULTS: dict = {}
_TITLE = (f"bench_text_encoder: Qwen3-4B dims, 2-block Q8_0 slice (vocab 4096), {WORKERS} "
          f"workers / threads")
_HEAD = ("| backend | tokens | s / block | s prompt -> features, 35 blocks (extrap.) | "
         "GFLOP/s | peak RSS MB | rel. err vs torch f32 |")
_WORDS = ("a red fox runs through the snowy forest at dawn, light falls between tall pines; "
          "its breath rises in small clouds and the river shines like glass below the hill. ")


def _file(vocab: int = CFG.vocab) -> Path:
    """The 2-block Qwen3-4B slice (generated once; each tensor drawn from its own seed and
    written one at a time). ``vocab``: the embedding's rows (Qwen3-4B's own is 151936, which
    bench_sdcpp needs: stable-diffusion.cpp tokenizes with its own vocabulary); the tokenizer
    fields are the tiny vocab padded to it."""
    cfg = dataclasses.replace(CFG, vocab=vocab)
    d = models_dir() / ("bench-qwen3-4b-2l" + ("" if vocab == CFG.vocab else f"-v{vocab}"))
    p = d / "model.gguf"
    if p.is_file():
        return p
    d.mkdir(parents=True, exist_ok=True)
    shapes = dict(cfg.global_shapes())
    for i in range(cfg.n_layers):
        shapes.update({n: cfg.shapes()[k] for k, n in layer_names(i).items()})

    def draw(i: int, name: str, shape: tuple[int, ...]):
        rng = np.random.default_rng([36, i])
        z = rng.standard_normal(shape, dtype=np.float32)
        if len(shape) == 1:
            return 1.0 + np.float32(0.3) * z
        return z if name == "token_embd.weight" else z * np.float32(1 / math.sqrt(shape[1]))
    tensors = {n: LazyTensor(s, "Q8_0" if len(s) == 2 else "F32",
                             lambda i=i, n=n, s=s: draw(i, n, s))
               for i, (n, s) in enumerate(shapes.items())}
    tmp = d / ".model.gguf.tmp"
    write_qwen3_gguf(tmp, cfg, weights={}, overrides=tensors,
                     tokenizer=vocab_metadata(*tiny_vocab(300, pad_to=cfg.vocab)))
    os.replace(tmp, p)
    return p


def _prompt(te: TextEncoder, n: int) -> str:
    """A prompt of exactly ``n`` tokens after the template (or truncated to 512)."""
    words = (_WORDS * 400).split(" ")
    lo, hi = 0, len(words)
    while lo < hi:                     # fewest words whose templated length reaches n
        mid = (lo + hi) // 2
        if te.templated_length(" ".join(words[:mid])) >= n:
            hi = mid
        else:
            lo = mid + 1
    text = " ".join(words[:lo])
    for cut in range(len(text), 0, -1):      # then trim characters to hit n exactly
        if len(te.tokenize(text[:cut])) == n:
            return text[:cut]
    return text


def _block_gflop(L: int) -> float:
    """Multiply-adds x 2 of one block at L tokens: the seven projections and causal
    attention (q k^T and p v over the L(L+1)/2 visible pairs of each head)."""
    c = CFG
    proj = c.dim * (c.q_width + 2 * c.kv_width) + c.q_width * c.dim + 3 * c.dim * c.ffn
    attn = 2 * c.n_heads * c.head_dim * L * (L + 1) / 2
    return 2 * (L * proj + attn) / 1e9


@pytest.fixture(scope="module")
def te():
    enc = TextEncoder(_file(), workers=WORKERS)
    yield enc
    enc.close()


@pytest.fixture(scope="module")
def prompts(te):
    return {n: _prompt(te, n) for n in TOKENS}


def _row(key, r) -> list:
    return [*key, f"{r['s_per_layer']:.3f}", f"{r['s_35_layers']:.2f}", f"{r['gflops']:.1f}",
            rss_cell(r), err_cell(r.get("rel_err_vs_torch_f32"), ".1e")]


_summary = summary_fixture(RESULTS, "bench_text_encoder", _TITLE, _HEAD, _row)


def _group(n: int) -> str:
    return f"text encoder Qwen3-4B dims, {n} tokens"


# ----------------------------------------------------------------------------- nxhpc

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_text_encoder_nxhpc(benchmark, te, prompts, tokens, precision):
    benchmark.group = _group(tokens)
    prompt = prompts[tokens]
    te.precision = precision
    te.encode(prompt)                             # the session: fork + arena (not timed)
    reset_peak_rss(["self", *children()])
    slow = precision != "f32" and lowp_is_scalar()
    out = benchmark.pedantic(lambda: te.encode(prompt), rounds=1 if slow else 3,
                             warmup_rounds=0)
    tm = dict(te.last_timings)
    per_layer = tm["us_layers"] / CFG.layers_needed / 1e6
    kids = [peak_rss_mb(p) or 0 for p in children()]
    r = {"n_tokens": out.shape[0], "s_per_layer": per_layer,
         "s_35_layers": (tm["us_total"] - tm["us_layers"]) / 1e6 + LAYERS_RUN * per_layer,
         "gflops": _block_gflop(out.shape[0]) / per_layer, "s_call": bench_stats(benchmark).median,
         **tm, **te.memory(), "worker_peak_rss_mb": max(kids, default=None), "output": out}
    # against the peak of the unit its projections run on (most of a block's work), 2 cores
    slot = {"f32": "matmul", "bf16": "matmul_bf16", "q8": "matmul_q8"}[precision]
    r.update(peak_fields(r["gflops"], precision, K.kernel_variants()[slot], workers=WORKERS))
    record(benchmark, RESULTS, (f"nxhpc {precision}", tokens), r)
    te.precision = "f32"
    assert out.shape == (tokens, CFG.dim) and np.isfinite(out).all()


# ----------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def torch_model(te, prompts):
    """transformers' Qwen3Model (float32) holding the file's weights as the ``gguf`` package
    decodes them, filled one tensor at a time, and nxhpc's tokenizer of the file. The encoder
    is closed here (after ``prompts`` are made; the nxhpc runs come first), so its mapped
    weights, arena and workers are not in torch's peak RSS."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import gguf
    from transformers import Qwen3Model

    from nxhpc.qwen3.oracle import HF_NAMES, transformers_config
    torch.set_num_threads(WORKERS)
    hc = transformers_config(te.config)
    hc._attn_implementation = "eager"
    model = Qwen3Model(hc).to(torch.float32).eval()
    params = dict(model.named_parameters())
    names = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight"}
    for i in range(CFG.n_layers):
        names.update({n: f"layers.{i}.{HF_NAMES[k]}.weight" for k, n in layer_names(i).items()})
    filled = set()
    for t in gguf.GGUFReader(str(te.path), "r").tensors:
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        a = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                       dtype=np.float32).reshape(shape)
        with torch.no_grad():
            params[names[t.name]].copy_(torch.tensor(a))
        filled.add(names[t.name])
    assert filled == set(params), sorted(set(params) - filled)[:5]
    tokenizer = te.tokenizer
    te.close()
    return {"model": model, "dtype": torch.float32, "tokenizer": tokenizer}


def _run_torch(benchmark, torch_model, prompts, tokens, dtype_name):
    import torch
    model = model_as(torch_model, getattr(torch, dtype_name))
    tok = torch_model["tokenizer"]
    benchmark.group = _group(tokens)
    prompt = prompts[tokens]

    def features():
        ids = tok.tokenize(prompt, MAX_TOKENS)   # the same tokenizer: prompt -> features
        with torch.no_grad():
            hs = model(torch.as_tensor([ids]), output_hidden_states=True).hidden_states
        return hs[-2][0].float().numpy()
    out, total, layer_s = run_timed_layers(benchmark, model.layers, features, CFG.n_layers,
                                           rounds=2)
    per_layer = layer_s / CFG.n_layers
    r = {"n_tokens": out.shape[0], "s_per_layer": per_layer,
         "s_35_layers": (total - layer_s) + LAYERS_RUN * per_layer,
         "gflops": _block_gflop(out.shape[0]) / per_layer, "s_call": total,
         "peak_rss_mb": peak_rss_mb(), "output": out}
    r.update(peak_fields(r["gflops"], "f32" if dtype_name == "float32" else "bf16",
                         workers=WORKERS))
    record(benchmark, RESULTS, (f"torch {dtype_name}", tokens), r)
    assert np.isfinite(out).all()
    return r


@pytest.mark.parametrize("tokens", TOKENS)
def test_text_encoder_torch_float32(benchmark, torch_model, prompts, tokens):
    r = _run_torch(benchmark, torch_model, prompts, tokens, "float32")
    ref = r["output"]
    for (name, n), other in RESULTS.items():
        if n == tokens:
            other["rel_err_vs_torch_f32"] = float(np.abs(other["output"] - ref).max()
                                                  / np.abs(ref).max())
    nx = RESULTS.get(("nxhpc f32", tokens))
    if nx is not None:               # float32 on both sides, the same weights
        assert nx["rel_err_vs_torch_f32"] <= 1e-4, nx["rel_err_vs_torch_f32"]


@pytest.mark.parametrize("tokens", TOKENS)
def test_text_encoder_torch_bfloat16(benchmark, torch_model, prompts, tokens):
    r = _run_torch(benchmark, torch_model, prompts, tokens, "bfloat16")
    ref = RESULTS.get(("torch float32", tokens), {}).get("output")
    if ref is not None:
        r["rel_err_vs_torch_f32"] = float(np.abs(r["output"] - ref).max() / np.abs(ref).max())
