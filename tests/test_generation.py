"""Generation on eager: the stream of steps (token, text, logprobs of the top-n, captured rows)
against generate's own tokens, logits and captures; the sampling knobs (same names on every
backend: tests/test_vllm_interventions.py runs them on vLLM) and their bad values by message."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.core.errors import InputError, OptionError
from engine.core.steering import Steer
from engine.model.sampling import KNOBS, Sampling
from test_vllm_common import eager_model

LLAMA = "meta-llama/Llama-3.2-1B"
TEXT = "The quick brown fox jumps over the lazy dog"
def model(name=LLAMA):  # eager models are shared across the session's test modules
    return eager_model(name)


@pytest.mark.parametrize("name", ["openai-community/gpt2", LLAMA, "google/gemma-2-2b", "mistralai/Mixtral-8x7B-v0.1",
                                  "LiquidAI/LFM2-350M"])
def test_stream_equals_generate(name):
    m = model(name)
    v = torch.randn(m.d_model, generator=torch.Generator().manual_seed(0))
    steer = [Steer("resid_post.0", "add", v, "generated")]
    ref = m.generate(TEXT, 5, points=["resid_post.1"], steer=steer)
    steps = list(m.stream(TEXT, 5, points=["resid_post.1"], steer=steer, logprobs=3))
    assert [s.index for s in steps] == list(range(5))
    assert [s.token for s in steps] == ref.new_tokens[0].tolist()
    assert "".join(s.text for s in steps) == ref.text[0]
    lp = torch.log_softmax(ref.logits[0].float(), -1)
    for s, row in zip(steps, lp):
        assert s.logprob == pytest.approx(float(row[s.token]), abs=1e-4)
        vals, ids = row.topk(3)
        assert list(s.top_logprobs) == ids.tolist()
        assert list(s.top_logprobs.values()) == pytest.approx(vals.tolist(), abs=1e-4)
    n = len(m._inputs(TEXT)["input_ids"][0])
    assert steps[0].rows["resid_post.1"].shape == (n, m.d_model)
    assert all(s.rows["resid_post.1"].shape == (1, m.d_model) for s in steps[1:])
    rows = torch.cat([s.rows["resid_post.1"] for s in steps])
    torch.testing.assert_close(rows, ref.cache["resid_post.1"][0])
    assert steps[-1].result is not None and torch.equal(steps[-1].result.new_tokens, ref.new_tokens[0])
    assert all(s.result is None for s in steps[:-1])


def test_stream_without_points_or_logprobs_and_early_close():
    m = model()
    steps = list(m.stream(TEXT, 3))
    assert all(s.rows is None and s.top_logprobs == {} and s.logprob is not None for s in steps)
    before = threading.active_count()
    it = m.stream(TEXT, 50)
    first = next(it)
    it.close()  # stops the worker thread
    assert first.index == 0 and threading.active_count() <= before
    assert m.generate(TEXT, 2).new_tokens.shape == (1, 2)  # the model serves on


def test_sampling_knobs_are_repeatable_and_greedy_limits():
    m = model()
    a = m.generate(TEXT, 6, temperature=1.5, seed=7)
    b = m.generate(TEXT, 6, temperature=1.5, seed=7)
    assert torch.equal(a.new_tokens, b.new_tokens)
    others = [m.generate(TEXT, 6, temperature=1.5, seed=s).new_tokens for s in range(1, 5)]
    assert any(not torch.equal(o, a.new_tokens) for o in others), "sampling never changed a token"
    greedy = m.generate(TEXT, 6)
    assert torch.equal(m.generate(TEXT, 6, temperature=1.0, top_k=1, seed=3).new_tokens, greedy.new_tokens)
    steps = list(m.stream(TEXT, 4, temperature=1.5, seed=7))
    assert [s.token for s in steps] == a.new_tokens[0, :4].tolist()


def test_a_seeded_call_leaves_the_callers_generator_as_it_was():
    """The seed is the call's own: torch's global generator continues afterwards as if the call had not
    run (a seeded generate used to leave it reseeded, so the caller's own random draws repeated)."""
    m = model()
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    a = m.generate(TEXT, 4, temperature=1.5, seed=7)
    assert torch.equal(torch.rand(4), want)
    assert torch.equal(m.generate(TEXT, 4, temperature=1.5, seed=7).new_tokens, a.new_tokens)  # still repeatable
    torch.manual_seed(123)
    list(m.stream(TEXT, 3, temperature=1.5, seed=7))
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("kw,fragment", [
    ({"do_sample": True}, "sample with temperature > 0"),
    ({"temperatur": 0.5}, r"unknown sampling option \['temperatur'\] for backend 'eager'"),
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"temperature": 1.0, "seed": 2 ** 70}, r"seed must be an int64 \(-2\*\*63 <= seed < 2\*\*63\) or None, got 1180"),
    ({"temperature": 1.0, "top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"temperature": 1.0, "top_k": 0}, "top_k must be an int >= 1"),
    ({"top_k": 5}, "temperature is 0"),
    ({"temperature": 1.0, "seed": "x"}, "seed must be an int"),
])
def test_bad_sampling_knobs(kw, fragment):
    m = model()
    with pytest.raises(OptionError, match=fragment):
        m.generate(TEXT, 2, **kw)
    with pytest.raises(OptionError, match=fragment):
        m.stream(TEXT, 2, **kw)


def test_stream_bad_input():
    m = model()
    with pytest.raises(InputError, match="stream takes one prompt, got 2"):
        m.stream([TEXT, "Water boils"], 2)
    with pytest.raises(ValueError, match="logprobs is how many"):
        m.stream(TEXT, 2, logprobs=-1)
    vocab = m.hf.get_input_embeddings().num_embeddings
    with pytest.raises(InputError, match=f"logprobs=1000000 asks for more top log-probabilities than the "
                                         f"vocabulary's {vocab} tokens; ask for at most {vocab}"):
        m.stream(TEXT, 2, logprobs=10 ** 6)  # torch's topk failed on the worker thread before
    assert len(next(iter(m.stream(TEXT, 2, logprobs=vocab))).top_logprobs) == vocab


def test_knob_translation():
    s = Sampling.parse({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1}, "eager")
    assert s.hf() == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20}
    assert s.vllm() == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1}
    assert Sampling.parse({}, "eager").hf() == {"do_sample": False}
    assert KNOBS == ("temperature", "top_p", "top_k", "seed")


