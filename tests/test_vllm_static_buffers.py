"""vllm-static's taps as a CUDA graph needs them (engine/backends/vllm/worker/static.py): every buffer keeps
its storage for the engine's life (a captured graph reads and writes fixed addresses), the per-row
steer coefficients are written into it in place before a forward, and the forward applies them and
leaves its rows in `cap`, its receipts and flags in its own buffers (and each layer guard its flags). The replay itself needs a GPU; everything
around it runs here on a Linear."""
from __future__ import annotations

import pytest
import torch

from engine.backends.vllm.worker.static import StaticTaps, lone_tap
from engine.backends.vllm.worker.tree import VSite
from engine.core.address import Address
from engine.core.steering import Steer

ROWS, WIDTH = 8, 4


def _tap():
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH).requires_grad_(False)  # as vLLM runs it: inference only
    site = VSite(lin, "post", "out", get=lambda out: out, put=lambda out, new: new)
    return lin, lone_tap("resid_post.0", site, WIDTH, ROWS, True, "cpu", torch.float32)


def _installed(*widths: int):
    """StaticTaps with a write tap mlp_act.i on a Linear of each width (a bank per width), as the loader
    installs them (the Linears stand in for the modules; mlp_act's width is its module's input size)."""
    torch.manual_seed(0)
    lins = [torch.nn.Linear(w, w).requires_grad_(False) for w in widths]
    sites = {f"mlp_act.{i}": VSite(lin, "post", "out", get=lambda out: out, put=lambda out, new: new)
             for i, lin in enumerate(lins)}
    taps = StaticTaps()
    taps.install([(Address("mlp_act", i), True) for i in range(len(widths))], lambda a: sites[str(a)], 0, ROWS,
                 torch.device("cpu"), torch.float32, {}, lins[0])
    return lins, taps


def _ptrs(tap):
    return {k: tap.buf(k).data_ptr() for k in ("cap", "u", "mul", "add", "change")}


def test_steer_coefficients_are_written_in_place_and_applied_per_row():
    lin, tap = _tap()
    before = _ptrs(tap)
    x = torch.randn(3, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)  # the reference, without the tap
    v = torch.tensor([1.0, -2.0, 3.0, 0.5])
    tap.fill(torch.tensor([1]), Steer("resid_post.0", "add", v), None)
    tap.fill(torch.tensor([2]), Steer("resid_post.0", "scale", torch.tensor(2.0)), None)
    assert _ptrs(tap) == before  # same storage: a captured graph sees the new coefficients
    out = lin(x)
    torch.testing.assert_close(out[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], plain[1] + v)
    torch.testing.assert_close(out[2], plain[2] * 2)
    torch.testing.assert_close(tap.buf("cap")[:3], out)  # the capture rows a step reads after the forward
    tap.reset()
    assert _ptrs(tap) == before
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)  # identity again on every row


