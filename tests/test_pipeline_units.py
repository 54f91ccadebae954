"""The shared pipeline's pure parts, without an engine: position specs, per-sequence accumulation
across chunks / preemption / prefix-cache gaps, run_site on a flat batch, the row map of vLLM's
persistent batch, plain-data messages, static taps' composition, the recompute of attention
patterns, and the merge of tensor-parallel ranks' tables."""
from __future__ import annotations

import pytest
import torch

from engine.backends.vllm.catalogue import VLLMCatalogue
from engine.backends.vllm.modes import MODES
from engine.backends.vllm.worker.attn import params, probs, scores
from engine.backends.vllm.worker.rows import apply_update
from engine.backends.vllm.worker.static import lone_tap
from engine.backends.vllm.worker.tree import VSite
from engine.backends.vllm.worker.wire import decode, encode, plan_in, plan_out
from engine.core import positions
from engine.core.address import Address
from engine.core.errors import SteeringError
from engine.core.plan import Plan, Span, site_work
from engine.core.site import apply_steer, run_site
from engine.core.steering import Steer
from engine.core.step import Step


def _rows(p0, n, d=3):
    return torch.arange(p0, p0 + n, dtype=torch.float32)[:, None].expand(n, d).clone()


# -- accumulation -------------------------------------------------------------------------------------
def test_chunks_assemble_by_absolute_position():
    plan = Plan(10)
    for p0, n in ((0, 4), (4, 4), (8, 2), (10, 1)):  # chunked prefill, then a decode step
        plan.add("resid_post.0", p0, _rows(p0, n))
    t = plan.tensor("resid_post.0")
    assert torch.equal(t[:, 0], torch.arange(11, dtype=torch.float32)) and plan.recomputed == 0


def test_preemption_recompute_truncates_then_continues():
    plan = Plan(6)
    plan.add("k", 0, _rows(0, 6))
    plan.add("k", 6, _rows(6, 1) + 100)  # a value computed before preemption...
    plan.add("k", 0, _rows(0, 7))  # ...recomputed from scratch after it
    plan.add("k", 7, _rows(7, 1))
    assert torch.equal(plan.tensor("k")[:, 0], torch.arange(8, dtype=torch.float32))
    assert plan.recomputed == 1


def test_blocks_of_many_keys_go_out_as_one_tensor_and_read_back_key_by_key():
    """vllm-static keeps a step's rows of every layer as one block (Plan.add_block); at collect the blocks of
    one keys tuple that follow each other become one tensor (Plan.stacked), each key a row of it, the same
    rows `add` would have kept key by key; a key also held alone (a logits tail) or recomputed is filed
    as `add` files it."""
    keys = ("resid_post.0", "resid_post.1", "final_norm")
    plan, ref = Plan(4), Plan(4)
    ref.add("final_norm", 3, _rows(3, 1) * 7)  # the prompt's last row, a tail of its own
    plan.add("final_norm", 3, _rows(3, 1) * 7)
    for p0, n in ((0, 4), (4, 1), (5, 1)):
        block = torch.stack([_rows(p0, n) * (j + 1) for j in range(3)])
        plan.add_block(keys, p0, block)
        for j, k in enumerate(keys):
            ref.add(k, p0, block[j])
    (index, first, rows), = plan.stacked()
    assert index == {"resid_post.0": 0, "resid_post.1": 1} and first == 0 and rows.shape == (3, 6, 3)
    for k in keys:
        assert torch.equal(plan.tensor(k, plan.first(k)), ref.tensor(k, ref.first(k))), k
    assert torch.equal(rows[1], ref.tensor("resid_post.1"))
    again, ref = Plan(4), Plan(4)  # recomputed from position 2 after a preemption: filed (truncated) as add files it
    for p0, n in ((0, 4), (4, 1), (2, 3)):
        rows = _rows(p0, n) + 10 * (p0 == 2)
        again.add_block(keys[:2], p0, torch.stack([rows] * 2))
        for k in keys[:2]:
            ref.add(k, p0, rows)
    assert again.stacked() == [] and again.recomputed == ref.recomputed == 2
    assert again.tensor("resid_post.0")[:, 0].tolist() == [0.0, 1.0, 12.0, 13.0, 14.0]


