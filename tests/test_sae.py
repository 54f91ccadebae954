"""engine/core/sae.py, sae_files.py and features.py: SAELens-format SAEs and transcoders loaded without
SAELens, checked against a plain-torch computation written here from the files on disk (cfg.json read
with json, the tensors with safetensors), and every malformed input refused by name.
(tests/test_sae_reference.py checks the same against SAELens itself, in its own venv.)"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.errors import SAEError
from engine.core.features import (
    above,
    add_feature_direction,
    clamp_feature,
    dense,
    edit_features,
    reconstruction_error,
    scale_feature,
    topk,
)
from engine.core.sae import ARCHITECTURES
from engine.core.sae_files import load_sae, random_sae, save_sae, write_random_sae

ARCHS = list(ARCHITECTURES)
TOL = 1e-5


def _reference(folder, x, factor=1.0):
    """(feats, recon) from the files alone: plain torch, written from SAELens's documented maths."""
    cfg = json.loads((folder / "cfg.json").read_text())
    w = load_file(str(folder / "sae_weights.safetensors"))
    arch, norm = cfg["architecture"], cfg["normalize_activations"]
    x = x.reshape(x.shape[0], -1).float()
    scale, mu, sd = 1.0, None, None
    if norm == "expected_average_only_in":
        scale = factor
    elif norm == "constant_norm_rescale":
        scale = math.sqrt(cfg["d_in"]) / torch.sqrt((x * x).sum(1, keepdim=True))
    h = x * scale
    if norm == "layer_norm":
        mu = x.mean(1, keepdim=True)
        sd = torch.sqrt(((x - mu) ** 2).sum(1, keepdim=True) / (x.shape[1] - 1))
        h = (x - mu) / (sd + 1e-5)
    if cfg["apply_b_dec_to_input"]:
        h = h - w["b_dec"]
    if arch == "gated":
        gate = torch.einsum("nd,df->nf", h, w["W_enc"]) + w["b_gate"]
        mag = torch.einsum("nd,df->nf", h, w["W_enc"] * w["r_mag"].exp()) + w["b_mag"]
        feats = mag.clamp(min=0) * (gate > 0)
    else:
        pre = torch.einsum("nd,df->nf", h, w["W_enc"]) + w["b_enc"]
        feats = pre.clamp(min=0)
        if "threshold" in w:
            feats = feats * (pre > w["threshold"])
        if arch == "topk":
            ranked = pre * w["W_dec"].norm(dim=1) if cfg.get("rescale_acts_by_decoder_norm") else pre
            keep = torch.zeros_like(pre, dtype=torch.bool)
            for r in range(pre.shape[0]):
                keep[r, ranked[r].argsort(descending=True)[:cfg["k"]]] = True
            feats = ranked.clamp(min=0) * keep
    dec_in = feats / w["W_dec"].norm(dim=1) if cfg.get("rescale_acts_by_decoder_norm") else feats
    recon = torch.einsum("nf,fo->no", dec_in, w["W_dec"]) + w["b_dec"]
    if norm == "layer_norm":
        recon = recon * sd + mu
    else:
        recon = recon / scale
    return feats, recon


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_decode_equal_a_plain_computation_from_the_files(tmp_path, arch):
    folder = write_random_sae(tmp_path / arch, arch, d_in=24, d_sae=96, seed=3, k=7)
    sae = load_sae(folder)
    x = torch.randn(9, 24, generator=torch.Generator().manual_seed(1))
    feats, recon = _reference(folder, x)
    got = sae.encode(x)
    assert got.shape == (9, 96) and got.dtype == torch.float32
    assert (got > 0).any() and (got == 0).any()  # some features fire, some do not
    torch.testing.assert_close(got, feats, atol=TOL, rtol=0)
    torch.testing.assert_close(sae.decode(got), recon, atol=TOL, rtol=0)
    skip = x @ load_file(str(folder / "sae_weights.safetensors"))["W_skip"].T if ARCHITECTURES[arch].skip else 0
    torch.testing.assert_close(sae.forward(x), recon + skip, atol=TOL, rtol=0)
    assert sae.arch.transcoder == ("transcoder" in arch)


