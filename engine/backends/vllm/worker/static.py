"""`vllm-static`: a tap set declared at load, baked into the forward as fixed buffers.

Each tap owns buffers registered on the module it wraps: `cap [rows, width]` (the forward copies the point
into it) and, for a write tap, `pre` (the point before the write), `change` (float64 [rows]: the norm of
each row's change, the step's receipts) and `flag` (float64 [rows]: NaN where y is not finite, or so large
that its squared norm overflows (`bounded`): such a row keeps x and its request fails after the step;
nothing non-finite reaches the KV cache). The write taps of one per-position width read their per-row
coefficients (u, mul, add of y = (x - (x.u) u) * mul + add) from one stacked buffer, their `Bank`'s
`coef [writes, rows, 3, width]`, which only the host writes. The wrappers are installed between weight
loading and compilation, so torch.compile (CPU) and CUDA graphs (GPU) capture plain tensor ops on buffers
with fixed addresses and no Python, no data-dependent control flow. Every buffer the graph writes is its
own tap's (or layer's): a compiled piece that wrote a slice of a buffer shared with other pieces copies the
whole buffer back after it (engine/backends/vllm/worker/guard.py).

Around each forward (the worker's step anchor), a step of ours does, whatever its layers, taps, steers,
captures and requests (engine/backends/vllm/worker/stepio.py builds what it writes and reads):
  before  one fill per bank: the step's coefficient rows, composed on the host from each steer's affine
          form (engine/backends/vllm/worker/table.py, from the op's own row in engine/core/ops.py) and
          written with one index_copy from a host-built index and table, after one reset of the rows the
          bank held that the forward reads and the fill does not rewrite (rows past the step's stay dirty
          until a step reads them: Bank.hold); one fill of the guard's marks. A decode step whose plans,
          rows and steers are the step before's, one position on, reuses what that step built and holds
          the same rows with the same values: it writes nothing. The first decode step after a prefill
          selects each request's last prefill row's coefficients and ledger entries (stepio);
  after   one read: every write tap's receipts and flags and every layer's flags stacked, and one gather
          of the steered and steering rows into the ledger (nothing read back: a request fails when its
          ledger is read at collect); one stack a bank of every captured tap's rows (and one gather of
          them at a step that keeps some rows only); then the readouts. The rows stay written;
  idle    before a forward with no step of ours (plain requests only): one reset per bank that holds
          rows and one clear of the marks, so nothing a finished step wrote applies to it.
Ops the taps cannot express (their row's `static` says why) are refused by name before a request
runs (engine/backends/vllm/modes.py: StaticTapsMode.check_steer / check_steers). The one exception to the
constant: a request that composes several steers at one tap gets each steer's receipt by replaying its
steers on that tap's `pre` rows (engine.core.site.steer), as every tap did before.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from engine.backends.vllm.worker import stepio
from engine.backends.vllm.worker.guard import FLAG, LayerGuard, Marks, bounded, nan_where
from engine.backends.vllm.worker.table import form_of
from engine.backends.vllm.worker.tree import Tree, VSite
from engine.core.address import Address
from engine.core.ledger import GUARD
from engine.core.site import readout, steer
from engine.core.step import Step, upload

if TYPE_CHECKING:
    from engine.core.steering import Steer


class Bank:
    """The coefficients of the write taps of one per-position width, stacked on `holder`."""

    def __init__(self, holder: torch.nn.Module, key: int, width: int, rows: int, writes: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.holder, self.width, self.rows, self.writes = holder, width, rows, writes
        self.name = f"_interp_bank{key}_coef"
        coef = torch.zeros((max(writes, 1), rows, 3, width), device=device, dtype=dtype)
        coef[:, :, 1] = 1.0
        holder.register_buffer(self.name, coef, persistent=False)
        self.identity = torch.tensor([0.0, 1.0, 0.0], device=device, dtype=dtype)[:, None].expand(3, width)
        self.dirty: tuple | None = None  # (flat (write * rows + row) index on the device or None, part, on the
        # host or None): rows that may differ from the identity
        self.held: tuple | None = None  # (index, values, part) of the last fill: the rows the bank holds now

    @property
    def coef(self) -> torch.Tensor:
        return getattr(self.holder, self.name)

    @property
    def nbytes(self) -> int:
        return self.coef.nbytes if self.writes else 0

    def fill(self, index: torch.Tensor, values: torch.Tensor, part: int | None = None,
             grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Write coefficient rows at flat (write * rows + row) `index`: values [k, 3, width], or [k, width] of
        one part (0: u, 1: mul, 2: add) where the step's steers change only that one (an add: a third of
        the bytes); one index_copy. With `grid` (writes [T, 1], rows [1, M]: the same rows of each write,
        `index` flattened), values [T, 1, ...] are broadcast over the rows: one index_put
        (engine/backends/vllm/worker/stepio.py: _write). The rows become dirty unless the caller (hold)
        has said which are."""
        self.held = (index, values, part)
        if self.dirty is None:
            self.dirty = (index, part, None)
        if grid is not None:
            coef4 = self.coef  # [writes, rows, 3, width]
            (coef4 if part is None else coef4[:, :, part]).index_put_(grid, values)
            return
        coef = self.coef.view(-1, 3, self.width)
        (coef if part is None else coef[:, part]).index_copy_(0, index, values)

    def hold(self, w: Any, n: int) -> None:
        """Hold exactly the rows of `w` (stepio.Write) among the first n rows of each write tap, the rows the
        forward reads. Nothing to write when the bank holds them already (a decode step carried from the one
        before: the same rows, the same values: stepio.fill_of). Else the rows held now that the forward
        reads and w does not write go back to the identity (every held row where w changes another part),
        then one fill. Held rows past n stay as they are and stay dirty: a later forward that reads them
        resets them first, idle resets every one (the first decode step after a 32-token prefill of 30
        layers reset 960 rows to write 30: 0.5 ms)."""
        h = self.held
        if h is not None and h[0] is w.index and h[1] is w.values and h[2] == w.part:
            return
        d = self.dirty
        if d is not None and d[1] == w.part and d[2] is not None:
            old = d[2]
            slot, row = np.divmod(old, self.rows)
            read = row < n
            stale = np.zeros((self.writes, n), dtype=bool)  # [write, row]: held, read, not rewritten
            stale[slot[read], row[read]] = True
            stale.reshape(-1)[stepio.flat_rows(w.slots, w.lens, w.rows, n)] = False
            s, r = np.nonzero(stale)
            if len(s):
                self._identity(upload(s * self.rows + r, self.coef.device), w.part)
            left = old[~read]  # held past n: untouched by this forward
            self.dirty = (None, w.part, np.concatenate([left, w.flat])) if len(left) else (w.index, w.part, w.flat)
        else:
            self.reset()
            self.dirty = (w.index, w.part, w.flat)
        self.fill(w.index, w.values, w.part, w.grid)

    def reset(self) -> None:
        """Every dirty row back to the identity: one index_copy (one index_fill for one part)."""
        if self.dirty is not None:
            (index, part, flat), self.dirty, self.held = self.dirty, None, None
            self._identity(index if index is not None else upload(flat, self.coef.device), part)

    def _identity(self, index: torch.Tensor, part: int | None) -> None:
        coef = self.coef.view(-1, 3, self.width)
        if part is None:
            coef.index_copy_(0, index, self.identity.expand(len(index), 3, self.width))
        else:
            coef[:, part].index_fill_(0, index, 1.0 if part == 1 else 0.0)