def test_positions_never_computed_are_an_error_not_a_short_tensor():
    plan = Plan(8)
    plan.add("resid_post.1", 4, _rows(4, 4))  # positions 0..3 came from a prefix cache
    with pytest.raises(RuntimeError, match=r"positions 0..3 were never computed") as e:
        plan.tensor("resid_post.1")
    # core code serves every backend: the message names what happened, not one backend's cache (issue 48: an
    # eager decode bug read "served from vLLM's prefix cache")
    assert "vLLM" not in str(e.value) and "no forward ran its site" in str(e.value)
    with pytest.raises(RuntimeError, match="never computed for this request") as e:
        plan.tensor("resid_post.0")
    assert "vLLM" not in str(e.value)


def test_tail_captures_start_where_asked():
    plan = Plan(5)
    plan.start_at["final_norm"] = 4
    assert plan.wanted("final_norm", 0, 3) is None  # a chunk wholly before the tail
    assert plan.wanted("final_norm", 3, 2) == 1
    plan.add("final_norm", 4, _rows(4, 1))
    plan.add("final_norm", 5, _rows(5, 1))
    assert plan.first("final_norm") == 4
    assert torch.equal(plan.tensor("final_norm", 4)[:, 0], torch.tensor([4.0, 5.0]))


def test_attention_patterns_concatenate_over_a_growing_key_axis():
    plan = Plan(3)
    plan.add("attn_probs.0", 0, torch.ones(3, 2, 3))
    plan.add("attn_probs.0", 3, torch.ones(1, 2, 4))
    t = plan.tensor("attn_probs.0")
    assert t.shape == (4, 2, 4) and t[:3, :, 3].abs().max() == 0 and t[3].min() == 1


# -- position specs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,touched", [("all", range(8)), ("last", range(4, 8)), ("generated", range(5, 8)),
                                          (2, [2]), (-1, [4]), (slice(1, 3), [1, 2]), ((6, None), [6, 7]),
                                          (slice(-2, None), [3, 4, 5, 6, 7])])
def test_masks_are_absolute_and_chunking_does_not_matter(spec, touched):
    spec = positions.normalize(spec)
    whole = positions.mask(spec, 0, 8, prompt_len=5)
    assert torch.nonzero(whole).flatten().tolist() == list(touched)
    chunked = torch.cat([positions.mask(spec, 0, 3, 5), positions.mask(spec, 3, 2, 5)] +
                        [positions.mask(spec, p, 1, 5) for p in range(5, 8)])
    assert torch.equal(chunked, whole)


@pytest.mark.parametrize("spec,prompt,new,fragment", [
    (999, 5, 0, "position 999 matches no token in a plain forward over 5 prompt tokens"),
    (-6, 5, 0, "position -6 matches no token"),
    (5, 5, 0, r"valid: 0..4"),
    ((3, 1), 5, 0, "matches no token"),
    ((100, 200), 5, 4, "matches no token in a call over 5 prompt tokens and 3 fed-back"),
    ("generated", 5, 0, "a plain forward has no generated tokens"),
    ("generated", 5, 1, "1 new token feeds back none"),
])
def test_specs_that_match_nothing_are_errors(spec, prompt, new, fragment):
    with pytest.raises(SteeringError, match=fragment):
        positions.check(positions.normalize(spec), prompt, new, "steer")


@pytest.mark.parametrize("spec,fragment", [(True, "positions=True is not a position spec"),
                                           ("first", "positions 'first'"), (slice(0, 6, 2), "step 2"),
                                           ((1, 2, 3), r"\(start, stop\)"), (1.5, "got 1.5")])
def test_malformed_specs_are_errors(spec, fragment):
    with pytest.raises(SteeringError, match=fragment):
        positions.normalize(spec)


def test_negative_positions_count_back_from_the_prompt_end_during_generation():
    positions.check(-1, 5, 4, "steer")  # the last prompt token, also while generating
    assert torch.nonzero(positions.mask(-1, 0, 8, 5)).flatten().tolist() == [4]


# -- run_site -------------------------------------------------------------------------------------
def test_run_site_touches_each_sequence_only_in_its_own_rows():
    a = Plan(3, [Address("resid_post", 0)], [Steer("resid_post.0", "add", torch.ones(2), positions=1)])
    b = Plan(2, [Address("resid_post", 0)])
    work = site_work([a, b], lambda addr: "site")["site"]
    t = torch.zeros(6, 2)  # rows: a at 0..2 (positions 0..2), a pad row, b at 4..5 (positions 0..1)
    spans = [Span(a, 0, 3, 0, 0), Span(b, 4, 6, 0, 1)]
    new = run_site(t, Step(spans, 6), work)
    assert torch.equal(new[:, 0], torch.tensor([0.0, 1, 0, 0, 0, 0]))
    assert torch.equal(a.tensor("resid_post.0")[:, 0], torch.tensor([0.0, 1, 0]))  # a sees its steer
    assert b.tensor("resid_post.0").abs().max() == 0 and t.abs().max() == 0  # t itself untouched


