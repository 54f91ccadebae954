"""engine/core/sae.py against SAELens itself: the same random SAE folders loaded by SAELens's own
`SAE.load_from_disk`, its `encode` / `decode` (and a skip transcoder's `forward`) run in a subprocess
with .saelens-ref/ first on its path (scripts/sae_reference.sh installs SAELens and the TransformerLens
3.x it needs there with --no-deps: our TransformerLens 4.x cannot serve it), compared to ours to 1e-5
in float32, for every architecture we load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.sae import ARCHITECTURES
from engine.core.sae_files import load_sae, write_random_sae

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
REF_DIR = Path(os.environ.get("SAE_REFERENCE_DIR", REPO / ".saelens-ref"))
TOL = 1e-5

# (case name, architecture, random_sae options, norm_scaling_factor)
CASES = [(arch, arch, {"d_out": 20} if ARCHITECTURES[arch].transcoder else {}, None) for arch in ARCHITECTURES] + [
    ("topk_rescaled", "topk", {"rescale_acts_by_decoder_norm": True}, None),
    ("standard_constant_norm_rescale", "standard", {"normalize_activations": "constant_norm_rescale"}, None),
    ("standard_layer_norm", "standard", {"normalize_activations": "layer_norm"}, None),
    ("jumprelu_layer_norm", "jumprelu", {"normalize_activations": "layer_norm"}, None),
    ("gated_expected_average", "gated", {"normalize_activations": "expected_average_only_in"}, 1.7),
    ("standard_expected_average_folded", "standard", {"normalize_activations": "expected_average_only_in"}, 1.0),
    ("standard_no_b_dec_in", "standard", {"apply_b_dec_to_input": False}, None),
    ("standard_hook_z", "standard", {"hook_z": True, "hook_name": "blocks.0.attn.hook_z"}, None),
]
D_IN, D_SAE, HEADS = 24, 96, 4
SAELENS_CLASS = {"standard": "StandardSAE", "topk": "TopKSAE", "jumprelu": "JumpReLUSAE", "gated": "GatedSAE",
                 "transcoder": "Transcoder", "skip_transcoder": "SkipTranscoder",
                 "jumprelu_transcoder": "JumpReLUTranscoder", "jumprelu_skip_transcoder": "JumpReLUSkipTranscoder"}

# runs with .saelens-ref first on the path: SAELens's public API only
REFERENCE = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    from importlib.metadata import version
    from sae_lens import SAE
    assert version("transformer-lens").startswith("3."), version("transformer-lens")  # the side directory's
    cases = json.loads(sys.argv[1])
    inputs = load_file(sys.argv[2])
    out = {}
    for name, folder, factor in cases:
        sae = SAE.load_from_disk(folder, device="cpu")
        if factor is not None:
            sae.fold_activation_norm_scaling_factor(factor)  # SAELens applies a known factor by folding it
        x = inputs[name]
        with torch.no_grad():
            feats = sae.encode(x)
            recon = sae.decode(feats)
            out[name + ".feats"] = feats.contiguous()
            out[name + ".recon"] = recon.reshape(x.shape[0], -1).contiguous()
            out[name + ".forward"] = sae.forward(x).reshape(x.shape[0], -1).contiguous()
        out[name + ".class"] = torch.tensor([ord(c) for c in type(sae).__name__])
    save_file(out, sys.argv[3])
""")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    if not (REF_DIR / "sae_lens").is_dir():
        pytest.skip(f"the SAELens reference is missing ({REF_DIR}): run `bash scripts/sae_reference.sh` "
                    f"(CI's slow step does)")
    root = tmp_path_factory.mktemp("sae_ref")
    g = torch.Generator().manual_seed(0)
    inputs, cases = {}, []
    for i, (name, arch, options, factor) in enumerate(CASES):
        write_random_sae(root / name, arch, D_IN, D_SAE, seed=10 + i, **options)
        shape = (7, HEADS, D_IN // HEADS) if options.get("hook_z") else (7, D_IN)
        inputs[name] = (2 * torch.randn(*shape, generator=g) + 0.5).contiguous()
        cases.append((name, str(root / name), factor))
    save_file(inputs, str(root / "inputs.safetensors"))
    script = root / "reference.py"
    script.write_text(REFERENCE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONPATH": str(REF_DIR)}  # SAELens and its TransformerLens 3.x shadow ours in this process only
    proc = subprocess.run([sys.executable, str(script), json.dumps(cases), str(root / "inputs.safetensors"),
                           str(root / "out.safetensors")], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, f"SAELens reference run failed:\n{proc.stderr[-4000:]}"
    return root, inputs, load_file(str(root / "out.safetensors"))


@pytest.mark.parametrize("name,arch,options,factor", CASES, ids=[c[0] for c in CASES])
def test_encode_decode_equal_saelens(reference, name, arch, options, factor):
    root, inputs, ref = reference
    sae = load_sae(root / name, norm_scaling_factor=factor)
    x = inputs[name]
    feats = sae.encode(x)
    # SAELens read the folder as the same architecture
    assert "".join(chr(c) for c in ref[name + ".class"].tolist()) == SAELENS_CLASS[arch]
    assert (feats > 0).any() and (feats == 0).any()
    torch.testing.assert_close(feats, ref[name + ".feats"], atol=TOL, rtol=0)
    torch.testing.assert_close(sae.decode(feats, x), ref[name + ".recon"], atol=TOL, rtol=0)
    torch.testing.assert_close(sae.forward(x), ref[name + ".forward"], atol=TOL, rtol=0)
