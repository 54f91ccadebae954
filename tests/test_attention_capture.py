"""capture_attention (engine/workflows/attention_capture.py) on one family of each kind plus BLOOM, Falcon and
GPT-J (whose attention HF computes inline): probabilities against HF's own output_attentions,
probs @ value = z, values against raw HF module hooks and against the reference engine
(interp-engine 1.14's eager backend), and what stays refused, by reason."""
from __future__ import annotations

import pytest
import torch

from engine.loading import load_hf
from engine.workflows.attention_capture import capture_attention
from test_vllm_common import eager_model

TEXT = "When Mary and John went to the store, John gave a drink to"
FAMILIES = {"gpt2": "openai-community/gpt2", "llama": "meta-llama/Llama-3.2-1B", "gemma2": "google/gemma-2-2b",
            "mixtral": "mistralai/Mixtral-8x7B-v0.1", "lfm2": "LiquidAI/LFM2-350M", "bloom": "bigscience/bloom-560m",
            "falcon": "tiiuae/falcon-7b", "gptj": "EleutherAI/gpt-j-6b"}
INLINE = ("bloom", "falcon", "gptj")
def model(name):  # eager models are shared across the session's test modules
    return eager_model(name)


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_capture_attention_against_hf(fam):
    m = model(FAMILIES[fam])
    att = capture_attention(m, TEXT)
    ids = m._inputs(TEXT)["input_ids"]
    # HF's own patterns come from its eager attention (the engine runs sdpa and forms a read pattern beside
    # it): a copy of the same weights loaded eager
    hf, _, _ = load_hf(FAMILIES[fam], source="zoo", attention="eager")
    with torch.no_grad():
        ref = hf(ids, output_attentions=True).attentions
    assert att.layers and set(att.probs) == set(att.layers) == set(att.value) == set(att.z)
    if len(ref) < m.n_layers:  # hybrids: HF returns the attention layers' patterns only
        ref = dict(zip(att.layers, ref))
    for layer in att.layers:
        torch.testing.assert_close(att.probs[layer], ref[layer].transpose(1, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(att.mixed(layer), att.z[layer], rtol=1e-5, atol=1e-6)  # probs @ value = z
        if layer in att.scores:
            torch.testing.assert_close(att.scores[layer].softmax(-1), att.probs[layer], rtol=1e-5, atol=1e-6)
    if fam in INLINE:
        assert not att.scores and all("attn_scores" in a for a in att.missing)
        assert m.verdict("attn_probs.0").capture_only  # returned beside the output, where nothing reads it
    else:
        assert set(att.scores) == set(att.layers)
    if fam == "lfm2":  # hybrid: only the attention layers
        assert att.layers == [i for i, k in enumerate(m.block_layout().mixers) if k == "attention"]


def _hf_value(m, fam, layer, ids):
    """The value tensor read with a forward hook written here on the module that computes it."""
    got = {}
    attn = m.hf.transformer.h[layer].self_attention if fam != "gptj" else m.hf.transformer.h[layer].attn
    mod = attn.v_proj if fam == "gptj" else attn.query_key_value
    h = mod.register_forward_hook(lambda mod_, a, o: got.__setitem__("x", o))
    try:
        with torch.no_grad():
            m.hf(ids)
    finally:
        h.remove()
    x, cfg = got["x"], m.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    if fam == "gptj":
        return x.reshape(*x.shape[:2], -1, hd)
    if fam == "bloom":  # per head [q | k | v]
        return x.reshape(*x.shape[:2], cfg.num_attention_heads, 3, hd)[..., 2, :]
    # falcon-7b: multi-query, queries then one key then one value
    return x[..., -hd:].reshape(*x.shape[:2], 1, hd)


@pytest.mark.parametrize("fam", INLINE)
def test_inline_families_value_and_probs_against_raw_hooks_and_the_reference_engine(fam):
    m = model(FAMILIES[fam])
    ids = m._inputs(TEXT)["input_ids"]
    att = capture_attention(m, ids, layers=[0, -1])
    for layer in att.layers:
        torch.testing.assert_close(att.value[layer], _hf_value(m, fam, layer, ids))
    import interp_engine as ie

    from engine.zoo import offline_session
    with offline_session():
        ref = ie.load_model(FAMILIES[fam], backend="eager", device="cpu", dtype="float32")
    cache = ie.run_with_cache(ref, ids, [f"attn_probs.{layer}" for layer in att.layers] +
                              [f"value.{layer}" for layer in att.layers])
    for layer in att.layers:
        probs = cache.get("attn_probs", layer)
        torch.testing.assert_close(att.probs[layer], probs.transpose(1, 2).float(), rtol=1e-5, atol=1e-6)
        value = cache.get("value", layer)
        torch.testing.assert_close(att.value[layer], value.reshape(att.value[layer].shape).float())


def test_refusals_and_bad_input():
    bloom, llama = model(FAMILIES["bloom"]), model(FAMILIES["llama"])
    assert "baddbmm" in bloom.refuses("attn_scores.0") and "attn_probs" in bloom.refuses("attn_scores.0")
    assert bloom.verdict("value.0").capture_only and "fused query_key_value" in bloom.verdict("value.0").capture_only
    gptj = model(FAMILIES["gptj"])
    assert "rotates q and k inline" in gptj.refuses("q.0") and gptj.verdict("value.0").capture_only is None
    with pytest.raises(ValueError, match="unknown attention piece"):
        capture_attention(llama, TEXT, pieces=("pattern",))
    with pytest.raises(ValueError, match="none of"):
        capture_attention(bloom, TEXT, layers=[0], pieces=("scores",))
    att = capture_attention(llama, TEXT, layers=[-1], pieces=("probs",))
    assert att.layers == [llama.n_layers - 1] and not att.value
