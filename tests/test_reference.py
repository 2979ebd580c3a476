"""The float64 oracle (nxhpc.dit.reference) and the rotary tables (nxhpc.dit.rope) against diffusers.

diffusers computes in float32, so agreement is expected at ~1e-6 relative; the bounds below
are a few times that. Each comparison has a negative control that must fail the same bound.
"""
import numpy as np
import pytest

import gguf

from nxhpc.dit import rope
from nxhpc.dit.oracle import diffusers_block
from nxhpc.dit.reference import (adaln_f64, attention_f64, block_forward_f64, dequantize_layer,
                                 rmsnorm_f64)
from nxhpc.dit.config import BlockConfig
from testutil import t32

torch = pytest.importorskip("torch")
zimg = pytest.importorskip("diffusers.models.transformers.transformer_z_image")
lum2 = pytest.importorskip("diffusers.models.transformers.transformer_lumina2")

Q8 = gguf.GGMLQuantizationType.Q8_0
# float32 evaluation of a block vs float64: relative (to the output's RMS) error bound. The
# longest reduction is the FFN down-projection (K=1024-1536); float32 dot products of that
# length with random signs err by ~sqrt(K)*2^-24 ~ 3e-6 relative in the worst elements.
TOL_BLOCK = 2e-5


def snap_q8(w):
    """Round a float matrix to the Q8_0 grid (what a Q8_0 GGUF file holds)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, Q8), Q8).astype(np.float64)


def make_weights(rng, D, H, KVH, hd, ffn, adaln_in):
    def proj(r, c, gain=1.0):
        return snap_q8(rng.standard_normal((r, c)) * gain / np.sqrt(c))
    w = {"qkv": proj((H + 2 * KVH) * hd, D), "out": proj(D, H * hd), "w1": proj(ffn, D),
         "w3": proj(ffn, D), "w2": proj(D, ffn), "adaln_w": proj(4 * D, adaln_in, 0.4),
         "adaln_b": (0.1 * rng.standard_normal(4 * D)).astype(np.float32).astype(np.float64)}
    for k, n in (("attention_norm1", D), ("attention_norm2", D), ("ffn_norm1", D),
                 ("ffn_norm2", D), ("q_norm", hd), ("k_norm", hd)):
        w[k] = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32).astype(np.float64)
    return w


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / np.sqrt(np.mean(b * b)))


def zimage_block(w, D, H, eps):
    cfg = BlockConfig(dim=D, n_heads=H, n_kv_heads=H, head_dim=D // H, ffn_dim=w["w1"].shape[0],
                      n_layers=1, adaln_in=w["adaln_w"].shape[1], variant="zimage",
                      adaln_silu=False, norm_eps=eps)
    return diffusers_block(cfg, w, eps)


def run_zimage(blk, x, t_emb, pe, mask):
    freqs = torch.complex(t32(pe[..., 0, 0]), t32(pe[..., 1, 0]))
    m = None if mask is None else torch.from_numpy(mask.astype(bool))[None]
    with torch.no_grad():
        return blk(t32(x)[None], m, freqs[None], t32(t_emb)[None])[0].double().numpy()


@pytest.mark.parametrize("n_heads", [6, 3], ids=["6x64", "3x128"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_block_matches_diffusers_zimage(n_heads, masked):
    D, T, eps = 384, 45, 1e-6
    hd = D // n_heads
    rng = np.random.default_rng(100 + n_heads + 10 * masked)
    w = make_weights(rng, D, n_heads, n_heads, hd, int(D / 3 * 8), 256)
    cfg = BlockConfig(dim=D, n_heads=n_heads, n_kv_heads=n_heads, head_dim=hd,
                      ffn_dim=int(D / 3 * 8), n_layers=1, adaln_in=256, variant="zimage",
                      adaln_silu=False, norm_eps=eps)
    x = rng.standard_normal((T, D)).astype(np.float32)
    t_emb = rng.standard_normal(256).astype(np.float32)
    ids = rope.position_ids(13, (1, 4, 8))
    pe = rope.rope_table(ids, rope.default_axes_dims(hd, "zimage"), 256.0).astype(np.float32)
    mask = None
    if masked:
        mask = np.ones(T, dtype=bool)
        mask[9:13] = False          # padded caption tokens
    ours = block_forward_f64(x, w, cfg, t_emb=t_emb, pe=pe, mask=mask)
    blk = zimage_block(w, D, n_heads, eps)
    theirs = run_zimage(blk, x, t_emb, pe, mask)
    assert rel_err(ours, theirs) < TOL_BLOCK
    # adaln_m path agrees with the t_emb path
    m = adaln_f64(t_emb, w["adaln_w"], w["adaln_b"])
    assert np.array_equal(block_forward_f64(x, w, cfg, adaln_m=m, pe=pe, mask=mask), ours)
    # negative controls: the mask matters, and the q/k norms are not interchangeable
    if masked:
        assert rel_err(ours, run_zimage(blk, x, t_emb, pe, None)) > 50 * TOL_BLOCK
    w2 = dict(w, q_norm=w["k_norm"], k_norm=w["q_norm"])
    assert rel_err(block_forward_f64(x, w2, cfg, t_emb=t_emb, pe=pe, mask=mask),
                   theirs) > 50 * TOL_BLOCK


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_block_matches_diffusers_lumina2_gqa(masked):
    """GQA (4 query heads share 2 kv heads) and SiLU-before-adaLN, against Lumina2's block."""
    D, H, KVH, T, eps = 384, 4, 2, 41, 1e-5
    hd = D // H
    sizing = lum2.Lumina2TransformerBlock(D, H, KVH, 256, None, eps)   # diffusers' own sizes
    ffn = sizing.feed_forward.linear_1.weight.shape[0]
    adaln_in = sizing.norm1.linear.weight.shape[1]
    rng = np.random.default_rng(7 + masked)
    w = make_weights(rng, D, H, KVH, hd, ffn, adaln_in)
    cfg = BlockConfig(dim=D, n_heads=H, n_kv_heads=KVH, head_dim=hd, ffn_dim=ffn,
                      n_layers=1, adaln_in=adaln_in, variant="lumina2", adaln_silu=True,
                      norm_eps=eps)
    blk = diffusers_block(cfg, w, eps)
    x = rng.standard_normal((T, D)).astype(np.float32)
    t_emb = rng.standard_normal(adaln_in).astype(np.float32)
    pe = rope.rope_table(rope.position_ids(11, (1, 5, 6)), (32, 32, 32), 10000.0
                         ).astype(np.float32)
    mask = None
    if masked:
        mask = np.ones(T, dtype=bool)
        mask[8:11] = False
    freqs = torch.complex(t32(pe[..., 0, 0]), t32(pe[..., 1, 0]))
    tm = None if mask is None else torch.from_numpy(mask)[None]
    with torch.no_grad():
        theirs = blk(t32(x)[None], tm, freqs[None], t32(t_emb)[None])[0].double().numpy()
    ours = block_forward_f64(x, w, cfg, t_emb=t_emb, pe=pe, mask=mask)
    assert rel_err(ours, theirs) < TOL_BLOCK
    # negative control: without the SiLU the adaLN output (and the block) differ
    cfg_nosilu = BlockConfig(**{**cfg.__dict__, "adaln_silu": False})
    assert rel_err(block_forward_f64(x, w, cfg_nosilu, t_emb=t_emb, pe=pe, mask=mask),
                   theirs) > 50 * TOL_BLOCK


