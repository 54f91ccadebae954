"""What a vllm-static step writes into its taps and reads out of them, built on the host once per step
(or taken from the step before, one position on), for StaticTaps (engine/backends/vllm/worker/static.py).

    fill = fill_of(taps, step, work)   # the coefficient writes per bank, the ledger's labels of the read
    capture(taps, step, work, fill)    # every capturing plan's rows, one stack a bank

Everything here is numpy and index arithmetic on the host, then one upload per index or table; the ops on
the device are the ones StaticTaps and `capture` issue: a constant number a step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.backends.vllm.worker.table import compose, stacked
from engine.core.step import Step, upload

HOST_GATHER = 1 << 20  # table rows gathered on the host up to this many elements, on the device above


@dataclass(eq=False)
class Captures:
    """One step's captures, per bank: (taps stacked, flat index into the stack or None when every stacked
    row is kept, what goes to which plan)."""
    banks: list
    free: bool  # every plan's every row: a step one position on reads the same rows
    shift: int = 0
    views: list | None = None  # per bank, its taps' first n rows of `cap` (capture)

    def one_on(self) -> Captures:
        """These captures for a step one position on (every decode step copies them: built directly, as
        dataclasses.replace walks the fields each time)."""
        return Captures(self.banks, self.free, self.shift + 1, self.views)

    def first_decode(self, step: Step) -> Captures | None:
        """These captures (a prefill's) for the first decode step after it (Fill.first_decode: the same
        requests, one row each), or None where they must be gathered again. Where every plan kept every
        row of every captured tap (no gather: the rows partition among the plans, so each plan read each
        tap) and the step's rows are the plans' rows, each read is the plan's one row now: the taps,
        keys, blocks and order stay, only the rows and positions change (at 30 layers, rebuilding took
        about half a millisecond a first decode step)."""
        if not self.free or step.n_tokens != len(step.spans) or any(index is not None for _, index, _ in self.banks):
            return None
        banks = []
        for stack, _, dist in self.banks:
            reads = []
            for plan, keys, coord, _, _, shape, (t, _) in dist:
                sp = step.span(plan)
                if sp is None:
                    return None
                reads.append((plan, keys, coord, sp.pos0, sp.n, shape, (t, sp.a)))
            banks.append((stack, None, reads))
        return Captures(banks, True)


@dataclass(eq=False)
class Write:
    """One bank's fill (Bank.hold): on the device the flat (write * rows + row) index, the coefficient rows
    (all three parts, or the one `part` the steers change), and `grid` where one row a write tap is
    broadcast (_write); on the host what they were made from, one entry per written row in tap order
    (`flat` the index, `rows` the step's row, `which` its row of `table`), and each tap's slot and entry
    count, so a step whose rows are some of these takes them by selection (`at`)."""
    bank: Any
    index: torch.Tensor
    values: torch.Tensor
    part: int | None
    grid: tuple | None
    flat: np.ndarray
    rows: np.ndarray
    table: np.ndarray
    which: np.ndarray
    slots: np.ndarray
    lens: np.ndarray

    def at(self, to: np.ndarray) -> Write | None:
        """The fill of a step whose row to[r] holds what row r held here (-1: none): the kept rows' table rows,
        per tap in the same order (None: it keeps none)."""
        new = to[self.rows]
        keep = new >= 0
        ends = np.cumsum(self.lens)
        lens = np.diff(np.concatenate(([0], np.cumsum(keep)[ends - 1])))
        has = lens > 0
        if not has.any():
            return None
        return _write(self.bank, self.slots[has], lens[has], new[keep], self.table, self.which[keep], self.part)


@dataclass(eq=False)
class Read:
    """The read after a step (StaticTaps._read): `flat` the host index into the `sources` stacked (n rows each),
    `index` its upload (None where it takes every stacked value in order), and the ledger records: (first,
    end, plan codes, steer indices, positions less the Fill's shift, distinct codes)."""
    index: torch.Tensor | None
    flat: np.ndarray
    records: list
    sources: int  # how many sources are stacked


@dataclass(eq=False)
class Fill:
    """What one step writes and reads: a Write per bank; the read's one gather and its ledger records
    (`_read_of`; None: nothing to read); taps whose receipts are replayed; whether nothing depends on
    positions (a step one position on takes it, `shift` one more; the first decode step after a prefill
    selects its rows from it: `first_decode`)."""
    step: Step
    writes: list
    read: Read | None
    replay: list
    free: bool
    shift: int = 0
    capture: Captures | None = None

    def one_on(self, step: Step) -> Fill:
        """This Fill for `step`, one position on from its own (free: nothing in it depends on positions);
        captures that keep every row come along, others are gathered again."""
        cap = None if self.capture is None or not self.capture.free else self.capture.one_on()
        return Fill(step, self.writes, self.read, self.replay, self.free, self.shift + 1, cap)

    def first_decode(self, step: Step, to: np.ndarray) -> Fill:
        """This Fill (free) for `step`, whose row to[r] is the next position of row r here, the last row of
        each request (`last_rows`): each write and the read take those rows' entries, in numpy, instead of
        composing every tap again (at 30 layers that was 0.9 ms a first decode step); captures likewise
        where they kept every row (Captures.first_decode), else they are gathered again."""
        writes = [w for w in (old.at(to) for old in self.writes) if w is not None]
        read = None if self.read is None else _read_at(self.read, self.step.n_tokens, step, to)
        cap = None if self.capture is None else self.capture.first_decode(step)
        return Fill(step, writes, read, self.replay, self.free, self.shift + 1, cap)


def last_rows(before: Step, step: Step) -> np.ndarray | None:
    """Where `step` is the first decode step after `before` (the same requests in the same order, each one
    row at the position after its last row there): for each row of `before`, the row of `step` that takes
    it (each request's last row; -1 elsewhere); else None."""
    if len(before.spans) != len(step.spans) or not step.spans:
        return None
    to = np.full(before.n_tokens, -1, dtype=np.int64)
    for old, sp in zip(before.spans, step.spans):
        if sp.plan is not old.plan or sp.n != 1 or old.n < 1 or sp.pos0 != old.pos0 + old.n or sp.plan.error:
            return None
        to[old.b - 1] = sp.a
    return to


def fill_of(taps: Any, step: Step, work: dict) -> Fill:
    """This step's Fill: built in before(), reused in after(); a step one position on from the one before
    (engine.core.step.one_on) whose steers do not depend on positions takes that one's, and the first
    decode step after a prefill selects its rows from the prefill's (Fill.first_decode)."""
    c = taps.carry
    if c is not None and c.step is step:
        return c
    if c is not None and c.free and step.prev is not None and c.step is step.prev:
        new = c.one_on(step)
    elif c is not None and c.free and (to := last_rows(c.step, step)) is not None:
        new = c.first_decode(step, to)
    else:
        new = _build(taps, step, work)
    taps.carry = new
    return new


def _build(taps: Any, step: Step, work: dict) -> Fill:
    """The step's coefficient rows per bank (index and values on the device), the guard's rows and every
    steered row's receipt index with their ledger labels (host)."""
    per_bank: dict[int, tuple] = {}
    labels = []
    free, replay = True, []
    for name, w in work.items():
        tap = taps.taps.get(name)
        if not w.steers or tap is None or tap.write is None:
            continue
        parts, sets = [], []
        for g in w.steers:
            rows, carried = step.steer_geometry(g, tap.shape(taps.head_dim[name], bool(g.steer.address.coords)))
            free = free and carried  # a group with no rows here may have some one position on
            if not rows.spans:
                continue
            form, starts = stacked([taps.form(m[2], tap, name) for m, _, _ in rows.spans])
            code = np.repeat(starts, rows.counts)
            parts.append((form, rows.flat, code + rows.pos if form.lead else code))
            sets.append(rows)
        if not parts:
            continue
        flat, table, which = compose(parts, tap.width)
        _, slots, flats, tables, whiches = per_bank.setdefault(id(tap.bank), (tap.bank, [], [], [], []))
        slots.append(tap.write)
        flats.append(flat)
        tables.append(table)
        whiches.append(which)
        if len(flat) < sum(r.m for r in sets):  # a row takes several steers here: replayed for receipts
            replay.append(name)
        else:
            labels += [(tap.row or 0, r) for r in sets]
    writes = [_bank_write(*entry) for entry in per_bank.values()]
    return Fill(step, writes, _read_of(taps, step, labels), replay, free)


def _read_of(taps: Any, step: Step, labels: list) -> Read | None:
    """The read's one gather from the stacked sources (StaticTaps.sources: every write tap's and layer's
    flags, then every write tap's receipts, n rows each) and the ledger records it makes (Read). The guard
    records every flag source's value at every steering row (NaN where it failed the row: the ledger fails
    the request under GUARD), then the receipts each steered row's change (`labels`: (the write tap's row,
    its steered Rows))."""
    n, k = step.n_tokens, len(taps.writes)
    f = k + (len(taps.guard.layers) if taps.guard is not None else 0)
    guarded = step.guard_rows()
    idx, records, at = [], [], 0
    if guarded.spans and f:
        idx.append((np.arange(f)[:, None] * n + guarded.flat[None, :]).reshape(-1))
        records.append((at, at + f * guarded.m, np.tile(guarded.plan, f), np.tile(guarded.steer, f),
                        np.tile(guarded.pos, f), guarded.codes))
        at += f * guarded.m
    if labels:
        idx += [(f + row) * n + r.flat for row, r in labels]
        m = sum(r.m for _, r in labels)
        records.append((at, at + m, np.concatenate([r.plan for _, r in labels]),
                        np.concatenate([r.steer for _, r in labels]), np.concatenate([r.pos for _, r in labels]),
                        frozenset().union(*(r.codes for _, r in labels))))
    if not records:
        return None
    return _read(np.concatenate(idx), records, f + k, step)


def _read(flat: np.ndarray, records: list, sources: int, step: Step) -> Read:
    """The Read of these records at host index `flat` into `sources` stacked sources of the step's rows
    (uploaded unless it is every stacked value in order)."""
    every = len(flat) == sources * step.n_tokens and bool((flat == np.arange(len(flat))).all())
    return Read(None if every else upload(flat, step.device), flat, records, sources)


def _read_at(read: Read, n: int, step: Step, to: np.ndarray) -> Read:
    """The read of a step whose row to[r] takes row r of a step of n rows (Fill.first_decode): the records'
    entries at rows it keeps, each now at its row there (the sources' rows are per step: n, then
    step.n_tokens)."""
    src, row = np.divmod(read.flat, n)
    new = to[row]
    keep = new >= 0
    records, at = [], 0
    for lo, hi, plan, steer_index, pos, codes in read.records:
        k = keep[lo:hi]
        m = int(k.sum())
        records.append((at, at + m, plan[k], steer_index[k], pos[k], codes))
        at += m
    return _read(src[keep] * step.n_tokens + new[keep], records, read.sources, step)


def _bank_write(bank: Any, slots: list, flats: list, tables: list, whiches: list) -> Write:
    """One bank's Write from each filled tap's slot, flat rows, table and each row's row of that table: the
    tables stacked, each tap's table rows after the earlier taps' (whole-bank numpy, not per tap)."""
    lens = np.array([len(f) for f in flats], dtype=np.int64)
    firsts = np.cumsum([0] + [len(t) for t in tables[:-1]])
    table, which = np.concatenate(tables), np.repeat(firsts, lens) + np.concatenate(whiches)
    changed = [j for j, same in enumerate((table[:, 0] == 0, table[:, 1] == 1, table[:, 2] == 0)) if not same.all()]
    part = changed[0] if len(changed) == 1 else None
    table = table if part is None else np.ascontiguousarray(table[:, part])
    return _write(bank, np.array(slots, dtype=np.int64), lens, np.concatenate(flats), table, which, part)


def flat_rows(slots: np.ndarray, lens: np.ndarray, rows: np.ndarray, per_tap: int) -> np.ndarray:
    """The flat (slot * per_tap + row) index of `lens[i]` rows of each tap at slot slots[i], in tap order: into
    a bank's coefficients (per_tap: Bank.rows) or into the [write, row] rows a forward of per_tap rows reads
    (Bank.hold)."""
    return np.repeat(slots * per_tap, lens) + rows


def _write(bank: Any, slots: np.ndarray, lens: np.ndarray, rows: np.ndarray, table: np.ndarray, which: np.ndarray,
           part: int | None) -> Write:
    """The Write of `lens[i]` rows of each tap (at slot slots[i]), in tap order: the step's `rows`, each taking
    `table` row `which` (the one part the rows change (an add: `add`), or all). Each tap's rows sit at
    slot * rows + row. Where every tap writes the same rows, each of them its one table row (a steer of
    every row of the step's requests at each layer), `grid` is (slots [T, 1], rows [1, M]) and the values
    [T, 1, ...]: one index_put broadcasts them, without the T * M rows gathered first (at a 32-token
    prefill of 30 layers, 2.2 MB); else grid is None and the values one per row (Bank.fill)."""
    coef = bank.coef
    flat = flat_rows(slots, lens, rows, bank.rows)
    index = upload(flat, coef.device)
    m = int(lens[0])
    if m > 1 and (lens == m).all():
        per_tap = which[::m]  # each tap's first row's table row
        if (rows.reshape(-1, m) == rows[:m]).all() and (which.reshape(-1, m) == per_tap[:, None]).all():
            values = torch.from_numpy(np.ascontiguousarray(table[per_tap][:, None])).to(
                coef.device, coef.dtype, non_blocking=True)
            grid = (upload(slots[:, None], coef.device), upload(rows[None, :m], coef.device))
            return Write(bank, index, values, part, grid, flat, rows, table, which, slots, lens)
    if len(which) * table[0].size <= HOST_GATHER:  # the step's rows gathered on the host: one upload
        values = torch.from_numpy(table[which]).to(coef.device, coef.dtype, non_blocking=True)
    else:  # many rows: the distinct ones uploaded, gathered on the device
        values = torch.from_numpy(table).to(coef.device, coef.dtype, non_blocking=True).index_select(
            0, upload(which, coef.device))
    return Write(bank, index, values, part, None, flat, rows, table, which, slots, lens)


# -- captures -------------------------------------------------------------------------------------------
def capture(taps: Any, step: Step, work: dict, fill: Fill) -> None:
    """Every capturing plan's rows of every tap: the bank's captured taps stacked (one op), a plan's every
    row of its keys without a coordinate kept as one block ([keys, rows, ...]: Plan.add_block), the others
    key by key; views of the stack where it holds only rows some plan keeps, else of one gather of those."""
    if fill.capture is None:
        fill.capture = _captures_of(taps, step, work)
    n, shift = step.n_tokens, fill.capture.shift
    if fill.capture.views is None:  # views of buffers that keep their storage: made once, carried with the Fill
        fill.capture.views = [[t.cap_rows(n) for t in stack_taps] for stack_taps, _, _ in fill.capture.banks]
    for (stack_taps, index, dist), views in zip(fill.capture.banks, fill.capture.views):
        rows = torch.stack(views)  # [taps, n, width]
        if index is not None:
            rows = rows.view(-1, rows.shape[-1]).index_select(0, index)
        for plan, keys, coord, p0, m, shape, at in dist:
            if index is None:  # `at`: (tap position or None for all of them, first flat row)
                t, a = at
                part = (rows if a == 0 and m == n else rows[:, a:a + m]) if t is None else rows[t, a:a + m]
            else:  # `at`: the first row in the gathered rows
                part = rows[at:at + len(keys) * m].view(len(keys), m, -1)
                part = part if len(keys) > 1 else part[0]
            if len(keys) > 1:
                plan.add_block(keys, p0 + shift, part.view(len(keys), m, *shape))
            else:
                t = part.view(m, *shape)
                plan.add(keys[0], p0 + shift, t if coord is None else t[:, coord])


def _captures_of(taps: Any, step: Step, work: dict) -> Captures:
    """Per bank the captured taps and, per plan, its reads there: (key, coord, first position, rows, shape,
    tap position, first flat row, whole span)."""
    per_bank: dict[int, tuple[list, dict]] = {}
    free = True
    for name, w in work.items():
        tap = taps.taps.get(name)
        if not w.reads or tap is None:
            continue
        for r in w.reads:
            rows = step.read_rows(r)
            if not rows.members:
                free = False  # rows a step one position on may have
                continue
            stack, plans = per_bank.setdefault(id(tap.bank), ([], {}))
            if tap not in stack:
                stack.append(tap)
            at = 0
            for plan, p0, m in rows.members:
                sp = step.span(plan)
                whole = sp is not None and m == sp.n
                free = free and whole
                f0 = int(rows.flat[at])
                at += m
                plans.setdefault(id(plan), (plan, []))[1].append(
                    (r.key, r.coord, p0, m, taps.shape_of(name), stack.index(tap), f0, whole))
    return Captures([_dist(stack, plans, step.n_tokens) for stack, plans in per_bank.values()], free)


def _dist(stack: list, plans: dict, n: int) -> tuple:
    """(taps, index, dist) of one bank: views of the stack when its every row is kept, else one gather."""
    kept = np.zeros((len(stack), n), dtype=bool)  # [tap, row]: some plan keeps it
    for _, reads in plans.values():
        for _, _, _, m, _, t, f0, _ in reads:
            kept[t, f0:f0 + m] = True
    every = bool(kept.all())
    dist: list = []
    idx: list = []
    at = 0
    for plan, reads in plans.values():
        shape = next((x[4] for x in reads if x[1] is None and x[7]), None)
        block = [x for x in reads if x[1] is None and x[7] and x[4] == shape]
        if len(block) < 2 or len({x[3] for x in block}) != 1 or (every and [x[5] for x in block] != list(range(len(stack)))):
            block = []
        for x in ([tuple(block)] if block else []) + [(x,) for x in reads if x not in block]:
            key, coord, p0, m, shape, t, f0, _ = x[0]
            keys = tuple(y[0] for y in x)
            if every:
                dist.append((plan, keys, coord, p0, m, shape, (None if len(x) > 1 else t, f0)))
            else:
                dist.append((plan, keys, coord, p0, m, shape, at))
                idx += [y[5] * n + np.arange(y[6], y[6] + m) for y in x]
                at += len(x) * m
    device = stack[0].buf("cap").device
    return stack, None if every else upload(np.concatenate(idx), device), dist
