"""Attention patterns on DeepSeek-V4's compressed layers: the key axis is [positions..., compressor
entries...] at every step and in a padded batch, as in HF's full recompute (the validator's decode rows
compare the last step with HF recomputing the whole sequence; the compressor entries used to be padded
as if they were positions: ours (1, 1, 4, 21) vs HF (1, 1, 4, 23), and a prefill capture crashed)."""
import numpy as np
import pytest
import torch

from engine.backends.hf.grid import Call, Layout
from engine.core.plan import pad_key_axis
from engine.core.results import scatter

NAME = "deepseek-ai/DeepSeek-V4-Flash"
ADDRS = [f"{p}.{layer}" for p in ("attn_probs", "attn_scores") for layer in range(4)]


def test_align_keys_pads_the_window_not_the_compressor_entries():
    # 19 columns seen, a window cache of 16 keys, rate 4 -> 4 compressor entries after the window
    window, entries = torch.arange(1.0, 17.0), torch.tensor([100.0, 101, 102, 103])
    seg = torch.cat([window, entries]).reshape(1, 1, 20)
    layout = Layout([], (1, 1), np.ones((1, 19), dtype=bool), Call(torch.device("cpu")))
    out = layout.align_keys(0, seg, "attn_probs.1", compress_rate=4)
    assert out.shape == (1, 1, 23)
    assert out[0, 0, :3].tolist() == [0.0, 0.0, 0.0]
    assert out[0, 0, 3:19].tolist() == window.tolist() and out[0, 0, 19:].tolist() == entries.tolist()
    plain = layout.align_keys(0, window.reshape(1, 1, 16), "attn_probs.0")
    assert plain.shape == (1, 1, 19) and plain[0, 0, 3:].tolist() == window.tolist()


def test_pad_key_axis_keeps_compressor_entries_after_the_positions():
    prefill = torch.ones(17, 1, 17 + 4)  # 17 positions, 4 entries
    step = torch.full((1, 1, 18 + 4), 2.0)  # 18 positions, still 4 entries
    last = torch.full((1, 1, 20 + 5), 3.0)  # 20 positions, 5 entries
    a, b, c = pad_key_axis("attn_probs.1", [prefill, step, last], seen=[17, 18, 20])
    assert a.shape[-1] == b.shape[-1] == c.shape[-1] == 25
    assert a[0, 0, 17:20].tolist() == [0.0] * 3 and a[0, 0, 20:].tolist() == [1.0] * 4 + [0.0]
    assert b[0, 0, 18:20].tolist() == [0.0] * 2 and b[0, 0, 20:].tolist() == [2.0] * 4 + [0.0]
    assert torch.equal(c, last)
    plain = pad_key_axis("attn_probs.0", [torch.ones(2, 1, 2), torch.ones(1, 1, 3)], seen=[2, 3])
    assert plain[0].shape == (2, 1, 3) and plain[0][0, 0].tolist() == [1.0, 1.0, 0.0]


def test_scatter_puts_compressor_entries_after_the_padded_columns():
    short = torch.arange(2 * 1 * 3, dtype=torch.float).reshape(2, 1, 3)  # 2 positions + 1 entry
    out = scatter("attn_probs.1", [short], [torch.tensor([1, 2])], 3)
    assert out.shape == (1, 3, 1, 4)
    assert out[0, 0].abs().sum() == 0  # the pad row
    assert out[0, 1, 0].tolist() == [0.0, 0.0, 1.0, 2.0] and out[0, 2, 0].tolist() == [0.0, 3.0, 4.0, 5.0]


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


def test_padded_prefill_patterns_equal_hf(v4):
    """A left-padded batch: every real query row's keys, compressor entries included, equal HF's."""
    m, ref, _ = v4
    from validator import prompts
    padded = next(c for c in prompts.build_cases(m.tokenizer, m.config) if c.name == "padded")
    _, ours = m.run_with_cache({"input_ids": padded.input_ids, "attention_mask": padded.attention_mask}, ADDRS)
    truth = ref.capture(padded, ADDRS)
    real = padded.attention_mask.bool()
    for a in ("attn_probs.1", "attn_probs.3"):
        assert ours[a].shape == truth[a].shape, (a, ours[a].shape, truth[a].shape)
        got, want = ours[a][real].float(), truth[a][real]
        assert float((got - want).norm() / want.norm()) < 1e-5, a
