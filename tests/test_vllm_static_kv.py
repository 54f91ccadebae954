"""KV-cache hygiene (engine/backends/vllm/worker/kv.py) against a stand-in of V1's runner: its host
block tables (`requests[id].block_ids`, `input_batch.req_ids`), its static forward context of caches
laid out as vLLM 0.32 lays them out, and scheduler outputs as the scheduler writes them. A block a
steering request's rows wrote is zeroed in every layer when a schedule hands it to another request,
exactly once, and nothing else in any cache changes; a block handed back to its owner is left alone.
The real engine: tests/test_serve_poison.py and tests/test_serve_fuzz.py (slow)."""
from __future__ import annotations

import types

import pytest
import torch

from engine.backends.vllm.worker import kv
from engine.core.plan import Plan, Span
from engine.core.steering import Steer
from engine.core.step import Step

BLOCKS, HEADS, BS, WIDTH = 8, 2, 4, 6
STEER = [Steer("resid_post.1", "add", torch.ones(4))]


def _runner(caches: dict, tables: dict, batch: list, num_blocks: int = BLOCKS, sizes=(BS,)):
    """V1's runner as Blocks reads it: per request its scheduler block ids per KV-cache group."""
    groups = [types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(block_size=s)) for s in sizes]
    return types.SimpleNamespace(
        input_batch=types.SimpleNamespace(req_ids=batch),
        requests={rid: types.SimpleNamespace(block_ids=ids) for rid, ids in tables.items()},
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=groups, num_blocks=num_blocks),
        cache_config=types.SimpleNamespace(block_size=sizes[0]),
        compilation_config=types.SimpleNamespace(
            static_forward_context={k: types.SimpleNamespace(kv_cache=v) for k, v in caches.items()}))


def _schedule(new=(), cached=(), resumed=()):
    """A SchedulerOutput's block assignments: new requests (id, block ids per group), then running or
    resumed ones (id, new block ids per group or None)."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=b) for r, b in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[r for r, _ in cached],
                                                    new_block_ids=[b for _, b in cached], resumed_req_ids=set(resumed)))


def _poisoned(shape=(BLOCKS, HEADS, BS, WIDTH)) -> torch.Tensor:
    torch.manual_seed(0)
    c = torch.randn(shape)
    c[c > 1.5] = float("inf")
    c[c < -1.5] = float("nan")
    return c


def test_a_steering_requests_blocks_are_zeroed_when_handed_to_another_and_nothing_else_changes():
    # batch row 0: "a" steers, its positions 5..9 this step (blocks 1 and 2 of its table: ids 3 and 6);
    # row 1: "p" plain, in block 4; row 2: "b" steers at position 0 (block 0 of its table: id 7)
    caches = {"model.layers.0.self_attn.attn": _poisoned(), "model.layers.1.self_attn.attn": _poisoned()}
    runner = _runner(caches, {"a": ([2, 3, 6],), "p": ([4],), "b": ([7],)}, ["a", "p", "b"])
    blocks = kv.Blocks(runner)
    a, p, b = Plan(9, steers=STEER), Plan(9), Plan(9, steers=STEER)
    step = Step([Span(a, 0, 5, 5, 0), Span(p, 5, 6, 2, 1), Span(b, 6, 7, 0, 2)], 7)
    assert blocks.mark(step) == 3
    assert blocks.owner == {3: "a", 6: "a", 7: "b"}  # block 2 (positions 0..3) was not written this step
    before = {k: c.clone() for k, c in caches.items()}
    # the next schedule: "a" grows into block 5 and gets its own block 6 back (no hand-on); "b" is done
    # and "c" is handed blocks 7 and 3 (both another's), "q" is handed block 2 (never marked)
    zeroed = blocks.reclaim(_schedule(new=[("c", ([7, 3],)), ("q", ([2],))], cached=[("a", ([5, 6],))]))
    assert zeroed == 2 and blocks.zeroed == 2 and blocks.owner == {6: "a"}
    for k, c in caches.items():
        want = before[k].clone()
        want[[3, 7]] = 0.0
        torch.testing.assert_close(c, want, rtol=0, atol=0, equal_nan=True)
    assert blocks.reclaim(_schedule(new=[("d", ([7, 3],))])) == 0  # zeroed once: they are no longer marked


def test_nothing_marked_costs_nothing_and_a_plain_step_marks_nothing():
    runner = _runner({"l.0.": _poisoned()}, {"p": ([1],)}, ["p"])
    blocks = kv.Blocks(runner)
    assert blocks.mark(Step([Span(Plan(3), 0, 3, 0, 0)], 3)) == 0 and blocks.owner == {}
    assert blocks.handed_on(_schedule(new=[("c", ([1, 2],))])) == []


def test_a_failed_steering_request_is_marked_like_any_other():
    """A plan that failed during a step may have steered the layers before it failed: its blocks are
    marked as a healthy one's."""
    runner = _runner({"l": _poisoned()}, {"a": ([1],), "b": ([2],)}, ["a", "b"])
    blocks = kv.Blocks(runner)
    ok, failed = Plan(1, steers=STEER), Plan(1, steers=STEER)
    failed.error = "RuntimeError: its own"
    blocks.mark(Step([Span(ok, 0, 1, 0, 0), Span(failed, 1, 2, 0, 1)], 2))
    assert blocks.owner == {1: "a", 2: "b"}