def test_unmodulated_block_matches_diffusers_context_refiner():
    """modulation=False (the context refiner, docs/denoiser.md) against diffusers'
    ZImageTransformerBlock(modulation=False): no adaLN, no tanh, gate multiplier 1."""
    D, H, T, eps = 384, 3, 29, 1e-6
    hd = D // H
    rng = np.random.default_rng(31)
    w = make_weights(rng, D, H, H, hd, int(D / 3 * 8), 256)
    unmod = {k: v for k, v in w.items() if not k.startswith("adaln")}
    cfg = BlockConfig(dim=D, n_heads=H, n_kv_heads=H, head_dim=hd, ffn_dim=int(D / 3 * 8),
                      n_layers=1, adaln_in=256, variant="zimage", adaln_silu=False,
                      norm_eps=eps)
    blk = zimg.ZImageTransformerBlock(0, D, H, H, eps, qk_norm=True, modulation=False)
    qkv = w["qkv"]
    sd = {"attention.to_q.weight": qkv[:D], "attention.to_k.weight": qkv[D:2 * D],
          "attention.to_v.weight": qkv[2 * D:], "attention.to_out.0.weight": w["out"],
          "attention.norm_q.weight": w["q_norm"], "attention.norm_k.weight": w["k_norm"],
          "feed_forward.w1.weight": w["w1"], "feed_forward.w2.weight": w["w2"],
          "feed_forward.w3.weight": w["w3"], "attention_norm1.weight": w["attention_norm1"],
          "attention_norm2.weight": w["attention_norm2"], "ffn_norm1.weight": w["ffn_norm1"],
          "ffn_norm2.weight": w["ffn_norm2"]}
    blk.load_state_dict({k: t32(v) for k, v in sd.items()}, strict=True)
    blk.attention.norm_q.eps = blk.attention.norm_k.eps = eps
    blk.eval()
    x = rng.standard_normal((T, D)).astype(np.float32)
    pe = rope.rope_table(rope.position_ids(T, (1, 1, 1))[:T], rope.default_axes_dims(hd, "zimage"),
                         256.0).astype(np.float32)
    freqs = torch.complex(t32(pe[..., 0, 0]), t32(pe[..., 1, 0]))
    with torch.no_grad():
        theirs = blk(t32(x)[None], None, freqs[None])[0].double().numpy()
    ours = block_forward_f64(x, unmod, cfg, pe=pe, modulation=False)
    assert rel_err(ours, theirs) < TOL_BLOCK
    # negative control: a modulated block with zero adaLN output (scale 0, gate tanh(0) = 0)
    # is not the unmodulated block
    zero = block_forward_f64(x, w, cfg, adaln_m=np.zeros(4 * D), pe=pe)
    assert rel_err(zero, theirs) > 50 * TOL_BLOCK
    with pytest.raises(ValueError, match="takes no t_emb"):
        block_forward_f64(x, unmod, cfg, t_emb=np.zeros(256), pe=pe, modulation=False)
    with pytest.raises(ValueError, match="lack"):
        block_forward_f64(x, unmod, cfg, t_emb=np.zeros(256), pe=pe)


