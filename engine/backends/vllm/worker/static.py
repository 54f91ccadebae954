"""`vllm-static`: a tap set declared at load, baked into the forward as fixed, stacked buffers.

The taps of one per-position width share a `Bank` of buffers, each indexed by tap: `cap [taps, rows,
width]` (the forward copies the point into it) and, for the write taps, `pre` (the point before the
write) and `coef [writes, rows, 3, width]`, the per-row coefficients (u, mul, add) of y = (x - (x.u) u)
* mul + add. Every write tap also leaves in the engine's one `Tally` (engine/backends/vllm/worker/
guard.py) the norm of each row's change (float64: the step's receipts) and NaN in its FLAG row where y
is not finite, or so large that its squared norm overflows (`bounded`): such a row keeps x, and its
request fails after the step; nothing non-finite reaches the KV cache. The wrappers are installed between
weight loading and compilation, so torch.compile (CPU) and CUDA graphs (GPU) capture plain tensor ops on
buffers with fixed addresses and no Python, no data-dependent control flow.

Around each forward (the worker's step anchor), a step of ours does, whatever its layers, taps,
steers, captures and requests:
  before  one fill per bank: the step's coefficient rows, composed on the host from each steer's affine
          form (engine/backends/vllm/worker/table.py, from the op's own row in engine/core/ops.py) and
          written with one index_copy from a host-built index and table; and one fill of the guard's
          MARK row;
  after   one read: every steering row's receipt and flag, one gather from the tally into the ledger
          (nothing read back: the request fails when its ledger is read at collect); one reset per bank
          (the same rows back to the identity) and one of the MARK and FLAG rows; one gather per bank of
          every capturing row; then the readouts.
A decode step whose plans, rows and steers are the step before's, one position on, reuses that step's
index and table (nothing depends on positions there). Ops the taps cannot express (their row's `static`
says why) are refused by name before a request runs, by the client's mode object
(engine/backends/vllm/modes.py: StaticTapsMode.check_steer / check_steers). The one exception to the
constant: a request that composes several steers at one tap gets each steer's receipt by replaying its
steers on that tap's `pre` rows (engine.core.site.steer), as every tap did before.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from engine.backends.vllm.worker.guard import LayerGuard, Tally, bounded, flag
from engine.backends.vllm.worker.table import Form, compose, form_of, stacked
from engine.backends.vllm.worker.tree import Tree, VSite
from engine.core.address import Address
from engine.core.site import readout, steer
from engine.core.step import Step, upload

if TYPE_CHECKING:
    from engine.core.steering import Steer

HOST_GATHER = 1 << 20  # table rows gathered on the host up to this many elements, on the device above


class Bank:
    """The stacked buffers of the taps of one per-position width, registered on `holder`."""

    def __init__(self, holder: torch.nn.Module, key: int, width: int, rows: int, taps: int, writes: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.holder, self.width, self.rows, self.writes = holder, width, rows, writes
        self.names = {k: f"_interp_bank{key}_{k}" for k in ("cap", "pre", "coef")}
        holder.register_buffer(self.names["cap"], torch.zeros((taps, rows, width), device=device, dtype=dtype),
                               persistent=False)
        if writes:
            holder.register_buffer(self.names["pre"], torch.zeros((writes, rows, width), device=device, dtype=dtype),
                                   persistent=False)
            coef = torch.zeros((writes, rows, 3, width), device=device, dtype=dtype)
            coef[:, :, 1] = 1.0
            holder.register_buffer(self.names["coef"], coef, persistent=False)
            self.identity = torch.tensor([0.0, 1.0, 0.0], device=device, dtype=dtype)[:, None].expand(3, width)
        self.dirty: tuple | None = None  # (flat (write, row) index, part) the last fill wrote

    def buf(self, k: str) -> torch.Tensor:
        return getattr(self.holder, self.names[k])

    @property
    def nbytes(self) -> int:
        return sum(self.buf(k).nbytes for k in (("cap", "pre", "coef") if self.writes else ("cap",)))

    def fill(self, index: torch.Tensor, values: torch.Tensor, part: int | None = None) -> None:
        """Write coefficient rows at flat (write * rows + row) `index`: values [k, 3, width], or [k, width] of
        one part (0: u, 1: mul, 2: add) where the step's steers change only that one (an add: a third of
        the bytes); one index_copy."""
        self.dirty = (index, part)
        coef = self.buf("coef").view(-1, 3, self.width)
        (coef if part is None else coef[:, part]).index_copy_(0, index, values)

    def reset(self) -> None:
        """The rows the last fill wrote back to the identity: one index_copy (one index_fill for one part)."""
        if self.dirty is not None:
            (index, part), self.dirty = self.dirty, None
            coef = self.buf("coef").view(-1, 3, self.width)
            if part is None:
                coef.index_copy_(0, index, self.identity.expand(len(index), 3, self.width))
            else:
                coef[:, part].index_fill_(0, index, 1.0 if part == 1 else 0.0)


class Tap:
    """One declared (point, layer): its slot in its bank's `cap`, and for a write tap its slot in the
    bank's `pre` and `coef` (`write`) and its receipt row in the tally (`row`); the wrapper on the module."""

    def __init__(self, name: str, site: VSite, bank: Bank, slot: int, write: int | None, tally: Tally,
                 row: int | None) -> None:
        self.name, self.site, self.bank, self.slot, self.write, self.tally = name, site, bank, slot, write, tally
        self.row = row
        self.width = bank.width
        self.writable = write is not None
        self.orig = site.module.forward  # the module's own forward, before the tap wraps it (a lens readout's norm)
        self._wrap()

    def buf(self, k: str) -> torch.Tensor:
        """This tap's [rows, width] view of a bank buffer ("cap", "pre", "u", "mul", "add"), or its
        receipt row of the tally ("change")."""
        if k == "cap":
            return self.bank.buf("cap")[self.slot]
        if k == "change":
            return self.tally.buf[self.row]
        if k == "pre":
            return self.bank.buf("pre")[self.write]
        return self.bank.buf("coef")[self.write, :, ("u", "mul", "add").index(k)]

    def shape(self, head_dim: int | None, head: bool = False) -> tuple:
        """The per-position shape of the point (one head's, with a head coordinate)."""
        full = (self.width // head_dim, head_dim) if head_dim else (self.width,)
        return full[1:] if head else full

    def _wrap(self) -> None:
        site, mod, holder, names = self.site, self.site.module, self.bank.holder, self.bank.names
        slot, w, row, tholder, flag_row = self.slot, self.write, self.row, self.tally.holder, self.tally.FLAG
        orig = mod.forward

        def tap(t):  # tensor ops only: traced into the compiled graph
            n = t.shape[0]
            x = t.reshape(n, -1)
            if w is not None:
                getattr(holder, names["pre"])[w, :n].copy_(x)
                co = getattr(holder, names["coef"])[w, :n]
                u = co[:, 0]
                y = x - (x * u).sum(-1, keepdim=True) * u
                y = y * co[:, 1] + co[:, 2]
                tally = getattr(tholder, Tally.NAME)
                tally[row, :n].copy_(torch.linalg.vector_norm(y - x, dim=-1, dtype=torch.float64))  # the receipt
                # a row the steer made non-finite (or so large that its squared norm overflows: every
                # norm after it would divide by inf) keeps its unsteered value (it must never reach the
                # KV cache) and is flagged for after() to fail its request
                ok = bounded(y) | ~bounded(x)
                flag(tally, flag_row, n, ~ok)
                x = torch.where(ok, y, x)
            getattr(holder, names["cap"])[slot, :n].copy_(x)
            return x.reshape(t.shape)

        if site.phase == "pre":
            def forward(*args, **kwargs):
                new = tap(site.get((args, kwargs)))
                if w is not None:
                    args, kwargs = site.put((args, kwargs), new)
                return orig(*args, **kwargs)
        else:
            def forward(*args, **kwargs):
                out = orig(*args, **kwargs)
                new = tap(site.get(out))
                return site.put(out, new) if w is not None else out
        mod.forward = forward

    # -- a tool for tests: one steer composed into this tap's rows on the device --------------------------
    def fill(self, rows: "torch.Tensor | slice", steer: Steer, head_dim: int | None,
             value: torch.Tensor | None = None) -> None:
        """Compose one steer into the coefficients at the given flat rows with its op's affine form (the
        steps compose on the host instead: table.compose); `value` its value for those rows."""
        u, mul, add = self.buf("u"), self.buf("mul"), self.buf("add")
        form = form_of(steer if value is None else steer.at(steer.address, value),  # type: ignore[arg-type]
                       self.width, head_dim, u.device)
        a, b = (torch.from_numpy(f).to(u.device, u.dtype) for f in (form.a, form.b))
        c = form.cols
        if form.u is not None:
            u[rows, c] = torch.from_numpy(form.u).to(u.device, u.dtype)
        mul[rows, c], add[rows, c] = mul[rows, c] * a, add[rows, c] * a + b

    def reset(self) -> None:
        """Every row of this tap the identity again."""
        self.buf("u").zero_()
        self.buf("mul").fill_(1.0)
        self.buf("add").zero_()


def lone_tap(name: str, site: VSite, width: int, rows: int, writable: bool, device: "torch.device | str",
             dtype: torch.dtype) -> Tap:
    """A tap with a bank and tally of its own on its module (tests and tools)."""
    device = torch.device(device)
    tally = Tally(site.module, int(writable), rows, device)
    return Tap(name, site, Bank(site.module, 0, width, rows, 1, int(writable), device, dtype), 0,
               0 if writable else None, tally, 0 if writable else None)


def width_of(site: VSite, point: str, d_model: int) -> int:
    """Per-token width of a tap, from the module it sits on (no forward needed)."""
    if site.kind in ("q", "k", "value"):
        m = site.module
        return (m.num_heads if site.kind == "q" else m.num_kv_heads) * m.head_size
    if point in ("z", "mlp_act"):
        m = site.module
        for name in ("input_size_per_partition", "input_size", "in_features"):
            if getattr(m, name, None):
                return int(getattr(m, name))
        return int(m.weight.shape[0 if type(m).__name__ == "Conv1D" else 1])
    return d_model


class StaticTaps:
    """All taps of one engine, plus the per-step fill, read and reset (the module docstring)."""

    def __init__(self) -> None:
        self.taps: dict[str, Tap] = {}  # address str (no coords) -> Tap
        self.head_dim: dict[str, int | None] = {}  # None: the point has no head axis
        self.banks: list[Bank] = []
        self.tally: Tally | None = None
        self.forms: dict[int, tuple[Any, Form]] = {}  # id(steer) -> (steer, its form), for the registered plans
        self._carry: Fill | None = None  # what the last step built, for the next step one position on

    def install(self, declared: list[tuple[Address, bool]], site_of: Callable[[Address], VSite], d_model: int,
                rows: int, device: torch.device, dtype: torch.dtype, head_dims: dict[str, int],
                holder: torch.nn.Module) -> None:
        """Taps at the declared sites (writable where asked and the site allows), their buffers stacked
        per width on `holder` (a module inside the compiled forward), and the tally."""
        sites = [(a, site_of(a)) for a, _ in declared]
        writable = [w and s.write_refused is None for (_, w), (_, s) in zip(declared, sites)]
        widths = [width_of(s, a.point, d_model) for a, s in sites]
        self.tally = Tally(holder, sum(writable), rows, device)
        banks: dict[int, Bank] = {}
        for width in dict.fromkeys(widths):
            n = widths.count(width)
            k = sum(w for w, x in zip(writable, widths) if x == width)
            banks[width] = Bank(holder, len(banks), width, rows, n, k, device, dtype)
        self.banks = list(banks.values())
        used = {w: [0, 0] for w in banks}
        write = 0
        for (a, s), width, wr in zip(sites, widths, writable):
            slot, wslot = used[width]
            used[width] = [slot + 1, wslot + int(wr)]
            self.taps[str(a)] = Tap(str(a), s, banks[width], slot, wslot if wr else None, self.tally,
                                    write if wr else None)
            self.head_dim[str(a)] = head_dims.get(a.point)
            write += int(wr)

    def install_guard(self, layers: list[torch.nn.Module], tree: Tree) -> None:
        """The layer guard on every decoder layer, outside any tap there (after install)."""
        assert self.tally is not None, "install the taps first"
        LayerGuard(layers, tree, self.tally)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.banks) + (self.tally.nbytes if self.tally is not None else 0)

    # -- the worker's mode (engine/backends/vllm/worker/extension.py: HookSites is the hooked one) --------
    def site_key(self, addr: Address) -> str:
        """A plan's work is grouped by tap name (the address without coordinates)."""
        return str(addr)

    def attach(self, work: dict) -> list:
        """Nothing to attach (the taps are part of the compiled forward): each registered steer's affine
        form, once per change of the plans (table.form_of: device work and a copy to the host, here and
        not in a step). A steer whose form fails keeps its error, raised by the step that fills it."""
        forms: dict = {}
        for name, w in work.items():
            tap = self.taps.get(name)
            if tap is None or not tap.writable:
                continue
            for g in w.steers:
                for _, _, st in g.members:
                    if id(st) not in forms:
                        try:
                            forms[id(st)] = (st, form_of(st, tap.width, self.head_dim[name], tap.bank.buf("coef").device))
                        except Exception as e:  # noqa: BLE001  (raised where it is filled: the step's plans fail)
                            forms[id(st)] = (st, e)
        self.forms, self._carry = forms, None
        return []

    def original_forward(self, name: str) -> Callable[..., Any] | None:
        """The forward of the module a tap named `name` wraps, before the tap (None: no such tap), so
        rows run through it (a lens readout's final norm) bypass the tap's capture and steer."""
        tap = self.taps.get(name)
        return None if tap is None else tap.orig

    def describe(self, addr: Address, info: dict) -> None:
        """What the engine's table says of this (point, layer): a declared tap, and whether it writes."""
        tap = self.taps.get(str(addr))
        info["tap"] = tap is not None
        info["writable"] = bool(tap is not None and tap.writable)

    def shape_of(self, name: str) -> tuple:
        tap, hd = self.taps[name], self.head_dim[name]
        return (tap.width // hd, hd) if hd else (tap.width,)

    # -- a step -----------------------------------------------------------------------------------------
    def before(self, step: Step, work: dict) -> None:
        """Mark the steering requests' rows for the layer guard and write this step's coefficient rows
        (identity elsewhere): one fill each. work: tap name -> SiteWork of the registered plans (steers
        already local to this rank). A fill that fails leaves every buffer the identity again before the
        error goes on (the step's plans fail; nothing stays applied)."""
        if step.n_tokens > max((b.rows for b in self.banks), default=math.inf):
            raise RuntimeError(f"step of {step.n_tokens} tokens exceeds the tap buffers; raise max_num_batched_tokens")
        self.identity()  # normally already (after() ends every step so); a step whose end never ran left rows
        try:
            assert self.tally is not None
            self.tally.mark(step.guard_rows(), step.n_tokens)
            fill = self._fill_of(step, work)
            for bank, index, values, part in fill.writes:
                bank.fill(index, values, part)
        except BaseException:
            self.identity()
            raise

    def identity(self) -> None:
        """Every write tap the identity on every row again and no row marked or flagged: the state
        outside a step, so a step the engine runs without starting one of ours (no registered plan has
        rows in it) applies nothing a finished request left behind (old code reset the rows a step
        filled only when it started the next step of its own: a benign steer stayed applied to every
        plain request after it)."""
        for bank in self.banks:
            bank.reset()
        if self.tally is not None:
            self.tally.clear()

    def after(self, step: Step, work: dict) -> None:
        """Back to the identity (first); the step's receipts and flags into the ledger, one gather, then
        the MARK and FLAG rows cleared; each capturing plan's rows, one gather per bank; the readouts.
        Nothing is read back (a request the flags fail fails when its ledger is read at collect)."""
        assert self.tally is not None
        for bank in self.banks:
            bank.reset()
        try:
            fill = self._fill_of(step, work)
            if fill.read is not None:
                index, plan, steer_index, at, codes = fill.read
                norms = self.tally.buf.view(-1).index_select(0, index)
                step.ledger.record(plan, steer_index, at, norms, codes, fill.shift)
        finally:
            self.tally.clear()
        for name in fill.replay:  # a tap where a request composes several steers: each one's receipt
            w = work[name]
            cur = self.taps[name].buf("pre")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
            for g in w.steers:
                cur = steer(cur, step, g)
        self._capture(step, work)
        for name, w in work.items():  # readouts last (a lens readout runs the final norm, bypassing its tap)
            if w.readouts:
                cap = self.taps[name].buf("cap")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
                for o in w.readouts:
                    readout(cap, step, o)

    # -- what a step writes and reads, built on the host once (or carried from the step before) ----------
    def _fill_of(self, step: Step, work: dict) -> Fill:
        """This step's Fill: built in before(), reused in after(); a step one position on from the one
        before (engine.core.step.one_on), whose steers do not depend on positions, takes that one's."""
        c = self._carry
        if c is not None and c.step is step:
            return c
        if c is not None and c.free and step.prev is not None and c.step is step.prev:
            new = dataclasses.replace(c, step=step, shift=c.shift + 1, capture=None)
            new.capture = None if c.capture is None or not c.capture.free else \
                dataclasses.replace(c.capture, shift=c.capture.shift + 1)
        else:
            new = self._build(step, work)
        self._carry = new
        return new

    def _form(self, st: Any, tap: Tap, name: str) -> Form:
        got = self.forms.get(id(st))
        if got is None:  # not attached (a step run by hand): made now
            got = self.forms[id(st)] = (st, form_of(st, tap.width, self.head_dim[name], tap.bank.buf("coef").device))
        if isinstance(got[1], Exception):
            raise got[1]
        return got[1]

    def _build(self, step: Step, work: dict) -> Fill:
        """The step's coefficient rows per bank (index and values on the device), and the index of every
        steering row's receipt and flag in the tally with their ledger labels (host)."""
        assert self.tally is not None
        per_bank: dict[int, tuple[Bank, list, list, list]] = {}
        labels = []
        guarded = step.guard_rows()
        if guarded.spans:
            labels.append((self.tally.FLAG * self.tally.rows + guarded.flat, guarded))
        free, replay = True, []
        for name, w in work.items():
            tap = self.taps.get(name)
            if not w.steers or tap is None or tap.write is None:
                continue
            parts, sets = [], []
            for g in w.steers:
                rows, carried = step.steer_geometry(g, tap.shape(self.head_dim[name], bool(g.steer.address.coords)))
                free = free and carried  # a group with no rows here may have some one position on
                if not rows.spans:
                    continue
                form, starts = stacked([self._form(m[2], tap, name) for m, _, _ in rows.spans])
                code = np.repeat(starts, rows.counts)
                parts.append((form, rows.flat, code + rows.pos if form.lead else code))
                sets.append(rows)
            if not parts:
                continue
            flat, table, which = compose(parts, tap.width)
            bank, idx, tables, whiches = per_bank.setdefault(id(tap.bank), (tap.bank, [], [], []))
            idx.append(tap.write * bank.rows + flat)
            whiches.append(which + sum(len(t) for t in tables))
            tables.append(table)
            if len(flat) < sum(r.m for r in sets):  # a row takes several steers here: replayed for receipts
                replay.append(name)
            else:
                labels += [(tap.row * self.tally.rows + r.flat, r) for r in sets]  # type: ignore[operator]
        writes = []
        for bank, idx, tables, whiches in per_bank.values():
            coef = bank.buf("coef")
            table, which = np.concatenate(tables), np.concatenate(whiches)
            changed = [j for j, same in enumerate((table[:, 0] == 0, table[:, 1] == 1, table[:, 2] == 0))
                       if not same.all()]
            part = changed[0] if len(changed) == 1 else None  # an add changes `add` alone: write that part
            table = table if part is None else np.ascontiguousarray(table[:, part])
            if len(which) * table[0].size <= HOST_GATHER:  # the step's rows gathered on the host: one upload
                values = torch.from_numpy(table[which]).to(coef.device, coef.dtype, non_blocking=True)
            else:  # many rows: the distinct ones uploaded, gathered on the device
                values = torch.from_numpy(table).to(coef.device, coef.dtype, non_blocking=True).index_select(
                    0, upload(which, coef.device))
            writes.append((bank, upload(np.concatenate(idx), coef.device), values, part))
        read = None
        if labels:
            read = (upload(np.concatenate([i for i, _ in labels]), self.tally.buf.device),
                    np.concatenate([r.plan for _, r in labels]), np.concatenate([r.steer for _, r in labels]),
                    np.concatenate([r.pos for _, r in labels]), frozenset().union(*(r.codes for _, r in labels)))
        return Fill(step, writes, read, replay, free)

    def _capture(self, step: Step, work: dict) -> None:
        """Every capturing plan's rows of every tap: one gather per bank; a plan's every row of the keys
        with no coordinate kept as one block ([keys, rows, width]: Plan.add_block), the others key by key."""
        fill = self._carry
        assert fill is not None and fill.step is step
        if fill.capture is None:
            fill.capture = self._captures_of(step, work)
        shift = fill.capture.shift
        for bank, index, dist in fill.capture.gathers:
            rows = bank.buf("cap").view(-1, bank.width).index_select(0, index)
            for plan, keys, coord, p0, n, shape, at in dist:
                part = rows[at:at + len(keys) * n]
                if coord is None and len(keys) > 1:
                    plan.add_block(keys, p0 + shift, part.view(len(keys), n, *shape))
                else:
                    t = part.view(n, *shape)
                    plan.add(keys[0], p0 + shift, t if coord is None else t[:, coord])

    def _captures_of(self, step: Step, work: dict) -> Captures:
        """Per bank the flat (tap, row) index of every capturing row, and in its order (plan, keys, coord,
        first position, rows, per-position shape, offset): per plan first its every-row keys without a
        coordinate, one block, then each other key."""
        per_bank: dict[int, tuple[Bank, dict]] = {}
        free = True
        for name, w in work.items():
            tap = self.taps.get(name)
            if not w.reads or tap is None:
                continue
            for r in w.reads:
                rows = step.read_rows(r)
                if not rows.members:
                    free = False  # rows a step one position on may have
                    continue
                bank, plans = per_bank.setdefault(id(tap.bank), (tap.bank, {}))
                at = 0
                for plan, p0, n in rows.members:
                    sp = step.span(plan)
                    whole = sp is not None and n == sp.n
                    free = free and whole
                    flat = tap.slot * bank.rows + rows.flat[at:at + n]
                    at += n
                    blocks, singles = plans.setdefault(id(plan), (plan, [], []))[1:]
                    (blocks if whole and r.coord is None else singles).append((r.key, r.coord, p0, n, self.shape_of(name), flat))
        gathers = []
        for bank, plans in per_bank.values():
            idx, dist, at = [], [], 0
            for plan, blocks, singles in plans.values():
                if blocks:  # one (plan, first position, rows) for all of them: the plan's span
                    _, _, p0, n, shape, _ = blocks[0]
                    same = [b for b in blocks if b[4] == shape]
                    singles = [b for b in blocks if b[4] != shape] + singles
                    dist.append((plan, tuple(b[0] for b in same), None, p0, n, shape, at))
                    idx += [b[5] for b in same]
                    at += len(same) * n
                for key, coord, p0, n, shape, flat in singles:
                    dist.append((plan, (key,), coord, p0, n, shape, at))
                    idx.append(flat)
                    at += n
            gathers.append((bank, upload(np.concatenate(idx), bank.buf("cap").device), dist))
        return Captures(gathers, free)


@dataclass(eq=False)
class Captures:
    """One step's capture gathers: per bank the flat (tap, row) index and, in its order, (capture key,
    coordinate, per-position shape, members (plan, first position, rows), rows per member)."""
    gathers: list
    free: bool  # every plan's every row: a step one position on reads the same rows
    shift: int = 0


@dataclass(eq=False)
class Fill:
    """What one step writes and reads (StaticTaps._build): per bank (bank, flat index, coefficient rows, the
    one part written or None);
    the tally gather with its ledger labels (index, plan codes, steer indices, positions less `shift`,
    distinct codes); taps whose receipts are replayed; whether nothing depends on positions."""
    step: Step
    writes: list
    read: tuple | None
    replay: list
    free: bool
    shift: int = 0
    capture: Captures | None = None