@pytest.mark.parametrize("norm", ["constant_norm_rescale", "layer_norm", "expected_average_only_in"])
@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_activation_normalizations(tmp_path, arch, norm):
    folder = write_random_sae(tmp_path, arch, d_in=16, d_sae=48, seed=5, normalize_activations=norm)
    factor = 2.5 if norm == "expected_average_only_in" else None
    sae = load_sae(folder, norm_scaling_factor=factor)
    x = 3 * torch.randn(6, 16, generator=torch.Generator().manual_seed(2)) + 1
    feats, recon = _reference(folder, x, factor or 1.0)
    f = sae.encode(x)
    torch.testing.assert_close(f, feats, atol=TOL, rtol=0)
    torch.testing.assert_close(sae.decode(f, x), recon, atol=TOL, rtol=1e-6)
    if sae.norm.needs_input:
        with pytest.raises(SAEError, match=f"normalize_activations is '{norm}', so decode needs the activation"):
            sae.decode(f)


def test_topk_rescaled_by_decoder_norm(tmp_path):
    folder = write_random_sae(tmp_path, "topk", 16, 48, seed=2, k=5, rescale_acts_by_decoder_norm=True)
    sae = load_sae(folder)
    assert sae.rescale_acts_by_decoder_norm
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    feats, recon = _reference(folder, x)
    torch.testing.assert_close(sae.encode(x), feats, atol=TOL, rtol=0)
    torch.testing.assert_close(sae.decode(sae.encode(x)), recon, atol=TOL, rtol=0)


def test_hook_z_sae_reads_heads_flattened(tmp_path):
    folder = write_random_sae(tmp_path, "standard", 4 * 8, 40, seed=1, hook_z=True, hook_name="blocks.0.attn.hook_z")
    sae = load_sae(folder)
    z = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(0))
    feats, recon = _reference(folder, z)
    torch.testing.assert_close(sae.encode(z), feats, atol=TOL, rtol=0)
    torch.testing.assert_close(sae.encode(z.flatten(-2)), feats, atol=TOL, rtol=0)
    assert sae.decode(sae.encode(z)).shape == (3, 32)
    torch.testing.assert_close(sae.forward(z), recon, atol=TOL, rtol=0)  # flat, as decode
    out = clamp_feature(sae, z, 0, 1.0)
    assert out.shape == z.shape
    assert add_feature_direction(sae, z, 1, 2.0).shape == z.shape


def test_dtype_from_cfg_and_override(tmp_path):
    folder = write_random_sae(tmp_path, "jumprelu", 16, 32, seed=0, dtype="bfloat16")
    assert json.loads((folder / "cfg.json").read_text())["dtype"] == "bfloat16"
    sae = load_sae(folder)
    assert sae.dtype == torch.bfloat16 and sae.threshold.dtype == torch.bfloat16
    x = torch.randn(2, 16)
    assert sae.encode(x).dtype == torch.bfloat16  # the input is cast to the SAE's dtype, as SAELens does
    wide = load_sae(folder, dtype="float64")
    assert wide.dtype == torch.float64
    raw = load_file(str(folder / "sae_weights.safetensors"))
    assert torch.equal(wide.W_enc, raw["W_enc"].double())
    with pytest.raises(SAEError, match=r"the dtype argument is 'int8'; use one of float32, float64"):
        load_sae(folder, dtype="int8")


def test_save_then_load_is_exact(tmp_path):
    for arch in ARCHS:
        sae = random_sae(arch, 8, 20, seed=4, hook_name="blocks.1.hook_resid_post",
                         hook_name_out="blocks.1.hook_mlp_out" if "transcoder" in arch else None)
        back = load_sae(save_sae(sae, tmp_path / arch))
        for name in ("W_enc", "W_dec", "b_dec", "b_enc", "threshold", "b_gate", "b_mag", "r_mag", "W_skip"):
            a, b = getattr(sae, name), getattr(back, name)
            assert (a is None and b is None) or torch.equal(a, b), (arch, name)
        assert (back.arch, back.k, back.apply_b_dec_to_input, back.hook_name, back.hook_name_out) == \
            (sae.arch, sae.k, sae.apply_b_dec_to_input, sae.hook_name, sae.hook_name_out)
        assert back.source == tmp_path / arch


