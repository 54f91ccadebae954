"""What the steers of a call did, kept on the model's device until it is read once.

Every steer application records, for each row it touched, the norm of that row's change (float64) at
its absolute position: inf or NaN where the row is not finite after the steer. The layer guard records
NaN for a steering plan whose hidden state went non-finite later in the forward. A row already not
finite before a steer counts as that steer's failure; the first failure recorded is the one named, and
a steer recorded earlier in the forward (or an earlier forward) is recorded first. None of
that reads a device value: `read()` moves everything recorded in one transfer (eager: once per call;
the vLLM worker: when a request is collected) and returns, per plan, its receipts and, where a row
went non-finite, its failure.

    ledger.record(codes, steer_indices, positions, norms)   # host arrays [m] (codes: ledger.code(plan.key)),
                                                            # device float64 [m]
    outcome = ledger.read([plan.key])[plan.key]              # Outcome: per steer (rows, sum of squares)

With `unique=False` (vLLM: the scheduler can preempt a request and recompute positions) a position
recorded twice for one steer counts once, as last recorded; eager never computes a position twice.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

_CODES = itertools.count()
GUARD = -1  # the steer index the layer guard records under: the request's hidden state went non-finite


@dataclass(slots=True)
class Outcome:
    """One plan's tally: per steer index, (rows touched, sum of squared changes); `failed` the steer
    index whose result was non-finite first recorded (GUARD: a later layer's hidden state), or None."""
    rows: dict = field(default_factory=dict)
    sumsq: dict = field(default_factory=dict)
    failed: int | None = None

    def of(self, index: int) -> tuple[int, float]:
        return self.rows.get(index, 0), self.sumsq.get(index, 0.0)


@dataclass(slots=True)
class _Entry:
    plan: np.ndarray  # int64 [m]
    steer: np.ndarray  # int64 [m]
    pos: np.ndarray  # int64 [m], less `shift`
    norm: torch.Tensor  # float32 or float64 [m], on the model's device
    codes: frozenset  # the live plan codes in `plan`: collect picks a request's entries without scanning arrays
    trimmed: bool = False  # `plan` also holds codes of dropped plans (no longer in `codes`)
    shift: int = 0  # added to `pos` when read (a carried step's rows: engine.core.step.Rows.shift)


class Ledger:
    """Device-side tallies of a call (eager) or of a worker's registered plans (vLLM)."""
    __slots__ = ("unique", "_entries", "_codes", "_keys")

    def __init__(self, unique: bool = True) -> None:
        self.unique = unique
        self._entries: list[_Entry] = []
        self._codes: dict = {}  # plan key (an int, or vLLM's request-key string) -> its int code here
        self._keys: dict = {}  # and back

    def code(self, key: object) -> int:
        """The int a plan key is recorded under (plan keys may be strings)."""
        c = self._codes.get(key)
        if c is None:
            c = self._codes[key] = next(_CODES)
            self._keys[c] = key
        return c

    def __bool__(self) -> bool:
        return bool(self._entries)

    def record(self, plan: np.ndarray, steer: np.ndarray, pos: np.ndarray, norm: torch.Tensor,
               codes: frozenset | None = None, shift: int = 0) -> None:
        """Rows of one application: plan codes (`code`), steer indices and absolute positions less `shift`
        (host), and the norm of each row's change (device, float32 or float64; inf or NaN for a row not
        finite). `codes`: the distinct codes of `plan` where the caller has them (engine.core.step.Rows).
        No device read, and no kernel: the norms are widened to float64 when read."""
        if norm.requires_grad:
            norm = norm.detach()
        self._entries.append(_Entry(plan, steer, pos, norm if norm.dim() == 1 else norm.reshape(-1),
                                    frozenset(plan.tolist()) if codes is None else codes, False, shift))

    def read(self, keys: "list | None" = None) -> dict:
        """{plan key: Outcome} for the plans `keys` (None: every plan recorded), in one transfer."""
        out: dict = {k: Outcome() for k in (keys or [])}
        codes = list(self._keys) if keys is None else [self._codes[k] for k in keys if k in self._codes]
        wanted = frozenset(codes)
        entries = [e for e in self._entries if not wanted.isdisjoint(e.codes)]
        if not entries:
            return out
        norms = [e.norm if e.norm.dtype == torch.float64 else e.norm.double() for e in entries]  # cat of one dtype
        sq = torch.cat(norms).to("cpu").numpy() ** 2  # the one read
        plan = np.concatenate([e.plan for e in entries])
        steer = np.concatenate([e.steer for e in entries])
        selected = None  # entries may hold rows of other plans, and of dropped ones
        if not all(not e.trimmed and e.codes <= wanted for e in entries):
            selected = np.isin(plan, codes)
            sq, plan, steer = sq[selected], plan[selected], steer[selected]
        if not self.unique:  # the last record of each (plan, steer, position) counts; guard records all do
            pos = np.concatenate([e.pos + e.shift for e in entries])  # positions matter here alone
            pos = pos if selected is None else pos[selected]
            real = np.flatnonzero(steer >= 0)  # the receipts' records: only they are deduplicated (and sorted)
            _, first = np.unique(_one_key(plan[real], steer[real], pos[real])[::-1], return_index=True)
            keep = steer < 0
            keep[real[len(real) - 1 - first]] = True
            sq, plan, steer = sq[keep], plan[keep], steer[keep]
        bad = ~np.isfinite(sq)
        plans, at_plan = np.unique(plan, return_inverse=True)
        if bad.any():
            for j in np.flatnonzero(np.bincount(at_plan, weights=bad, minlength=len(plans))):
                mine = np.flatnonzero(at_plan == j)
                out.setdefault(self._keys[int(plans[j])], Outcome()).failed = int(steer[mine[np.argmax(bad[mine])]])
        real = steer >= 0  # receipts: per (plan, steer), rows and the sum of squares, at once
        width = int(steer.max()) + 1 if real.any() else 1
        pair = at_plan.reshape(-1)[real] * width + steer[real]  # (plan, steer) as one key, in (plan, steer) order
        rows = np.bincount(pair, minlength=len(plans) * width)
        sums = np.bincount(pair, weights=sq[real], minlength=len(plans) * width)
        for j in np.flatnonzero(rows).tolist():
            o = out.setdefault(self._keys[int(plans[j // width])], Outcome())
            o.rows[j % width], o.sumsq[j % width] = int(rows[j]), float(sums[j])
        for k in plans.tolist():
            out.setdefault(self._keys[k], Outcome())
        return out

    def drop(self, keys: list) -> None:
        """Forget what was recorded for these plans (collected); entries of other plans stay."""
        codes = [self._codes.pop(k) for k in keys if k in self._codes]
        for c in codes:
            del self._keys[c]
        gone = frozenset(codes)
        kept = []
        for e in self._entries:  # an entry's rows of dropped plans stay until all its plans are dropped:
            live = e.codes - gone  # codes are never reused, so no later read can match them
            if live:
                e.trimmed = e.trimmed or live != e.codes
                e.codes = live
                kept.append(e)
        self._entries = kept


def _one_key(*cols: np.ndarray) -> np.ndarray:
    """Integer columns of equal length as one int64 key per row, equal exactly where every column is:
    mixed radix over each column's span of values (max - min + 1: no sort), or where their product would
    not fit, over each column's rank among its distinct values (a 1-d unique: np.unique over rows,
    axis=0, sorts them as structured records, 50x slower at a request's few thousand records)."""
    if not len(cols[0]):
        return np.zeros(0, dtype=np.int64)
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows)]
    if float(np.prod([float(x) for x in spans])) < 2.0 ** 62:
        key = np.zeros(len(cols[0]), dtype=np.int64)
        for c, lo, span in zip(cols, lows, spans):
            key = key * span + (c - lo)
        return key
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        values, rank = np.unique(c, return_inverse=True)
        key = key * len(values) + rank.reshape(-1)
    return key
