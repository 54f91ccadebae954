"""One integer rule (engine/core/integers.py) wherever an index or a count is taken: any integer scalar
(numpy's, a 0-d integer tensor or array) is the int it holds; bools, floats and arrays of more than
one element are not. Each entry point is checked against the same call made with Python ints."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Steer, capture_attention, logit_diff
from engine.core.errors import InputTypeError, SAEError, SteeringError
from engine.core.features import clamp_feature, topk
from engine.core.integers import as_int
from engine.core.positions import normalize
from engine.core.sae_files import random_sae
from test_vllm_common import eager_model

LLAMA = "meta-llama/Llama-3.2-1B"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("value,want", [
    (3, 3), (-2, -2), (np.int64(3), 3), (np.int32(-2), -2), (np.uint8(5), 5), (np.array(3), 3),
    (torch.tensor(3), 3), (torch.tensor(-1, dtype=torch.int8), -1), (2 ** 70, 2 ** 70),
    (True, None), (np.True_, None), (torch.tensor(True), None), (3.0, None), (np.float64(3.0), None),
    (torch.tensor(3.0), None), (torch.tensor([3]), None), (np.array([3]), None), ("3", None), (None, None),
])
def test_as_int(value, want):
    got = as_int(value)
    assert got == want and (want is None or type(got) is int)


@pytest.fixture(scope="module")
def em():
    return eager_model(LLAMA)


def _last_rows(m, steer):
    _, cache = m.run_with_cache(PROMPT, ["resid_post.1"], steer=[steer])
    return cache["resid_post.1"], cache.receipts[0].rows


@pytest.mark.parametrize("spec,plain", [
    (np.int64(-1), -1), (torch.tensor(2), 2), ([np.int64(1), torch.tensor(3), 5], [1, 3, 5]),
    ((np.int32(1), np.int64(4)), (1, 4)), (slice(torch.tensor(2), None), slice(2, None)),
])
def test_positions_take_integer_scalars(em, spec, plain):
    v = torch.ones(em.d_model)
    got = _last_rows(em, Steer("resid_post.0", "add", v, positions=spec))
    want = _last_rows(em, Steer("resid_post.0", "add", v, positions=plain))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] > 0
    assert normalize(spec) == normalize(plain)


@pytest.mark.parametrize("spec,phrase", [
    ([1, 2.0], "a positions list holds one or more ints"), ((0, 2.5), "a positions tuple is (start, stop) of ints"),
    (slice(0, 3, 2), "has step 2"), (slice(0.0, 3), "positions slice bounds must be ints or None"),
    (torch.tensor([1]), "a positions mask is a bool tensor"), (True, "is not a position spec"),
])
def test_positions_still_refuse_non_integers(spec, phrase):
    with pytest.raises(SteeringError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        normalize(spec)


def test_model_calls_take_integer_scalars(em):
    """max_new_tokens, stop_at_layer, W_O / W_down layers, token ids, a logit difference's token ids,
    capture_attention's layers: each the same as with Python ints."""
    a = em.generate("Hi there", torch.tensor(3))
    b = em.generate("Hi there", 3)
    assert torch.equal(a.new_tokens, b.new_tokens)
    h1, _ = em.run_with_cache(PROMPT, stop_at_layer=np.int64(1))
    h2, _ = em.run_with_cache(PROMPT, stop_at_layer=1)
    assert torch.equal(h1, h2)
    assert torch.equal(em.W_O(np.int64(1)), em.W_O(1)) and torch.equal(em.W_down(torch.tensor(0)), em.W_down(0))
    ids = em.tokenizer(PROMPT)["input_ids"]
    assert torch.equal(em.forward([np.int64(i) for i in ids]), em.forward(ids))
    assert torch.equal(em.forward([torch.tensor(i) for i in ids]), em.forward(ids))
    logits = em.forward(PROMPT)
    assert torch.equal(logit_diff(em, np.int64(5), torch.tensor(9))(logits), logit_diff(em, 5, 9)(logits))
    att = capture_attention(em, PROMPT, layers=[np.int64(1)])
    assert att.layers == [1] and torch.equal(att.probs[1], capture_attention(em, PROMPT, layers=[1]).probs[1])
    with pytest.raises(InputTypeError, match=r"max_new_tokens must be an int >= 1, got Tensor tensor\(\[3\]\)"):
        em.generate("Hi there", torch.tensor([3]))


def test_sampling_knobs_take_integer_scalars(em):
    a = em.generate("Hi there", 4, temperature=0.9, top_k=np.int64(5), seed=torch.tensor(7))
    b = em.generate("Hi there", 4, temperature=0.9, top_k=5, seed=7)
    assert torch.equal(a.new_tokens, b.new_tokens)


def test_sae_feature_indices_take_integer_scalars():
    sae = random_sae("standard", 16, 32, seed=0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sae.direction(np.int64(4)), sae.direction(4))
    assert torch.equal(clamp_feature(sae, x, np.int64(4), 0.0), clamp_feature(sae, x, 4, 0.0))
    assert torch.equal(clamp_feature(sae, x, [torch.tensor(4), np.int32(6)], 1.0), clamp_feature(sae, x, [4, 6], 1.0))
    feats = sae.encode(x)
    assert all(torch.equal(p, q) for p, q in zip(topk(feats, np.int64(3)), topk(feats, 3)))
    with pytest.raises(SAEError, match="feature index 4.0 is not an integer; the SAE has d_sae=32"):
        sae.direction(4.0)
    with pytest.raises(SAEError, match="feature index 32 is out of range"):
        sae.direction(np.int64(32))


def test_readout_k_and_exclusions_take_integer_scalars():
    import numpy as np
    import torch

    from engine.core.readouts import LensTopK, ReadoutError
    from engine.core.steering import Steer, SteeringError
    assert LensTopK(np.int64(3)).k == 3 and type(LensTopK(torch.tensor(2)).k) is int
    for bad in (True, 2.0, 0, torch.tensor([3])):
        with pytest.raises(ReadoutError, match="LensTopK k must be a positive int"):
            LensTopK(bad)
    st = Steer("resid_post.0", "add", torch.ones(4), exclude=[np.int64(2), torch.tensor(0), 2])
    assert st.exclude == [0, 2] and all(type(i) is int for i in st.exclude)
    with pytest.raises(SteeringError, match="exclude is a list of positions"):
        Steer("resid_post.0", "add", torch.ones(4), exclude=[1.0])
