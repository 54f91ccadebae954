"""vllm-static's coefficient table: a step's steers as per-row affine coefficients, built on the host.

A write tap applies y = (x - (x.u) u) * mul + add per row (engine/backends/vllm/worker/static.py).
Every op the taps express maps the coefficients already at a row the same way,

    mul' = mul * a        add' = add * a + b        u' = u, or the op's own u (a `first` op)

with (a, b, u) the op's own affine form (engine/core/ops.py) applied to the identity: `form_of` computes
them once per steer, when the worker's plans change, on the device and copied to the host (numpy), so a
step composes its steers with numpy alone. `compose` gives, for one tap, the distinct coefficient rows
of the step (a table) and which of them each touched row takes; the worker uploads the table and writes
every tap's rows with one index_copy (StaticTaps.before).
tests/test_ops_table.py holds every static op to that form.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.address import parse
from engine.core.errors import SteeringError
from engine.core.ops import OPS, AffineRows

if TYPE_CHECKING:
    from engine.core.steering import Steer


@dataclass(frozen=True)
class Form:
    """One steer's affine form on its tap, host float32. a, b (and u for a `first` op): [P, c], one row
    per position of a value by position (`lead`), else one row; `cols` the tap columns it writes (a head
    coordinate's slice), c wide."""
    first: bool
    cols: slice
    a: np.ndarray
    b: np.ndarray
    u: np.ndarray | None
    lead: bool

    alone: dict = field(default_factory=dict, compare=False, repr=False)  # width -> table_alone's table

    def table_alone(self, width: int) -> np.ndarray:
        """[P, 3, width]: this form applied alone to identity rows: a step's table at a tap whose one steer
        group it is, made once per registered steer (and tap width), not every step."""
        got = self.alone.get(width)
        if got is None:
            got = self.alone[width] = _table([(self, None)], self.a.shape[0], width)
            got.flags.writeable = False  # shared by every step that takes it
        return got


def form_of(steer: Steer, width: int, head_dim: int | None, device: torch.device) -> Form:
    """The steer's (a, b, u) from its op's affine form on identity rows (a bound, local steer)."""
    op = OPS[steer.op]
    why = op.static_refusal(steer)
    if why or op.affine is None:
        raise SteeringError(f"vllm-static cannot apply {steer.op!r}: {why}.")
    cols = slice(0, width)
    address = parse(steer.address) if isinstance(steer.address, str) else steer.address
    if address.coords:
        (_, h), = address.coords
        assert head_dim, "a head coordinate is on a headed point"
        h = h % (width // head_dim)
        cols = slice(h * head_dim, (h + 1) * head_dim)
    c = cols.stop - cols.start
    lead = bool(steer.bound().lead)
    v = steer.value
    if isinstance(v, torch.Tensor):
        v = v.to(device, torch.float32)
        v = v.reshape(v.shape[0], -1) if lead else (v if v.dim() == 0 else v.reshape(-1))
    n = v.shape[0] if lead and isinstance(v, torch.Tensor) else 1
    new = op.affine(AffineRows.identity(n, c, torch.float32, device), v, steer)  # type: ignore[arg-type]

    def host(t: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(t.expand(n, c).detach().to("cpu").numpy(), dtype=np.float32)
    return Form(op.first, cols, host(new.mul), host(new.add), host(new.u) if op.first else None, lead)


_FIRST = np.zeros(1, dtype=np.int64)  # one form's rows start at 0 (read only: never written)
_FIRST.flags.writeable = False


def stacked(forms: list[Form]) -> tuple[Form, np.ndarray]:
    """The forms of one steer group's members (one op, one address: the same cols, `first` and `lead`)
    as one Form whose rows are theirs one after another, and where each member's rows start."""
    if len(forms) == 1:
        return forms[0], _FIRST
    sizes = np.array([f.a.shape[0] for f in forms], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    f0 = forms[0]
    u = None if f0.u is None else np.concatenate([f.u for f in forms])  # type: ignore[misc]
    return Form(f0.first, f0.cols, np.concatenate([f.a for f in forms]), np.concatenate([f.b for f in forms]), u,
                f0.lead), starts


def compose(parts: list[tuple[Form, np.ndarray, np.ndarray]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, table, which): for one tap's (form, flat rows, each row's row of the form) of the step, one
    per steer group in order, the flat rows they touch, the distinct coefficient rows [D, 3, width]
    (u, mul, add) and each touched row's index in the table. Host only (numpy)."""
    if len(parts) == 1:  # one group (the common case): the table is its form's rows, each row takes its own
        form, rows, code = parts[0]
        return rows, form.table_alone(width), code
    rows = np.unique(np.concatenate([f for _, f, _ in parts]))
    codes = np.full((len(rows), len(parts)), -1, dtype=np.int64)  # per row, its row of each group's form
    for j, (_, flat, code) in enumerate(parts):
        codes[np.searchsorted(rows, flat), j] = code
    combos, which = np.unique(codes, axis=0, return_inverse=True)
    return rows, _table([(form, combos[:, j]) for j, (form, _, _) in enumerate(parts)], len(combos), width), \
        which.reshape(-1)


def _table(steps: list[tuple[Form, np.ndarray | None]], d: int, width: int) -> np.ndarray:
    """[d, 3, width] coefficient rows (u, mul, add): from the identity, each (form, its row per table row,
    -1: none; None: table row i is the form's row i, every one) applied in order."""
    table = np.zeros((d, 3, width), dtype=np.float32)
    table[:, 1] = 1.0
    u, mul, add = table[:, 0], table[:, 1], table[:, 2]
    for form, k in steps:
        hit: np.ndarray | slice
        if k is None:  # a form alone (Form.table_alone): its own rows, no mask and no gather
            hit, a, b, fu = slice(None), form.a, form.b, form.u
        else:
            hit = k >= 0
            k = k[hit]
            a, b, fu = form.a[k], form.b[k], None if form.u is None else form.u[k]
        cols = form.cols
        mul[hit, cols] = mul[hit, cols] * a
        add[hit, cols] = add[hit, cols] * a + b
        if fu is not None:
            u[hit, cols] = fu
    return table
