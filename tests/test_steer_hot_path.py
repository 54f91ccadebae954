"""The steering hot path (engine.core.site: run_site, and apply_steer, its one-sequence form) on plain
tensors: the whole-batch paths (every row touched, or a row index over several plans) give what the op
computed row by row gives, refuse what the full check refuses, and tally receipts alike."""
from __future__ import annotations

import math

import pytest
import torch

from engine.core.plan import Plan, Span, site_work
from engine.core.site import apply_steer, run_site
from engine.core.steering import NonFiniteSteer, Steer
from engine.core.step import Step

D = 6


def _rows(n=4, seed=0):
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed))


def test_every_row_and_a_full_mask_and_no_mask_agree_with_the_op_row_by_row():
    x, v = _rows(), torch.arange(D, dtype=torch.float32)
    st = Steer("resid_post.0", "add", v).bound()
    want = torch.stack([r + v for r in x])
    for mask in (None, torch.ones(4, dtype=torch.bool)):
        out = apply_steer(st, x, mask)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        assert out.data_ptr() != x.data_ptr()  # never in place
    part = apply_steer(st, x, torch.tensor([False, True, False, True]))
    torch.testing.assert_close(part[[1, 3]], want[[1, 3]], rtol=0, atol=0)
    torch.testing.assert_close(part[[0, 2]], x[[0, 2]], rtol=0, atol=0)


def test_a_head_steer_on_every_row_changes_only_that_head():
    x = torch.randn(3, 2, D)
    v = torch.ones(D)
    st = Steer("z.0.head-1", "add", v).bound()
    out = apply_steer(st, x, None)
    torch.testing.assert_close(out[:, 0], x[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 1], x[:, 1] + v, rtol=0, atol=0)


def test_a_positional_value_on_every_row_reads_each_rows_position():
    x, val = _rows(3), torch.randn(10, D)
    st = Steer("resid_post.0", "add", val).bound()  # [pos, d]
    out = apply_steer(st, x, None, pos0=5)
    torch.testing.assert_close(out, x + val[5:8], rtol=0, atol=0)


def test_a_result_that_overflows_is_refused_naming_the_steer():
    x = _rows()
    with pytest.raises(NonFiniteSteer, match=r"'scale' at resid_post\.0 produced inf or NaN"):
        apply_steer(Steer("resid_post.0", "scale", 3e38).bound(), x * 10, None)


def test_a_value_that_does_not_fit_the_dtype_is_refused_as_such():
    st = Steer("resid_post.0", "add", torch.full((D,), 1e300, dtype=torch.float64)).bound()
    with pytest.raises(NonFiniteSteer, match="does not fit the model's float32"):
        apply_steer(st, _rows(), None)


def test_a_row_already_non_finite_fails_its_steer_and_finite_rows_whose_sum_overflows_pass():
    """The one record per row is the norm of its change: a row not finite after the steer fails it, also
    one that was not finite before (not told apart: that would cost two more passes per site; the first
    failure recorded in a forward is the one named, so an earlier steer's overflow is still blamed on it).
    Rows whose float32 sum overflows but whose entries are finite pass."""
    x = _rows()
    x[1, 2] = math.inf
    with pytest.raises(NonFiniteSteer, match=r"'add' at resid_post\.0 produced inf or NaN"):
        apply_steer(Steer("resid_post.0", "add", torch.ones(D)).bound(), x, None)
    big = torch.full((4, D), 3e38)  # every entry finite; their float32 sum is not
    assert not math.isfinite(float(big.sum()))
    out = apply_steer(Steer("resid_post.0", "add", torch.zeros(D)).bound(), big, None)
    torch.testing.assert_close(out, big, rtol=0, atol=0)


def test_receipts_of_every_row_and_of_a_mask_count_positions_and_change_alike():
    v = torch.randn(D)
    every = Plan(4, steers=[Steer("resid_post.0", "add", v).bound()])
    masked = Plan(4, steers=[Steer("resid_post.0", "add", v, positions=slice(4, 6)).bound()])
    x = _rows(6)
    outcomes = []
    for plan in (every, masked):
        step = Step([Span(plan, 0, 6, 2)], 6)
        run_site(x, step, site_work([plan], str)["resid_post.0"])
        outcomes.append(step.ledger.read()[plan.key])
    (r_all,), (r_mask,) = every.receipts(outcomes[0]), masked.receipts(outcomes[1])
    d = ((x + v) - x).pow(2).sum(-1).double()
    assert (r_all.rows, r_mask.rows) == (6, 2)
    assert r_all.change_norm == pytest.approx(float(d.sum().sqrt()))
    assert r_mask.change_norm == pytest.approx(float(d[2:4].sum().sqrt()))  # positions 4, 5 = rows 2, 3