def test_pre_6_config_layout(tmp_path):
    folder = write_random_sae(tmp_path, "topk", 16, 32, seed=0, k=3)
    modern = load_sae(folder)
    cfg = json.loads((folder / "cfg.json").read_text())
    old = {"d_in": 16, "d_sae": 32, "dtype": "torch.float32", "hook_point": "blocks.2.hook_resid_pre",
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 3}, "normalize_activations": False,
           "apply_b_dec_to_input": cfg["apply_b_dec_to_input"]}
    (folder / "cfg.json").write_text(json.dumps(old))
    sae = load_sae(folder)
    assert (sae.arch.name, sae.k, sae.hook_name, sae.norm.name) == ("topk", 3, "blocks.2.hook_resid_pre", "none")
    x = torch.randn(3, 16)
    assert torch.equal(sae.encode(x), modern.encode(x))


# ---- sparse helpers ----------------------------------------------------------------------------------

def test_topk_above_dense():
    f = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.5]])
    idx, val = topk(f, 2)
    assert idx.tolist() == [[1, 3], [0, 3]] and val.tolist() == [[3.0, 2.0], [5.0, 0.5]]
    back = dense(idx, val, 4)
    assert back.tolist() == [[0.0, 3.0, 0.0, 2.0], [5.0, 0.0, 0.0, 0.5]]
    coo, v = above(f, 0.75)
    assert coo.tolist() == [[0, 1], [0, 2], [0, 3], [1, 0]] and v.tolist() == [3.0, 1.0, 2.0, 5.0]
    for k in (0, 5, 1.5, True):
        with pytest.raises(SAEError, match=f"topk k={k!r}; give an integer from 1 to the number of features"):
            topk(f, k)


# ---- steering ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated"])
def test_clamp_keeps_the_reconstruction_error(tmp_path, arch):
    sae = load_sae(write_random_sae(tmp_path, arch, 16, 48, seed=7, k=6))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    f = sae.encode(x)
    i = int(f.sum(0).argmax())  # a feature that fires somewhere
    out = clamp_feature(sae, x, i, 4.0)
    f_edit = f.clone()
    f_edit[:, i] = 4.0
    # the error term x - decode(f) is the same before and after
    torch.testing.assert_close(out - sae.decode(f_edit), x - sae.decode(f), atol=TOL, rtol=0)
    # and independently: the change is (4 - f_i) times feature i's decoder row
    torch.testing.assert_close(out - x, (4.0 - f[:, i:i + 1]) * sae.W_dec[i], atol=TOL, rtol=0)
    torch.testing.assert_close(clamp_feature(sae, x, i, f[0, i].item())[0], x[0], atol=TOL, rtol=0)
    torch.testing.assert_close(scale_feature(sae, x, i, 1.0), x, atol=TOL, rtol=0)
    torch.testing.assert_close(scale_feature(sae, x, [i, 0], [0.0, 1.0]) - x, -f[:, i:i + 1] * sae.W_dec[i],
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("arch,options", [
    ("standard", {}), ("topk", {"rescale_acts_by_decoder_norm": True}), ("gated", {}),
    ("jumprelu", {"normalize_activations": "layer_norm"}), ("standard", {"normalize_activations": "constant_norm_rescale"}),
    ("topk", {"normalize_activations": "expected_average_only_in"}), ("jumprelu_skip_transcoder", {}),
])
def test_clamp_and_scale_equal_the_two_decode_definition(tmp_path, arch, options):
    """clamp/scale read only the edited decoder rows; the result is the definition's
    x + decode(f') - decode(f) with two full decodes (edit_features)."""
    factor = 1.3 if options.get("normalize_activations") == "expected_average_only_in" else None
    sae = load_sae(write_random_sae(tmp_path, arch, 16, 48, seed=9, **options), norm_scaling_factor=factor)
    g = torch.Generator().manual_seed(4)
    src = 2 * torch.randn(2, 5, 16, generator=g) + 0.3
    x = src if not sae.arch.transcoder else torch.randn(2, 5, 16, generator=g)
    source = src if sae.arch.transcoder else None
    idx = [3, 17, 40]

    def set_to(f):
        f[..., idx] = torch.tensor([1.5, 0.0, -0.5])
        return f

    def times(f):
        f[..., idx] = f[..., idx] * torch.tensor([2.0, 0.0, 0.5])
        return f
    torch.testing.assert_close(clamp_feature(sae, x, idx, [1.5, 0.0, -0.5], source=source),
                               edit_features(sae, x, set_to, source=source), atol=TOL, rtol=0)
    torch.testing.assert_close(scale_feature(sae, x, idx, [2.0, 0.0, 0.5], source=source),
                               edit_features(sae, x, times, source=source), atol=TOL, rtol=0)


def test_clamp_under_constant_norm_rescale_keeps_the_error(tmp_path):
    sae = load_sae(write_random_sae(tmp_path, "standard", 16, 48, seed=1, normalize_activations="constant_norm_rescale"))
    x = 5 * torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    f = sae.encode(x)
    out = clamp_feature(sae, x, 2, 1.5)
    f2 = f.clone()
    f2[:, 2] = 1.5
    torch.testing.assert_close(out - sae.decode(f2, x), x - sae.decode(f, x), atol=1e-4, rtol=0)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True) / 4.0  # sqrt(d_in) = 4
    torch.testing.assert_close(out - x, (1.5 - f[:, 2:3]) * sae.W_dec[2] * norm, atol=1e-4, rtol=0)


