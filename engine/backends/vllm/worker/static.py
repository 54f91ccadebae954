"""`vllm-static`: a tap set declared at load, baked into the forward as fixed buffers.

Each tap owns preallocated `[max_tokens, width]` buffers registered on the module it wraps: `cap`
(the forward copies the point into it) and, for write taps, `pre` (the point before the write),
`u`, `mul`, `add` (the forward applies y = (x - (x.u) u) * mul + add) and `bad` ([max_tokens, 1]:
a row whose y is not finite keeps x, flagged there, and its request fails after the step; nothing
non-finite reaches the KV cache). The wrapper is installed between weight loading and compilation,
so torch.compile (CPU) and CUDA graphs (GPU) capture plain tensor ops on buffers with fixed
addresses and no Python, no data-dependent control flow. Between steps, Python fills the write
buffers for each steering request's rows (identity elsewhere) and copies each capturing request's
rows out of `cap`. That per-row affine form composes add / set / scale / ablate / mean_ablate / swap
in any order (values per position too: each row gets its own), and project_out (rescale with coeff
0) when it comes first at a tap. Each op's form on these buffers is its row's `affine` in
engine/core/ops.py (`Tap.fill` only gathers the rows and writes the result back); ops it cannot
express (their row's `static` says why) are refused by name before a request runs, by the client's
mode object (engine/backends/vllm/modes.py: StaticTapsMode.check_steer / check_steers).

Receipts and the guard: after each step, the steering requests' rows of `pre` go through the same
steer routine as the hooked backends (engine.core.site.steer), outside the graph, which records each
steer's rows and change in the worker's ledger exactly as `vllm` and `eager` define them (the graph's
affine arithmetic may round differently in the last bits), and NaN for a row the op makes non-finite:
the same rows the graph's `bad` flag marks. The graph's own flags (a tap's `bad`, the layer guard's
`flag`, engine/backends/vllm/worker/guard.py) go to the ledger too, on the device: nothing is read
back per step, and the request fails when its ledger is read at collect. Between steps every write
tap is the identity (`identity`), and the KV blocks a steering request's rows wrote are zeroed before
they are handed to another request (engine/backends/vllm/worker/kv.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.backends.vllm.worker.guard import LayerGuard, bounded
from engine.backends.vllm.worker.tree import Tree, VSite
from engine.core.address import Address
from engine.core.errors import SteeringError
from engine.core.ops import OPS, AffineRows
from engine.core.site import readout, steer
from engine.core.step import Step

if TYPE_CHECKING:
    from engine.core.steering import Steer


class Tap:
    """Buffers and wrapper of one declared (point, layer)."""

    def __init__(self, name: str, site: VSite, width: int, rows: int, writable: bool, device: torch.device,
                 dtype: torch.dtype, index: int) -> None:
        self.name, self.site, self.width, self.rows, self.writable = name, site, width, rows, writable
        self.dirty: tuple | None = None  # rows [lo, hi) the last step filled (None: identity everywhere)
        mod, p = site.module, f"_interp_tap{index}"
        self.orig = mod.forward  # the module's own forward, before the tap wraps it (a lens readout's norm)
        self.attrs = {k: f"{p}_{k}" for k in ("cap", "pre", "u", "mul", "add", "bad")}
        def buffer(k, fill):
            mod.register_buffer(self.attrs[k], torch.full((rows, width), fill, device=device, dtype=dtype),
                                persistent=False)
        buffer("cap", 0.0)
        if writable:
            buffer("pre", 0.0)
            buffer("u", 0.0)
            buffer("mul", 1.0)
            buffer("add", 0.0)
            mod.register_buffer(self.attrs["bad"], torch.zeros((rows, 1), device=device, dtype=dtype),
                                persistent=False)
        self._wrap()

    def buf(self, k: str) -> torch.Tensor:
        return getattr(self.site.module, self.attrs[k])

    def shape(self, head_dim: int | None, head: bool = False) -> tuple:
        """The per-position shape of the point (one head's, with a head coordinate)."""
        full = (self.width // head_dim, head_dim) if head_dim else (self.width,)
        return full[1:] if head else full

    @property
    def nbytes(self) -> int:
        names = ("cap", "pre", "u", "mul", "add", "bad") if self.writable else ("cap",)
        return sum(self.buf(k).nbytes for k in names)

    def _wrap(self) -> None:
        site, mod, names, writable = self.site, self.site.module, self.attrs, self.writable
        orig = mod.forward

        def tap(t):  # tensor ops only: traced into the compiled graph
            n = t.shape[0]
            x = t.reshape(n, -1)
            if writable:
                getattr(mod, names["pre"])[:n].copy_(x)
                u = getattr(mod, names["u"])[:n]
                y = x - (x * u).sum(-1, keepdim=True) * u
                y = y * getattr(mod, names["mul"])[:n] + getattr(mod, names["add"])[:n]
                # a row the steer made non-finite (or so large that its squared norm overflows: every
                # norm after it would divide by inf) keeps its unsteered value (it must never reach the
                # KV cache) and is flagged for after() to fail its request
                ok = bounded(y) | ~bounded(x)
                getattr(mod, names["bad"])[:n].copy_((~ok).to(y.dtype))
                x = torch.where(ok, y, x)
            getattr(mod, names["cap"])[:n].copy_(x)
            return x.reshape(t.shape)

        if site.phase == "pre":
            def forward(*args, **kwargs):
                new = tap(site.get((args, kwargs)))
                if writable:
                    args, kwargs = site.put((args, kwargs), new)
                return orig(*args, **kwargs)
        else:
            def forward(*args, **kwargs):
                out = orig(*args, **kwargs)
                new = tap(site.get(out))
                return site.put(out, new) if writable else out
        mod.forward = forward

    # -- between steps (Python, outside the graph) -------------------------------------------------
    def reset(self, lo: int = 0, hi: int | None = None) -> None:
        """Back to identity on rows [lo, hi) (all rows by default): only the rows a step filled, not the
        whole [max_tokens, width] buffers (three of them per tap, every step)."""
        self.buf("u")[lo:hi].zero_()
        self.buf("mul")[lo:hi].fill_(1.0)
        self.buf("add")[lo:hi].zero_()

    def fill(self, rows: "torch.Tensor | slice", steer: Steer, head_dim: int | None,
             value: torch.Tensor | None = None) -> None:
        """Compose one steer into the write buffers at the given flat rows (an index tensor, or a slice
        for a contiguous run); `value` is its value for those rows (engine.core.step.Step.steer_rows:
        [n, *shape] one per row, or one [*shape] / scalar for every row)."""
        u, mul, add = self.buf("u"), self.buf("mul"), self.buf("add")
        cols = slice(None)
        # a bound steer (engine.core.steering.Steer.bound): its address is an Address, its value a tensor or None
        if steer.address.coords:  # type: ignore[union-attr]
            (_, h), = steer.address.coords  # type: ignore[union-attr]
            h = h % (self.width // head_dim)
            cols = slice(h * head_dim, (h + 1) * head_dim)
        v = steer.value if value is None else value
        if v is not None:
            v = v.to(mul.device, mul.dtype)  # type: ignore[union-attr]
            n = rows.stop - rows.start if isinstance(rows, slice) else rows.numel()
            per_row = v.dim() > len(self.shape(head_dim, bool(steer.address.coords)))  # type: ignore[union-attr]
            v = v.reshape(n, -1) if per_row else (v if v.dim() == 0 else v.reshape(-1))
        op = OPS[steer.op]
        why = op.static_refusal(steer)
        if why or op.affine is None:
            raise SteeringError(f"vllm-static cannot apply {steer.op!r}: {why}.")
        # the op's own affine form (engine/core/ops.py), composed onto these rows' coefficients
        new = op.affine(AffineRows(u[rows, cols], mul[rows, cols], add[rows, cols]), v, steer)
        u[rows, cols], mul[rows, cols], add[rows, cols] = new.u, new.mul, new.add


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
    """All taps of one engine, plus the per-step fill and harvest."""

    def __init__(self) -> None:
        self.taps: dict[str, Tap] = {}  # address str (no coords) -> Tap
        self.head_dim: dict[str, int | None] = {}  # None: the point has no head axis
        self.guard: LayerGuard | None = None  # every decoder layer's (engine/backends/vllm/worker/guard.py)

    def install(self, declared: list[tuple[Address, bool]], site_of: Callable[[Address], VSite], d_model: int,
                rows: int, device: torch.device, dtype: torch.dtype, head_dims: dict[str, int]) -> None:
        for i, (addr, writable) in enumerate(declared):
            site = site_of(addr)
            self.taps[str(addr)] = Tap(str(addr), site, width_of(site, addr.point, d_model), rows,
                                       writable and site.write_refused is None, device, dtype, i)
            self.head_dim[str(addr)] = head_dims.get(addr.point)

    def install_guard(self, layers: list[torch.nn.Module], tree: Tree, rows: int, device: torch.device,
                      dtype: torch.dtype) -> None:
        """The layer guard on every decoder layer, outside any tap there (after install)."""
        self.guard = LayerGuard(layers, tree, rows, device, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.taps.values()) + (self.guard.nbytes if self.guard is not None else 0)

    # -- the worker's mode (engine/backends/vllm/worker/extension.py: HookSites is the hooked one) --------
    def site_key(self, addr: Address) -> str:
        """A plan's work is grouped by tap name (the address without coordinates)."""
        return str(addr)

    def attach(self, work: dict) -> list:
        """Nothing to attach: the taps are part of the compiled forward."""
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

    def before(self, step: Step, work: dict) -> None:
        """Fill each write tap's buffers for the steering rows of this step (identity elsewhere) and
        mark the rows of every steering request for the layer guard; work: tap name -> SiteWork of the
        registered plans (steers already local to this rank). A fill that fails leaves every buffer
        the identity again before the error goes on (the step's plans fail; nothing stays applied)."""
        if step.n_tokens > max((t.rows for t in self.taps.values()), default=math.inf):
            raise RuntimeError(f"step of {step.n_tokens} tokens exceeds the tap buffers; raise max_num_batched_tokens")
        self.identity()  # normally already (after() ends every step so); a step whose end never ran left rows
        try:
            if self.guard is not None:
                self.guard.mark(step.guard_rows(), step.n_tokens)
            for name, tap in self.taps.items():
                if tap.writable:
                    self._fill(step, name, tap, work[name].steers if name in work else [])
        except BaseException:
            self.identity()
            raise

    def _fill(self, step: Step, name: str, tap: Tap, groups: list) -> None:
        filled = [(g, *step.steer_rows(g, tap.shape(self.head_dim[name], bool(g.steer.address.coords))))
                  for g in groups]
        filled = [(g, rows, v) for g, rows, v in filled if rows.spans]
        if not filled:
            return
        # marked before filling, so a fill that fails midway is undone too
        tap.dirty = (min(int(r.flat.min()) for _, r, _ in filled), max(int(r.flat.max()) for _, r, _ in filled) + 1)
        for g, rows, v in filled:
            at = slice(0, step.n_tokens) if rows.index is None else rows.index.to(tap.buf("mul").device)
            tap.fill(at, g.steer, self.head_dim[name], v)

    def identity(self) -> None:
        """Every write tap the identity on every row again and no row marked for the guard: the state
        outside a step, so a step the engine runs without starting one of ours (no registered plan has
        rows in it) applies nothing a finished request left behind (old code reset the rows a step
        filled only when it started the next step of its own: a benign steer stayed applied to every
        plain request after it)."""
        for tap in self.taps.values():
            if tap.dirty is not None:
                tap.reset(*tap.dirty)
                tap.dirty = None
        if self.guard is not None:
            self.guard.clear()

    def after(self, step: Step, work: dict) -> None:
        """Back to the identity (before anything else); then record in the ledger, for every row of a
        steering request, whether a tap kept it unsteered (its steer made it non-finite or unbounded)
        or the layer guard zeroed it (its request fails when the ledger is read at collect); nothing is
        read back. Then replay this step's steers on the `pre` rows through the shared routine
        (receipts), copy each capturing plan's rows out of the capture buffers and feed the readouts."""
        self.identity()
        self._guarded(step, work)
        for name, w in work.items():
            tap = self.taps[name]
            if w.steers and tap.writable:  # the graph already applied them: tallies only
                cur = tap.buf("pre")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
                for g in w.steers:
                    cur = steer(cur, step, g)
            if w.reads:
                cap = tap.buf("cap")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name))
                for r in w.reads:
                    step.capture(r, cap)
        # readouts last: a lens readout runs the final norm and head, whose taps' buffers it may write
        for name, w in work.items():
            if w.readouts:
                cap = self.taps[name].buf("cap")[:step.n_tokens].reshape(step.n_tokens, *self.shape_of(name)).clone()
                for o in w.readouts:
                    readout(cap, step, o)

    def _guarded(self, step: Step, work: dict) -> None:
        """The graph's flags of this step, on the device: a row of a steering request is bad where a
        write tap kept it unsteered or the layer guard zeroed it; recorded under GUARD (the request
        fails at collect, naming its steers)."""
        rows = step.guard_rows()
        if not rows.spans:
            return
        n = step.n_tokens
        flags = [self.guard.flag[:n]] if self.guard is not None else []
        flags += [self.taps[name].buf("bad")[:n] for name, w in work.items()
                  if w.steers and self.taps[name].writable]
        if not flags:
            return
        bad = torch.stack([f.reshape(n) for f in flags]).amax(0) > 0  # [n] bool
        mine = bad if rows.index is None else bad.index_select(0, rows.index)
        step.ledger.record(rows.plan, rows.steer, rows.at, torch.where(mine, torch.nan, 0.0), rows.codes, rows.shift)

    def shape_of(self, name: str) -> tuple:
        tap, hd = self.taps[name], self.head_dim[name]
        return (tap.width // hd, hd) if hd else (tap.width,)