def test_vllm_features_that_would_mix_rows_are_refused_by_name():
    """n > 1 sampling (the samples of one request would share its plan's rows), a per-request LoRA
    adapter, and at load speculative decoding and LoRA on the hooked vLLM backends: each refused
    before anything is submitted or started, naming the option."""
    from engine.loading import load_model
    with pytest.raises(OptionError, match=r"n=2: the vLLM backends run one sample per request"):
        Sampling.parse({"n": 2}, "vllm")
    with pytest.raises(OptionError, match=r"n=True"):
        Sampling.parse({"n": True}, "vllm-static")
    assert Sampling.parse({"n": 1}, "vllm").vllm()["n"] == 1
    with pytest.raises(OptionError, match=r"unknown sampling option \['n'\] for backend 'eager'"):
        Sampling.parse({"n": 2}, "eager")
    with pytest.raises(OptionError, match=r"unknown sampling option \['lora_request'\]"):
        Sampling.parse({"lora_request": "my-adapter"}, "vllm")
    for backend in ("vllm", "vllm-static"):
        with pytest.raises(OptionError, match=rf"speculative_config=.* not served by backend '{backend}': speculative"):
            load_model(LLAMA, backend=backend, source="zoo",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})
        with pytest.raises(OptionError, match=rf"enable_lora=True is not served by backend '{backend}'.*merged"):
            load_model(LLAMA, backend=backend, source="zoo", enable_lora=True)
