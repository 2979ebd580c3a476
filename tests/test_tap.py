"""Tapping a real diffusers run (nxhpc.models.tap): the written directory opens, its config is
inferred right, and the float64 oracle on the tapped inputs reproduces the tapped outputs."""
import numpy as np
import pytest

import gguf
from nxhpc.formats.gguf_io import PREFIX, GGUFFile
from nxhpc.models import open_model
from nxhpc.dit.reference import block_forward_f64, dequantize_layer

torch = pytest.importorskip("torch")
Z = pytest.importorskip("diffusers.models.transformers.transformer_z_image")

Q8 = gguf.GGMLQuantizationType.Q8_0
TOL = 2e-5   # float32 torch run vs float64 oracle, relative to the output's RMS


def small_model(seed=0, n_heads=6):
    torch.manual_seed(seed)
    hd = 384 // n_heads
    axes = [hd // 4, 3 * hd // 8, 3 * hd // 8]
    m = Z.ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4,
                                   dim=384, n_layers=3, n_refiner_layers=1, n_heads=n_heads,
                                   n_kv_heads=n_heads, norm_eps=1e-5, qk_norm=True,
                                   cap_feat_dim=64, rope_theta=256.0, axes_dims=axes,
                                   axes_lens=[128, 32, 32]).eval()
    # a freshly initialised model has near-zero modulation; draw weights that make each
    # layer change its input substantially
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 1 / np.sqrt(p.shape[1]))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    return m


def run_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(4, 1, 8, 10, generator=g)]          # 4x5 patches -> padded to 32 tokens
    cap = [torch.randn(13, 64, generator=g)]              # 13 caption tokens -> padded to 32
    return x, torch.tensor([0.6]), cap


@pytest.fixture(scope="module")
def tapped(tmp_path_factory):
    from nxhpc.models.tap import snap_weights_to_q8_0, tap_zimage
    model = small_model()
    assert snap_weights_to_q8_0(model) > 0
    x, t, cap = run_inputs()
    d = tap_zimage(model, x, t, cap, tmp_path_factory.mktemp("tap") / "z", include_weights=True)
    return model, d


def test_tapped_directory_opens_with_right_config(tapped):
    model, d = tapped
    with open_model(d) as m:
        c = m.config
        assert (c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.n_layers) == \
            (384, 6, 6, 64, 1024, 3)
        assert c.variant == "zimage" and not c.adaln_silu and c.adaln_in == 256
        assert c.norm_eps == 1e-5 and m.rope == (256.0, (16, 24, 24))
        assert m.gguf.prefix == PREFIX and m.gguf.architecture == "lumina2"
        assert m.n_tokens == 64 and m.mask() is None
        # the whole model is there in the original naming, refiners and embedders included
        names = set(m.gguf.names())
        for n in ("noise_refiner.0.attention.qkv.weight", "context_refiner.0.ffn_norm2.weight",
                  "x_embedder.weight", "final_layer.linear.weight", "t_embedder.mlp.0.weight",
                  "cap_embedder.1.weight", "layers.2.adaLN_modulation.0.bias"):
            assert n in names, n
        # Q8_0 bytes are the gguf quantizer's bytes of the model's (snapped) weights
        sd = model.state_dict()
        qkv = torch.cat([sd[f"layers.1.attention.to_{a}.weight"] for a in "qkv"]).numpy()
        np.testing.assert_array_equal(m.layer_weights(1).qkv.data, gguf.quants.quantize(qkv, Q8))
        np.testing.assert_array_equal(m.layer_weights(1).q_norm,
                                      sd["layers.1.attention.norm_q.weight"].numpy())


def test_reference_reproduces_tapped_layers(tapped):
    _, d = tapped
    with open_model(d) as m:
        c = m.config
        pe, t_emb = m.pe(), m.t_emb()
        ws = [dequantize_layer(m.layer_weights(i)) for i in range(c.n_layers)]
        for i in range(c.n_layers):
            x = m.blk_in(i)
            ref = m.ref_out(i).astype(np.float64)
            ours = block_forward_f64(x, ws[i], c, t_emb=t_emb, pe=pe)
            rms = np.sqrt(np.mean(ref ** 2))
            assert np.abs(ours - ref).max() / rms < TOL, i
            assert np.abs(ref - x).max() / rms > 0.05          # the layer did something
            # adaLN from the GGUF = the tapped modulation
            ours_m = ws[i]["adaln_w"] @ t_emb.astype(np.float64) + ws[i]["adaln_b"]
            np.testing.assert_allclose(m.adaln_m(i), ours_m, rtol=1e-5, atol=1e-5)
            if i + 1 < c.n_layers:
                np.testing.assert_array_equal(m.blk_in(i + 1), m.ref_out(i))
            # negative control: another layer's weights do not reproduce this layer
            other = ws[(i + 1) % c.n_layers]
            bad = block_forward_f64(x, other, c, t_emb=t_emb, pe=pe)
            assert np.abs(bad - ref).max() / rms > 100 * TOL
        # fixture weights re-quantize to the GGUF bytes
        fw, gw = m.layer_weights(0, "fixtures"), m.layer_weights(0, "gguf")
        np.testing.assert_array_equal(fw.w2.data, gw.w2.data)
        assert m.fixtures.dims("final_out") == (4, 1, 8, 10)