def test_run_site_gives_back_a_single_span_covering_the_step_without_copying_the_input():
    v = torch.randn(D)
    plan = Plan(4, steers=[Steer("resid_post.0", "add", v).bound()])
    t = _rows()
    out = run_site(t, Step([Span(plan, 0, 4, 0)], 4), site_work([plan], str)["resid_post.0"])
    torch.testing.assert_close(out, t + v, rtol=0, atol=0)
    other = Plan(4)  # two spans, one steered: the other's rows are the input's
    t2 = _rows(6, 1)
    work = site_work([plan, other], str)["resid_post.0"]
    out2 = run_site(t2, Step([Span(plan, 0, 3, 0), Span(other, 3, 6, 0)], 6), work)
    torch.testing.assert_close(out2[:3], t2[:3] + v, rtol=0, atol=0)
    torch.testing.assert_close(out2[3:], t2[3:], rtol=0, atol=0)


def test_an_op_that_gives_back_its_input_still_returns_new_storage(monkeypatch):
    from engine.core import ops
    op = ops.OPS["add"]
    monkeypatch.setitem(ops.OPS, "add", ops.Op(op.name, op.value, op.doc, lambda x, v, p: x.reshape(x.shape),
                                               op.affine))
    x = _rows()
    out = apply_steer(Steer("resid_post.0", "add", torch.ones(D)).bound(), x, None)
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("a,b,pos0,n_tokens", [(0, 4, 0, 4), (0, 1, 9, 1), (2, 5, 7, 6), (0, 3, 4, 5)])
def test_one_span_rows_are_its_range_of_flat_rows_and_positions(a, b, pos0, n_tokens):
    """One plan's every row (a decode step of one sequence, or a prefill) takes a shortcut in the row
    geometry: its rows are still flat rows a..b-1 at positions pos0.., each labelled with the plan and the
    steer, and a value by position is gathered at those positions; the index is None only when the span
    is the whole step."""
    value = torch.arange(20 * D, dtype=torch.float32).reshape(20, D)
    st = Steer("resid_post.0", "add", value, positions="all").bound()
    plan = Plan(pos0 + b - a, steers=[st])
    step = Step([Span(plan, a, b, pos0)], n_tokens)
    g = site_work([plan], str)["resid_post.0"].steers[0]
    rows, v = step.steer_rows(g, (D,))
    assert rows.flat.tolist() == list(range(a, b)) and rows.pos.tolist() == list(range(pos0, pos0 + b - a))
    assert rows.plan.tolist() == [step.ledger.code(plan.key)] * (b - a) and rows.steer.tolist() == [0] * (b - a)
    assert rows.members == [((plan, 0, st), pos0, b - a)]
    if (a, b) == (0, n_tokens):
        assert rows.index is None
    else:
        assert rows.index.tolist() == list(range(a, b))
    torch.testing.assert_close(v, value[pos0:pos0 + b - a], rtol=0, atol=0)
    t = torch.randn(n_tokens, D)
    out = run_site(t, step, site_work([plan], str)["resid_post.0"])
    want = t.clone()
    want[a:b] += value[pos0:pos0 + b - a]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def _decode_steps(plans, steps=3, pos0=(5, 9)):
    """Steps of a decode of two sequences (rows 0 and 1 of each forward), each after the one before,
    and the same steps built on their own (the reference)."""
    chained, alone, prev = [], [], None
    for i in range(steps):
        spans = [Span(p, r, r + 1, pos0[r] + i, r) for r, p in enumerate(plans)]
        prev = Step(spans, len(plans), prev=prev)  # the ledger of the first
        chained.append(prev)
        alone.append(Step([Span(p, r, r + 1, pos0[r] + i, r) for r, p in enumerate(plans)], len(plans),
                          ledger=prev.ledger))
    return chained, alone


def _same_rows(got, want):
    assert (got.index is None) == (want.index is None)
    if got.index is not None:
        assert torch.equal(got.index, want.index)
    for f in ("flat", "plan", "pos", "steer"):
        assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
    assert got.members == want.members and got.codes == want.codes


