"""Decode-time attention patterns on DeepSeek-V4's compressed layers: the key axis is [positions...,
compressor entries...] at every step, as in a full recompute (the validator's decode rows compare the
last step with HF recomputing the whole sequence; before the fix the compressor entries were padded as
if they were positions: ours (1, 1, 4, 21) vs HF (1, 1, 4, 23))."""
import pytest
import torch

from engine.model import _absolute_keys, _pad_key_axis, _Step

NAME = "deepseek-ai/DeepSeek-V4-Flash"
ADDRS = [f"{p}.{layer}" for p in ("attn_probs", "attn_scores") for layer in range(4)]


def test_absolute_keys_pads_the_window_not_the_compressor_entries():
    # 19 positions seen, window cache of 16 keys, rate 4 -> 4 compressor entries after the window
    window, entries = torch.arange(1.0, 17.0), torch.tensor([100.0, 101, 102, 103])
    t = torch.cat([window, entries]).reshape(1, 1, 1, 20)
    out = _absolute_keys("attn_probs.1", t, _Step(offset=18, decoding=True), compress_rate=4)
    assert out.shape == (1, 1, 1, 23)
    assert out[0, 0, 0, :3].tolist() == [0.0, 0.0, 0.0]
    assert out[0, 0, 0, 3:19].tolist() == window.tolist() and out[0, 0, 0, 19:].tolist() == entries.tolist()
    plain = _absolute_keys("attn_probs.0", window[None, None, None], _Step(offset=18, decoding=True))
    assert plain.shape == (1, 1, 1, 19) and plain[0, 0, 0, 3:].tolist() == window.tolist()


def test_pad_key_axis_keeps_compressor_entries_after_the_positions():
    prefill = torch.ones(1, 17, 1, 17 + 4)  # 17 positions, 4 entries
    step = torch.full((1, 1, 1, 18 + 4), 2.0)  # 18 positions, still 4 entries
    last = torch.full((1, 1, 1, 19 + 4), 3.0)
    a, b, c = _pad_key_axis("attn_probs.1", [prefill, step, last], compress_rate=4)
    assert a.shape[-1] == b.shape[-1] == c.shape[-1] == 23
    assert a[0, 0, 0, 17:19].tolist() == [0.0, 0.0] and a[0, 0, 0, 19:].tolist() == [1.0] * 4
    assert b[0, 0, 0, 18].item() == 0.0 and b[0, 0, 0, 19:].tolist() == [2.0] * 4
    assert torch.equal(c, last)


@pytest.fixture(scope="module")
def v4():
    from engine.loading import load_model
    from validator import prompts
    from validator.engines.base import ModelContext
    from validator.engines.hf_ref import HFReference
    from validator.models import zoo_spec
    m = load_model(NAME, source="zoo")
    hf, tok = zoo_spec(NAME).load_reference()
    short = prompts.build_cases(tok, m.config)[0]
    return m, HFReference(ModelContext(NAME, hf, tok, "zoo")), short


def test_generated_patterns_equal_the_full_recompute(v4):
    """Every step of a 3-token generation (not only the last) against HF recomputing the sequence."""
    from validator.prompts import decode_case
    m, ref, short = v4
    gen = m.generate({"input_ids": short.input_ids, "attention_mask": short.attention_mask}, max_new_tokens=3,
                     points=ADDRS)
    truth = ref.capture(decode_case(gen.tokens), ADDRS)
    for a in ADDRS:
        ours, hf = gen.cache[a].float(), truth[a]
        assert ours.shape == hf.shape, (a, ours.shape, hf.shape)
        if a.startswith("attn_scores"):  # masked entries compare as a mask
            keep = hf > -1e4
            assert torch.equal(ours > -1e4, keep), a
            ours, hf = ours[keep], hf[keep]
        assert float((ours - hf).norm() / hf.norm()) < 1e-5, a