def test_transcoder_clamp_reads_source_and_writes_output(tmp_path):
    sae = load_sae(write_random_sae(tmp_path, "skip_transcoder", 16, 40, seed=2, d_out=12,
                                    hook_name="blocks.0.ln2.hook_normalized", hook_name_out="blocks.0.hook_mlp_out"))
    assert (sae.d_in, sae.d_out, sae.hook_name_out) == (16, 12, "blocks.0.hook_mlp_out")
    x_in = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    x_out = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    f = sae.encode(x_in)
    out = clamp_feature(sae, x_out, 5, 2.0, source=x_in)
    torch.testing.assert_close(out - x_out, (2.0 - f[:, 5:6]) * sae.W_dec[5], atol=TOL, rtol=0)
    with pytest.raises(SAEError, match=r"pass source= \(the activation at blocks.0.ln2.hook_normalized\) with x the "
                                       r"activation at blocks.0.hook_mlp_out"):
        clamp_feature(sae, x_out, 5, 2.0)


@pytest.mark.parametrize("arch", ["transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"])
def test_transcoder_error_is_the_output_point_minus_the_prediction(tmp_path, arch):
    """Encode at the input point, decode compared with the output point's activation: x_out minus (the
    files' decode of x_in, plus x_in @ W_skip.T for a skip transcoder), computed here from the files."""
    folder = write_random_sae(tmp_path, arch, 16, 40, seed=3, d_out=12)
    sae = load_sae(folder)
    g = torch.Generator().manual_seed(5)
    x_in, x_out = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 12, generator=g)
    _, recon = _reference(folder, x_in.reshape(6, 16))
    w = load_file(str(folder / "sae_weights.safetensors"))
    if "W_skip" in w:
        recon = recon + x_in.reshape(6, 16) @ w["W_skip"].T
    err = reconstruction_error(sae, x_out, source=x_in)
    assert err.shape == x_out.shape and err.dtype == x_out.dtype
    torch.testing.assert_close(err, x_out - recon.reshape(2, 3, 12), atol=TOL, rtol=0)
    with pytest.raises(SAEError, match=r"pass source= \(the activation at the input point\)"):
        reconstruction_error(sae, x_out)
    with pytest.raises(SAEError, match=r"the decoder writes 12 values \(cfg.json field 'd_out'\) but x is 16 wide"):
        reconstruction_error(sae, x_in, source=x_in)
    with pytest.raises(SAEError, match=r"source of shape \(2, 16\) predicts \(2, 12\), which does not match x of "
                                       r"shape \(2, 3, 12\)"):
        reconstruction_error(sae, x_out, source=x_in[:, 0])


def test_sae_error_defaults_to_its_own_input(tmp_path):
    folder = write_random_sae(tmp_path, "standard", 16, 40, seed=6)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    _, recon = _reference(folder, x)
    torch.testing.assert_close(reconstruction_error(load_sae(folder), x), x - recon, atol=TOL, rtol=0)


