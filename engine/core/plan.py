"""The intervention pipeline every backend shares: per-sequence plans, and what the plans of a call
do at each site.

    Plan      one sequence of one call: what it captures and steers (addresses resolved), and what it
              has captured so far, accumulated by absolute position
    Span      the rows a..b of a step's flat [tokens, ...] tensor that belong to one plan, the first of
              them at absolute position pos0
    SiteWork  what the plans of a call do at one site, grouped so that a site runs one whole-batch
              operation per group: SteerGroup (the k-th steer of each plan there, when their op and
              parameters agree), ReadGroup (one capture key), ReadoutGroup (one readout kind)
    site_work the SiteWork of every site the plans use

A step's rows, index tensors and values are in engine/core/step.py; what a site does with them in
engine/core/site.py. A backend only says how a step's rows map to spans (eager: the real columns of
each padded batch row; vLLM: each request's slice of the continuous batch) and how a site is attached
(a hook, a static tap buffer). Captured chunks are kept by absolute position: a chunk that starts before
what is held (the scheduler preempted and recomputed the sequence) truncates the accumulator first; one
that starts after it (positions never computed, e.g. served from a prefix cache) is an error at
assembly, never a silently short tensor. Receipts come from the step's ledger (engine/core/ledger.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from engine.core import positions
from engine.core.address import Address
from engine.core.errors import SteeringError
from engine.core.points import KEY_AXIS_POINTS
from engine.core.results import Receipt
from engine.core.steering import Steer

if TYPE_CHECKING:
    from engine.core.ledger import Outcome
    from engine.core.readouts import Kind

_keys = itertools.count(1)


@dataclass(eq=False, slots=True)
class Plan:
    prompt_len: int
    captures: list[Address] = field(default_factory=list)  # resolved (absolute layer), with coords
    steers: list[Steer] = field(default_factory=list)  # resolved addresses
    internal: list[Address] = field(default_factory=list)  # read for the engine itself (logits, q/k)
    start_at: dict = field(default_factory=dict)  # capture key -> first position worth keeping
    key: int = field(default_factory=lambda: next(_keys))
    recomputed: int = 0  # chunks that restarted below what was held (preemption + recompute)
    store: dict = field(default_factory=dict)  # capture key -> list[(pos0, rows)]
    blocks: list = field(default_factory=list)  # (keys, pos0, rows [len(keys), n, ...]): a step's rows of several keys
    error: object | None = None  # what failed when this plan failed inside a forward (vLLM workers: a wire Failure)
    readouts: list = field(default_factory=list)  # engine.core.readouts.Readout, resolved addresses
    accumulators: dict = field(default_factory=dict)  # readout name -> Accumulator, bound where it runs

    def reads(self) -> list[Address]:
        return list(dict.fromkeys(self.captures + self.internal))

    def check_positions(self, max_new_tokens: int, row: str = "") -> None:
        """Every steer must touch at least one position of this call (engine.core.positions.check), also
        after its exclusions; a per-row mask may select nothing in one sequence (checked per call).
        `row` names the sequence in a batch ("prompt 1 (of 2)") in the error."""
        n = positions.call_length(self.prompt_len, max_new_tokens)
        for st in self.steers:
            what = f"steer {st.op!r} at {st.address}" + (f" in {row}" if row else "")
            positions.check(st.positions, self.prompt_len, max_new_tokens, what)
            if st.exclude and not positions.is_mask(st.positions) and not bool(st.touched(0, n, self.prompt_len).any()):
                raise SteeringError(f"{what}: every position it selects is excluded (exclude={st.exclude}); "
                                    f"nothing would be steered.")

    def receipts(self, outcome: Outcome | None = None) -> list[Receipt]:
        """One Receipt per steer from what the ledger recorded for this plan (engine.core.ledger):
        distinct positions touched and the norm of the change over them."""
        out = []
        for i, st in enumerate(self.steers):
            rows, sumsq = outcome.of(i) if outcome is not None else (0, 0.0)
            out.append(Receipt(i, str(st.address), st.op, rows, math.sqrt(sumsq)))
        return out

    def wanted(self, key: str, pos0: int, n: int) -> int | None:
        """How many leading rows of a chunk to skip for `key` (None: skip the whole chunk)."""
        lo = self.start_at.get(key, 0)
        return None if pos0 + n <= lo else max(0, lo - pos0)

    def add(self, key: str, pos0: int, rows: torch.Tensor) -> None:
        chunks = self.store.setdefault(key, [])
        end = chunks[-1][0] + chunks[-1][1].shape[0] if chunks else None
        if end is not None and pos0 < end:  # recomputed after preemption: drop what is being recomputed
            self.recomputed += 1
            chunks[:] = [(p, c[: pos0 - p]) for p, c in chunks if p < pos0]
        chunks.append((pos0, rows))

    def add_block(self, keys: tuple, pos0: int, rows: torch.Tensor) -> None:
        """One step's rows of several capture keys at once (rows[j]: keys[j]'s, from absolute position pos0),
        kept whole: `settle` files them under their keys, `stacked` hands them on as one tensor."""
        self.blocks.append((keys, pos0, rows))

    def settle(self) -> None:
        """Every block's rows filed under their keys (`add`, in order): what `store` readers see."""
        blocks, self.blocks = self.blocks, []
        for keys, pos0, rows in blocks:
            for j, k in enumerate(keys):
                self.add(k, pos0, rows[j])

    def stacked(self) -> list[tuple[dict, int, torch.Tensor]]:
        """The blocks as runs ({key: index}, first position, rows [keys, positions, ...]): blocks of one keys
        tuple that follow each other position by position, concatenated once, so that a collect sends a
        request's every layer as one tensor. A key is in a run's index when the run holds all of it (no
        other run, no chunk of its own in `store`); every key also gets its rows in `store` (views)."""
        runs: list = []  # [keys, first, end, [(pos0, rows)]]
        for keys, pos0, rows in self.blocks:
            run = runs[-1] if runs else None
            if run is not None and run[0] == keys and run[2] == pos0:
                run[3].append((pos0, rows))
                run[2] += rows.shape[1]
            else:
                runs.append([keys, pos0, pos0 + rows.shape[1], [(pos0, rows)]])
        self.blocks = []
        seen: dict = {}
        for run in runs:
            for k in run[0]:
                seen[k] = seen.get(k, 0) + 1
        out = []
        for keys, first, _, parts in runs:
            t = parts[0][1] if len(parts) == 1 else torch.cat([r for _, r in parts], dim=1)
            index = {}
            for j, k in enumerate(keys):
                if seen[k] == 1 and k not in self.store:
                    index[k] = j
                    self.store[k] = [(first, t[j])]
                else:
                    for pos0, rows in parts:
                        self.add(k, pos0, rows[j])
            if index:
                out.append((index, first, t))
        return out

    def first(self, key: str) -> int:
        """Absolute position of the first captured row of `key`."""
        self.settle()
        chunks = self.store.get(key) or []
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request.")
        return chunks[0][0]

    def tensor(self, key: str, start: int = 0) -> torch.Tensor:
        """The [pos, ...] capture of `key` from absolute position `start`, checked contiguous; attention
        patterns (a key axis that grows per step) are right-padded on that axis to the longest chunk."""
        self.settle()
        chunks = self.store.get(key)
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request (no forward of it reached its site: "
                               f"the request was aborted, or a cache served every position).")
        at = start
        for p, c in chunks:
            if p != at:
                raise RuntimeError(f"{key}: positions {at}..{p - 1} were never computed in this request (no "
                                   f"forward ran its site at those positions: a step that skipped it, or positions "
                                   f"a cache served, which the engine's per-request cache salt should prevent); "
                                   f"report this as a bug.")
            at += c.shape[0]
        return torch.cat(pad_key_axis(key, [c for _, c in chunks], [p + c.shape[0] for p, c in chunks]), dim=0)