def test_run_site_read_only_returns_none():
    plan = Plan(2, [Address("resid_post", 0)])
    work = site_work([plan], lambda addr: "s")["s"]
    assert run_site(torch.randn(2, 4), Step([Span(plan, 0, 2, 0)], 2), work) is None
    assert plan.tensor("resid_post.0").shape == (2, 4)


def test_run_site_isolates_a_failing_plan_when_asked():
    bad = Plan(2, [], [Steer("resid_post.0", "add", torch.ones(3))])  # wrong width
    good = Plan(2, [Address("resid_post", 0)], [Steer("resid_post.0", "add", torch.ones(2))])
    work = site_work([bad, good], lambda addr: "s")["s"]
    spans = [Span(bad, 0, 2, 0), Span(good, 2, 4, 0)]
    with pytest.raises(SteeringError):
        run_site(torch.zeros(4, 2), Step(spans, 4), work)
    errors = []
    new = run_site(torch.zeros(4, 2), Step(spans, 4, on_error=lambda p, e: (errors.append(p),
                                                                            setattr(p, "error", str(e)))), work)
    assert errors == [bad] and "shape (3,)" in bad.error and torch.equal(new[2:], torch.ones(2, 2))
    assert torch.equal(new[:2], torch.zeros(2, 2)) and good.tensor("resid_post.0").equal(torch.ones(2, 2))


# -- vLLM's persistent batch -----------------------------------------------------------------------
class _Params:
    def __init__(self, key):
        self.extra_args = {"interp_plan": key} if key else None


class _Update:
    def __init__(self, removed=(), added=(), moved=()):
        self.removed, self.added, self.moved = removed, added, moved


def test_row_map_follows_adds_removes_moves_and_swaps():
    from vllm.v1.sample.logits_processor import MoveDirectionality as D
    rows = {}
    apply_update(rows, _Update(added=[(0, _Params("a"), [], []), (1, _Params(None), [], []), (2, _Params("c"), [], [])]))
    assert rows == {0: "a", 2: "c"}
    apply_update(rows, _Update(removed=[0], moved=[(2, 0, D.UNIDIRECTIONAL)]))  # condense
    assert rows == {0: "c"}
    apply_update(rows, _Update(added=[(1, _Params("d"), [], [])], moved=[(0, 1, D.SWAP)]))
    assert rows == {1: "c", 0: "d"}
    apply_update(rows, _Update(added=[(0, _Params(None), [], [])]))  # a plain request replaces d
    assert rows == {1: "c"}


# -- plain-data messages --------------------------------------------------------------------------
def test_tensors_and_plans_survive_the_wire():
    x = {"a": [torch.randn(2, 3), torch.arange(4)], "b": torch.randn(3).to(torch.bfloat16), "n": 3}
    back = decode(encode(x))
    assert torch.equal(back["a"][0], x["a"][0]) and torch.equal(back["a"][1], x["a"][1])
    assert back["b"].dtype == torch.bfloat16 and torch.equal(back["b"], x["b"]) and back["n"] == 3
    plan = Plan(5, [Address("z", 1, head=2)], [Steer("resid_post.0", "add", torch.randn(4), slice(1, 3)),
                                              Steer("mlp_out.1", "scale", 0.5, "generated")],
                [Address("final_norm")], {"final_norm": 4})
    got = plan_in(plan_out(plan, "k1"))
    assert got.key == "k1" and got.prompt_len == 5 and got.captures == plan.captures
    assert got.internal == plan.internal and got.start_at == {"final_norm": 4}
    for a, b in zip(got.steers, plan.steers):
        assert (a.address, a.op, a.positions) == (b.address, b.op, b.positions)
        assert torch.equal(a.value, b.value)


