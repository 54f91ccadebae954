"""The intervention pipeline every backend shares: per-sequence plans, the rows of a forward step,
and the one routine that steers and captures at a site.

    Plan      one sequence of one call: what it captures and steers (addresses resolved), and what it
              has captured so far, accumulated by absolute position
    Span      the rows a..b of a step's flat [tokens, ...] tensor that belong to one plan, the first of
              them at absolute position pos0
    Step      the spans of one forward
    SiteWork  what the plans of a call do at one site (their steers and their reads)
    run_site  apply the steers, then capture, on the flat tensor a site sees
    steer_span  the plan's steers at one site on one span's rows, each tallied for its receipt

A backend only says how a step's rows map to spans (eager: the real columns of each padded batch
row; vLLM: each request's slice of the continuous batch) and how a site is attached (a hook, a
static tap buffer). Captured chunks are kept by absolute position: a chunk that starts before what
is held (the scheduler preempted and recomputed the sequence) truncates the accumulator first; one
that starts after it (positions never computed, e.g. served from a prefix cache) is an error at
assembly, never a silently short tensor. Receipts (engine.core.results.Receipt) are tallied the same
way: per steer, the squared change of each touched row at its absolute position, the last
computation of a position counting.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.core import positions
from engine.core.address import Address
from engine.core.errors import SteeringError
from engine.core.points import KEY_AXIS_POINTS
from engine.core.results import Receipt
from engine.core.steering import Steer, apply_steer

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
    error: str | None = None  # set when this plan failed inside a forward (vLLM workers)
    tallies: dict = field(default_factory=dict)  # steer index -> [(positions [k] CPU, squared change [k])]
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

    def tally(self, index: int, positions: "torch.Tensor | range", old: torch.Tensor, new: torch.Tensor) -> None:
        """Record steer `index`'s change on the rows at absolute `positions` (a tensor, or a range when
        the steer touched a contiguous run: no tensor made for it; old / new: those rows)."""
        d = (new.detach() - old.detach()).float().reshape(old.shape[0], -1)
        self.tallies.setdefault(index, []).append((positions, d.pow(2).sum(-1)))

    def receipts(self) -> list[Receipt]:
        """One Receipt per steer: distinct positions touched and the norm of the change over them (a
        position computed twice, after preemption, counts once, as last computed)."""
        out = []
        for i, st in enumerate(self.steers):
            rows, norm = 0, 0.0
            chunks = self.tallies.get(i)
            if chunks:
                pos = [q for p, _ in chunks for q in (p if isinstance(p, range) else p.tolist())]
                sq = torch.cat([q for _, q in chunks]).to("cpu", torch.float64)
                last = torch.tensor(list({p: j for j, p in enumerate(pos)}.values()), dtype=torch.long)
                rows, norm = len(last), float(sq[last].sum().sqrt())
            out.append(Receipt(i, str(st.address), st.op, rows, norm))
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

    def first(self, key: str) -> int:
        """Absolute position of the first captured row of `key`."""
        chunks = self.store.get(key) or []
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request.")
        return chunks[0][0]

    def tensor(self, key: str, start: int = 0) -> torch.Tensor:
        """The [pos, ...] capture of `key` from absolute position `start`, checked contiguous; attention
        patterns (a key axis that grows per step) are right-padded on that axis to the longest chunk."""
        chunks = self.store.get(key)
        if not chunks:
            raise RuntimeError(f"{key} was never computed for this request: vLLM served all of it "
                               f"from a cache or the request was aborted.")
        at = start
        for p, c in chunks:
            if p != at:
                raise RuntimeError(f"{key}: positions {at}..{p - 1} were never computed in this request "
                                   f"(served from vLLM's prefix cache); capturing requests need their own "
                                   f"cache salt, which the engine sets: report this as a bug.")
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

    def mask(self, spec: object) -> torch.Tensor:
        return positions.mask(spec, self.pos0, self.b - self.a, self.plan.prompt_len)

    def touched(self, steer: Steer) -> torch.Tensor:
        """Bool [rows]: which rows of this span the steer touches (its positions minus exclusions)."""
        return steer.touched(self.pos0, self.b - self.a, self.plan.prompt_len)


@dataclass(slots=True)
class Step:
    spans: list[Span]
    n_tokens: int


@dataclass(slots=True)
class SiteWork:
    """What the plans of one call do at one site: steers and reads, keyed by plan key."""
    writes: dict = field(default_factory=dict)  # plan key -> [(index in plan.steers, Steer)]
    reads: dict = field(default_factory=dict)  # plan key -> [(capture key, coordinate index or None)]
    readouts: dict = field(default_factory=dict)  # plan key -> [(coordinate index or None, Accumulator)]


def site_work(plans: list[Plan], site_key: Callable[[Address], object], local_read: Callable | None = None, local_steer: Callable | None = None,
              local_readout: Callable | None = None) -> dict:
    """{site key: SiteWork} for the plans of a call; site_key(address without coords) names a site.
    Under tensor parallelism local_read(plan, address) -> (capture key, coordinate) | None,
    local_steer(steer) -> Steer | None and local_readout(readout) -> bool say what this rank records
    and applies (its own shard)."""
    work: dict = {}
    for plan in plans:
        for i, st in enumerate(plan.steers):
            st_here = st if local_steer is None else local_steer(st)
            if st_here is not None:
                w = work.setdefault(site_key(st.address.base), SiteWork())
                w.writes.setdefault(plan.key, []).append((i, st_here))
        for addr in plan.reads():
            read = (str(addr), addr.coords[0][1] if addr.coords else None) if local_read is None \
                else local_read(plan, addr)
            if read is not None:
                w = work.setdefault(site_key(addr.base), SiteWork())
                w.reads.setdefault(plan.key, []).append(read)
        for acc in plan.accumulators.values():
            addr = acc.readout.address
            if local_readout is None or local_readout(acc.readout):
                w = work.setdefault(site_key(addr.base), SiteWork())
                w.readouts.setdefault(plan.key, []).append((addr.coords[0][1] if addr.coords else None, acc))
    return work


def feed_readouts(sp: Span, work: SiteWork, rows: torch.Tensor) -> None:
    """Hand one span's rows [n, ...] at a site to the plan's readouts there."""
    for coord, acc in work.readouts.get(sp.plan.key, ()):
        acc.add(sp.pos0, rows if coord is None else rows[:, coord])


def touches_every_row(st: Steer) -> bool:
    """Whether the steer touches every position (no mask to build, no rows to pick)."""
    return isinstance(st.positions, str) and st.positions == "all" and not st.exclude


def steer_span(sp: Span, writes: list, rows: torch.Tensor) -> torch.Tensor | None:
    """The plan's steers at one site ((index, Steer) in order) on one span's rows [n, ...], each
    tallied for its receipt; the new rows, or None when no steer touched a row."""
    cur = rows
    if rows.shape[0] == 0:
        return None
    for i, st in writes:
        m = None if touches_every_row(st) else sp.touched(st)
        if m is not None and bool(m.all()):
            m = None
        if m is not None and not bool(m.any()):
            continue
        new = apply_steer(st, cur, m, sp.pos0)
        if m is None:
            sp.plan.tally(i, range(sp.pos0, sp.pos0 + cur.shape[0]), cur, new)
        else:
            touched = torch.nonzero(m).flatten()
            on = touched.to(cur.device)
            sp.plan.tally(i, touched + sp.pos0, cur[on], new[on])
        cur = new
    return None if cur is rows else cur


def run_site(t: torch.Tensor, spans: list[Span], work: SiteWork, keep: Callable, on_error: Callable | None = None) -> torch.Tensor | None:
    """Steer then capture (and feed readouts) on the flat [tokens, ...] tensor `t` of one site.
    Writers run before readers, so a capture sees the steered value, as the rest of the forward does. keep(span, key,
    rows) makes what is stored (a detached copy, a CPU copy). Returns the replacement, or None when
    nothing was steered (the forward then continues with `t` itself). With on_error(plan, exc), a
    failure is that plan's alone: it is reported, its rows keep their unsteered values (a steer
    whose result is not finite never reaches the rest of the forward) and the plan is skipped from
    then on; the others carry on."""
    out = t
    for sp in spans:
        if sp.plan.error is not None:
            continue
        writes = work.writes.get(sp.plan.key)
        if not writes:
            continue
        try:
            new = steer_span(sp, writes, out[sp.a:sp.b])
            if new is not None:
                if out is t and sp.a == 0 and sp.b == t.shape[0]:
                    out = new  # a fresh tensor covering every row: no copy of t to make
                else:
                    if out is t:
                        out = t.clone()
                    out[sp.a:sp.b] = new
        except Exception as e:
            if on_error is None:
                raise
            on_error(sp.plan, e)
    for sp in spans:
        if sp.plan.error is not None:
            continue
        try:
            for key, coord in work.reads.get(sp.plan.key, ()):
                skip = sp.plan.wanted(key, sp.pos0, sp.b - sp.a)
                if skip is None:
                    continue
                seg = out[sp.a + skip:sp.b]
                sp.plan.add(key, sp.pos0 + skip, keep(sp, key, seg if coord is None else seg[:, coord]))
            feed_readouts(sp, work, out[sp.a:sp.b])
        except Exception as e:
            if on_error is None:
                raise
            on_error(sp.plan, e)
    return None if out is t else out