def test_gqa_equals_mha_with_repeated_kv_heads():
    rng = np.random.default_rng(3)
    T, H, KVH, hd = 17, 6, 2, 8
    q = rng.standard_normal((T, H, hd))
    k = rng.standard_normal((T, KVH, hd))
    v = rng.standard_normal((T, KVH, hd))
    rep = H // KVH
    a = attention_f64(q, k, v)
    b = attention_f64(q, np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1))
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    # tiling (h % KVH) instead of grouping (h // group) gives a different answer
    c = attention_f64(q, np.tile(k, (1, rep, 1)), np.tile(v, (1, rep, 1)))
    assert np.abs(a - c).max() > 1e-3


def test_attention_mask_semantics():
    rng = np.random.default_rng(4)
    T, hd = 9, 4
    q, k, v = (rng.standard_normal((T, 1, hd)) for _ in range(3))
    mask = np.array([1, 1, 0, 1, 0, 1, 1, 1, 0], dtype=bool)
    a = attention_f64(q, k, v, mask)
    b = attention_f64(q, k[mask], v[mask])      # dropping masked keys is the same thing
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    assert np.all(attention_f64(q, k, v, np.zeros(T, bool)) == 0)   # all masked -> zeros


def test_rmsnorm_and_adaln_by_hand():
    v = np.array([[3.0, 4.0]])
    np.testing.assert_allclose(rmsnorm_f64(v, np.array([1.0, 2.0]), 0.0),
                               [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-15)
    t = np.array([1.0, -2.0])
    w = np.array([[1.0, 0.5], [0.0, 1.0]])
    np.testing.assert_allclose(adaln_f64(t, w, np.zeros(2)), [0.0, -2.0])
    s = t / (1 + np.exp(-t))
    np.testing.assert_allclose(adaln_f64(t, w, np.ones(2), silu=True), w @ s + 1)


def test_dequantize_layer_uses_gguf_values():
    class LW:
        pass
    rng = np.random.default_rng(5)
    lw = LW()
    w = rng.standard_normal((64, 64)).astype(np.float32)
    q = gguf.quants.quantize(w, Q8)
    for k in ("qkv", "out", "w1", "w2", "w3", "adaln_w"):
        setattr(lw, k, q)
    for k in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2", "q_norm",
              "k_norm", "adaln_b"):
        setattr(lw, k, np.ones(64, np.float32))
    d = dequantize_layer(lw)
    assert d["qkv"].dtype == np.float64 and d["qkv"].shape == (64, 64)
    # value = d*q: the first block's first value by hand
    scale = np.frombuffer(q[0, :2].tobytes(), np.float16)[0]
    assert d["qkv"][0, 0] == float(scale) * float(q[0, 2].view(np.int8))
    assert np.abs(d["qkv"] - w).max() <= np.abs(w).max() / 127