def test_a_decode_step_carries_position_free_rows_from_the_step_before_exactly():
    """Eager decode: a step whose spans are the last step's, one position on (Step.prev), takes the rows
    that do not depend on positions (a steer of every position with one vector, the guard's, a
    readout's) from it, shifted; they equal the rows the step builds on its own."""
    v = torch.randn(D)
    plans = [Plan(5, steers=[Steer("resid_post.0", "add", v).bound()]), Plan(9, steers=[Steer("resid_post.0", "add", v).bound()])]
    g = site_work(plans, str)["resid_post.0"].steers[0]
    chained, alone = _decode_steps(plans)
    for c, a in zip(chained, alone):
        (rc, vc), (ra, va) = c.steer_rows(g, (D,)), a.steer_rows(g, (D,))
        _same_rows(rc, ra)
        assert torch.equal(vc, va)
        _same_rows(c.guard_rows(), a.guard_rows())
    built = []
    real = Step._steer_rows
    Step._steer_rows = lambda self, *a: built.append(self) or real(self, *a)
    try:
        chained, _ = _decode_steps(plans)
        for c in chained:
            c.steer_rows(g, (D,))
    finally:
        Step._steer_rows = real
    assert built == chained[:1]  # built once, carried after


@pytest.mark.parametrize("how", ["positional value", "position window"])
def test_rows_that_depend_on_positions_are_built_again_at_every_decode_step(how):
    """A value by position reads each step's own positions, and a window of positions touches a row at
    some steps only: neither is carried from the step before."""
    val = torch.randn(20, D)
    st = (Steer("resid_post.0", "add", val) if how == "positional value"
          else Steer("resid_post.0", "add", val[0], positions=slice(6, 7))).bound()
    plans = [Plan(5, steers=[st]), Plan(9, steers=[st])]
    g = site_work(plans, str)["resid_post.0"].steers[0]
    chained, alone = _decode_steps(plans)
    for c, a in zip(chained, alone):
        (rc, vc), (ra, va) = c.steer_rows(g, (D,)), a.steer_rows(g, (D,))
        _same_rows(rc, ra)
        assert (vc is None) == (va is None) and (vc is None or torch.equal(vc, va))
    if how == "position window":  # row 0 is at position 6 in the second step only
        assert [c.steer_rows(g, (D,))[0].pos.tolist() for c in chained] == [[], [6], []]


def test_the_guard_bound_is_a_float32_norm_for_every_dtype():
    """engine.core.site.row_bounds: inf or NaN for a row not finite or too large for a float32 sum of
    squares (|row| past ~1.8e19), finite otherwise; a float16 row of norm 64000 (finite in float16, its
    square is not) is within bounds, as it is for the model that holds it."""
    from engine.core.site import row_bounds
    x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [float("inf"), 0.0], [1.4e19, 1.4e19], [1.2e19, 1.2e19]])
    got = row_bounds(x)
    assert got.dtype == torch.float32
    assert torch.isfinite(got).tolist() == [True, False, False, False, True]
    torch.testing.assert_close(got[[0, 4]], x[[0, 4]].double().norm(dim=-1).float())
    half = torch.full((1, 4096), 1000.0, dtype=torch.float16)
    assert row_bounds(half).tolist() == [64000.0]
    assert row_bounds(torch.zeros(3, 2, 4)).shape == (3,)  # per row of a headed point


def test_a_guarded_site_leaves_a_non_finite_row_to_the_layer_guard():
    """With sanitize on (vLLM), a steer's non-finite row keeps its unsteered value, unless the site is
    `guarded` (the layer guard checks its output next, and zeroes the row there); both fail the plan."""
    x = _rows(2)
    plan = Plan(2, steers=[Steer("resid_post.0", "scale", 3e38).bound()])
    for guarded in (False, True):
        work = site_work([plan], str)["resid_post.0"]
        work.guarded = guarded
        step = Step([Span(plan, 0, 2, 0)], 2, sanitize=True)
        out = run_site(x * 10, step, work)
        if guarded:
            assert not torch.isfinite(out).all()
        else:
            torch.testing.assert_close(out, x * 10, rtol=0, atol=0)
        assert step.ledger.read([plan.key])[plan.key].failed == 0


