"""int8_attention_error.py -- probe: would an int8 attention keep `q8`'s errors within torch
bfloat16's? (Issue 20 allows "QK^T and PV ... int8 with smoothing, if its error holds".)

    python benchmarks/probes/int8_attention_error.py [model_id] [--qnorm-scale S ...]

One DiT block of ``model_id`` (default ``zimage-1l``, built in: Z-Image dims, Q8_0 layers, T=256)
from its fixture input, graded as blockrun grades (``max_rel``, and rms(out - ref) / rms(ref))
against the block in float64 (``nxhpc.dit.reference``, weights dequantized by the ``gguf``
package). Beside it, in the same run:

- torch bfloat16: diffusers' block (``nxhpc.dit.oracle``) cast to bfloat16, as bench_block runs it;
- nxhpc's own ``bf16`` and ``q8`` blocks (the C kernels; at --qnorm-scale 1 only, since they read
  the file's q_norm);
- float64 simulations, each of one change to the float64 block, so that every error below has a
  single cause:
  - ``q8 acts``: every projection's input quantized as q8 does (per 32 elements of a row, int8,
    scale absmax / 127 rounded to float16, round to nearest), the weights exact (q8 runs the
    file's own codes), the attention exact -- what q8 costs before its attention;
  - the attention variants, alone and on top of ``q8 acts``:
    ``bf16`` (q, k, v and p rounded to bfloat16 -- nxhpc's bf16 attention contract, which q8 runs);
    ``i8 qk`` (q and k quantized per token and head, one scale per head row; p and v bf16);
    ``i8 qk smooth`` (the same after subtracting from k its mean over the tokens, per head and
    channel -- SageAttention's smoothing, exact for the softmax);
    ``i8 qk smooth /32`` (smoothing, a scale per 32 channels instead of per head row);
    ``+ u8 p, i8 v`` (the last with P V on integers too: p as uint8 of 1/255, v int8 per channel
    and 32-key group);
  - ``q8 acts`` alone (the attention exact), and with a scale per 16 elements instead of 32;
  - ``q8 acts per 256``: one float32 scale per 256 elements (ggml's Q8_K activation blocks, what
    a contract with integer sums over the K-quants' 256-value superblocks would quantize by),
    with the attention exact and with the bf16 attention q8 runs.

``--qnorm-scale S`` multiplies q_norm's weights by S in every model of the run (torch and the
simulations alike): the logits grow by S, so the attention is sharper than this random model's.
Owns nothing the package uses; a probe, not a test (it asserts nothing).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from nxhpc.dit import reference as R
from nxhpc.dit.grade import rel_errors
from nxhpc.models.registry import open_model


def fq(a: np.ndarray, blk: int, scale_dtype=np.float16) -> np.ndarray:
    """Per-``blk`` int8 fake quantization along the last axis (q8's activation rule; the scale
    rounded to ``scale_dtype``)."""
    sh = a.shape
    b = a.reshape(sh[:-1] + (sh[-1] // blk, blk))
    d = (np.abs(b).max(-1, keepdims=True) / 127.0).astype(scale_dtype).astype(np.float64)
    q = np.clip(np.round(b / np.where(d > 0, d, 1.0)), -127, 127)
    return (q * d).reshape(sh)


def bf(a: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even), back to float64."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def attention(q, k, v, mask, mode: str) -> np.ndarray:
    """q [T, H, hd], k, v [T, KVH, hd] -> [T, H * hd] with the dots of ``mode``."""
    T, H, hd = q.shape
    group = H // k.shape[1]
    keep = None if mask is None else np.asarray(mask).astype(bool)
    out = np.zeros((T, H, hd))
    for h in range(H):
        qh, kh, vh = q[:, h], k[:, h // group], v[:, h // group]
        if mode == "exact":
            s = qh @ kh.T
        elif mode == "bf16":
            s = bf(qh) @ bf(kh).T
        else:
            blk = 32 if "/32" in mode else hd
            ks = kh - kh.mean(0, keepdims=True) if "smooth" in mode else kh
            s = fq(qh, blk) @ fq(ks, blk).T
        s = s / np.sqrt(hd)
        if keep is not None:
            s = np.where(keep[None, :], s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        lsum = p.sum(1, keepdims=True)
        if mode == "exact":
            o = p @ vh
        elif "u8 p" in mode:
            n = -(-T // 32) * 32
            vp = np.zeros((n, hd))
            vp[:T] = vh
            o = (np.round(p * 255.0) / 255.0) @ fq(vp.T.copy(), 32).T[:T]
        else:
            o = bf(p) @ bf(vh)
        out[:, h] = o / lsum
    return out.reshape(T, H * hd)


def block(x, w, cfg, t_emb, pe, mask, acts, amode: str) -> np.ndarray:
    """The float64 block of nxhpc.dit.reference, with ``acts`` applied to every projection's
    input and the attention's dots by ``amode``."""
    D, H, KVH, hd, eps = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
    m = R.adaln_f64(t_emb, w["adaln_w"], w["adaln_b"], silu=cfg.adaln_silu)
    s_msa, g_msa, s_mlp, g_mlp = m[:D], m[D:2 * D], m[2 * D:3 * D], m[3 * D:]
    x = np.asarray(x, np.float64)
    T = x.shape[0]
    qkv = acts(R.rmsnorm_f64(x, w["attention_norm1"], eps) * (1 + s_msa)) @ w["qkv"].T
    q = qkv[:, :H * hd].reshape(T, H, hd)
    k = qkv[:, H * hd:(H + KVH) * hd].reshape(T, KVH, hd)
    v = qkv[:, (H + KVH) * hd:].reshape(T, KVH, hd)
    q = R.rope_f64(R.rmsnorm_f64(q, w["q_norm"], eps), pe)
    k = R.rope_f64(R.rmsnorm_f64(k, w["k_norm"], eps), pe)
    a = attention(q, k, v, mask, amode)
    mid = x + np.tanh(g_msa) * R.rmsnorm_f64(acts(a) @ w["out"].T, w["attention_norm2"], eps)
    h2 = acts(R.rmsnorm_f64(mid, w["ffn_norm1"], eps) * (1 + s_mlp))
    g = h2 @ w["w1"].T
    f = g / (1 + np.exp(-g)) * (h2 @ w["w3"].T)
    return mid + np.tanh(g_mlp) * R.rmsnorm_f64(acts(f) @ w["w2"].T, w["ffn_norm2"], eps)


