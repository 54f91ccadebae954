"""What a site does in one forward: its steer groups in order, then its captures and readouts, each one
whole-batch operation over the rows of every plan it concerns (engine/core/plan.py groups them,
engine/core/step.py builds their rows once per step).

    new = run_site(t, step, work)   # t: the flat [tokens, ...] tensor the site sees; None: unchanged

A steer group gathers its rows (or takes the whole tensor when it touches every row), applies its op
(engine/core/ops.py) once, and records each row's change in the step's ledger: the float64 norm of
(new - old) per row, inf or NaN where the row is not finite after the op (three kernels: the op, the
difference, the norm). That record is the guard and the receipt at once, and nothing is read back here: the ledger is read once per call (eager) or at
collect (vLLM). With `step.sanitize` (vLLM) a row made non-finite keeps its unsteered value, so nothing
non-finite reaches the rest of the forward or the KV cache; its request fails when the ledger is read.
A site whose output the layer guard checks next (`SiteWork.guarded`) leaves that to the guard, which
zeroes such a row.
Writers run before readers, so a capture sees the steered value, as the rest of the forward does.
"""
from __future__ import annotations

import functools

import torch

from engine.core.ops import OPS
from engine.core.plan import Plan, ReadoutGroup, SiteWork, Span, SteerGroup, site_work
from engine.core.readouts import DEFER_ROWS
from engine.core.steering import Steer, failure
from engine.core.step import Step


def run_site(t: torch.Tensor, step: Step, work: SiteWork) -> torch.Tensor | None:
    """Steer, then capture and read out, on the flat [tokens, ...] tensor `t` of one site. Returns the
    replacement, or None when nothing was steered (the forward then continues with `t` itself)."""
    out = t
    sanitize = step.sanitize and not work.guarded
    for g in work.steers:
        try:
            out = steer(out, step, g, sanitize)
        except Exception as e:  # with on_error (vLLM), the group's plans fail alone, their rows unsteered
            _fail(step, [m[0] for m in g.members], e)
    for r in work.reads:
        try:
            step.capture(r, out)
        except Exception as e:
            _fail(step, r.plans, e)
    for o in work.readouts:
        readout(out, step, o)
    return None if out is t else out


def _fail(step: Step, plans: list, exc: Exception) -> None:
    """A failure inside a site: raised, or, with step.on_error, each plan's own (the forward carries on)."""
    if step.on_error is None:
        raise exc
    for plan in plans:
        if step.span(plan) is not None:
            step.on_error(plan, exc)


def steer(t: torch.Tensor, step: Step, g: SteerGroup, sanitize: bool = False) -> torch.Tensor:
    """The group's op on its rows of t (a new tensor; t itself is never written). `sanitize`: a row the
    op made non-finite keeps its unsteered value."""
    st = g.steer
    h = st.address.coords[0][1] if st.address.coords else None  # type: ignore[union-attr]
    view = t if h is None else t[:, h]
    rows, value = step.steer_rows(g, tuple(view.shape[1:]))
    if not rows.spans:
        return t
    x = view if rows.index is None else view.index_select(0, rows.index)
    new = OPS[st.op].apply(x, value if value is None or value.dtype == x.dtype else value.to(x.dtype), st)
    # the receipt and the guard in one: inf or NaN where the row went non-finite (with gradients on, the
    # ledger keeps it detached: nothing backpropagates through a receipt)
    change = new - x
    change = torch.linalg.vector_norm(change if change.dim() == 2 else change.reshape(rows.m, -1), dim=-1,
                                      dtype=torch.float64)
    step.ledger.record(rows.plan, rows.steer, rows.at, change, rows.codes, rows.shift)
    if sanitize:
        new = torch.where(torch.isfinite(change).reshape(-1, *[1] * (new.dim() - 1)), new, x)
    if rows.index is None and h is None:  # every row: the op's result is the new tensor
        return new.clone() if new.data_ptr() == t.data_ptr() else new
    out = t.clone()
    target = out if h is None else out[:, h]
    if rows.index is None:
        target.copy_(new)
    else:
        target.index_copy_(0, rows.index, new.to(target.dtype))
    return out