def pad_key_axis(key: str, chunks: list, seen: list | None = None) -> list:
    """Attention patterns [q, h, kpos] grow a key axis at every decode step; right-pad the earlier
    chunks (probability 0, or the most negative score) so the steps concatenate by position.
    `seen[i]`: positions chunk i's keys cover; keys beyond them are compressor entries
    (DeepSeek-V4), which stay after the positions: the padding goes between the two."""
    if key.split(".")[0] not in KEY_AXIS_POINTS or len({c.shape[-1] for c in chunks}) <= 1:
        return chunks
    fill = torch.finfo(chunks[0].dtype).min if key.startswith("attn_scores") else 0.0
    pad = torch.nn.functional.pad
    extra = [c.shape[-1] - s for c, s in zip(chunks, seen)] if seen else []
    if not extra or min(extra) < 0 or max(extra) == 0:
        n = max(c.shape[-1] for c in chunks)
        return [pad(c, (0, n - c.shape[-1]), value=fill) for c in chunks]
    width, most = max(seen), max(extra)
    return [torch.cat([pad(c[..., :s], (0, width - s), value=fill), pad(c[..., s:], (0, most - e), value=fill)], -1)
            for c, s, e in zip(chunks, seen, extra)]


@dataclass(slots=True)
class Span:
    plan: Plan
    a: int  # first row of this sequence in the step's flat tensor
    b: int  # one past its last row
    pos0: int  # absolute position of row a
    row: int = 0  # the sequence's index in the call (eager: its batch row)

    @property
    def n(self) -> int:
        return self.b - self.a