def test_every_steer_field_of_every_op_survives_the_wire():
    """The wire message is made from dataclasses.fields(Steer): each op's steer, with every optional
    field it takes, an exclusion and engine metadata, comes back field for field after msgpack (what
    collective_rpc carries). The hand-written copy it replaces had to be edited for each new field."""
    import dataclasses

    import msgspec

    from engine.backends.vllm.worker.wire import steer_in, steer_out
    from engine.core.steering import Steer
    for st in _head_steers(8):
        st.lead, st.lengths = 0, [5]  # set by the engine when it binds a steer to a sequence
        back = steer_in(msgspec.msgpack.decode(msgspec.msgpack.encode(steer_out(st))))
        assert back.checked  # validated once, by the client that made it
        for f in dataclasses.fields(Steer):
            if f.name == "checked":
                continue
            a, b = getattr(back, f.name), getattr(st, f.name)
            same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
            assert same, (st.op, f.name, a, b)


# -- static taps --------------------------------------------------------------------------------
class _Lin(torch.nn.Module):
    def forward(self, x):
        return x


def _tap(width=8):
    site = VSite(_Lin(), "post", "out", lambda o: o, lambda o, n: n)
    return lone_tap("x.0", site, width, rows=6, writable=True, device="cpu", dtype=torch.float32)


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
    want = x.clone()
    mask = torch.zeros(6, dtype=torch.bool)
    mask[rows] = True
    for st in steers:
        want = apply_steer(st, want, mask)
    torch.testing.assert_close(got, want)
    assert torch.equal(tap.buf("cap")[:6], got)  # the capture holds the steered value


def test_static_head_coordinate_touches_only_that_head():
    tap = _tap(width=8)
    st = Steer("z.0.head-1", "set", torch.tensor([5.0, 6.0, 7.0, 8.0]))
    tap.fill(torch.tensor([0]), st, 4)
    x = torch.randn(6, 8)
    got = tap.site.module(x)
    want = apply_steer(st, x.reshape(6, 2, 4), torch.tensor([True, False, False, False, False, False]))
    torch.testing.assert_close(got, want.reshape(6, 8))


STATIC = MODES["vllm-static"]


def test_static_refuses_orders_it_cannot_compose():
    v = torch.ones(4)
    with pytest.raises(SteeringError, match="project_out at resid_post.0 before any other op"):
        STATIC.check_steers([Steer("resid_post.0", "add", v), Steer("resid_post.0", "project_out", v)])
    with pytest.raises(SteeringError, match="one project_out direction per tap"):
        STATIC.check_steers([Steer("resid_post.0", "project_out", v), Steer("resid_post.0", "project_out", v)])
    STATIC.check_steers([Steer("resid_post.0", "project_out", v), Steer("resid_post.1", "add", v)])


# -- attention recompute ----------------------------------------------------------------------------
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


# -- tensor-parallel tables --------------------------------------------------------------------------
def _describe(rank, held_q, held_k):
    pts = {"q": {"0": {"shape": [len(held_q), 8], "held": held_q, "write_refused": None}},
           "k": {"0": {"shape": [len(held_k), 8], "held": held_k, "write_refused": None}},
           "resid_post": {"0": {"shape": [16], "held": None, "write_refused": None}},
           "final_norm": {"None": {"shape": [16], "held": None, "write_refused": None}},
           "attn_out_post": {"0": {"why": "'attn_out_post' at layer 0 is not served: no post-attention sandwich norm"}}}
    return {"rank": rank, "tp": 2, "n_layers": 1, "model_class": "X", "points": pts, "tap_bytes": 0,
            "attn": {"0": {"scale": 1.0, "softcap": None, "window": None, "alibi": False, "sinks": False}}}


def test_ranks_tables_merge_into_full_shapes():
    # 4 query heads split 2 + 2; one kv head replicated on both ranks
    cat = VLLMCatalogue([_describe(0, [0, 1], [0]), _describe(1, [2, 3], [0])], "vllm", None)
    assert cat.shape(Address("q", 0)) == (4, 8) and cat.shape(Address("k", 0)) == (1, 8)
    assert cat.shape(Address("q", 0, head=1)) == (8,) and cat.heads(Address("attn_probs", 0)) == 4
    assert cat.info(Address("q", 0))["sharded"] and not cat.info(Address("resid_post", 0))["sharded"]
    assert cat.tp == 2 and cat.n_layers == 1
    with pytest.raises(Exception, match="no post-attention sandwich norm"):
        cat.check(Address("attn_out_post", 0))