def test_add_feature_direction(tmp_path):
    sae = load_sae(write_random_sae(tmp_path, "topk", 16, 48, seed=3, rescale_acts_by_decoder_norm=True))
    x = torch.randn(2, 3, 16)
    got = add_feature_direction(sae, x, [4, 9], [2.0, -1.0])
    w = sae.W_dec
    torch.testing.assert_close(got, x + 2.0 * w[4] / w[4].norm() - w[9] / w[9].norm(), atol=TOL, rtol=0)


def test_steering_input_errors(tmp_path):
    sae = load_sae(write_random_sae(tmp_path, "standard", 16, 48, seed=0))
    x = torch.randn(2, 16)
    where = str(tmp_path)
    with pytest.raises(SAEError, match=rf"{where}: feature index 48 is out of range; the SAE has d_sae=48 features "
                                       r"\(0..47\)"):
        clamp_feature(sae, x, 48, 1.0)
    with pytest.raises(SAEError, match=r"clamp value \[1.0\]: give one number, or one per feature index \(2\)"):
        clamp_feature(sae, x, [1, 2], [1.0])
    with pytest.raises(SAEError, match="scale factor nan contains NaN or inf"):
        scale_feature(sae, x, 1, float("nan"))
    with pytest.raises(SAEError, match=r"feature indices \[3, 3\] name a feature twice"):
        clamp_feature(sae, x, [3, 3], 1.0)
    with pytest.raises(SAEError, match="no feature index given"):
        clamp_feature(sae, x, [], 1.0)
    with pytest.raises(SAEError, match=r"input of shape \(2, 15\) has last dim 15; the SAE reads d_in=16"):
        sae.encode(torch.randn(2, 15))
    with pytest.raises(SAEError, match=r"feature tensor of shape \(2, 47\); the SAE has d_sae=48 features"):
        sae.decode(torch.randn(2, 47))
    with pytest.raises(SAEError, match=r"activation of shape \(2, 8\); the decoder writes d_out=16"):
        add_feature_direction(sae, torch.randn(2, 8), 0, 1.0)
    torch.testing.assert_close(edit_features(sae, x, lambda f: f), x, atol=0, rtol=0)


def test_width_checks_name_the_point_and_field(tmp_path):
    sae = load_sae(write_random_sae(tmp_path / "s", "standard", 16, 48))
    sae.check_width(16, "resid_post.3")
    with pytest.raises(SAEError, match=rf"{tmp_path / 's'}: d_in is 16 \(cfg.json field 'd_in'\) but resid_post.3 is "
                                       r"128 wide; attach an SAE trained on this model's resid_post.3"):
        sae.check_width(128, "resid_post.3")
    tc = load_sae(write_random_sae(tmp_path / "t", "transcoder", 16, 48, d_out=12))
    tc.check_out_width(12, "mlp_out.0")
    with pytest.raises(SAEError, match=r"the decoder writes 12 values \(cfg.json field 'd_out'\) but mlp_out.0 is 16"):
        tc.check_out_width(16, "mlp_out.0")


# ---- malformed folders -------------------------------------------------------------------------------