def signature(st: Steer) -> tuple:
    """What steers must share to run as one operation over the rows of several plans: the op, where
    (coordinates included), its parameters, and the axes of its value (the values themselves may differ)."""
    sae = st.sae if isinstance(st.sae, str) or st.sae is None else id(st.sae)
    feature = tuple(st.feature) if isinstance(st.feature, list) else st.feature
    return (st.op, str(st.address), st.coeff, st.bounds, sae, feature, st.bound().lead)


@dataclass(eq=False, slots=True)
class SteerGroup:
    """The k-th steer at one site of each of some plans, with one signature: applied in one operation.
    members: (plan, the steer's index in plan.steers, the steer as bound for that plan)."""
    order: int  # k: the group runs after every group of a lower k at its site
    members: list = field(default_factory=list)

    @property
    def steer(self) -> Steer:
        return self.members[0][2]


@dataclass(eq=False, slots=True)
class ReadGroup:
    """One capture key (with its coordinate on this rank) read by some plans."""
    key: str
    coord: int | None
    plans: list = field(default_factory=list)


@dataclass(eq=False, slots=True)
class ReadoutGroup:
    """One readout kind at one site (and coordinate), computed by some plans' accumulators."""
    coord: int | None
    kind: Kind
    members: list = field(default_factory=list)  # (plan, Accumulator)


@dataclass(slots=True)
class SiteWork:
    """What the plans of one call do at one site, in the order it runs: steers (group k before
    group k + 1), then reads and readouts of the steered value. `guarded`: the backend's layer guard
    checks this site's output before anything else reads it (the vLLM worker's hooks on a decoder
    layer's output), so a steer here needs no sanitizing of its own (engine.core.site.steer)."""
    steers: list[SteerGroup] = field(default_factory=list)
    reads: list[ReadGroup] = field(default_factory=list)
    readouts: list[ReadoutGroup] = field(default_factory=list)
    guarded: bool = False

    def plans_reading(self) -> set:
        return {id(p) for g in self.reads for p in g.plans}


def site_work(plans: list[Plan], site_key: Callable[[Address], object], local_read: Callable | None = None,
              local_steer: Callable | None = None, local_readout: Callable | None = None) -> dict:
    """{site key: SiteWork} for the plans of a call; site_key(address without coords) names a site.
    Under tensor parallelism local_read(plan, address) -> (capture key, coordinate) | None,
    local_steer(steer) -> Steer | None and local_readout(readout) -> bool say what this rank records
    and applies (its own shard)."""
    work: dict = {}
    groups: dict = {}  # (site, order at the site, signature) -> SteerGroup
    known: dict = {}  # id(steer) -> (site, signature): the plans of an eager call share their steers
    reads: dict = {}  # (site, key, coord) -> ReadGroup
    outs: dict = {}  # (site, coord, kind) -> ReadoutGroup
    for plan in plans:
        order: dict = {}
        for i, st in enumerate(plan.steers):
            st_here = st if local_steer is None else local_steer(st)
            if st_here is None:
                continue
            if id(st_here) not in known:
                known[id(st_here)] = (site_key(st.address.base), signature(st_here), st_here)
            site, sig, _ = known[id(st_here)]
            k = order[site] = order.get(site, -1) + 1
            w = work.setdefault(site, SiteWork())
            g = groups.get((site, k, sig))
            if g is None:
                g = groups[(site, k, sig)] = SteerGroup(k)
                w.steers.append(g)
            g.members.append((plan, i, st_here))
        for addr in plan.reads():
            read = (str(addr), addr.coords[0][1] if addr.coords else None) if local_read is None \
                else local_read(plan, addr)
            if read is not None:
                site = site_key(addr.base)
                w = work.setdefault(site, SiteWork())
                r = reads.get((site, *read))
                if r is None:
                    r = reads[(site, *read)] = ReadGroup(*read)
                    w.reads.append(r)
                r.plans.append(plan)
        for acc in plan.accumulators.values():
            addr = acc.readout.address
            if local_readout is None or local_readout(acc.readout):
                site = site_key(addr.base)
                w = work.setdefault(site, SiteWork())
                coord = addr.coords[0][1] if addr.coords else None
                kind = acc.readout.kind
                key = (site, coord, _kind_key(kind))
                o = outs.get(key)
                if o is None:
                    o = outs[key] = ReadoutGroup(coord, kind)
                    w.readouts.append(o)
                o.members.append((plan, acc))
    for w in work.values():  # the k-th steers of every plan after the (k-1)-th (a stable sort)
        w.steers.sort(key=lambda g: g.order)
    return work


def _kind_key(kind: object) -> object:
    """What readouts must share to run as one group: an equal kind (each vLLM request brings its own
    Mean(), equal to the others'), or the kind itself where it compares by identity (a probe's weights)."""
    try:
        hash(kind)
    except TypeError:
        return id(kind)
    return kind


def touches_every_row(st: Steer) -> bool:
    """Whether the steer touches every position (no mask to build, no rows to pick)."""
    return isinstance(st.positions, str) and st.positions == "all" and not st.exclude
