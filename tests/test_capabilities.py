"""Verdicts before running (engine/model/capabilities.py) agree with what a call then does, point by point
and layer by layer, on one family of each kind; block layouts; weight accessors against the
captured tensors they produce (z @ W_O = attn_out, mlp_act @ W_down = mlp_out, final_norm @ W_U =
logits)."""
from __future__ import annotations

import pytest
import torch

from engine.core.errors import AddressError, SteeringError, UnsupportedPointError
from engine.core.points import POINTS
from engine.core.steering import Steer
from test_vllm_common import eager_model

KINDS = {"gpt2": "openai-community/gpt2", "gqa_rope": "meta-llama/Llama-3.2-1B", "sandwich": "google/gemma-2-2b",
         "moe": "mistralai/Mixtral-8x7B-v0.1", "hybrid": "LiquidAI/LFM2-350M"}
TEXT = "The quick brown fox jumps over the lazy dog"
def model(name):  # eager models are shared across the session's test modules
    return eager_model(name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_verdict_matches_the_call(kind):
    m = model(KINDS[kind])
    table = m.describe()
    assert len(table) == sum(1 if p.scope == "trunk" else m.n_layers for p in POINTS)
    served = [v.address for v in table.served()]
    _, cache = m.run_with_cache(TEXT, served)  # every served address captures, in one call
    assert set(cache) == set(served)
    for v in table:
        if not v.served:
            with pytest.raises(AddressError) as e:
                m.address(v.address)
            assert v.reason.rstrip(".").split(": ")[-1] in str(e.value)
            assert m.refuses(v.address).startswith(v.reason)
        else:
            assert m.serves(v.address) and m.refuses(v.address) is None and v.how in ("hook", "recompute")
    for v in [v for v in table if v.served and v.capture_only][:3]:
        with pytest.raises((SteeringError, UnsupportedPointError)):
            m.run_with_cache(TEXT, (), [Steer(v.address, "scale", 1.0)])


def test_verdicts_name_the_reason_and_the_alternative():
    llama, mixtral = model(KINDS["gqa_rope"]), model(KINDS["moe"])
    assert "no post-attention sandwich norm" in llama.refuses("attn_out_post.0")
    assert llama.verdict("attn_scores.-1").how == "recompute"
    assert llama.verdict("resid_post.-1").address == f"resid_post.{llama.n_layers - 1}"
    v = mixtral.verdict("mlp_act.0")
    assert not v.served and "fused" in v.reason and v.instead and "mlp_in" in v.instead
    assert mixtral.verdict("expert_indices.0").capture_only
    assert "head 9 is out of range" in llama.refuses("z.0.head-9")
    text = llama.describe().table()
    assert "| `attn_out_post` | - |" in text and "| `resid_post` | layers 0-1 (hook) |" in text


@pytest.mark.parametrize("name,kind", [("openai-community/gpt2", "sequential"), ("google/gemma-2-2b", "sandwich"),
                                       ("EleutherAI/gpt-j-6b", "parallel"), ("allenai/OLMo-2-0425-1B", "post_norm"),
                                       ("facebook/opt-350m", "post_ln")])
def test_block_layout_kinds(name, kind):
    assert model(name).block_layout().kind == kind


def test_block_layout_facts():
    lay = model("ibm-granite/granite-3.0-2b-base").block_layout()
    assert lay.residual_multiplier == pytest.approx(0.22) and lay.embedding_multiplier == pytest.approx(12.0)
    assert lay.logits == ("divide by 8",)
    assert model("google/gemma-2-2b").block_layout().logits == ("softcap 30",)
    hybrid = model(KINDS["hybrid"]).block_layout()
    assert "attention" in hybrid.mixers and "conv" in hybrid.mixers
    assert model(KINDS["moe"]).block_layout().moe_layers == (0, 1)
    assert model("bigscience/bloom-560m").block_layout().sublayer_adds_residual


@pytest.mark.parametrize("name", ["openai-community/gpt2", "meta-llama/Llama-3.2-1B", "google/gemma-2-2b"])
def test_weights_reproduce_the_points_they_read(name):
    m = model(name)
    logits, c = m.run_with_cache(TEXT, ["z.1", "attn_out.1", "mlp_act.1", "mlp_out.1", "final_norm"])
    fam = m.family
    o = m.hf.get_submodule(f"{fam.layers}.1.{fam.attn}.{fam.o_proj}")
    down = m.hf.get_submodule(f"{fam.layers}.1.{fam.mlp}.{fam.mlp_down}")
    bias = lambda mod: 0 if getattr(mod, "bias", None) is None else mod.bias  # noqa: E731
    W_O = m.W_O(1)
    assert W_O.shape == (m.config.num_attention_heads, c["z.1"].shape[-1], m.d_model)
    torch.testing.assert_close(torch.einsum("bphd,hdm->bpm", c["z.1"], W_O) + bias(o), c["attn_out.1"],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c["mlp_act.1"] @ m.W_down(1 - m.n_layers) + bias(down),
                               c["mlp_out.1"], rtol=1e-4, atol=1e-5)
    raw = c["final_norm"] @ m.W_U
    cap = getattr(m.config, "final_logit_softcapping", None)
    torch.testing.assert_close(torch.tanh(raw / cap) * cap if cap else raw, logits, rtol=1e-4, atol=1e-4)


def test_weights_refused_by_name():
    with pytest.raises(UnsupportedPointError, match="MoE layer"):
        model(KINDS["moe"]).W_down(0)
    hybrid = model(KINDS["hybrid"])
    conv = hybrid.block_layout().mixers.index("conv")
    with pytest.raises(UnsupportedPointError, match="not available at layer"):
        hybrid.W_O(conv)


# -- point definitions (issue item 6) --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["openai-community/gpt2", "facebook/opt-125m", "bigscience/bloom-560m",
                                  "google/gemma-2-2b"])