def test_project_out_and_set_rows_keep_the_storage():
    lin, tap = _tap()
    before = _ptrs(tap)
    x = torch.randn(2, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    d = torch.tensor([0.0, 1.0, 0.0, 0.0])
    tap.fill(torch.tensor([0]), Steer("resid_post.0", "project_out", d), None)
    tap.fill(torch.tensor([1]), Steer("resid_post.0", "set", torch.full((WIDTH,), 7.0)), None)
    assert _ptrs(tap) == before
    out = lin(x)
    want0 = plain[0].clone()
    want0[1] = 0.0
    torch.testing.assert_close(out[0], want0)
    torch.testing.assert_close(out[1], torch.full((WIDTH,), 7.0))


def test_a_step_fills_only_its_rows_and_the_next_step_undoes_them():
    """StaticTaps.before: a steer at every position fills its span's rows, one at some positions only
    those rows; the next step without steers leaves every row the identity again."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    (lin,), taps = _installed(WIDTH)
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    a = Plan(4, steers=[Steer("mlp_act.0", "add", v)])
    b = Plan(4, steers=[Steer("mlp_act.0", "add", w, positions=slice(5, 6))])
    x = torch.randn(5, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    # rows 0-1: plan a at positions 3, 4; rows 2-4: plan b at positions 4, 5, 6 (only position 5 touched)
    taps.before(Step([Span(a, 0, 2, 3), Span(b, 2, 5, 4)], 5), site_work([a, b], str))
    out = lin(x)
    want = plain.clone()
    want[0:2] += v
    want[3] += w
    torch.testing.assert_close(out, want)
    taps.before(Step([Span(a, 0, 1, 5)], 1), site_work([], str))  # plan a finished steering: nothing registered
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)
    assert all(bank.dirty is None for bank in taps.banks)


def test_a_finished_steer_never_reaches_a_step_the_engine_runs_without_ours():
    """A step's rows stay written after it (the next step keeps them when it is the same one a position
    on), so the worker calls `idle` before every forward without a step of ours (plain requests only):
    old code reset the rows only at the next step it started, and a steer stayed applied to whatever
    plain request came next (measured on vllm-static: a benign add at resid_post.0 changed 5 of 5 later
    plain prompts). The worker side: WorkerState._begin; end to end: tests/test_serve_poison.py."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    (lin,), taps = _installed(WIDTH)
    tap = taps.taps["mlp_act.0"]
    v = torch.tensor([1.0, -2.0, 3.0, 0.5])
    a = Plan(4, steers=[Steer("mlp_act.0", "add", v)])
    x = torch.randn(3, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    work = site_work([a], str)
    step = Step([Span(a, 0, 3, 0)], 3)
    taps.before(step, work)
    torch.testing.assert_close(lin(x), plain + v)
    taps.after(step, work)
    taps.idle()  # the next forward, no step of ours around it
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)
    for k, want in (("u", 0.0), ("mul", 1.0), ("add", 0.0)):
        assert bool((tap.buf(k) == want).all()), k
    assert bool((taps.marks.buf == 0).all()) and taps.marks.dirty is None  # no row marked


def test_a_carried_decode_step_keeps_the_rows_without_writing_them():
    """A decode step one position on from the last, with the same plans and steers (stepio.fill_of carries
    its Fill), holds the same rows with the same values: no fill, no reset, no mark; a step of other rows
    resets the old ones and writes its own."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step, one_on
    (lin,), taps = _installed(WIDTH)
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    a, b = Plan(8, steers=[Steer("mlp_act.0", "add", v)]), Plan(8, steers=[Steer("mlp_act.0", "add", w)])
    work = site_work([a, b], str)
    taps.attach(work)
    (bank,) = taps.banks
    writes, marks = [], []
    real_fill = bank.fill

    def fill(index, values, part=None, grid=None):
        writes.append(index.tolist())
        return real_fill(index, values, part, grid)
    bank.fill = fill
    x = torch.randn(2, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    last = None
    for t in range(3):  # a and b decode side by side (rows 0 and 1), positions 4, 5, 6
        spans = [Span(a, 0, 1, 4 + t, 0), Span(b, 1, 2, 4 + t, 1)]
        step = Step(spans, 2, prev=one_on(last, spans, 2))
        taps.before(step, work)
        marks.append(taps.marks.dirty)
        torch.testing.assert_close(lin(x), plain + torch.stack([v, w]))
        taps.after(step, work)
        step.prev, last = None, step
    assert len(writes) == 1 and marks == [(0, 2)] * 3, (writes, marks)  # written by the first step only
    step = Step([Span(b, 0, 1, 7, 0)], 1)  # a finished: b alone, now in row 0
    taps.before(step, work)
    assert len(writes) == 2
    torch.testing.assert_close(lin(x[:1]), plain[:1] + w)
    taps.after(step, work)
    taps.idle()
    torch.testing.assert_close(lin(x), plain, rtol=0, atol=0)
    assert bank.dirty is None and bank.held is None and taps.marks.dirty is None


def test_a_fill_that_fails_midway_leaves_the_identity():
    """Two banks (two widths): the first is written, the second's fill fails; every row is the
    identity again before the error goes on."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    lins, taps = _installed(WIDTH, WIDTH + 2)
    a = Plan(4, steers=[Steer("mlp_act.0", "add", torch.ones(WIDTH)), Steer("mlp_act.1", "add", torch.ones(WIDTH + 2))])
    xs = [torch.randn(2, lin.in_features) for lin in lins]
    plain = [torch.nn.functional.linear(x, lin.weight, lin.bias) for x, lin in zip(xs, lins)]
    first, second = taps.banks
    calls = []
    real = first.fill

    def fill(index, values, part=None, grid=None):
        calls.append(index)
        return real(index, values, part, grid)

    def fails(index, values, part=None, grid=None):
        calls.append(index)
        raise RuntimeError("fill failed")
    first.fill, second.fill = fill, fails
    with pytest.raises(RuntimeError, match="fill failed"):
        taps.before(Step([Span(a, 0, 2, 0)], 2), site_work([a], str))
    assert len(calls) == 2  # the first bank was written, then the second failed
    for x, lin, want in zip(xs, lins, plain):
        torch.testing.assert_close(lin(x), want, rtol=0, atol=0)