def test_pe_is_the_runs_rotary_table(tapped):
    model, d = tapped
    from nxhpc.dit import rope
    with open_model(d) as m:
        pe = m.pe()
        # image tokens first (4x5 grid at t = 32+1), then the caption (t = 1..32)
        ids = np.concatenate([rope.position_ids(0, (1, 4, 5), caption_start=33),
                              np.zeros((12, 3), int),
                              rope.position_ids(32, (1, 1, 1))[:32]])
        ours = rope.rope_table(ids, (16, 24, 24), 256.0)
        assert np.abs(ours[:20] - pe[:20]).max() < 1e-5
        assert np.abs(ours[32:] - pe[32:]).max() < 1e-5


def test_tap_rejects_bad_calls(tmp_path):
    from nxhpc.models.tap import tap_zimage
    model = small_model()
    x, t, cap = run_inputs()
    with pytest.raises(ValueError, match="batch size must be 1"):
        tap_zimage(model, x * 2, t, cap * 2, tmp_path / "a")
    with pytest.raises(TypeError, match="ZImageTransformer2DModel"):
        tap_zimage(object(), x, t, cap, tmp_path / "a")
    (tmp_path / "b").mkdir()
    with pytest.raises(FileExistsError):
        tap_zimage(model, x, t, cap, tmp_path / "b")


def test_unsnapped_tap_differs_by_quantization_error(tmp_path):
    """Without snapping, the GGUF holds rounded weights: the oracle on the GGUF weights then
    misses the tapped output by about the Q8_0 error (~1e-3), far above float32 level."""
    from nxhpc.models.tap import tap_zimage
    model = small_model(seed=3)
    x, t, cap = run_inputs(2)
    d = tap_zimage(model, x, t, cap, tmp_path / "u", prefix=False)
    with open_model(d) as m:
        assert m.gguf.prefix == ""
        ref = m.ref_out(0).astype(np.float64)
        ours = block_forward_f64(m.blk_in(0), dequantize_layer(m.layer_weights(0)), m.config,
                                 t_emb=m.t_emb(), pe=m.pe())
        err = np.abs(ours - ref).max() / np.sqrt(np.mean(ref ** 2))
        assert 10 * TOL < err < 0.1


def test_snap_gives_exactly_the_stored_weights_even_for_small_qkv_parts(tmp_path):
    """At D=32 each of to_q/to_k/to_v has 1024 values (kept F32 on its own) while the fused
    qkv the file stores is quantized: snapping must follow the fused shape. Every Q8_0 tensor
    of the file then dequantizes exactly to the (snapped) model's weight."""
    from nxhpc.models.tap import original_state_dict, snap_weights_to_q8_0, tap_zimage
    torch.manual_seed(0)
    model = Z.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=1,
        n_refiner_layers=1, n_heads=1, n_kv_heads=1, norm_eps=1e-5, qk_norm=True,
        cap_feat_dim=32, rope_theta=256.0, axes_dims=[8, 12, 12], axes_lens=[64, 16, 16]).eval()
    before = original_state_dict(model)
    snap_weights_to_q8_0(model)
    g = torch.Generator().manual_seed(1)
    d = tap_zimage(model, [torch.randn(4, 1, 4, 4, generator=g)], torch.tensor([0.5]),
                   [torch.randn(5, 32, generator=g)], tmp_path / "z")
    after = original_state_dict(model)
    with GGUFFile(d / "model.gguf") as f:
        q8 = [n for n in f.names() if f.type_name(n) == "Q8_0"]
        assert "layers.0.attention.qkv.weight" in q8
        for n in q8:
            np.testing.assert_array_equal(f.load_f32(n), after[n], err_msg=n)
        # negative control: the unsnapped weights are not what the file holds
        assert np.abs(f.load_f32("layers.0.attention.qkv.weight")
                      - before["layers.0.attention.qkv.weight"]).max() > 0


def test_overwrite_replaces_the_model_and_keeps_the_users_files(tmp_path):
    """overwrite=True replaces the model's files as one (the stale fixtures go, none of the old
    model is mixed into the new); a file of the user's beside it is passed on, not deleted with
    the old model (modeldir.build_model_dir, 2026-12-07)."""
    from nxhpc.models.tap import tap_zimage
    model = small_model(seed=4)
    x, t, cap = run_inputs(3)
    d = tmp_path / "z"
    d.mkdir()
    (d / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match="not a model directory"):
        tap_zimage(model, x, t, cap, d, overwrite=True)     # a folder of other files is kept
    assert [p.name for p in d.iterdir()] == ["notes.txt"]
    (d / "fixtures.safetensors").write_bytes(b"stale")       # an old model directory
    tap_zimage(model, x, t, cap, d, overwrite=True)
    assert sorted(p.name for p in d.iterdir()) == ["fixtures.safetensors", "model.gguf",
                                                   "notes.txt"]
    assert (d / "fixtures.safetensors").read_bytes() != b"stale"
    assert (d / "notes.txt").read_text() == "not a model"
    assert [p.name for p in tmp_path.iterdir()] == ["z"]        # no temporary directories
    with open_model(d) as m:
        assert m.config.n_layers == 3