def test_dequantize_layer_decodes_each_stored_type():
    """Typed matrices decode by their type: F16 and BF16 checked by hand (float16 widening, the
    bf16 bits as the upper half of a float32), F32 as is; an unmodulated block has no adaLN."""
    from nxhpc.dit.binding import LayerWeights
    from nxhpc.formats.weights import WeightTensor
    rng = np.random.default_rng(9)
    a = rng.standard_normal((8, 64)).astype(np.float32)
    f16 = a.astype(np.float16)
    bf = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16)
    by_hand_bf = (bf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    mats = {"qkv": WeightTensor.from_array("q", a), "out": WeightTensor.from_array("o", f16),
            "w1": WeightTensor.from_raw("w1", "BF16", 64, bf),
            "w3": WeightTensor.from_raw("w3", "Q8_0", 64, gguf.quants.quantize(a, Q8)),
            "w2": WeightTensor.from_array("w2", a)}
    vec = {k: np.ones(64, np.float32) for k in ("attention_norm1", "attention_norm2",
                                                "ffn_norm1", "ffn_norm2", "q_norm", "k_norm")}
    d = dequantize_layer(LayerWeights(**mats, **vec))
    assert "adaln_w" not in d and "adaln_b" not in d
    assert np.array_equal(d["qkv"], a.astype(np.float64))
    assert np.array_equal(d["out"], f16.astype(np.float64))
    assert np.array_equal(d["w1"], by_hand_bf.astype(np.float64))
    assert d["w3"].shape == (8, 64) and np.abs(d["w3"] - a).max() <= np.abs(a).max() / 127
    assert not np.array_equal(d["w1"], d["qkv"])          # bf16 rounding is visible


# ----------------------------------------------------------------------------- rope

@pytest.mark.parametrize("variant,theta,axes,lens", [
    ("zimage", 256.0, (32, 48, 48), (1024, 512, 512)),
    ("lumina2", 10000.0, (32, 32, 32), (1024, 512, 512))])
def test_rope_table_matches_diffusers_rope_embedder(variant, theta, axes, lens):
    ids = rope.position_ids(32, (1, 40, 48))          # caption then a 40x48 grid; t up to 33
    ids = np.concatenate([ids, [[1000, 511, 511]]])   # and the largest positions it supports
    emb = zimg.RopeEmbedder(theta=theta, axes_dims=list(axes), axes_lens=list(lens))
    theirs = emb(torch.from_numpy(ids)).numpy()       # complex64 [T, hd/2]
    ours = rope.rope_table(ids, axes, theta)
    assert ours.shape == (len(ids), sum(axes) // 2, 2, 2)
    # diffusers rounds each angle to float32 before cos/sin: error <= |angle| 2^-24 + 2^-24
    ang = np.concatenate([ids[:, a:a + 1] * theta ** (-np.arange(0, d, 2) / d)
                          for a, d in enumerate(axes)], axis=1)
    bound = np.abs(ang) * 2.0 ** -23 + 2.0 ** -22
    z = rope.pe_to_complex(ours)
    assert np.all(np.abs(z.real - theirs.real) <= bound)
    assert np.all(np.abs(z.imag - theirs.imag) <= bound)
    # layout: [[cos, -sin], [sin, cos]]
    np.testing.assert_array_equal(ours[..., 0, 1], -ours[..., 1, 0])
    np.testing.assert_array_equal(ours[..., 0, 0], ours[..., 1, 1])
    # negative control: the other variant's theta is far outside the bound
    other = rope.pe_to_complex(rope.rope_table(ids, axes, 10256.0 - theta))
    assert np.any(np.abs(other.real - theirs.real) > 100 * bound)


def test_rope_is_float64_accurate_at_large_positions():
    """rot(a+b) = rot(a) rot(b) to 1e-12 at positions ~50000 (float32 angles fail by 1e-3)."""
    axes, theta = (32, 48, 48), 256.0
    a = np.array([[50000, 30000, 41000]])
    b = np.array([[1234, 567, 890]])
    za, zb, zab = (rope.pe_to_complex(rope.rope_table(i, axes, theta)) for i in (a, b, a + b))
    np.testing.assert_allclose(zab, za * zb, rtol=0, atol=1e-10)
    # negative control: the same identity with angles formed in float32 fails by far
    def table32(ids):
        ang = np.concatenate([ids[:, k:k + 1].astype(np.float32) * np.float32(theta) ** (
            -np.arange(0, d, 2, dtype=np.float32) / np.float32(d)) for k, d in enumerate(axes)],
            axis=1)
        return np.exp(1j * ang.astype(np.float64))
    assert np.abs(table32(a + b) - table32(a) * table32(b)).max() > 1e-4


def test_position_ids_layout():
    ids = rope.position_ids(3, (1, 2, 3))
    assert ids.tolist() == [[1, 0, 0], [2, 0, 0], [3, 0, 0],
                            [4, 0, 0], [4, 0, 1], [4, 0, 2], [4, 1, 0], [4, 1, 1], [4, 1, 2]]


def test_default_axes_dims():
    assert rope.default_axes_dims(128, "zimage") == (32, 48, 48)
    assert rope.default_axes_dims(96, "lumina2") == (32, 32, 32)
    # other head dims by the documented rule, worked out by hand: hd/2 pairs split in Z-Image's
    # ratio 32:48:48 (1/4, 3/8, 3/8), floors, the remainder one pair at a time to the leading
    # axes. hd 14: 7 pairs, floors (1, 2, 2), +1 +1 -> (2, 3, 2) pairs; hd 40: 20 pairs,
    # (5, 7, 7) +1 -> (6, 7, 7); hd 64: 32 pairs, (8, 12, 12) exactly
    assert rope.default_axes_dims(14, "zimage") == (4, 6, 4)
    assert rope.default_axes_dims(40, "zimage") == (12, 14, 14)
    assert rope.default_axes_dims(64, "zimage") == (16, 24, 24)
    for hd in (8, 32, 64, 96, 128, 256):
        for var in ("zimage", "lumina2"):
            ax = rope.default_axes_dims(hd, var)
            assert sum(ax) == hd and all(a >= 2 and a % 2 == 0 for a in ax)


def test_reference_rejects_bad_shapes():
    cfg = BlockConfig(dim=64, n_heads=2, n_kv_heads=2, head_dim=32, ffn_dim=128, n_layers=1,
                      adaln_in=64, variant="zimage", adaln_silu=False)
    w = make_weights(np.random.default_rng(0), 64, 2, 2, 32, 128, 64)
    x = np.zeros((5, 64))
    pe = np.zeros((5, 16, 2, 2))
    with pytest.raises(ValueError, match="pe"):
        block_forward_f64(x, w, cfg, t_emb=np.zeros(64))
    with pytest.raises(ValueError, match="x is"):
        block_forward_f64(np.zeros((5, 63)), w, cfg, t_emb=np.zeros(64), pe=pe)
    with pytest.raises(ValueError, match="t_emb or adaln_m"):
        block_forward_f64(x, w, cfg, pe=pe)
    with pytest.raises(ValueError, match="mask"):
        block_forward_f64(x, w, cfg, t_emb=np.zeros(64), pe=pe, mask=np.ones(4))