def _edit_cfg(folder, **changes):
    cfg = json.loads((folder / "cfg.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "cfg.json").write_text(json.dumps(cfg))


def _edit_weights(folder, drop=(), **changes):
    w = load_file(str(folder / "sae_weights.safetensors"))
    for k in drop:
        del w[k]
    w.update(changes)
    save_file(w, str(folder / "sae_weights.safetensors"))


@pytest.mark.parametrize("case,expect", [
    ("no_folder", r"nope: no such folder; give the folder that holds cfg.json and sae_weights.safetensors"),
    ("no_cfg", r"cfg.json: missing; an SAELens SAE folder holds cfg.json and sae_weights.safetensors"),
    ("no_weights", r"sae_weights.safetensors: missing"),
    ("bad_json", r"cfg.json: not valid JSON"),
    ("json_list", r"cfg.json: holds a list; expected a JSON object"),
    ("unknown_arch", r"cfg.json: field 'architecture' is 'sparsemax', an unknown architecture; implemented: standard"),
    ("refused_arch", r"field 'architecture' is 'abstopk', which this loader refuses: its signed top-k"),
    ("no_arch", r"cfg.json: field 'architecture' is missing"),
    ("bad_d_in", r"cfg.json: field 'd_in' is '16'; expected a positive integer \(the width of the activation"),
    ("zero_d_sae", r"cfg.json: field 'd_sae' is 0; expected a positive integer \(the number of features\)"),
    ("big_k", r"cfg.json: field 'k' is 99, more than d_sae=32 features"),
    ("no_k", r"cfg.json: field 'k' is missing"),
    ("bad_dtype", r"cfg.json: field 'dtype' is 'float8'; use one of float32"),
    ("bad_norm", r"cfg.json: field 'normalize_activations' is 'rms'; known values: none, expected_average_only_in"),
    ("whitening", r"field 'normalize_activations' is 'covariance_whitening': SAELens folds the whitening"),
    ("average_no_factor", r"'expected_average_only_in', whose factor is not in the folder: pass norm_scaling_factor="),
    ("bad_reshape", r"field 'reshape_activations' is 'heads'; known values: none, hook_z"),
    ("bad_bool", r"field 'apply_b_dec_to_input' is 'yes'; expected true or false"),
    ("wrong_shape", r"sae_weights.safetensors: tensor 'W_enc' has shape \(16, 31\); cfg.json \(d_in, d_sae, d_out\) "
                    r"says \(16, 32\)"),
    ("d_in_mismatch", r"tensor 'W_enc' has shape \(16, 32\); cfg.json \(d_in, d_sae, d_out\) says \(20, 32\)"),
    ("missing_tensor", r"tensor\(s\) threshold missing; this architecture needs W_enc, W_dec, b_dec, b_enc, threshold"),
    ("extra_tensor", r"unexpected tensor\(s\) log_threshold for this architecture"),
    ("nan", r"tensor 'b_enc' contains NaN or inf"),
    ("int_tensor", r"tensor 'b_dec' has dtype torch.int64; expected floating weights"),
    ("not_safetensors", r"sae_weights.safetensors: not a readable safetensors file"),
    ("scaling_factor", r"tensor 'scaling_factor' is not all ones"),
])
def test_malformed_folders_are_refused_by_name(tmp_path, case, expect):
    folder = write_random_sae(tmp_path / "sae", "jumprelu" if case in ("missing_tensor", "extra_tensor") else "topk",
                              16, 32, seed=0, k=4)
    arg = folder
    if case == "no_folder":
        arg = tmp_path / "nope"
    elif case == "no_cfg":
        (folder / "cfg.json").unlink()
    elif case == "no_weights":
        (folder / "sae_weights.safetensors").unlink()
    elif case == "bad_json":
        (folder / "cfg.json").write_text("{'d_in': 16")
    elif case == "json_list":
        (folder / "cfg.json").write_text("[1, 2]")
    elif case in ("unknown_arch", "refused_arch", "no_arch"):
        _edit_cfg(folder, architecture={"unknown_arch": "sparsemax", "refused_arch": "abstopk", "no_arch": None}[case])
    elif case == "bad_d_in":
        _edit_cfg(folder, d_in="16")
    elif case == "zero_d_sae":
        _edit_cfg(folder, d_sae=0)
    elif case in ("big_k", "no_k"):
        _edit_cfg(folder, k=99 if case == "big_k" else None)
    elif case == "bad_dtype":
        _edit_cfg(folder, dtype="float8")
    elif case in ("bad_norm", "whitening", "average_no_factor"):
        _edit_cfg(folder, normalize_activations={"bad_norm": "rms", "whitening": "covariance_whitening",
                                                 "average_no_factor": "expected_average_only_in"}[case])
    elif case == "bad_reshape":
        _edit_cfg(folder, reshape_activations="heads")
    elif case == "bad_bool":
        _edit_cfg(folder, apply_b_dec_to_input="yes")
    elif case == "wrong_shape":
        _edit_weights(folder, W_enc=torch.zeros(16, 31))
    elif case == "d_in_mismatch":
        _edit_cfg(folder, d_in=20)
    elif case == "missing_tensor":
        _edit_weights(folder, drop=("threshold",))
    elif case == "extra_tensor":
        _edit_weights(folder, log_threshold=torch.zeros(32))
    elif case == "nan":
        _edit_weights(folder, b_enc=torch.full((32,), float("nan")))
    elif case == "int_tensor":
        _edit_weights(folder, b_dec=torch.zeros(16, dtype=torch.int64))
    elif case == "not_safetensors":
        (folder / "sae_weights.safetensors").write_bytes(b"\x00" * 40)
    elif case == "scaling_factor":
        _edit_weights(folder, scaling_factor=torch.full((32,), 2.0))
    with pytest.raises(SAEError, match=expect):
        load_sae(arg)


def test_transcoder_specific_refusals(tmp_path):
    folder = write_random_sae(tmp_path, "transcoder", 16, 32, d_out=8)
    _edit_cfg(folder, apply_b_dec_to_input=True)
    with pytest.raises(SAEError, match=r"field 'apply_b_dec_to_input' is true for a transcoder; a transcoder's b_dec is "
                                       r"d_out wide"):
        load_sae(folder)
    _edit_cfg(folder, apply_b_dec_to_input=False, normalize_activations="layer_norm")
    with pytest.raises(SAEError, match=r"'layer_norm' on a transcoder; only 'none' is defined for transcoders"):
        load_sae(folder)
    _edit_cfg(folder, normalize_activations="none", d_out=None)
    with pytest.raises(SAEError, match=r"cfg.json: field 'd_out' is missing"):
        load_sae(folder)


def test_scaling_factor_of_ones_is_dropped_and_factor_checks(tmp_path):
    folder = write_random_sae(tmp_path, "standard", 16, 32)
    _edit_weights(folder, scaling_factor=torch.ones(32))
    assert load_sae(folder).d_sae == 32
    with pytest.raises(SAEError, match="norm_scaling_factor applies to expected_average_only_in SAEs"):
        load_sae(folder, norm_scaling_factor=2.0)
    _edit_cfg(folder, normalize_activations="expected_average_only_in")
    for bad in (0.0, -1.0, float("inf"), True):
        with pytest.raises(SAEError, match=f"norm_scaling_factor is {bad!r}; give a finite positive number"):
            load_sae(folder, norm_scaling_factor=bad)


# ---- the README's example ------------------------------------------------------------------------------

def test_readme_sae_example_runs_as_written(tmp_path, monkeypatch, capsys):
    from scripts import readme_blocks
    block = readme_blocks.get("sae").code()
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(block, "README.md", "exec"), ns)
    m, sae, x, off, idx = ns["m"], ns["sae"], ns["x"], ns["off"], ns["idx"]
    assert (tmp_path / "my_sae" / "cfg.json").is_file() and sae.d_in == m.d_model
    f = sae.encode(x)
    i = int(idx[-1, 0])
    assert i == int(f[-1].argmax()) and (f > 0).sum(-1).max() <= 8
    # clamping to 0 moved every row by -f_i times feature i's decoder row, nothing else
    torch.testing.assert_close(off - x, -f[:, i:i + 1] * sae.W_dec[i], atol=TOL, rtol=0)
    assert (ns["steered"] - ns["logits"]).norm() > 0
    assert str(idx[-1].tolist()) in capsys.readouterr().out


def test_cached_sae_reuses_and_rereads_a_rewritten_folder(tmp_path):
    import os
    import pickle

    from engine.core.sae_files import cached_sae
    folder = write_random_sae(tmp_path, "standard", 16, 32, seed=0)
    a = cached_sae(folder)
    assert cached_sae(str(folder)) is a  # same folder, same options: the same object
    assert cached_sae(folder, dtype="float64") is not a
    write_random_sae(tmp_path, "standard", 16, 32, seed=1)
    weights = folder / "sae_weights.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a rewrite in the same mtime tick
    b = cached_sae(folder)
    assert b is not a and not torch.equal(a.W_enc, b.W_enc)
    assert torch.equal(b.W_enc, load_sae(folder).W_enc)
    # an SAE crosses a process boundary as plain data (a worker may receive one)
    back = pickle.loads(pickle.dumps(b))
    x = torch.randn(3, 16)
    assert back.arch is b.arch and back.norm is b.norm and torch.equal(back.encode(x), b.encode(x))