def test_tap_check_fails_a_steer_whose_squared_norm_overflows():
    """3.4e38 is finite in float32, but a row of it has an infinite sum of squares, so every norm
    after it divides by inf and outputs 0 (the issue's single-steer attack): the tap keeps the row
    unsteered and flags it (NaN in its flags), as it does a row the steer made inf; its receipts hold
    the change it asked for."""
    from engine.backends.vllm.worker.guard import bounded
    assert bounded(torch.tensor([[1.0, 2.0], [3.4e38, 0.0], [float("nan"), 0.0], [1e18, 1e18]])).flatten().tolist() \
        == [True, False, False, True]
    lin, tap = _tap()
    x = torch.randn(2, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    tap.fill(torch.tensor([1]), Steer("resid_post.0", "add", torch.full((WIDTH,), 3.4e38)), None)
    out = lin(x)
    torch.testing.assert_close(out, plain)  # row 1 kept its unsteered value
    assert torch.isnan(tap.buf("flag")[:2]).tolist() == [False, True]
    assert tap.buf("change")[0] == 0 and tap.buf("change")[1] == pytest.approx(3.4e38 * WIDTH ** 0.5, rel=1e-6)


class _Layer(torch.nn.Module):
    """A decoder layer as vLLM's Llama returns it: (hidden, residual), the stream their sum."""

    def __init__(self, add: torch.Tensor) -> None:
        super().__init__()
        self.add = add

    def forward(self, h, r):
        return h + self.add[: h.shape[0]], r


def test_layer_guard_zeroes_only_the_marked_rows_that_went_non_finite():
    """In the graph: a steering request's row whose stream left a layer inf, or too large to norm, is
    zeroed in both halves of the (hidden, residual) pair and flagged; a plain request's row is never
    touched. After the step the flags reach the ledger (the request fails at collect, named by its
    steers) with nothing read back, and the next forward without a step of ours (idle) has no row marked."""
    from engine.backends.vllm.worker.tree import Tree
    from engine.core.ledger import GUARD
    from engine.core.plan import Plan, Span
    from engine.core.step import Step
    n = 4
    # layer 0 sends row 1 (marked) and row 3 (not marked) to inf; layer 1 makes row 2 (marked) too large to norm
    add0 = torch.zeros(ROWS, WIDTH)
    add0[1], add0[3] = float("inf"), float("inf")
    add1 = torch.zeros(ROWS, WIDTH)
    add1[2] = 3e38
    layers = [_Layer(add0), _Layer(add1)]
    _, taps = _installed(WIDTH)
    taps.install_guard(layers, Tree())
    steering = Plan(4, steers=[Steer("mlp_out.0", "add", torch.ones(WIDTH))])
    plain = Plan(1)
    step = Step([Span(steering, 0, 3, 0), Span(plain, 3, 4, 0)], n)
    taps.before(step, {})
    h, r = torch.randn(n, WIDTH), torch.randn(n, WIDTH)
    out = layers[1](*layers[0](h, r))
    assert out[0][3].isinf().all()  # a plain request's row is never altered
    for row in (1, 2):
        assert bool((out[0][row] == 0).all() and (out[1][row] == 0).all()), row
    torch.testing.assert_close(out[0][0] + out[1][0], h[0] + r[0])
    flags = [f[:n] for f in taps.guard.flags]  # each layer's own: layer 0 flagged row 1, layer 1 row 2
    assert [torch.isnan(f).tolist() for f in flags] == [[False, True, False, False], [False, False, True, False]]
    taps.after(step, {})
    assert step.ledger.read([steering.key])[steering.key].failed == GUARD
    taps.idle()  # the next forward without a step of ours
    assert bool((taps.marks.buf == 0).all()) and taps.marks.dirty is None
    out = layers[1](*layers[0](h, r))  # nothing marked: nothing guarded
    assert out[0][1].isinf().all() and all(f[:n].sum() == 0 for f in taps.guard.flags)


def test_a_read_of_every_stacked_value_in_order_is_the_stack_alone():
    """The read stacks every flag and receipt buffer, then gathers the steering and steered rows. Where those
    are every stacked value in order (every row steers every write tap: a decode step of requests that all
    steer each layer), the stack is the read and no gather runs (one op less each such step: the index was
    the identity before); a step with a row that does not steer still gathers. The tallies are the changes."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    (lin,), taps = _installed(WIDTH)
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    a, b = Plan(8, steers=[Steer("mlp_act.0", "add", v)]), Plan(8, steers=[Steer("mlp_act.0", "add", w)])
    plain = Plan(8)
    work = site_work([a, b, plain], str)
    taps.attach(work)
    for spans, gathers in (([Span(a, 0, 1, 4, 0), Span(b, 1, 2, 4, 1)], False),
                           ([Span(a, 0, 1, 5, 0), Span(plain, 1, 2, 4, 1), Span(b, 2, 3, 5, 2)], True)):
        n = len(spans)
        step = Step(spans, n)
        taps.before(step, work)
        x = torch.randn(n, WIDTH)
        lin(x)
        taps.after(step, work)
        assert (taps.carry.read.index is not None) == gathers
        got = step.ledger.read([a.key, b.key])
        for plan, value in ((a, v), (b, w)):
            rows, squares = got[plan.key].of(0)
            assert rows == 1 and squares == pytest.approx(float(value.double().square().sum()), rel=1e-5)
            assert got[plan.key].failed is None
        step.ledger.drop([a.key, b.key])


def test_a_steer_of_every_row_at_each_tap_is_broadcast_from_one_row_a_tap():
    """Where every write tap of a bank steers the same rows, each with one coefficient row on all of them (one
    request steering each layer: a prefill of 32 tokens at 30 layers wrote 960 gathered rows), the fill
    broadcasts one row a tap (stepio._write's grid): the same coefficients as a fill row by row, and the
    next step's reset leaves the identity. Two requests with their own vectors take the rows one by one."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    lins, taps = _installed(WIDTH, WIDTH)  # one bank, two write taps
    (bank,) = taps.banks
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    x = torch.randn(3, WIDTH)
    plain = [torch.nn.functional.linear(x, lin.weight, lin.bias) for lin in lins]
    grids = []
    real_fill = bank.fill

    def fill(index, values, part=None, grid=None):
        grids.append(grid is not None)
        return real_fill(index, values, part, grid)
    bank.fill = fill
    a = Plan(8, steers=[Steer("mlp_act.0", "add", v), Steer("mlp_act.1", "scale", torch.tensor(3.0))])
    b = Plan(8, steers=[Steer("mlp_act.0", "add", w)])
    for plans, spans, broadcast in (([a], [Span(a, 0, 3, 0)], True),
                                    ([a, b], [Span(a, 0, 2, 0), Span(b, 2, 3, 5, 1)], False)):
        work = site_work(plans, str)
        taps.attach(work)
        step = Step(spans, 3)
        taps.before(step, work)
        assert grids[-1] == broadcast
        want0, want1 = plain[0].clone(), plain[1].clone()
        want0[0:2] += v
        want1[0:2] *= 3.0
        if b in plans:
            want0[2] += w
        else:
            want0[2] += v
            want1[2] *= 3.0
        torch.testing.assert_close(lins[0](x), want0, rtol=0, atol=0)
        torch.testing.assert_close(lins[1](x), want1, rtol=0, atol=0)
        coef = bank.coef
        rows = 2 if b in plans else 3
        assert bool((coef[0, :rows, 2] == v).all()) and bool((coef[1, :2, 1] == 3.0).all())  # the values, by row
        rest = coef[:, 3:]  # rows no step wrote: the identity
        assert bool((rest[:, :, 1] == 1).all()) and bool((rest[:, :, 0] == 0).all()) and bool((rest[:, :, 2] == 0).all())
        taps.after(step, work)
        taps.idle()
        for lin, p in zip(lins, plain):
            torch.testing.assert_close(lin(x), p, rtol=0, atol=0)


def _counting(monkeypatch, taps):
    """(builds, resets): the steps that composed their Fill from the steers, and the row count of each reset
    of the bank to the identity."""
    from engine.backends.vllm.worker import stepio
    (bank,) = taps.banks
    builds, resets = [], []
    real_build, real_identity = stepio._build, bank._identity

    def build(taps, step, work):
        builds.append(step.n_tokens)
        return real_build(taps, step, work)

    def identity(index, part):
        resets.append(len(index))
        return real_identity(index, part)
    monkeypatch.setattr(stepio, "_build", build)
    monkeypatch.setattr(bank, "_identity", identity)
    return builds, resets


@pytest.mark.parametrize("two", [False, True], ids=["one request", "two requests"])
def test_the_first_decode_step_selects_its_rows_from_the_prefills(monkeypatch, two):
    """The first decode step after a prefill, the same requests each one row on, takes each request's last
    prefill row's coefficients and ledger entries (stepio.Fill.first_decode) instead of composing every tap
    again, and resets only the rows its forward reads that it does not write (Bank.hold): at 30 layers
    that was 0.9 ms of composing and 0.5 ms resetting 960 rows to write 30. Checked against the taps'
    outputs, a Fill built from the steers, the ledger's tallies, and the identity where nothing steers
    (rows held past the decode step are reset by the next step that reads them)."""
    from engine.backends.vllm.worker import stepio
    from engine.core.ledger import Ledger
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step, one_on
    lins, taps = _installed(WIDTH, WIDTH)  # one bank, two write taps
    builds, resets = _counting(monkeypatch, taps)
    v, w = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([0.0, 5.0, 0.0, 1.0])
    a = Plan(8, steers=[Steer("mlp_act.0", "add", v), Steer("mlp_act.1", "scale", torch.tensor(3.0))])
    b = Plan(8, steers=[Steer("mlp_act.0", "add", w)])
    plans = [a, b] if two else [a]
    work = site_work(plans, str)
    taps.attach(work)
    prefill = [Span(a, 0, 3, 0, 0)] + ([Span(b, 3, 5, 0, 1)] if two else [])
    decode = [Span(a, 0, 1, 3, 0)] + ([Span(b, 1, 2, 2, 1)] if two else [])
    carried = [Span(a, 0, 1, 4, 0)] + ([Span(b, 1, 2, 3, 1)] if two else [])  # the next step: carried
    x = torch.randn(ROWS, WIDTH)
    plain = [torch.nn.functional.linear(x, lin.weight, lin.bias) for lin in lins]
    last, ledger = None, Ledger()
    for spans in (prefill, decode, carried):
        n = spans[-1].b
        step = Step(spans, n, ledger=ledger, prev=one_on(last, spans, n))  # the worker's one ledger
        taps.before(step, work)
        want0, want1 = plain[0][:n].clone(), plain[1][:n].clone()
        for sp in spans:
            want0[sp.a:sp.b] += v if sp.plan is a else w
            if sp.plan is a:
                want1[sp.a:sp.b] *= 3.0
        torch.testing.assert_close(lins[0](x[:n]), want0, rtol=0, atol=0)
        torch.testing.assert_close(lins[1](x[:n]), want1, rtol=0, atol=0)
        taps.after(step, work)
        if spans is decode and builds == [5 if two else 3]:  # the first decode step, derived: as if built
            fresh = stepio._build(taps, step, work)
            builds.pop()
            for got, want in zip(taps.carry.writes, fresh.writes):
                assert got.flat.tolist() == want.flat.tolist() and torch.equal(got.values, want.values)
                assert got.part == want.part
            assert taps.carry.read.flat.tolist() == fresh.read.flat.tolist()
            assert [[r[0], r[1], r[2].tolist(), r[3].tolist(), (r[4] + taps.carry.shift).tolist(), r[5]]
                    for r in taps.carry.read.records] == \
                [[r[0], r[1], r[2].tolist(), r[3].tolist(), r[4].tolist(), r[5]] for r in fresh.read.records]
        step.prev, last = None, step
    assert builds == [5 if two else 3], builds  # composed once, for the prefill
    # the decode step writes each request's row at each tap: row 1 of tap 1 (b's, unsteered there) held a's
    # prefill value and is reset; rows past the step's 2 wait for a step that reads them
    assert resets == ([1] if two else []), resets
    got = ledger.read([p.key for p in plans])
    assert got[a.key].of(0)[0] == 5 and got[a.key].of(0)[1] == pytest.approx(5 * float(v.square().sum()))
    if two:
        assert got[b.key].of(0)[0] == 4 and got[b.key].of(0)[1] == pytest.approx(4 * float(w.square().sum()))
    # a prefill of another request over 5 rows: every row it reads that it does not steer is the identity again
    c = Plan(8, steers=[Steer("mlp_act.0", "scale", torch.tensor(2.0))])
    work = site_work([c], str)
    taps.attach(work)
    step = Step([Span(c, 0, 5, 0, 0)], 5)
    taps.before(step, work)
    torch.testing.assert_close(lins[0](x[:5]), plain[0][:5] * 2, rtol=0, atol=0)
    torch.testing.assert_close(lins[1](x[:5]), plain[1][:5], rtol=0, atol=0)
    taps.after(step, work)
    taps.idle()
    for lin, want in zip(lins, plain):
        torch.testing.assert_close(lin(x), want, rtol=0, atol=0)


def test_a_first_decode_step_of_position_dependent_steers_is_composed_again(monkeypatch):
    """A steer at generated positions only touches rows by position: the decode step composes its own Fill."""
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step
    (lin,), taps = _installed(WIDTH)
    builds, _ = _counting(monkeypatch, taps)
    v = torch.tensor([1.0, -2.0, 3.0, 0.5])
    a = Plan(3, steers=[Steer("mlp_act.0", "add", v, positions="generated")])
    work = site_work([a], str)
    taps.attach(work)
    x = torch.randn(4, WIDTH)
    plain = torch.nn.functional.linear(x, lin.weight, lin.bias)
    for spans, n in (([Span(a, 0, 3, 0, 0)], 3), ([Span(a, 0, 1, 3, 0)], 1)):
        step = Step(spans, n)
        taps.before(step, work)
        torch.testing.assert_close(lin(x[:n]), plain[:n] + (v if n == 1 else 0), rtol=0, atol=0)
        taps.after(step, work)
    assert builds == [3, 1]


@pytest.mark.parametrize("case", ["one request", "two requests", "a plain row", "one tap each"])
def test_the_first_decode_step_takes_its_captures_from_the_prefills(monkeypatch, case):
    """The first decode step after a prefill whose plans kept every row of every captured tap takes the
    prefill's captures with each plan's one row (stepio.Captures.first_decode) instead of gathering them
    again; where the prefill kept only some rows (each plan its own tap), or the step has a row of no plan
    of ours, they are gathered again. Either way each plan holds the taps' outputs at its rows, position by
    position, against the Linears run without the taps."""
    from engine.backends.vllm.worker import stepio
    from engine.core.plan import Plan, Span, site_work
    from engine.core.step import Step, one_on
    lins, taps = _installed(WIDTH, WIDTH)
    gathers = []
    real = stepio._captures_of

    def counted(taps, step, work):
        gathers.append(step.n_tokens)
        return real(taps, step, work)
    monkeypatch.setattr(stepio, "_captures_of", counted)
    both = [Address("mlp_act", 0), Address("mlp_act", 1)]
    a = Plan(3, both if case != "one tap each" else both[:1])
    b = Plan(2, both if case != "one tap each" else both[1:])
    plans = [a] if case == "one request" else [a, b]
    work = site_work(plans, str)
    taps.attach(work)
    spans = [[Span(a, 0, 3, 0, 0)] + ([Span(b, 3, 5, 0, 1)] if len(plans) > 1 else [])]
    for k in range(1, 3):  # the first decode step, then one carried
        spans.append([Span(a, 0, 1, 2 + k, 0)] + ([Span(b, 1, 2, 1 + k, 1)] if len(plans) > 1 else []))
    x = torch.randn(ROWS, WIDTH)
    extra = int(case == "a plain row")  # a request without a plan of ours, in the decode steps' last row
    last, want = None, {id(p): {str(k): [] for k in p.captures} for p in plans}
    for i, sp in enumerate(spans):
        n = sp[-1].b + (extra if i else 0)
        step = Step(sp, n, prev=one_on(last, sp, n))
        taps.before(step, work)
        for lin in lins:
            lin(x[i:i + n])
        plain = [torch.nn.functional.linear(x[i:i + n], lin.weight, lin.bias) for lin in lins]  # the same shapes
        for s in sp:
            for key in want[id(s.plan)]:
                want[id(s.plan)][key].append(plain[int(key[-1])][s.a:s.b])
        taps.after(step, work)
        step.prev, last = None, step
    derived = case in ("one request", "two requests")
    assert gathers == ([5 if len(plans) > 1 else 3] if derived else [5, 2 + extra]), gathers
    for p in plans:
        p.settle()
        for key, rows in want[id(p)].items():
            got = torch.cat([c for _, c in p.store[key]])
            assert [pos for pos, _ in p.store[key]] == [0, p.prompt_len, p.prompt_len + 1]
            torch.testing.assert_close(got, torch.cat(rows), rtol=0, atol=0)


def test_read_groups_of_the_same_plans_and_rows_share_their_rows():
    """Every layer's capture of a call is a read group of the same plans keeping the same rows: one Rows for
    all of them (a step built 30, one per layer); a group of other plans, or one whose plan keeps fewer rows
    (a key starting later), gets rows of its own. Each is checked against the spans it came from."""
    from engine.core.plan import Plan, ReadGroup, Span
    from engine.core.step import Step
    a, b = Plan(3), Plan(2)
    a.start_at["late"] = 2  # key "late" keeps a's rows from position 2 on
    step = Step([Span(a, 0, 3, 0, 0), Span(b, 3, 5, 0, 1)], 5)
    groups = [ReadGroup(f"resid_post.{i}", None, [a, b]) for i in range(4)]  # alive: the step keys by id, as
    groups += [ReadGroup("resid_post.0", None, [a]), ReadGroup("late", None, [a, b])]  # the worker's work does
    layers = [step.read_rows(g) for g in groups[:4]]
    assert all(r is layers[0] for r in layers)
    assert layers[0].flat.tolist() == [0, 1, 2, 3, 4] and layers[0].pos.tolist() == [0, 1, 2, 0, 1]
    assert [(p, f, n) for p, f, n in layers[0].members] == [(a, 0, 3), (b, 0, 2)]
    only_a, late = step.read_rows(groups[4]), step.read_rows(groups[5])
    assert only_a is not layers[0] and late is not layers[0]
    assert only_a.flat.tolist() == [0, 1, 2]
    assert late.flat.tolist() == [2, 3, 4] and late.pos.tolist() == [2, 0, 1]