def test_a_mark_that_fails_cleans_every_cache_whole_and_fails_the_step():
    """The runner's host tables not as mark reads them (here a batch row with no request): no block can be
    marked, so every cache loses its inf / NaN at once, and the error goes on to fail the step's plans."""
    caches = {"a": _poisoned(), "b": _poisoned()}
    runner = _runner(caches, {}, [])
    with pytest.raises(IndexError):
        kv.Blocks(runner).guarded_mark(Step([Span(Plan(1, steers=STEER), 0, 1, 0, 3)], 1))
    assert all(bool(torch.isfinite(c).all()) for c in caches.values())


@pytest.mark.parametrize("pos0,n,want", [(0, 1, [10]), (3, 1, [10]), (4, 1, [11]), (3, 2, [10, 11]),
                                         (0, 12, [10, 11, 12]), (8, 3, [12])])
def test_the_marked_blocks_are_those_of_the_positions_written(pos0, n, want):
    runner = _runner({"l": _poisoned()}, {"a": ([10, 11, 12, 13],)}, ["a"], num_blocks=16)
    blocks = kv.Blocks(runner)
    blocks.mark(Step([Span(Plan(20, steers=STEER), 0, n, pos0, 0)], n))
    brute = sorted({[10, 11, 12, 13][(pos0 + r) // BS] for r in range(n)})
    assert sorted(blocks.owner) == brute == want


def test_every_kv_cache_group_is_marked_with_its_own_block_size():
    runner = _runner({"l": _poisoned((16, HEADS, BS, WIDTH))}, {"a": ([1, 2, 3], [9, 10])}, ["a"],
                     num_blocks=16, sizes=(4, 8))
    blocks = kv.Blocks(runner)
    blocks.mark(Step([Span(Plan(20, steers=STEER), 0, 3, 6, 0)], 3))  # positions 6..8
    assert blocks.owner == {2: "a", 3: "a", 9: "a", 10: "a"}


def test_layouts_keys_and_values_first_and_kernel_blocks_are_zeroed_whole():
    """[2, blocks, ...] (keys and values first) and a kernel block half the scheduler's ([2 x blocks,
    ...]): the scheduler block's every entry, and only those, become 0."""
    kv_first = _poisoned((2, BLOCKS, BS, HEADS, WIDTH))
    split = _poisoned((2 * BLOCKS, HEADS, BS // 2, WIDTH))
    runner = _runner({"x": kv_first, "y": split}, {}, [])
    before = kv_first.clone(), split.clone()
    blocks = kv.Blocks(runner)
    assert blocks.zero([5, 1]) == 2
    want = before[0].clone()
    want[:, [1, 5]] = 0.0
    torch.testing.assert_close(kv_first, want, rtol=0, atol=0, equal_nan=True)
    want = before[1].clone()
    want[[2, 3, 10, 11]] = 0.0
    torch.testing.assert_close(split, want, rtol=0, atol=0, equal_nan=True)


def test_a_cache_with_no_block_dimension_loses_its_inf_and_nan_whole():
    odd = _poisoned((3, 5, WIDTH))
    runner = _runner({"z": odd}, {}, [], num_blocks=BLOCKS)
    assert kv.block_dim(odd, BLOCKS) is None
    kv.Blocks(runner).zero([1])
    assert bool(torch.isfinite(odd).all())


def test_caches_skip_quantized_and_shared_storage():
    f = torch.zeros(2, 1, 4, 4)
    layers = {"a": types.SimpleNamespace(kv_cache=f), "b": types.SimpleNamespace(kv_cache=f),  # shared
              "c": types.SimpleNamespace(kv_cache=torch.zeros(2, 1, 4, 4, dtype=torch.uint8)),  # fp8 in uint8
              "d": types.SimpleNamespace(kv_cache=[g := f.clone()]), "e": types.SimpleNamespace()}
    got = kv.caches(layers)
    assert len(got) == 2 and got[0] is f and got[1] is g


def test_the_first_layer_a_steer_can_change():
    plans = [Plan(1, steers=[Steer("resid_post.3", "add", torch.ones(4))]),
             Plan(1, steers=[Steer("attn_in.2", "add", torch.ones(4)), Steer("resid_post.5", "add", torch.ones(4))])]
    assert kv.first_layer(plans) == 2
    assert kv.first_layer([Plan(1, steers=[Steer("embeddings", "add", torch.ones(4))])]) == 0


def test_the_worker_reclaims_before_the_runner_takes_each_schedule():
    """wrap_execute_model: the hand-on is zeroed before the runner's own execute_model runs (which
    updates its states, then runs the forward), on every call, and a second wrap never nests."""
    from engine.backends.vllm.worker.seams import wrap_execute_model
    order = []

    class Runner:
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            order.append(("runner", scheduler_output))
            return "out"
    r = Runner()
    assert wrap_execute_model(r, lambda so: order.append(("reclaim", so)))
    assert wrap_execute_model(r, lambda so: order.append(("reclaim", so)))
    assert r.execute_model("s1") == "out" and r.execute_model("s2", None) == "out"
    assert order == [("reclaim", "s1"), ("runner", "s1"), ("reclaim", "s2"), ("runner", "s2")]
    assert not wrap_execute_model(types.SimpleNamespace(), print)


def test_a_carried_decode_step_marks_only_where_it_crosses_into_a_new_block():
    """A decode step one position on from the last (engine.core.step.one_on) marks nothing while its rows
    stay in the blocks the steps before marked, without reading the runner's tables (a step's first host work
    after the forward, every step); the step whose row starts a new block marks it. The owners are those of
    marking every step afresh."""
    from engine.core.step import one_on
    tables = {"a": ([10, 11, 12, 13],), "b": ([20, 21, 22, 23],)}
    runner = _runner({"l": _poisoned()}, tables, ["a", "b"], num_blocks=24)
    reads = []
    states = runner.requests

    class Watched(dict):
        def get(self, rid, default=None):
            reads.append(rid)
            return states.get(rid, default)
    runner.requests = Watched(states)
    blocks, fresh = kv.Blocks(runner), {}
    a, b = Plan(20, steers=STEER), Plan(20, steers=STEER)
    last = None
    for pos in range(2, 10):  # a at positions 2..9 (its blocks 10-12: BS 4), b at 5..12 (21-23), crossing apart
        spans = [Span(a, 0, 1, pos, 0), Span(b, 1, 2, pos + 3, 1)]
        step = Step(spans, 2, prev=one_on(last, spans, 2))
        reads.clear()
        got = blocks.mark(step)
        crossing = last is None or pos % BS == 0 or (pos + 3) % BS == 0
        assert (got > 0) == crossing and bool(reads) == crossing, (pos, got, reads)
        for rid, p0 in (("a", pos), ("b", pos + 3)):
            fresh[tables[rid][0][p0 // BS]] = rid
        assert blocks.owner == fresh, pos
        step.prev, last = None, step
