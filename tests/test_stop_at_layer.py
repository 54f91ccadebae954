"""run_with_cache(stop_at_layer=L) on the eager backend (TransformerLens's stop_at_layer): blocks
0..L-1 run, what they produce equals the full forward, nothing past the stop is computed, and asking
for something past it is refused by name. Harvests use it (engine/harvest/capture.stop_layer)."""
from __future__ import annotations

import pytest
import torch

from engine import load_model
from engine.core.errors import AddressError, OptionError
from engine.core.steering import Steer
from engine.harvest import capture
from engine.loading import load_hf

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Water boils."]


@pytest.fixture(scope="module", params=["meta-llama/Llama-3.2-1B", "openai-community/gpt2"])
def m(request):
    return load_model(request.param, source="zoo")


def test_blocks_before_the_stop_equal_the_full_forward_and_the_rest_never_runs(m):
    enc = m.to_tokens(PROMPTS)  # left-padded: padded positions must stay 0
    plain, _, _ = load_hf(m.name, source="zoo")  # a separate HF copy (output_hidden_states leaves hooks on a model)
    with torch.no_grad():
        ref = plain(**enc, position_ids=m._position_ids(enc["attention_mask"]), output_hidden_states=True)
    pad = ~enc["attention_mask"].bool()
    calls = []
    last = m.hf.get_submodule(f"{m.family.layers}.{m.n_layers - 1}")
    head = m.hf.get_output_embeddings()
    hooks = [mod.register_forward_hook(lambda mod, i, o, name=name: calls.append(name))
             for name, mod in (("last block", last), ("head", head))]
    try:
        hidden, cache = m.run_with_cache(enc, ["resid_post.0", "embeddings"], stop_at_layer=1)
        _, full = m.run_with_cache(enc, ["resid_post.0", "embeddings"])
        assert calls == ["last block", "head"]  # only the full run reached them (the stopped one ran block 0)
        # the first value is what block 1 receives: HF's hidden_states[1], padded positions 0
        torch.testing.assert_close(hidden[~pad], ref.hidden_states[1][~pad], rtol=0, atol=0)
        assert hidden.shape == (2, enc["input_ids"].shape[1], m.d_model) and not hidden[pad].any()
        for key in ("resid_post.0", "embeddings"):
            torch.testing.assert_close(cache[key], full[key], rtol=0, atol=0)
        # stopping at n_layers: the final norm's input, i.e. the last block's output; no logits computed
        calls.clear()
        hidden, cache = m.run_with_cache(enc, [f"resid_post.{m.n_layers - 1}"], stop_at_layer=m.n_layers)
        assert calls == ["last block"]
        torch.testing.assert_close(hidden, full_last(m, enc), rtol=0, atol=0)
    finally:
        for h in hooks:
            h.remove()
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.hf.modules())


def full_last(m, enc):
    _, c = m.run_with_cache(enc, [f"resid_post.{m.n_layers - 1}"])
    return c[f"resid_post.{m.n_layers - 1}"]


def test_a_steer_before_the_stop_acts_as_in_the_full_forward(m):
    steer = [Steer("resid_post.0", "add", torch.ones(m.d_model) * 0.5, positions=-1)]
    _, stopped = m.run_with_cache(PROMPTS[0], ["resid_post.0"], steer=steer, stop_at_layer=1)
    _, full = m.run_with_cache(PROMPTS[0], ["resid_post.0"], steer=steer)
    _, plain = m.run_with_cache(PROMPTS[0], ["resid_post.0"])
    torch.testing.assert_close(stopped["resid_post.0"], full["resid_post.0"], rtol=0, atol=0)
    assert not torch.equal(stopped["resid_post.0"], plain["resid_post.0"])
    assert stopped.receipts == full.receipts


@pytest.mark.parametrize("stop,points,steer,err,phrase", [
    (1, ["resid_post.1"], (), AddressError, "capture at resid_post.1 runs after the forward stops (stop_at_layer=1"),
    (1, ["final_norm"], (), AddressError, "capture at final_norm runs after the forward stops"),
    (1, ["logits"], (), AddressError, "capture at lm_head runs after the forward stops"),
    (1, [], [("mlp_out.1", "add")], AddressError, "steer at mlp_out.1 runs after the forward stops"),
    (0, [], (), ValueError, "stop_at_layer must be between 1 and"),
    (99, [], (), ValueError, "stop_at_layer must be between 1 and"),
    (1.0, [], (), TypeError, "stop_at_layer must be an int (blocks 0..stop_at_layer-1 run), got float 1.0"),
    (True, [], (), TypeError, "got bool True"),
])
def test_bad_stops_are_refused_by_name_before_anything_runs(m, stop, points, steer, err, phrase):
    steers = [Steer(a, op, torch.zeros(m.d_model)) for a, op in steer]
    with pytest.raises(err) as info:
        m.run_with_cache(PROMPTS[0], points, steer=steers, stop_at_layer=stop)
    assert phrase in str(info.value)
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.hf.modules())


def test_any_integer_type_is_a_stop(m):
    """numpy ints and 0-d integer tensors (what a sweep over np.arange yields) stop where the int does."""
    import numpy as np
    _, want = m.run_with_cache(PROMPTS[0], ["resid_post.0"], stop_at_layer=1)
    for layer in (np.int64(1), np.int32(1), torch.tensor(1)):
        _, got = m.run_with_cache(PROMPTS[0], ["resid_post.0"], stop_at_layer=layer)
        torch.testing.assert_close(got["resid_post.0"], want["resid_post.0"], rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"got ndarray array\(\[1\]\)"):
        m.run_with_cache(PROMPTS[0], ["resid_post.0"], stop_at_layer=np.array([1]))
    with pytest.raises(TypeError, match=r"got Tensor tensor\(\[1\]\)"):  # one element, but a batch's shape
        m.run_with_cache(PROMPTS[0], ["resid_post.0"], stop_at_layer=torch.tensor([1]))
    with pytest.raises(ValueError, match="stop_at_layer must be between 1 and"):
        m.run_with_cache(PROMPTS[0], ["resid_post.0"], stop_at_layer=np.int64(0))


def test_a_harvest_stops_after_the_last_block_it_reads(m):
    last = m.n_layers - 1
    assert capture.stop_layer(m, ["resid_post.0"]) == 1
    assert capture.stop_layer(m, ["embeddings"]) == 1
    assert capture.stop_layer(m, [f"resid_post.{last}", "resid_post.0"]) == m.n_layers
    assert capture.stop_layer(m, ["resid_post.0", "final_norm"]) is None
    rows = capture.forward(m, [[5, 6, 7, 8], [9, 10]], ["resid_post.0"])  # right-padded, stopped after block 0
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    _, full = m.run_with_cache(batch, ["resid_post.0"])  # the same batch, the whole forward
    torch.testing.assert_close(rows[1]["resid_post.0"], full["resid_post.0"][1, :2], rtol=0, atol=0)
    _, solo = m.run_with_cache(torch.tensor([[9, 10]]), ["resid_post.0"])
    torch.testing.assert_close(rows[1]["resid_post.0"], solo["resid_post.0"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.vllm
def test_vllm_refuses_stop_at_layer_by_name():
    from test_vllm_common import vllm_model
    vm = vllm_model("meta-llama/Llama-3.2-1B")  # the session's shared engine
    with pytest.raises(OptionError, match=r"stop_at_layer=1 \(vLLM runs its whole forward\) is not served by backend 'vllm'; use backend='eager'"):
        vm.run_with_cache("Hi", ["resid_post.0"], stop_at_layer=1)
