"""The guard on the eager backend (engine.core.site.guard, engine/core/ledger.py): a steer whose own result is
finite can still overflow a later layer; the call fails with NonFiniteSteer naming the request's steers,
read once with the rest of the ledger, and nothing of it stays behind for the next call. A finite row so large
that every norm after it divides by inf (its float32 sum of squares overflows) fails too; ordinary large
values pass. The vLLM servers' side of the same invariant: tests/test_serve_poison.py, test_serve_fuzz.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import load_model
from engine.core.ledger import GUARD, Ledger
from engine.core.steering import NonFiniteSteer, Steer

LLAMA = "meta-llama/Llama-3.2-1B"


@pytest.fixture(scope="module")
def m():
    return load_model(LLAMA, source="zoo")


def _full(m, v: float) -> torch.Tensor:
    return torch.full((m.d_model,), v)


def test_two_finite_steers_that_overflow_a_later_layer_fail_the_call_naming_both(m):
    steers = [Steer("attn_out.0", "add", _full(m, 3e38)), Steer("mlp_out.0", "add", _full(m, 3e38))]
    for call in (lambda: m.run_with_cache("Hello there", ["resid_post.1"], steer=steers),
                 lambda: m.generate("Hello there", 3, steer=steers)):
        with pytest.raises(NonFiniteSteer, match=r"downstream of its steers \('add' at attn_out\.0; 'add' at mlp_out\.0\)"):
            call()
    solo = m.run_with_cache("The weather today", ["resid_post.1"])[1]["resid_post.1"]  # nothing stayed behind
    assert torch.equal(m.run_with_cache("The weather today", ["resid_post.1"])[1]["resid_post.1"], solo)


def test_a_finite_row_too_large_for_any_norm_fails_and_large_values_pass(m):
    with pytest.raises(NonFiniteSteer, match="or too large for any norm after it"):
        m.generate("Hello there", 3, steer=[Steer("resid_post.0", "add", _full(m, 3.4e38))])
    with pytest.raises(NonFiniteSteer):
        m.forward("Hello there", steer=[Steer("resid_post.0", "add", _full(m, 1e30))])
    out = m.generate("Hello there", 3, steer=[Steer("resid_post.0", "add", _full(m, 1e10))])
    assert out.new_tokens.shape == (1, 3) and torch.isfinite(out.logits).all()


def test_a_steer_whose_own_result_overflows_is_named_itself(m):
    with pytest.raises(NonFiniteSteer, match=r"'scale' at resid_post\.0 produced inf or NaN"):
        m.forward("Hello there", steer=[Steer("resid_post.0", "add", _full(m, 1.0)),
                                        Steer("resid_post.0", "scale", 3e38), Steer("resid_post.1", "add", _full(m, 1.0))])
    with pytest.raises(NonFiniteSteer, match="does not fit the model's float32"):
        m.forward("Hello there", steer=[Steer("resid_post.0", "add", torch.full((m.d_model,), 1e300, dtype=torch.float64))])


def test_the_first_failure_recorded_is_the_one_named():
    led = Ledger()
    a, b = led.code("a"), led.code("b")
    led.record(np.array([a, a]), np.array([0, 0]), np.array([0, 1]), torch.tensor([1.0, 2.0]))
    led.record(np.array([a, b]), np.array([1, 0]), np.array([0, 0]), torch.tensor([float("inf"), 3.0]))
    led.record(np.array([a]), np.array([GUARD]), np.array([0]), torch.tensor([float("nan")]))
    out = led.read()
    assert out["a"].failed == 1 and out["b"].failed is None
    assert out["a"].of(0) == (2, pytest.approx(5.0)) and out["b"].of(0) == (1, pytest.approx(9.0))
