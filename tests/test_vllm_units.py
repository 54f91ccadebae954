"""The vLLM backends' pure-tensor parts, without an engine: per-request accumulation across
chunks / preemption / prefix-cache gaps, absolute-position masks against eager's, and the static
taps' per-row affine composition against applying the same steers one by one."""
from __future__ import annotations

import pytest
import torch

from engine.address import Address
from engine.backends.vllm_attn import params, probs, scores
from engine.backends.vllm_batch import Plan, position_mask
from engine.backends.vllm_static import StaticTaps, Tap
from engine.backends.vllm_tree import VSite
from engine.errors import SteeringError
from engine.steering import Steer, apply_steer
from engine.steering import position_mask as eager_mask


def _rows(p0, n, d=3):
    return torch.arange(p0, p0 + n, dtype=torch.float32)[:, None].expand(n, d).clone()


def test_chunks_assemble_by_absolute_position():
    plan = Plan([1] * 10)
    for p0, n in ((0, 4), (4, 4), (8, 2), (10, 1)):  # chunked prefill, then a decode step
        plan.add("resid_post.0", p0, _rows(p0, n))
    t = plan.tensor("resid_post.0")
    assert torch.equal(t[:, 0], torch.arange(11, dtype=torch.float32)) and plan.recomputed == 0


def test_preemption_recompute_truncates_then_continues():
    plan = Plan([1] * 6)
    plan.add("k", 0, _rows(0, 6))
    plan.add("k", 6, _rows(6, 1) + 100)  # a value computed before preemption...
    plan.add("k", 0, _rows(0, 7))  # ...recomputed from scratch after it
    plan.add("k", 7, _rows(7, 1))
    assert torch.equal(plan.tensor("k")[:, 0], torch.arange(8, dtype=torch.float32))
    assert plan.recomputed == 1


def test_positions_never_computed_are_an_error_not_a_short_tensor():
    plan = Plan([1] * 8)
    plan.add("resid_post.1", 4, _rows(4, 4))  # positions 0..3 came from a prefix cache
    with pytest.raises(RuntimeError, match=r"positions 0..3 were never computed"):
        plan.tensor("resid_post.1")
    with pytest.raises(RuntimeError, match="never computed for this request"):
        plan.tensor("resid_post.0")


def test_tail_captures_start_at_the_last_prompt_token():
    plan = Plan([1] * 5)
    plan.start_at["final_norm"] = 4
    assert plan.wanted("final_norm", 0, 3) is None  # a chunk wholly before the tail
    assert plan.wanted("final_norm", 3, 2) == 1
    plan.add("final_norm", 4, _rows(4, 1))
    plan.add("final_norm", 5, _rows(5, 1))
    p0, t = plan.tail("final_norm")
    assert p0 == 4 and torch.equal(t[:, 0], torch.tensor([4.0, 5.0]))


def test_salt_only_for_requests_that_capture_or_steer():
    assert Plan([1]).salt is None
    a, b = Plan([1], captures=[Address("resid_post", 0)]), Plan([1], steers=[Steer("resid_post.0", "ablate")])
    assert a.salt and b.salt and a.salt != b.salt and a.salt == a.salt


@pytest.mark.parametrize("positions", ["all", "last", "generated", 3, slice(2, 5), slice(4, None)])
def test_absolute_masks_match_eager_prefill_and_decode(positions):
    prompt_len = 6
    ours = position_mask(positions, 0, prompt_len, prompt_len)  # the whole prefill in one chunk
    assert torch.equal(ours, eager_mask(positions, prompt_len, 0, False)[0])
    for pos in range(prompt_len, prompt_len + 3):  # each decode step feeds back one token
        assert torch.equal(position_mask(positions, pos, 1, prompt_len), eager_mask(positions, 1, pos, True)[0])
    chunked = torch.cat([position_mask(positions, 0, 4, prompt_len), position_mask(positions, 4, 2, prompt_len)])
    assert torch.equal(chunked, ours)


class _Lin(torch.nn.Module):
    def forward(self, x):
        return x


def _tap(width=8, heads=None):
    site = VSite(_Lin(), "post", "out", lambda o: o, lambda o, n: n)
    return Tap("x.0", site, width, rows=6, writable=True, device="cpu", dtype=torch.float32, index=0)


@pytest.mark.parametrize("steers", [
    [Steer("resid_post.0", "add", torch.arange(8.0))],
    [Steer("resid_post.0", "set", torch.ones(8)), Steer("resid_post.0", "add", torch.arange(8.0))],
    [Steer("resid_post.0", "add", torch.arange(8.0)), Steer("resid_post.0", "scale", -2.0),
     Steer("resid_post.0", "mean_ablate", torch.ones(8))],
    [Steer("resid_post.0", "project_out", torch.randn(8)), Steer("resid_post.0", "scale", 0.5)],
    [Steer("resid_post.0", "ablate"), Steer("resid_post.0", "add", torch.ones(8))],
])
def test_static_composition_equals_sequential_ops(steers):
    tap = _tap()
    x = torch.randn(6, 8)
    rows = torch.tensor([1, 2, 4])
    for st in steers:
        tap.fill(rows, st, None)
    got = tap.site.module(x)  # the wrapped forward applies the buffers
    want = x.clone()[None]
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, rows] = True
    for st in steers:
        want = apply_steer(st, want, mask)
    torch.testing.assert_close(got, want[0])
    assert torch.equal(tap.buf("cap")[:6], got)  # the capture holds the steered value


def test_static_head_coordinate_touches_only_that_head():
    tap = _tap(width=8)
    st = Steer("z.0.head-1", "set", torch.tensor([5.0, 6.0, 7.0, 8.0]))
    tap.fill(torch.tensor([0]), st, 4)
    x = torch.randn(6, 8)
    got = tap.site.module(x)
    want = apply_steer(st, x.reshape(1, 6, 2, 4), torch.tensor([[True, False, False, False, False, False]]))
    torch.testing.assert_close(got, want.reshape(6, 8))


def test_static_refuses_orders_it_cannot_compose():
    v = torch.ones(4)
    with pytest.raises(SteeringError, match="project_out at resid_post.0 before any other op"):
        StaticTaps.check_order([Steer("resid_post.0", "add", v), Steer("resid_post.0", "project_out", v)])
    with pytest.raises(SteeringError, match="one project_out direction per tap"):
        StaticTaps.check_order([Steer("resid_post.0", "project_out", v), Steer("resid_post.0", "project_out", v)])
    StaticTaps.check_order([Steer("resid_post.0", "project_out", v), Steer("resid_post.1", "add", v)])


class _Impl:
    scale, logits_soft_cap, sliding_window, alibi_slopes, sinks = 0.5, 0, 3, None, None


class _Kernel:
    impl = _Impl()


def test_recomputed_scores_follow_the_causal_and_window_mask():
    q, k = torch.randn(5, 4, 2), torch.randn(5, 2, 2)  # 4 query heads over 2 kv heads
    p = params(_Kernel())
    s = scores(q, k, p)
    ref = torch.einsum("qhd,khd->qhk", q, k.repeat_interleave(2, dim=1)) * 0.5
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    allowed = (j <= i) & (i - j < 3)
    torch.testing.assert_close(s[allowed[:, None, :].expand_as(s)], ref[allowed[:, None, :].expand_as(ref)])
    assert bool((s[~allowed[:, None, :].expand_as(s)] == torch.finfo(s.dtype).min).all())
    torch.testing.assert_close(probs(s).sum(-1), torch.ones(5, 4))
