"""KV-cache hygiene (engine/backends/vllm/worker/kv.py) on a cache laid out as vLLM 0.32 lays it out
(blocks first, [blocks, kv_heads, block_size, 2 * head_dim]) inside a stand-in forward context: the
blocks a steering request's rows wrote this step lose their inf / NaN (all of them, for a request the
guard flagged), every other block is left exactly as it was, and each block is read once however
long the span. The real engine: tests/test_vllm_static.py and tests/test_serve_poison.py (slow)."""
from __future__ import annotations

import types

import pytest
import torch

from engine.backends.vllm.worker import kv
from engine.core.plan import Plan, Span

BLOCKS, HEADS, BS, WIDTH = 6, 2, 4, 6


@pytest.mark.parametrize("a,n,pos0", [(0, 1, 0), (3, 1, 7), (0, 9, 0), (5, 10, 3), (2, 4, 4), (0, 4, 5)])
def test_block_rows_meet_each_block_of_a_span_once(a, n, pos0):
    rows, owner = kv.block_rows([(a, n, pos0)], BS)
    want = sorted({(pos0 + r) // BS for r in range(n)})  # the blocks of the span's positions, by brute force
    assert [(pos0 + r - a) // BS for r in rows] == want
    assert all(a <= r < a + n for r in rows) and owner == [0] * len(rows)


def _context(monkeypatch, caches: dict, slots: torch.Tensor):
    import vllm.forward_context as fc
    ctx = types.SimpleNamespace(no_compile_layers={k: types.SimpleNamespace(kv_cache=v) for k, v in caches.items()},
                                slot_mapping={k: slots for k in caches})
    monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)


def _span(a, b, pos0):
    return Span(Plan(pos0 + b - a, steers=[]), a, b, pos0)


def test_scrub_cleans_the_steering_rows_blocks_and_nothing_else(monkeypatch):
    torch.manual_seed(0)
    cache = torch.randn(BLOCKS, HEADS, BS, WIDTH)
    cache[1, 0, 2, 3] = float("inf")  # block 1: the steering request's, with one inf and one NaN
    cache[1, 1, 0, 0] = float("nan")
    cache[4, 0, 0, 0] = float("nan")  # block 4: another request's (not scrubbed here: not this step's rows)
    cache[2, 1, 3, 5] = float("-inf")  # block 2: the flagged request's
    before = cache.clone()
    # step rows: 0-1 a steering request at positions 5, 6 (block 1: slots 5, 6); 2-4 a plain one in
    # block 4; 5-6 a flagged steering request at positions 0, 1 (block 2: slots 8, 9)
    slots = torch.tensor([5, 6, 16, 17, 18, 8, 9])
    _context(monkeypatch, {"layer.0": cache}, slots)
    spans = [_span(0, 2, 5), _span(5, 7, 0)]
    done = kv.scrub(spans, torch.tensor([False, True]))
    assert done == 2  # one block each
    want = before.clone()
    want[1] = want[1].nan_to_num(0.0, 0.0, 0.0)
    want[2] = 0.0
    torch.testing.assert_close(cache, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(cache[4, 0, 0, 0])  # another request's block is its own business


def test_scrub_without_a_per_layer_slot_mapping_cleans_whole_caches(monkeypatch):
    import vllm.forward_context as fc
    cache = torch.ones(BLOCKS, HEADS, BS, WIDTH)
    cache[5, 0, 0, 0] = float("nan")
    ctx = types.SimpleNamespace(no_compile_layers={"l": types.SimpleNamespace(kv_cache=cache)},
                                slot_mapping=[{"l": torch.zeros(1, dtype=torch.long)}])  # dual-batch overlap
    monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    kv.scrub([_span(0, 1, 0)])
    assert bool(torch.isfinite(cache).all()) and cache.sum() == cache.numel() - 1


def test_caches_skip_quantized_and_shared_storage():
    f = torch.zeros(2, 1, 4, 4)
    ctx = types.SimpleNamespace(no_compile_layers={
        "a": types.SimpleNamespace(kv_cache=f), "b": types.SimpleNamespace(kv_cache=f),  # shared across layers
        "c": types.SimpleNamespace(kv_cache=torch.zeros(2, 1, 4, 4, dtype=torch.uint8)),  # fp8 in uint8 storage
        "d": types.SimpleNamespace(kv_cache=[f.clone()]), "e": types.SimpleNamespace()})
    assert [name for name, _ in kv.caches(ctx)] == ["a", "d"]


def test_scrub_outside_a_forward_context_does_nothing():
    """A step without vLLM's forward context ran no attention layer (nothing wrote a KV block): the
    scrub returns 0 rather than failing the step (the static taps' unit tests run so)."""
    assert kv.scrub([_span(0, 1, 0)]) == 0


def test_scrub_starts_at_the_first_layer_a_steer_can_change(monkeypatch):
    """A layer below every steer of the step computes the steering rows from unsteered inputs: the scrub
    leaves it alone (its NaN here is planted, as no real forward could write it), cleans the layers
    from the first steered one on, and always cleans a layer whose index its name does not give."""
    from engine.core.steering import Steer
    caches = {name: torch.ones(BLOCKS, HEADS, BS, WIDTH) for name in
              ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn",
               "shared_attn")}
    for c in caches.values():
        c[0, 0, 0, 0] = float("nan")
    _context(monkeypatch, caches, torch.tensor([0]))
    plans = [Plan(1, steers=[Steer("resid_post.3", "add", torch.ones(4))]),
             Plan(1, steers=[Steer("attn_in.2", "add", torch.ones(4)), Steer("resid_post.5", "add", torch.ones(4))])]
    start = kv.first_layer(plans)
    assert start == 2 and kv.first_layer([Plan(1, steers=[Steer("embeddings", "add", torch.ones(4))])]) == 0
    assert kv.layer_of("model.layers.13.self_attn.attn") == 13 and kv.layer_of("shared_attn") is None
    assert kv.scrub([Span(plans[0], 0, 1, 0)], None, start) == 3
    assert torch.isnan(caches["model.layers.0.self_attn.attn"][0, 0, 0, 0])
    assert all(bool(torch.isfinite(caches[n]).all()) for n in caches if n != "model.layers.0.self_attn.attn")


def test_a_step_scrubs_each_steering_request_and_drops_those_the_guard_flagged(monkeypatch):
    """scrub_step hands scrub the steering requests' spans (a plain request between them is not one)
    and, per span, whether the guard flagged any of its rows: the same verdict as reading each span's
    rows one by one, from one reduction for the whole step."""
    from engine.core.steering import Steer
    from engine.core.step import Step
    steer = [Steer("resid_post.1", "add", torch.ones(4))]
    plans = [Plan(9, steers=steer), Plan(9, steers=[]), Plan(9, steers=steer), Plan(9, steers=steer)]
    spans = [Span(plans[0], 0, 3, 6), Span(plans[1], 3, 5, 7), Span(plans[2], 5, 9, 5), Span(plans[3], 9, 10, 8)]
    step = Step(spans, 10)
    got = []
    monkeypatch.setattr(kv, "scrub", lambda sp, failed=None, start=0: got.append(
        ([s.plan for s in sp], None if failed is None else failed.tolist(), start)) or 0)
    for marked in ([], [1], [3, 4], [9], [0, 2, 6, 9]):
        bad = torch.zeros(10, dtype=torch.bool)
        bad[marked] = True
        kv.scrub_step(step, bad)
        steering = [sp for sp in spans if sp.plan.steers]
        assert got.pop() == ([sp.plan for sp in steering], [bool(bad[sp.a:sp.b].any()) for sp in steering], 1)
    kv.scrub_step(step, None)
    assert got.pop() == ([plans[0], plans[2], plans[3]], None, 1)