def readout(t: torch.Tensor, step: Step, g: ReadoutGroup) -> None:
    """The group's readout kind on its rows of t, in one call; each member's accumulator takes its
    part (per-position rows, or its reduction over its rows)."""
    rows = step.readout_rows(g)
    if not rows.spans:
        return
    src = t.detach() if g.coord is None else t.detach()[:, g.coord]
    x = src if rows.index is None else src.index_select(0, rows.index)
    if g.kind.per_position and rows.m < DEFER_ROWS and all(acc.chunks or acc.waiting for (_, acc), _, _ in rows.spans):
        # a decode step's rows, each member's readout computed before (its binding has run once): they
        # wait, and are computed with the next ones (Accumulator.defer)
        x = x.clone() if x is src else x
        for ((_, acc), p0, _), part in zip(rows.members, x.split(rows.counts)):
            acc.defer(p0, part)
        return
    try:
        if g.kind.per_position:
            fn = g.members[0][1].fn  # the members share the kind, bound alike
            pieces = list(zip(*(p.split(rows.counts) for p in fn(x))))
        else:
            partials = g.kind.segments(x, rows.counts, step.device)
            pieces = [tuple(p[j] for p in partials) for j in range(len(rows.members))]
    except Exception as e:
        _fail(step, [plan for (plan, _), _, _ in rows.members], e)
        return
    for ((_, acc), p0, n), piece in zip(rows.members, pieces):
        acc.put(p0, n, piece)


def row_bounds(x: torch.Tensor) -> torch.Tensor:
    """Per row of x [n, ...]: its norm, accumulated in float32; inf or NaN where the row is not finite, or
    so large that its float32 sum of squares overflows (|row| past ~1.8e19: finite, but every RMSNorm /
    LayerNorm after it divides by inf, so it fails like inf). Tensor ops only: vllm-static traces it
    into its compiled graph (engine/backends/vllm/worker/guard.py)."""
    return torch.linalg.vector_norm(x if x.dim() == 2 else x.reshape(x.shape[0], -1), dim=-1, dtype=torch.float32)


def guard(t: torch.Tensor, step: Step, keep: bool = False) -> torch.Tensor | None:
    """The layer guard on a flat [tokens, d] hidden state: for each plan of the step that steers, whether
    any of its rows is out of bounds there (`row_bounds`), recorded in the ledger under GUARD (its request
    fails when the ledger is read). With `keep`, returns a bool [tokens] (device) that is False on each
    such row of those plans, for a backend that must keep such rows from going further (`zero_rows`);
    None when no plan of the step steers, or without `keep`. Nothing is read back."""
    rows = step.guard_rows()
    if not rows.spans:
        return None
    x = t if rows.index is None else t.index_select(0, rows.index)
    norm = row_bounds(x)  # with gradients on, the ledger keeps it detached
    step.ledger.record(rows.plan, rows.steer, rows.at, norm, rows.codes, rows.shift)  # only its finiteness counts
    if not keep:
        return None
    ok = torch.isfinite(norm)
    if rows.index is None:
        return ok
    return torch.ones(t.shape[0], dtype=torch.bool, device=t.device).index_copy(0, rows.index, ok)


def zero_rows(t: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """t [tokens, ...] with 0 on every row where ok [tokens] (or ok already shaped [tokens, 1, ...]) is False
    (a new tensor)."""
    return torch.where(ok if ok.dim() == t.dim() else ok.reshape(-1, *[1] * (t.dim() - 1)), t, _zero(t.dtype, t.device))


@functools.cache
def _zero(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim zero per dtype and device, made once (where() with a Python 0.0 wraps a new one each call)."""
    return torch.zeros((), dtype=dtype, device=device)


def apply_steer(steer: Steer, rows: torch.Tensor, mask: torch.Tensor | None = None, pos0: int = 0) -> torch.Tensor:
    """One steer on one sequence's rows [n, ...] (absolute positions pos0..pos0+n-1) where mask [n] is True
    (None: every row): the routine every backend runs (run_site) on a step of one plan, its ledger read at
    once, so a non-finite result raises NonFiniteSteer here. For tests and tools; backends use run_site."""
    n = rows.shape[0]
    spec = "all" if mask is None else torch.cat([torch.zeros(pos0, dtype=torch.bool), mask.bool().cpu()])
    st = steer.bound().replace(positions=spec, exclude=None)
    plan = Plan(pos0 + n, [], [st])
    step = Step([Span(plan, 0, n, pos0)], n, rows.device)
    out = run_site(rows, step, site_work([plan], lambda a: 0)[0])
    o = step.ledger.read().get(plan.key)
    if o is not None and o.failed is not None:
        raise failure(steer, rows.dtype)
    return rows.clone() if out is None else out
