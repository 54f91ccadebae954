"""One forward's rows as index tensors, built once per step from its spans.

A backend makes a Step for each forward (eager: each forward of a call; the vLLM worker: each engine
step) from host facts it already holds: which rows of the flat `[tokens, ...]` tensor belong to
which plan, and at which absolute positions. The Step turns them, on first use and then once per
step, into what the sites need:

    rows, value = step.steer_rows(group, shape)  # Rows: flat row index [m] (device), plan / steer /
                                                 # position of each row (host); the value per row (device)
    rows = step.read_rows(group)                 # the rows a capture keeps (each plan's wanted tail)

Nothing here reads a device value: positions, masks and exclusions are evaluated on the host, then
uploaded as index tensors (non-blocking), and values are gathered with device index tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from engine.core.errors import SteeringError
from engine.core.ledger import GUARD, Ledger
from engine.core.plan import touches_every_row

if TYPE_CHECKING:
    from engine.core.plan import Plan, ReadGroup, ReadoutGroup, Span, SteerGroup
    from engine.core.steering import Steer


@dataclass(eq=False, slots=True)
class Rows:
    """Some rows of a step's flat tensor, member by member (a member: a plan, or a plan's steer).
    index: device long [m] (None: every row of the step, in order); flat / plan / steer: host int64 [m]
    (the rows, their plan key, steer index); at: host int64 [m], each row's absolute position less
    `shift`; spans: (member, absolute position of its first row less `shift`, its row count) for members
    with rows; codes: the distinct plan codes. A carried step's rows share every array with the step
    before and differ in `shift` alone (positions are added when used: `pos`, `members`, the ledger's read)."""
    index: torch.Tensor | None
    flat: np.ndarray
    plan: np.ndarray
    at: np.ndarray
    steer: np.ndarray
    spans: list
    codes: frozenset = frozenset()
    shift: int = 0

    def shifted(self, d: int) -> Rows:
        """The same rows of a step whose every sequence is d positions further on (a decode step)."""
        return Rows(self.index, self.flat, self.plan, self.at, self.steer, self.spans, self.codes, self.shift + d)

    @property
    def pos(self) -> np.ndarray:
        """Each row's absolute position (host int64 [m])."""
        return self.at + self.shift if self.shift else self.at

    @property
    def members(self) -> list:
        """(member, absolute position of its first row, its row count) for members with rows."""
        d = self.shift
        return [(m, f + d, n) for m, f, n in self.spans] if d else self.spans

    @property
    def m(self) -> int:
        return len(self.plan)

    @property
    def counts(self) -> list[int]:
        return [n for _, _, n in self.spans]

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """These rows of the flat tensor t (a copy)."""
        return t.clone() if self.index is None else t.index_select(0, self.index)


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host int64 array as a device tensor, copied without waiting for the device."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


_EMPTY = np.zeros(0, dtype=np.int64)
_GUARD_KEY = ("guard",)


class Step:
    """The spans of one forward and, built on first use, the index tensors and values its sites use.
    `ledger` receives every steer application's tally; `sanitize`: a row a steer makes non-finite keeps
    its unsteered value (vLLM: nothing non-finite may reach the KV cache); `on_error(plan, exc)`: a
    plan's own failure while building its rows (None: raise). `prev`: the Step of the previous forward
    of the same sequences when this one's spans are exactly those, one position on (eager decode): rows
    that do not depend on positions are taken from it, shifted, instead of rebuilt."""
    __slots__ = ("spans", "n_tokens", "device", "ledger", "sanitize", "on_error", "prev", "_span", "_built")

    def __init__(self, spans: list[Span], n_tokens: int, device: torch.device | str | None = None,
                 ledger: Ledger | None = None, sanitize: bool = False,
                 on_error: Callable[[Plan, BaseException], None] | None = None, prev: Step | None = None) -> None:
        self.spans, self.n_tokens, self.prev = spans, n_tokens, prev
        self.device = torch.device(device if device is not None else "cpu")
        before: Ledger | None = None if prev is None else prev.ledger
        if before is not None and ledger is not None and ledger is not before:
            raise ValueError("a Step carried from another records in its ledger: rows carry its plan codes")
        self.ledger: Ledger = ledger if ledger is not None else before if before is not None else Ledger()
        self.sanitize, self.on_error = sanitize, on_error
        self._span = {id(sp.plan): sp for sp in spans}
        self._built: dict = {}

    def span(self, plan: Plan) -> Span | None:
        sp = self._span.get(id(plan))
        return None if sp is None or sp.plan.error is not None else sp

    # -- rows --------------------------------------------------------------------------------------
    def _rows(self, parts: list) -> Rows:
        """Rows from (member, plan key, steer index, span, offsets within the span, or None for every row
        of the span) of each member (plan keys are recorded as the ledger's codes). The row geometry
        is built once per step for each distinct set of spans and offsets (every layer's capture of a
        call has the same one), the labels per group."""
        parts = [p for p in parts if p[4] is None or len(p[4])]
        if not parts:
            return Rows(None, _EMPTY, _EMPTY, _EMPTY, _EMPTY, [])
        key = ("rows", *((id(p[3]), None if p[4] is None else p[4].tobytes()) for p in parts))
        geo = self._built.get(key)
        if geo is None:
            geo = self._built[key] = self._geometry([(p[1], p[3], p[4]) for p in parts])
        index, flat, plan, where, counts, firsts, codes = geo
        indices = {p[2] for p in parts}
        steer = (np.full(len(flat), parts[0][2], dtype=np.int64) if len(indices) == 1
                 else np.repeat(np.array([p[2] for p in parts], dtype=np.int64), counts))
        return Rows(index, flat, plan, where, steer, [(p[0], f, n) for p, f, n in zip(parts, firsts, counts)], codes)

    def _geometry(self, spans: list) -> tuple:
        """(device index or None, flat rows, plan codes, positions, counts, first positions, distinct plan
        codes) for (plan key, span, offsets or None) of each member."""
        code = self.ledger.code
        if len(spans) == 1 and spans[0][2] is None:  # one plan's every row (a decode step of one sequence):
            key, sp, _ = spans[0]  # two ranges, no array arithmetic (this runs once per forward)
            flat = np.arange(sp.a, sp.b, dtype=np.int64)
            where = np.arange(sp.pos0, sp.pos0 + sp.n, dtype=np.int64)
            index = None if sp.a == 0 and sp.n == self.n_tokens else upload(flat, self.device)
            c = code(key)
            return index, flat, np.full(sp.n, c, dtype=np.int64), where, [sp.n], [sp.pos0], frozenset((c,))
        counts = np.array([sp.n if off is None else len(off) for _, sp, off in spans], dtype=np.int64)
        firsts = [sp.pos0 + (0 if off is None else int(off[0])) for _, sp, off in spans]
        if all(off is None for _, _, off in spans):  # every row of each span: ranges, built at once
            start = np.repeat(np.cumsum(counts) - counts, counts)
            within = np.arange(int(counts.sum()), dtype=np.int64) - start
            flat = np.repeat([sp.a for _, sp, _ in spans], counts) + within
            where = np.repeat([sp.pos0 for _, sp, _ in spans], counts) + within
        else:
            offs = [np.arange(sp.n, dtype=np.int64) if off is None else off for _, sp, off in spans]
            flat = np.concatenate([o + sp.a for o, (_, sp, _) in zip(offs, spans)])
            where = np.concatenate([o + sp.pos0 for o, (_, sp, _) in zip(offs, spans)])
        codes = [code(k) for k, _, _ in spans]
        plan = np.repeat(np.array(codes, dtype=np.int64), counts)
        every = len(flat) == self.n_tokens and bool((flat == np.arange(self.n_tokens)).all())
        return (None if every else upload(flat, self.device), flat, plan, where, counts.tolist(), firsts,
                frozenset(codes))

    def _carried(self, key: tuple) -> tuple | None:
        """What `key` built in this step: from the previous step, shifted a position, where it was built
        there and marked as not depending on positions (the entry's last item); None: to be built now."""
        got = self._built.get(key)
        if got is None and self.prev is not None:
            old = self.prev._built.get(key)
            if old is not None and old[-1]:
                got = self._built[key] = (old[0].shifted(1), *old[1:])
        return got

    def steer_rows(self, g: SteerGroup, shape: tuple) -> tuple[Rows, torch.Tensor | None]:
        """The rows the group's steers touch in this step and the value for each (checked against the
        per-position `shape` the site has; a member whose value does not fit fails alone, when
        on_error is set)."""
        key = ("steer", id(g))
        got = self._carried(key)
        if got is None:
            rows, free = self.steer_geometry(g, shape)
            got = self._built[key] = (rows, self._values(rows, shape), free)
        return got[0], got[1]

    def steer_geometry(self, g: SteerGroup, shape: tuple) -> tuple[Rows, bool]:
        """The rows the group's steers touch in this step, without their values (host work only: a
        backend that builds the values itself, vllm-static's coefficient table), and whether they do not
        depend on positions (then a step one position on carries them)."""
        key = ("steer-rows", id(g))
        got = self._carried(key)
        if got is None:
            got = self._built[key] = self._steer_rows(g, shape)
        return got[0], got[1]

    def _steer_rows(self, g: SteerGroup, shape: tuple) -> tuple:
        """(rows, whether they do not depend on positions, that again: the carry flag) of a steer group."""
        parts = []
        for plan, i, st in g.members:
            sp = self.span(plan)
            if sp is None:
                continue
            off = None if touches_every_row(st) else self._offsets(st, sp)
            try:
                last = sp.pos0 + sp.n - 1 if off is None else sp.pos0 + int(off[-1]) if len(off) else -1
                check_value(st, shape, last)
            except SteeringError as e:
                if self.on_error is None:
                    raise
                self.on_error(plan, e)
                continue
            parts.append(((plan, i, st), plan.key, i, sp, off))
        rows = self._rows(parts)
        free = all(off is None for *_, off in parts) and (g.steer.value is None or not g.steer.bound().lead)
        return rows, free, free

    def _offsets(self, st: Steer, sp: Span) -> np.ndarray:
        """st.offsets on the span, computed once per step for steers whose positions and exclusions agree."""
        p = st.positions
        spec = id(p) if isinstance(p, torch.Tensor) else (p.start, p.stop) if isinstance(p, slice) else \
            tuple(p) if isinstance(p, list) else p
        key = ("offsets", spec, tuple(st.exclude or ()), sp.pos0, sp.n, sp.plan.prompt_len)
        if key not in self._built:
            self._built[key] = st.offsets(sp.pos0, sp.n, sp.plan.prompt_len)
        return self._built[key]

    def _values(self, rows: Rows, shape: tuple) -> torch.Tensor | None:
        """The group's value for each of its rows: one tensor when every member shares it (a vector,
        or one gather by position), else each member's rows stacked."""
        if not rows.members:
            return None
        sts = [st for (_, _, st), _, _ in rows.members]
        first = sts[0]
        if first.value is None:
            return None
        lead = first.bound().lead
        if all(st.value is first.value for st in sts):
            v = first.value
            return v.index_select(0, upload(rows.pos, v.device)) if lead else v
        per, at = [], 0
        for st, n in zip(sts, rows.counts):
            v = st.value
            if lead:
                per.append(v.index_select(0, upload(rows.pos[at:at + n], v.device)))
            else:  # one value per member, the same on each of its rows (a scalar scale: [n, 1, ...])
                lift = v.reshape(1, *([1] * len(shape))) if v.dim() == 0 else v.unsqueeze(0)
                per.append(lift.expand(n, *lift.shape[1:]))
            at += n
        return torch.cat(per)

    def read_rows(self, g: ReadGroup) -> Rows:
        """The rows each plan of the group keeps for its capture key (its wanted tail)."""
        key = ("read", id(g))
        got = self._built.get(key)
        if got is None:
            parts, kept = [], []
            for plan in g.plans:
                sp = self.span(plan)
                if sp is None:
                    continue
                skip = plan.wanted(g.key, sp.pos0, sp.n)
                if skip is not None:
                    parts.append((plan, plan.key, 0, sp, None if skip == 0 else np.arange(skip, sp.n, dtype=np.int64)))
                    kept.append((id(plan), skip))
            same = ("read-rows", *kept)  # groups whose plans keep the same rows share them (every layer's
            got = self._built.get(same)  # capture of a call: 30 groups, one Rows)
            if got is None:
                got = self._built[same] = self._rows(parts)
            self._built[key] = got
        return got

    def readout_rows(self, g: ReadoutGroup) -> Rows:
        """Every row of each member's span (a member: (plan, Accumulator))."""
        key = ("readout", id(g))
        got = self._carried(key)
        if got is None:
            parts = [((plan, acc), plan.key, 0, sp, None) for plan, acc in g.members
                     if (sp := self.span(plan)) is not None]
            got = self._built[key] = (self._rows(parts), True)
        return got[0]

    def guard_rows(self) -> Rows:
        """Every row of each plan that steers (what the layer guard watches)."""
        got = self._carried(_GUARD_KEY)
        if got is None:
            parts = [(sp.plan, sp.plan.key, GUARD, sp, None) for sp in self.spans
                     if sp.plan.steers and sp.plan.error is None]
            got = self._built[_GUARD_KEY] = (self._rows(parts), True)
        return got[0]

    # -- what a site keeps ---------------------------------------------------------------------------
    def capture(self, g: ReadGroup, t: torch.Tensor) -> None:
        """Keep the group's rows of the flat tensor t (one copy for all plans), each plan its slice."""
        rows = self.read_rows(g)
        if not rows.members:
            return
        src = t.detach() if g.coord is None else t.detach()[:, g.coord]
        for (plan, p0, _), part in zip(rows.members, rows.take(src).split(rows.counts)):
            plan.add(g.key, p0, part)


def one_on(prev: Step | None, spans: list[Span], n_tokens: int) -> Step | None:
    """`prev` when `spans` are its own one position on (a decode step of the same sequences in the same
    rows, none of them failed): the Step these may carry rows from (Step(prev=...)); else None."""
    if prev is None or prev.n_tokens != n_tokens or len(prev.spans) != len(spans):
        return None
    for old, sp in zip(prev.spans, spans):
        if sp.plan is not old.plan or sp.a != old.a or sp.b != old.b or sp.pos0 != old.pos0 + 1 or sp.plan.error:
            return None
    return prev


def check_value(st: Steer, shape: tuple, last: int) -> None:
    """Refuse a value whose per-position shape is not the point's (Steer.check_shape), and a positional
    value that does not cover a position the steer touches (`last`: the latest absolute one; -1: none)."""
    st.check_shape(shape)
    v = st.value
    if not isinstance(v, torch.Tensor):
        return
    if st.bound().lead == 2:
        raise SteeringError(f"steering value for {st.address} still has its batch axis {tuple(v.shape)}; the "
                            f"engine binds it per sequence (report this as a bug).")
    if st.bound().lead and last >= v.shape[0]:
        raise SteeringError(f"steering value for {st.address} has shape {tuple(v.shape)}: it covers positions "
                            f"0..{v.shape[0] - 1} but the steer touches position {last}; give a value "
                            f"for every touched position or narrow positions=.")