class Tap:
    """One declared (point, layer): its own buffers on the module it wraps, and for a write tap its slot in
    its bank's `coef` (`write`) and its row among the write taps' receipts (`row`)."""

    def __init__(self, name: str, site: VSite, bank: Bank, write: int | None, row: int | None, index: int) -> None:
        self.name, self.site, self.bank, self.write, self.row = name, site, bank, write, row
        self.width, self.rows, self.writable = bank.width, bank.rows, write is not None
        mod, p = site.module, f"_interp_tap{index}"
        self.orig = mod.forward  # the module's own forward, before the tap wraps it (a lens readout's norm)
        self.attrs = {k: f"{p}_{k}" for k in ("cap", "pre", "change", "flag")}
        dev, dtype = bank.coef.device, bank.coef.dtype
        shapes: dict[str, tuple[tuple, torch.dtype]] = {"cap": ((self.rows, self.width), dtype)}
        if self.writable:
            shapes.update(pre=((self.rows, self.width), dtype), change=((self.rows,), torch.float64),
                          flag=((self.rows,), torch.float64))
        for k, (shape, dt) in shapes.items():
            mod.register_buffer(self.attrs[k], torch.zeros(shape, device=dev, dtype=dt), persistent=False)
        self._caps: dict[int, torch.Tensor] = {}  # n -> the first n rows of `cap` (StaticTaps.sources' reasoning)
        self._wrap()

    def buf(self, k: str) -> torch.Tensor:
        """This tap's buffer ("cap", "pre", "change", "flag"), or its [rows, width] view of its bank's
        coefficients ("u", "mul", "add")."""
        if k in self.attrs:
            return getattr(self.site.module, self.attrs[k])
        return self.bank.coef[self.write, :, ("u", "mul", "add").index(k)]

    def cap_rows(self, n: int) -> torch.Tensor:
        """The first n rows of `cap`: a view made once per row count (the buffer keeps its storage for the
        engine's life; a module attribute lookup and a slice cost microseconds, 30 taps a step)."""
        got = self._caps.get(n)
        if got is None:
            got = self._caps[n] = self.buf("cap")[:n]
        return got

    @property
    def nbytes(self) -> int:
        return sum(self.buf(k).nbytes for k in (("cap", "pre", "change", "flag") if self.writable else ("cap",)))

    def shape(self, head_dim: int | None, head: bool = False) -> tuple:
        """The per-position shape of the point (one head's, with a head coordinate)."""
        full = (self.width // head_dim, head_dim) if head_dim else (self.width,)
        return full[1:] if head else full

    def _wrap(self) -> None:
        site, mod, names, holder, coef, w = self.site, self.site.module, self.attrs, self.bank.holder, \
            self.bank.name, self.write
        orig = mod.forward

        def tap(t):  # tensor ops only: traced into the compiled graph
            n = t.shape[0]
            x = t.reshape(n, -1)
            if w is not None:
                getattr(mod, names["pre"])[:n].copy_(x)
                co = getattr(holder, coef)[w, :n]
                u = co[:, 0]
                y = x - (x * u).sum(-1, keepdim=True) * u
                y = y * co[:, 1] + co[:, 2]
                getattr(mod, names["change"])[:n].copy_(torch.linalg.vector_norm(y - x, dim=-1, dtype=torch.float64))
                # a row the steer made non-finite (or so large that its squared norm overflows: every
                # norm after it would divide by inf) keeps its unsteered value (it must never reach the
                # KV cache) and is flagged for after() to fail its request
                ok = bounded(y) | ~bounded(x)
                getattr(mod, names["flag"])[:n].copy_(nan_where(~ok, n))
                x = torch.where(ok, y, x)
            getattr(mod, names["cap"])[:n].copy_(x)
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
    """A tap with a bank of its own on its module (tests and tools)."""
    bank = Bank(site.module, 0, width, rows, int(writable), torch.device(device), dtype)
    return Tap(name, site, bank, 0 if writable else None, 0 if writable else None, 0)


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
        self.marks: Marks | None = None
        self.guard: LayerGuard | None = None
        self.forms: dict[int, tuple[Any, Any]] = {}  # id(steer) -> (steer, its form or the error making it)
        self.carry: stepio.Fill | None = None  # what the last step built, for the next step one position on
        self._sources: dict[int, list[torch.Tensor]] = {}  # row count -> the read's views (sources)
        self.max_rows: float = math.inf  # the most rows a step may have (the banks' rows)
        self._readers: tuple[Any, list[str]] = (None, [])  # (work, its taps with readouts): once per work

    def install(self, declared: list[tuple[Address, bool]], site_of: Callable[[Address], VSite], d_model: int,
                rows: int, device: torch.device, dtype: torch.dtype, head_dims: dict[str, int],
                holder: torch.nn.Module) -> None:
        """Taps at the declared sites (writable where asked and the site allows), their coefficients stacked
        per width on `holder` (a module inside the compiled forward, which also holds the guard's marks)."""
        sites = [(a, site_of(a)) for a, _ in declared]
        writable = [w and s.write_refused is None for (_, w), (_, s) in zip(declared, sites)]
        widths = [width_of(s, a.point, d_model) for a, s in sites]
        banks: dict[int, Bank] = {}
        for width in dict.fromkeys(widths):
            k = sum(w for w, x in zip(writable, widths) if x == width)
            banks[width] = Bank(holder, len(banks), width, rows, k, device, dtype)
        self.banks, self.marks = list(banks.values()), Marks(holder, rows, device, dtype)
        self.max_rows = rows
        used = dict.fromkeys(banks, 0)
        row = 0
        for i, ((a, s), width, wr) in enumerate(zip(sites, widths, writable)):
            self.taps[str(a)] = Tap(str(a), s, banks[width], used[width] if wr else None, row if wr else None, i)
            self.head_dim[str(a)] = head_dims.get(a.point)
            used[width] += int(wr)
            row += int(wr)

    def install_guard(self, layers: list[torch.nn.Module], tree: Tree) -> None:
        """The layer guard on every decoder layer, outside any tap there (after install)."""
        assert self.marks is not None, "install the taps first"
        self.guard = LayerGuard(layers, tree, self.marks)
        self._sources = {}

    @property
    def writes(self) -> list[Tap]:
        return [t for t in self.taps.values() if t.writable]

    def sources(self, n: int) -> list[torch.Tensor]:
        """What the read stacks, first n rows each: every write tap's flags (in `row` order) and every layer's,
        then every write tap's receipts (in `row` order). Views of buffers that keep their storage for the
        engine's life, so made once per row count (a decode step's is the step before's)."""
        got = self._sources.get(n)
        if got is None:
            taps = sorted(self.writes, key=lambda t: t.row or 0)
            flags = [t.buf("flag") for t in taps] + (self.guard.flags if self.guard is not None else [])
            got = self._sources[n] = [f[:n] for f in flags] + [t.buf("change")[:n] for t in taps]
        return got

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.banks) + sum(t.nbytes for t in self.taps.values()) + \
            (self.guard.nbytes if self.guard is not None else self.marks.buf.nbytes if self.marks else 0)

    # -- the worker's mode (engine/backends/vllm/worker/hooks.py: HookSites is the hooked one) --------
    def site_key(self, addr: Address) -> str:
        """A plan's work is grouped by tap name (the address without coordinates)."""
        return str(addr)

    def attach(self, work: dict) -> list:
        """Nothing to attach (the taps are part of the compiled forward): each registered steer's affine
        form (table.form_of: device work and a copy to the host, here and not in a step), made once per
        steer: a steer registered before keeps its form (a request registering, or one collected, no longer
        makes every other request's forms again). A steer whose form fails keeps its error, raised by the
        step that fills it."""
        old, forms = self.forms, {}
        for name, w in work.items():
            tap = self.taps.get(name)
            if tap is None or not tap.writable:
                continue
            for g in w.steers:
                for _, _, st in g.members:
                    if id(st) in forms:
                        continue
                    kept = old.get(id(st))
                    if kept is not None and kept[0] is st:  # the same steer (an id alone may be reused)
                        forms[id(st)] = kept
                    else:
                        try:
                            forms[id(st)] = (st, form_of(st, tap.width, self.head_dim[name], tap.bank.coef.device))
                        except Exception as e:  # noqa: BLE001  (raised where it is filled: the step's plans fail)
                            forms[id(st)] = (st, e)
        self.forms, self.carry = forms, None
        return []

    def form(self, st: Any, tap: Tap, name: str) -> Any:
        """A registered steer's form (made now for a step run by hand, unattached)."""
        got = self.forms.get(id(st))
        if got is None:
            got = self.forms[id(st)] = (st, form_of(st, tap.width, self.head_dim[name], tap.bank.coef.device))
        if isinstance(got[1], Exception):
            raise got[1]
        return got[1]

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
        (identity elsewhere): one fill each, and none where the buffers hold them already (a decode step
        carried from the one before: the same rows, the same values). work: tap name -> SiteWork of the
        registered plans (steers already local to this rank). A fill that fails leaves every buffer the
        identity again before the error goes on (the step's plans fail; nothing stays applied)."""
        if step.n_tokens > self.max_rows:
            raise RuntimeError(f"step of {step.n_tokens} tokens exceeds the tap buffers; raise max_num_batched_tokens")
        try:
            fill = stepio.fill_of(self, step, work)
            assert self.marks is not None
            self.marks.mark(step.guard_rows(), step.n_tokens)
            writes = {id(w.bank): w for w in fill.writes}
            for bank in self.banks:
                w = writes.get(id(bank))
                if w is None:
                    bank.reset()
                else:
                    bank.hold(w, step.n_tokens)
        except BaseException:
            self.identity()
            raise

    def identity(self) -> None:
        """Every write tap the identity on every row again and no row marked: the state for a forward the
        engine runs without a step of ours (no registered plan has rows in it: the worker calls `idle`
        before it), so it applies nothing a finished request left behind (old code reset the rows a step
        filled only when it started the next step of its own: a benign steer stayed applied to every
        plain request after it). One index_copy a bank that holds rows, one fill of the marks."""
        for bank in self.banks:
            bank.reset()
        if self.marks is not None:
            self.marks.clear()

    def idle(self) -> None:
        """Before a forward with no step of ours: the identity (a step's rows stay written after it, for the
        next step to keep when it is the same one a position on)."""
        self.identity()

    def after(self, step: Step, work: dict) -> None:
        """The step's receipts and flags into the ledger in one read; each capturing plan's rows, one stack
        a bank; the readouts. Nothing is read back (a request the flags fail fails when its ledger is read
        at collect). The coefficient rows and marks stay: the next step keeps them (carried) or replaces
        them (before), and a forward without a step of ours starts at the identity (idle)."""
        fill = stepio.fill_of(self, step, work)
        self._read(step, fill)
        for name in fill.replay:  # a tap where a request composes several steers: each one's receipt
            cur = self.taps[name].buf("pre")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
            for g in work[name].steers:
                cur = steer(cur, step, g)
        stepio.capture(self, step, work, fill)
        if self._readers[0] is not work:
            self._readers = (work, [name for name, w in work.items() if w.readouts])
        for name in self._readers[1]:  # readouts last (a lens readout runs the final norm, bypassing its tap)
            cap = self.taps[name].buf("cap")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
            for o in work[name].readouts:
                readout(cap, step, o)

    def _read(self, step: Step, fill: stepio.Fill) -> None:
        """The step's flags (every write tap's and layer's, at every steering row, under GUARD) and receipts
        (each steered row of a write tap) into the ledger: one stack and one gather, none where the records
        take every stacked value in order (stepio._read_of: a decode step of requests that all steer every
        write tap); the ledger keeps views of it (read at collect)."""
        if fill.read is None:
            return
        index = fill.read.index
        got = torch.stack(self.sources(step.n_tokens)).view(-1)
        got = got if index is None else got.index_select(0, index)
        for lo, hi, plan, steer_index, at, codes in fill.read.records:
            step.ledger.record(plan, steer_index, at, got[lo:hi], codes, fill.shift)

__all__ = ["Bank", "Tap", "StaticTaps", "lone_tap", "width_of", "FLAG", "GUARD"]
