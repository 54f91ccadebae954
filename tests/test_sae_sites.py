"""An SAE's cfg.json names the TransformerLens hook it was trained at; used at another address it was
silently accepted because only its width was checked. Now every feature steer and SAE readout is
compared with its SAE's hook through the TransformerLens mapper (engine/interop/mappers.py): a warning
naming both, or with strict=True a refusal before anything runs."""
from __future__ import annotations

import warnings

import pytest
import torch

from engine import Readout, SAEFeatures, Steer
from engine.core.errors import SAESiteError, SAESiteWarning
from engine.core.sae_files import load_sae, sae_hooks, write_random_sae
from engine.interop.mappers import check_sae_sites, sae_site_problem, to_tl
from test_vllm_common import eager_model, vllm_model

LLAMA = "meta-llama/Llama-3.2-1B"
PROMPT = "The quick brown fox jumps over the lazy dog"
D = 256  # the zoo Llama's width


@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    root = tmp_path_factory.mktemp("sae-sites")

    def sae(name, **kw):
        return str(write_random_sae(root / name, "standard", D, 64, seed=1, **kw))
    return {"post1": sae("post1", hook_name="blocks.1.hook_resid_post"),
            "alias1": sae("alias1", hook_name="blocks.1.hook_out"),  # the bridge's other name for resid_post.1
            "normalized": sae("normalized", hook_name="blocks.1.ln2.hook_normalized"),  # not a point of ours
            "none": sae("none"),
            "tc": str(write_random_sae(root / "tc", "transcoder", D, 64, seed=2, hook_name="blocks.1.mlp.hook_in",
                                       hook_name_out="blocks.1.mlp.hook_out"))}


def _site_warnings(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, SAESiteWarning)]


def test_an_sae_used_away_from_its_hook_warns_naming_both(em, saes):
    """The issue's case: an SAE trained at blocks.1.hook_resid_post used at resid_post.0."""
    steer = Steer("resid_post.0", "feature_clamp", sae=saes["post1"], feature=3, coeff=0.0)
    got = _site_warnings(lambda: em.run_with_cache(PROMPT, steer=[steer]))
    assert got == [f"feature_clamp at resid_post.0: the SAE {saes['post1']}: its cfg.json names hook_name "
                   f"'blocks.1.hook_resid_post', our resid_post.1, but it is used at resid_post.0 (TransformerLens "
                   f"'blocks.0.hook_resid_post'); use it at resid_post.1, or use an SAE trained at resid_post.0 "
                   f"(strict=True refuses this)."]
    read = Readout("resid_post.-2", SAEFeatures(saes["post1"], k=4), name="feats")  # -2 is layer 0 of 2
    got = _site_warnings(lambda: em.generate(PROMPT, 2, readouts=[read]))
    assert len(got) == 1 and got[0].startswith("readout 'feats': the SAE") and "used at resid_post.0" in got[0]


def test_strict_refuses_before_anything_runs(em, saes, monkeypatch):
    ran = []
    monkeypatch.setattr(type(em), "_attached", lambda *a, **k: ran.append(1))  # the forward's hooks: never reached
    steer = Steer("resid_post.0", "feature_add", sae=saes["post1"], feature=3, coeff=1.0)
    with pytest.raises(SAESiteError, match=r"feature_add at resid_post.0: the SAE .*post1: its cfg.json names "
                                           r"hook_name 'blocks.1.hook_resid_post', our resid_post.1, but it is used at "
                                           r"resid_post.0 .*\(strict=True refuses an SAE used away from its hook"):
        em.run_with_cache(PROMPT, steer=[steer], strict=True)
    with pytest.raises(SAESiteError, match="readout 'f': the SAE"):
        em.generate(PROMPT, 2, readouts=[Readout("resid_post.0", SAEFeatures(saes["post1"], k=4), name="f")],
                    strict=True)
    assert ran == []


def test_an_sae_at_its_own_hook_is_silent_and_unchanged(em, saes):
    """At its hook (by either of the bridge's names, by a negative layer, as a loaded SAE) nothing is
    said, and the result is the SAE's own arithmetic on the captured rows."""
    for sae, where in ((saes["post1"], "resid_post.1"), (saes["alias1"], "resid_post.1"),
                       (load_sae(saes["post1"]), "resid_post.-1"), (saes["none"], "resid_post.0")):
        read = Readout(where, SAEFeatures(sae, k=4), name="feats")
        got = []
        assert _site_warnings(lambda: got.append(em.run_with_cache(PROMPT, [where], readouts=[read], strict=True)[1])) == []
        x = got[0][where][0]
        want = torch.topk(load_sae(saes["post1"] if sae is not saes["none"] else saes["none"]).encode(x), 4)
        assert torch.allclose(got[0].readouts["feats"].values[0], want.values, atol=1e-5)


def test_a_hook_that_is_no_point_of_ours_and_a_transcoder_out_side(em, saes):
    why = sae_site_problem(em, "blocks.1.ln2.hook_normalized", "resid_post.1")
    assert why == ("its cfg.json names hook_name 'blocks.1.ln2.hook_normalized', which holds no point of our catalogue "
                   "on this model, but it is used at resid_post.1 (TransformerLens 'blocks.1.hook_resid_post'); use it "
                   "where it was trained, or use an SAE trained at resid_post.1")
    assert sae_site_problem(em, "blocks.0.hook_resid_pre", "embeddings") is None  # one tensor, two names
    assert sae_site_problem(em, None, "resid_post.0") is None
    # a transcoder reads hook_name and writes hook_name_out: a feature_add adds its decode, at the out side
    assert to_tl(em, "mlp_out.1") == sae_hooks(saes["tc"]).hook_name_out
    at_out = Steer("mlp_out.1", "feature_add", sae=saes["tc"], feature=2, coeff=1.0)
    at_in = Steer("mlp_in.1", "feature_add", sae=saes["tc"], feature=2, coeff=1.0)
    assert _site_warnings(lambda: check_sae_sites(em, [em._steer(at_out)])) == []
    assert "used at mlp_in.1" in _site_warnings(lambda: check_sae_sites(em, [em._steer(at_in)]))[0]
    read_in = Readout("mlp_in.1", SAEFeatures(saes["tc"], k=4), name="t")
    assert _site_warnings(lambda: check_sae_sites(em, readouts=[em._readout(read_in)])) == []


@pytest.mark.vllm
def test_vllm_warns_and_strict_refuses_the_same(saes):
    vm = vllm_model(LLAMA)
    steer = Steer("resid_post.0", "feature_clamp", sae=saes["post1"], feature=3, coeff=0.0)
    got = _site_warnings(lambda: vm.run_with_cache(PROMPT, steer=[steer]))
    assert len(got) == 1 and "'blocks.1.hook_resid_post', our resid_post.1, but it is used at resid_post.0" in got[0]
    with pytest.raises(SAESiteError, match="readout 'f': the SAE"):
        vm.generate(PROMPT, 2, readouts=[Readout("resid_post.0", SAEFeatures(saes["post1"], k=4), name="f")],
                    strict=True)
    ok = Readout("resid_post.1", SAEFeatures(saes["post1"], k=4), name="f")
    assert _site_warnings(lambda: vm.generate(PROMPT, 2, readouts=[ok], strict=True)) == []