def errors(out, ref) -> tuple[float, float]:
    d = np.asarray(out, np.float64) - ref
    return float(rel_errors(out, ref).max()), float(np.sqrt(np.mean(d * d) / np.mean(ref * ref)))


def torch_bf16(cfg, w, x, t_emb, pe, mask) -> np.ndarray:
    import torch

    from nxhpc.dit.oracle import diffusers_block
    blk = diffusers_block(cfg, w).to(torch.bfloat16)
    freqs = torch.complex(torch.from_numpy(pe[..., 0, 0].copy()),
                          torch.from_numpy(pe[..., 1, 0].copy()))
    mm = torch.from_numpy(mask)[None] if mask is not None else None
    with torch.no_grad():
        return blk(torch.from_numpy(x)[None].to(torch.bfloat16), mm, freqs[None],
                   torch.from_numpy(t_emb)[None].to(torch.bfloat16))[0].float().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="zimage-1l")
    ap.add_argument("--qnorm-scale", type=float, nargs="+", default=[1.0, 4.0])
    args = ap.parse_args()
    model = open_model(args.model)
    cfg = model.config
    x, t_emb, pe, mask = model.blk_in(0), model.t_emb(), model.pe(), model.mask()
    w0 = R.dequantize_layer(model.layer_weights(0))
    print(f"model {args.model}: T={x.shape[0]}, D={cfg.dim}, heads {cfg.n_heads} x "
          f"{cfg.head_dim}; errors vs float64: max_rel, rms_rel")
    q8 = lambda a: fq(a, 32)                                        # noqa: E731
    same = lambda a: a                                              # noqa: E731
    for scale in args.qnorm_scale:
        w = dict(w0, q_norm=w0["q_norm"] * scale)
        t0 = time.perf_counter()
        ref = block(x, w, cfg, t_emb, pe, mask, same, "exact")
        print(f"q_norm x {scale:g}")
        print(f"  {'torch bfloat16 (diffusers block)':34s} %.3e  %.3e"
              % errors(torch_bf16(cfg, w, x, t_emb, pe, mask), ref))
        if scale == 1.0:
            with model.block(0) as blk:
                for p in ("bf16", "q8"):
                    out, _ = blk.forward(x, t_emb, pe, mask=mask, workers=2, precision=p)
                    print(f"  {'nxhpc ' + p + ' (the kernels)':34s} %.3e  %.3e" % errors(out, ref))
        for amode in ("bf16", "i8 qk", "i8 qk smooth", "i8 qk smooth /32",
                      "i8 qk smooth /32 + u8 p, i8 v"):
            for tag, acts in (("", same), ("q8 acts + ", q8)):
                print(f"  {tag + amode:34s} %.3e  %.3e"
                      % errors(block(x, w, cfg, t_emb, pe, mask, acts, amode), ref), flush=True)
        print(f"  {'q8 acts (exact attention)':34s} %.3e  %.3e"
              % errors(block(x, w, cfg, t_emb, pe, mask, q8, "exact"), ref))
        print(f"  {'q8 acts per 16 (exact attention)':34s} %.3e  %.3e"
              % errors(block(x, w, cfg, t_emb, pe, mask, lambda a: fq(a, 16), "exact"), ref))
        q8k = lambda a: fq(a, 256, np.float32)                      # noqa: E731
        for amode in ("exact", "bf16"):
            print(f"  {'q8 acts per 256 (' + amode + ' attention)':34s} %.3e  %.3e"
                  % errors(block(x, w, cfg, t_emb, pe, mask, q8k, amode), ref), flush=True)
        print(f"  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
