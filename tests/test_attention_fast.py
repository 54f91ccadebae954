"""The eager backend's attention: every call runs the implementation HF loaded (sdpa) with the engine's
points around it, and a read pattern (attn_scores / attn_probs) computed beside it by the family's eager
attention (engine/backends/hf/attention.py). Checked against the same twin loaded with eager attention
everywhere: every capture, the logits and a steered forward agree within fp32's tolerance on every zoo
twin (slow; a sample in the default run); a pattern equals eager's bit for bit while the forward stays
the fast one bit for bit; and the fast function is what runs."""
from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.backends.hf import attention
from engine.core.points import KEY_AXIS_POINTS
from engine.core.steering import Steer
from engine.zoo.entries import ZOO

TOL = 1e-5  # fp32 relative error, as the family tests (norm of the difference over the reference's)
SAMPLE = ["meta-llama/Llama-3.2-1B", "openai-community/gpt2", "google/gemma-2-2b", "tiiuae/falcon-7b",
          "Qwen/Qwen2.5-0.5B", "microsoft/phi-2", "mistralai/Mistral-7B-v0.1", "EleutherAI/pythia-70m-deduped"]
PROMPTS = ["The quick brown fox jumps over the lazy dog and runs", "Hello there"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _compare(name: str) -> None:
    fast, eager = load_model(name, source="zoo"), load_model(name, source="zoo", attention="eager")
    enc = eager.to_tokens(PROMPTS)
    points = [a for a in fast.expand(fast.points()) if a.point not in KEY_AXIS_POINTS]
    lf, cf = fast.run_with_cache(enc, points)
    le, ce = eager.run_with_cache(enc, points)
    assert _rel(lf, le) < TOL, f"{name}: logits"
    for key in ce:
        assert _rel(cf[key], ce[key]) < TOL, f"{name}: {key} rel err {_rel(cf[key], ce[key]):.2e}"
    point = "resid_post" if "resid_post" in fast.points() else "mlp_out"  # DeepSeek-V4: several streams
    st = Steer(f"{point}.{fast.n_layers // 2}", "add", torch.randn(fast.d_model, generator=torch.Generator().manual_seed(0)))
    assert _rel(fast.forward(enc, steer=[st]), eager.forward(enc, steer=[st])) < TOL, f"{name}: steered logits"
    patterns = [a for a in fast.expand(fast.points()) if a.point in KEY_AXIS_POINTS][:2]
    if patterns:  # reading a pattern leaves the fast forward as it was, bit for bit; the pattern is eager's
        lp, cp = fast.run_with_cache(enc, patterns)  # (bit for bit where the layer's inputs are: the first)
        _, ce2 = eager.run_with_cache(enc, patterns)
        assert torch.equal(lp, lf), f"{name}: reading {patterns} changed the forward"
        for k in ce2:
            real = ce2[k] > torch.finfo(ce2[k].dtype).min / 2  # scores: the masked value is not compared
            same = torch.equal(cp[k], ce2[k]) if k.split(".")[1] == "0" else _rel(cp[k][real], ce2[k][real]) < TOL
            assert same, f"{name}: {k}"


@pytest.mark.parametrize("name", SAMPLE)
def test_fast_attention_agrees_with_eager(name):
    _compare(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ZOO) - set(SAMPLE)))
def test_fast_attention_agrees_with_eager_on_every_twin(name):
    _compare(name)


def test_the_fast_path_runs_and_a_pattern_is_computed_beside_it(monkeypatch):
    """The loaded implementation's function runs in every call, never the all-eager one; a read pattern
    calls the family's eager function beside it; a softcapping family, and one whose attention runs
    inline, run eager (SDPA would drop the softcap; HF forms an inline family's pattern only when eager)."""
    m = load_model("meta-llama/Llama-3.2-1B", source="zoo")
    assert m._attention == "interp_sdpa" and m.hf.config._attn_implementation == "interp_sdpa"
    everything, beside = [], []
    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS._global_mapping, attention.NAME,
                        lambda *a, **k: everything.append(1) or attention.interp_attention(*a, **k))
    real = attention._eager_fn
    monkeypatch.setattr(attention, "_eager_fn", lambda mod: (beside.append(1), real(mod))[1])
    m.run_with_cache("Hello there", ["resid_post.0", "z.0", "q.0"], steer=[Steer("k.0", "scale", 2.0)])
    assert everything == [] and beside == []
    m.run_with_cache("Hello there", ["attn_probs.0", "attn_probs.1"])
    assert everything == [] and len(beside) == 2
    assert load_model("google/gemma-2-2b", source="zoo")._attention == attention.NAME
    falcon = load_model("tiiuae/falcon-7b", source="zoo")
    assert falcon._attention == "eager" and falcon.hf.config._attn_implementation == "eager"