def test_embeddings_is_what_block_0_receives(name):
    """Not the token embedding alone: position embeddings, embedding norms and scales are in it."""
    m = model(name)
    ids = m._inputs(TEXT)["input_ids"]
    _, c = m.run_with_cache(ids, ["embeddings", "resid_pre.0"])
    with torch.no_grad():
        hs = m.hf(ids, output_hidden_states=True).hidden_states[0]
        tok = torch.nn.functional.embedding(ids, m.hf.get_input_embeddings().weight)  # the table rows alone
    torch.testing.assert_close(c["embeddings"], c["resid_pre.0"])
    torch.testing.assert_close(c["embeddings"], hs)
    assert not torch.allclose(c["embeddings"], tok, atol=1e-4)


@pytest.mark.parametrize("name,transform", [("google/gemma-2-2b", "softcap"), ("ibm-granite/granite-3.0-2b-base",
                                                                              "divide"), ("meta-llama/Llama-3.2-1B", None)])
def test_lm_head_raw_and_logits_are_both_named(name, transform):
    m = model(name)
    logits, c = m.run_with_cache(TEXT, ["lm_head", "lm_head_raw", "final_norm"])
    raw = c["lm_head_raw"]
    torch.testing.assert_close(c["lm_head"], logits)
    torch.testing.assert_close(raw, c["final_norm"] @ m.W_U, rtol=1e-4, atol=1e-4)
    cfg = m.config
    if transform == "softcap":
        cap = cfg.final_logit_softcapping
        torch.testing.assert_close(torch.tanh(raw / cap) * cap, logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(raw, logits)
    elif transform == "divide":
        torch.testing.assert_close(raw / cfg.logits_scaling, logits, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(raw, logits)
    # while generating both are read from the last prompt token on: [b, new, vocab], like the logits
    out = m.generate(TEXT, 3, points=["lm_head", "lm_head_raw"])
    assert out.cache["lm_head_raw"].shape == out.cache["lm_head"].shape == out.logits.shape
    torch.testing.assert_close(out.cache["lm_head"], out.logits)
    if transform == "softcap":
        cap = cfg.final_logit_softcapping
        torch.testing.assert_close(torch.tanh(out.cache["lm_head_raw"] / cap) * cap, out.logits, rtol=1e-5, atol=1e-5)


def test_post_norm_points_are_refused_not_aliased_without_those_norms():
    llama, olmo2 = model(KINDS["gqa_rope"]), model("allenai/OLMo-2-0425-1B")
    for p in ("attn_out_post", "mlp_out_post"):
        side = p.split("_")[0]
        assert f"use {side}_out" in llama.refuses(f"{p}.0") and llama.verdict(f"{p}.0").instead == f"use {side}_out"
        assert olmo2.serves(f"{p}.0")  # post-sublayer norms (no pre-norm): served