def test_a_step_carries_from_the_one_before_only_when_its_spans_are_those_one_position_on():
    """engine.core.step.one_on, the vLLM worker's test before Step(prev=...): the same plans in the same
    rows, every one a position further, none failed."""
    from engine.core.step import one_on
    a, b = Plan(4), Plan(6)
    prev = Step([Span(a, 0, 1, 4), Span(b, 1, 2, 6)], 2)
    assert one_on(prev, [Span(a, 0, 1, 5), Span(b, 1, 2, 7)], 2) is prev
    assert one_on(None, [Span(a, 0, 1, 5), Span(b, 1, 2, 7)], 2) is None
    for spans, n in (([Span(a, 0, 1, 5), Span(b, 1, 2, 7)], 3),  # another step size
                     ([Span(b, 0, 1, 7), Span(a, 1, 2, 5)], 2),  # rows swapped
                     ([Span(a, 0, 1, 5)], 2),  # a request left
                     ([Span(a, 0, 1, 6), Span(b, 1, 2, 7)], 2),  # two positions on (or recomputed)
                     ([Span(a, 0, 1, 4), Span(b, 1, 2, 6)], 2)):  # the same positions again
        assert one_on(prev, spans, n) is None
    b.error = "failed"
    assert one_on(prev, [Span(a, 0, 1, 5), Span(b, 1, 2, 7)], 2) is None


def test_carried_rows_record_each_steps_own_positions_in_the_ledger():
    """A carried step's rows share the step before's arrays and differ by a shift the ledger adds when it
    is read: vLLM's ledger (unique=False) counts a position once per steer, so three decode steps of two
    sequences are three rows each, with the change norms each step recorded (the reference: the value's
    norm, every row steered by `add` of one vector)."""
    from engine.core.ledger import Ledger
    v = torch.randn(D, generator=torch.Generator().manual_seed(3))
    plans = [Plan(5, steers=[Steer("resid_post.0", "add", v).bound()]), Plan(9, steers=[Steer("resid_post.0", "add", v).bound()])]
    work = site_work(plans, str)["resid_post.0"]
    prev = None
    ledger = Ledger(unique=False)
    for i in range(3):
        spans = [Span(p, r, r + 1, (5, 9)[r] + i, r) for r, p in enumerate(plans)]
        prev = Step(spans, 2, ledger=ledger if prev is None else None, prev=prev)
        run_site(_rows(2, seed=i), prev, work)
        assert prev.steer_rows(work.steers[0], (D,))[0].pos.tolist() == [5 + i, 9 + i]
    out = ledger.read([p.key for p in plans])
    for p in plans:
        rows, sumsq = out[p.key].of(0)
        assert rows == 3 and out[p.key].failed is None
        assert math.isclose(sumsq, 3 * float(v.double().norm()) ** 2, rel_tol=1e-5)


def test_the_vllm_worker_keeps_no_chain_of_finished_steps():
    """engine.backends.vllm.worker.extension.WorkerState._end: a finished step stays as `last` (the next
    step's rows carry from it) but drops its own link to the step before; kept, every step of a long
    generation held all earlier ones, with their rows and values, until the plans changed."""
    import types

    from engine.backends.vllm.worker.extension import WorkerState
    from engine.core.step import one_on
    plan = Plan(4, steers=[Steer("resid_post.0", "add", torch.ones(D)).bound()])
    work = site_work([plan], str)["resid_post.0"]
    ws = object.__new__(WorkerState)  # the state _end reads, without a vLLM runner
    ws.blocks = types.SimpleNamespace(guarded_mark=lambda step: None)
    ws.mode = types.SimpleNamespace(after=lambda step, work: None)
    from engine.backends.vllm.worker.meters import Meters
    ws.work, ws.step, ws.last = {}, None, None
    ws.meters = Meters()  # none of them switched on
    steps = []
    for i in range(4):
        spans = [Span(plan, 0, 1, 4 + i)]
        ws.step = Step(spans, 1, prev=one_on(ws.last, spans, 1))
        assert (ws.step.prev is None) == (i == 0) and ws.step.prev is ws.last  # the one before, while built
        run_site(_rows(1, seed=i), ws.step, work)
        steps.append(ws.step)
        ws._end(None, None, None)
        assert ws.step is None and ws.last is steps[-1] and ws.last.prev is None
    assert all(s.prev is None for s in steps)