# -- step anchors in vLLM's worker --------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        self.model.norm = torch.nn.LayerNorm(2)


class _WholeCompiled(_Net):
    """Like a class under vLLM's @support_torch_compile: __call__ goes to forward, skipping hooks."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)


def test_step_anchor_is_the_top_model_where_its_hooks_fire():
    from engine.backends.vllm.worker.seams import step_anchors
    from engine.backends.vllm.worker.tree import Tree
    net = _Net()
    assert step_anchors(net, Tree()) == (net, net, 1, None)


def test_step_anchor_falls_back_to_first_layer_and_final_norm_when_the_top_is_compile_decorated():
    from engine.backends.vllm.worker.seams import step_anchors
    from engine.backends.vllm.worker.tree import Tree
    net = _WholeCompiled()
    net.do_not_compile = True  # vllm (eager forward): layer hooks fire
    begin, end, positions_at, error = step_anchors(net, Tree())
    assert begin is net.model.layers[0] and end is net.model.norm and positions_at == 0 and error is None
    net.do_not_compile = False  # compiled whole: nothing inside is visible
    error = step_anchors(net, Tree())[3]
    assert "_WholeCompiled as a whole" in error and "compile=False" in error


def _head_steers(hd: int):
    """One steer per op of the table at z.0.head-3, every optional field set where the op takes it."""
    from engine.core.steering import OPS, Steer
    g = torch.Generator().manual_seed(0)
    vec = torch.randn(hd, generator=g)
    value = {"none": None, "vector": vec, "scale": 0.5, "direction": vec, "activation": torch.randn(5, hd, generator=g)}
    extra = {"rescale": {"coeff": 3.0}, "norm_scaled_add": {"coeff": 0.25}, "projection_cap": {"bounds": (-0.1, 0.2)}}
    import tempfile

    from engine.core.sae_files import write_random_sae
    sae = str(write_random_sae(tempfile.mkdtemp(prefix="head-steers-sae-"), "standard", hd, 4, seed=0))
    extra.update({n: {"coeff": 1.5, "sae": sae, "feature": 2} for n, o in OPS.items() if "sae" in o.params})
    return [Steer("z.0.head-3", name, value[op.value], positions=slice(1, 4), exclude=[-1], **extra.get(name, {}))
            for name, op in OPS.items()]


def test_tensor_parallel_head_steer_keeps_every_field_on_the_rank_holding_the_head():
    """Under TP a rank holding heads [2, 3] steers global head 3 as its local head 1; the rebuilt steer
    used to keep only (address, op, value, positions), dropping coeff / bounds / exclude."""
    import types

    from engine.backends.vllm.worker.extension import WorkerState
    from engine.core.steering import Steer
    rank = types.SimpleNamespace(site=lambda base: types.SimpleNamespace(held=[2, 3]))
    for st in _head_steers(8):
        local = WorkerState._local_steer(rank, st)
        assert isinstance(local, Steer) and local is not st
        assert local.address == Address("z", 0, head=1), st.op
        for field in ("op", "positions", "coeff", "bounds", "exclude", "lead", "lengths"):
            assert getattr(local, field) == getattr(st, field), (st.op, field)
        assert (local.value is None and st.value is None) or torch.equal(local.value, st.value), st.op
    other = types.SimpleNamespace(site=lambda base: types.SimpleNamespace(held=[0, 1]))
    assert all(WorkerState._local_steer(other, st) is None for st in _head_steers(8))


# -- the sync API's event loop ---------------------------------------------------------------------------
_INTERRUPTED_LOOP = r"""
import asyncio, sys
from engine.backends.vllm.runtime import Loop
loop = Loop()
started = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop.loop)
started.result(5)
pending = []
loop.loop.call_soon_threadsafe(lambda: pending.append(loop.loop.create_task(asyncio.sleep(1000))))
started = asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop.loop)
started.result(5)
loop.stop()
print("cancelled" if pending[0].cancelled() else "pending", flush=True)
"""


def test_stopping_the_loop_unwinds_interrupted_calls_instead_of_destroying_them():
    """A call interrupted by Ctrl-C leaves its task on the loop: stop() cancels it and lets it unwind,
    so exit prints no "Task was destroyed but it is pending" lines."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _INTERRUPTED_LOOP], capture_output=True, text=True, timeout=60,
                       cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cancelled"
    assert "Task was destroyed" not in r.stderr, r.stderr
