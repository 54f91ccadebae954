"""The eager backend's attention: calls that read no pattern run the implementation HF loaded (sdpa),
calls that read attn_scores / attn_probs run the family's eager attention (engine/backends/hf/attention.py).
Checked here against the same twin loaded with eager attention everywhere: every capture, the logits and a
steered forward agree within fp32's tolerance on every zoo twin (slow; a sample of families in the default
run), a pattern call is bit-identical to eager, and the fast path is what runs when no pattern is read."""
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
    if patterns:  # a call that reads a pattern runs eager attention: the same bits as the eager model
        lp, cp = fast.run_with_cache(enc, patterns)
        le2, ce2 = eager.run_with_cache(enc, patterns)
        assert torch.equal(lp, le2) and all(torch.equal(cp[k], ce2[k]) for k in ce2)


@pytest.mark.parametrize("name", SAMPLE)
def test_fast_attention_agrees_with_eager(name):
    _compare(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(ZOO) - set(SAMPLE)))
def test_fast_attention_agrees_with_eager_on_every_twin(name):
    _compare(name)


def test_the_fast_path_runs_when_no_pattern_is_read(monkeypatch):
    """With no pattern asked, the loaded implementation's function runs (sdpa), never the eager one;
    with a pattern asked, the eager one runs; a softcapping family runs eager either way."""
    m = load_model("meta-llama/Llama-3.2-1B", source="zoo")
    assert m._attn == ("interp_sdpa", attention.NAME)
    calls = []
    real = attention.interp_attention
    monkeypatch.setattr(attention, "interp_attention", lambda *a, **k: calls.append("eager") or real(*a, **k))
    attention.ALL_ATTENTION_FUNCTIONS._global_mapping[attention.NAME] = attention.interp_attention
    try:
        m.run_with_cache("Hello there", ["resid_post.0", "z.0", "q.0"], steer=[Steer("k.0", "scale", 2.0)])
        assert calls == []
        m.run_with_cache("Hello there", ["attn_probs.0"])
        assert calls and set(calls) == {"eager"}
    finally:
        attention.ALL_ATTENTION_FUNCTIONS._global_mapping[attention.NAME] = real
    gemma = load_model("google/gemma-2-2b", source="zoo")
    assert gemma._attn == (attention.NAME, attention.NAME)  # softcapped logits: SDPA would drop the softcap
