"""One eager call's rows: a [batch, columns] grid per forward, captured whole, assembled once at the end.

    call = Call(device)                          # the call's ledger and captured chunks
    layout = prefill_layout(plans, mask, call)   # mask: host [b, T] bool; then decode_layouts, one per step
    step = layout.step(n_cols)                   # the Step a site of n_cols columns runs with (engine/core/step.py)
    grid = call.grid(key)                        # [b, columns, ...] of every forward, in order

HF runs the batch as a padded [batch, columns] grid. Sites steer and read out over the real rows
(spans, built on the host from the mask), and a capture keeps the site's whole grid with one copy
(GridStep.capture): the padded columns are zeroed when the call assembles its result, where the
mask is known anyway. Attention patterns need each row's keys aligned to its own positions, which is
per row: done once at assembly (`pattern_rows`), never inside the forward.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.core.ledger import Ledger
from engine.core.plan import Plan, ReadGroup, Span
from engine.core.step import Step


@dataclass(eq=False, slots=True)
class Call:
    """What the forwards of one call share: where the model runs, the ledger of its steers, and the
    captured chunks per key, each with the layout of the forward that made it."""
    device: torch.device
    ledger: Ledger = field(default_factory=Ledger)
    store: dict = field(default_factory=dict)  # capture key -> [(Layout, [b, n_cols, ...])]
    steps: dict = field(default_factory=dict)  # (id(layout), n_cols) -> GridStep

    def close(self) -> None:
        """Drop the chunks and steps once the call's result is assembled. A step points back at its
        layout, and a layout at this call: left to the cyclic collector, each call's captured grids
        outlived it (a harvest's resident memory grew with its dataset, 463 -> 603 MB over 400 calls)."""
        self.store.clear()
        for step in self.steps.values():
            step.layout.last = None  # a layout and its last step point at each other
        self.steps.clear()

    def grid(self, key: str) -> torch.Tensor:
        """Every forward's chunk of `key`, concatenated along the columns: [b, columns, ...]."""
        chunks = [c for _, c in self.store[key]]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)


@dataclass(eq=False, slots=True)
class Layout:
    """How one forward's [batch, cols] rows map to sequences: spans over the flat rows, the chunk's
    shape, and which columns of the sequence so far are real tokens (host, for attention keys).
    `after`: the previous forward's layout when these spans are its own, one position on (decode)."""
    spans: list[Span]
    shape: tuple[int, int]
    key_mask: np.ndarray  # [batch, columns so far], bool
    call: Call
    after: Layout | None = None
    last: GridStep | None = None  # the step `step` returned last (every site of a forward asks for the same one)

    def step(self, n_cols: int) -> GridStep:
        """The Step of a site whose tensor holds the last n_cols columns (HF computes the logits of the
        last prompt token alone when generating); kept by the call until it closes."""
        step = self.last
        if step is not None and step.shape[1] == n_cols:
            return step
        key = (id(self), n_cols)
        step = self.call.steps.get(key)
        if step is None:
            prev = None if self.after is None else self.call.steps.get((id(self.after), n_cols))
            step = self.call.steps[key] = GridStep(self.spans_for(n_cols), (self.shape[0], n_cols), self, prev)
        self.last = step
        return step

    def spans_for(self, n_cols: int) -> list[Span]:
        b, width = self.shape
        if n_cols == width:
            return self.spans
        out = []
        for sp in self.spans:
            c0, c1 = sp.a - sp.row * width, sp.b - sp.row * width
            lo = max(c0, width - n_cols)
            if lo < c1:
                a = sp.row * n_cols + lo - (width - n_cols)
                out.append(Span(sp.plan, a, a + c1 - lo, sp.pos0 + lo - c0, sp.row))
        return out

    def align_keys(self, row: int, seg: torch.Tensor, key: str, compress_rate: int = 0) -> torch.Tensor:
        """An attention pattern's key axis, which covers the last K columns of the sequence so far
        (a sliding-window cache holds only the newest keys), as the row's own absolute key positions:
        pad keys dropped, keys the cache no longer holds filled with the masked value. Compressed-KV
        layers (DeepSeek-V4) append one compressor entry per `compress_rate` columns after the
        positions: those are kept as they are, after the aligned positions."""
        extra = self.key_mask.shape[1] // compress_rate if compress_rate else 0
        seg, entries = seg[..., :seg.shape[-1] - extra], seg[..., seg.shape[-1] - extra:]
        k = seg.shape[-1]
        # the real keys' indices, found on the host: a boolean mask would make CUDA read its count back
        real = torch.from_numpy(np.flatnonzero(self.key_mask[row, -k:])).to(seg.device)
        seg = seg.index_select(-1, real)
        missing = int(self.key_mask[row].sum()) - seg.shape[-1]
        if missing > 0:
            fill = torch.finfo(seg.dtype).min if key.startswith("attn_scores") else 0.0
            seg = torch.nn.functional.pad(seg, (missing, 0), value=fill)
        return torch.cat([seg, entries], dim=-1) if extra else seg


class GridStep(Step):
    """The Step of one eager forward: a capture keeps the site's whole [b, n_cols, ...] grid."""
    __slots__ = ("shape", "layout")

    def __init__(self, spans: list[Span], shape: tuple[int, int], layout: Layout, prev: GridStep | None = None) -> None:
        super().__init__(spans, shape[0] * shape[1], layout.call.device, layout.call.ledger, prev=prev)
        self.shape, self.layout = shape, layout

    def capture(self, g: ReadGroup, t: torch.Tensor) -> None:
        src = t.detach() if g.coord is None else t.detach()[:, g.coord]
        # a copy: HF edits some outputs in place after the hook (Falcon adds the attention output into
        # mlp_out), which must not reach the capture
        chunk = src.reshape(*self.shape, *src.shape[1:]).clone()
        self.layout.call.store.setdefault(g.key, []).append((self.layout, chunk))


def prefill_layout(plans: list[Plan], mask: np.ndarray, call: Call) -> Layout:
    """The layout of a call's first forward: each row's real columns (one run per row)."""
    b, width = mask.shape
    first = mask.argmax(1)
    spans = [Span(plan, r * width + int(first[r]), r * width + int(first[r]) + plan.prompt_len, 0, r)
             for r, plan in enumerate(plans)]
    return Layout(spans, (b, width), mask, call)


def decode_layout(plans: list[Plan], mask: np.ndarray, step: int, call: Call, after: Layout | None = None) -> Layout:
    """The forward feeding back generated token `step` (1-based): one column per row. `after`: the
    layout of step - 1 (its rows, one position on)."""
    spans = [Span(plan, r, r + 1, plan.prompt_len + step - 1, r) for r, plan in enumerate(plans)]
    key_mask = np.concatenate([mask, np.ones((mask.shape[0], step), dtype=bool)], axis=1)
    return Layout(spans, (mask.shape[0], 1), key_mask, call, after)


def decode_layouts(plans: list[Plan], mask: np.ndarray, n: int, call: Call) -> Iterator[Layout]:
    """The layouts of decode steps 1..n-1, built one forward at a time (a step's key mask grows with
    it: all of them at once is O(n^2)), each after the one before."""
    last = None
    for step in range(1, n):
        last = decode_layout(plans, mask, step, call, last)
        yield last


def pattern_rows(call: Call, key: str, compress_rate: int) -> None:
    """Hand each plan its rows of an attention pattern's chunks, keys aligned to its own positions
    (per row, after the forward)."""
    for layout, chunk in call.store.get(key, ()):
        step = layout.step(chunk.shape[1])
        for sp in step.spans:
            c0 = sp.a - sp.row * chunk.shape[1]
            seg = chunk[sp.row, c0:c0 + sp.n]
            sp.plan.add(key, sp.pos0, layout.align_keys(sp.row, seg, key, compress_rate))


def padded(grid: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The grid [b, C, ...] with 0 wherever real [b, C] (bool, on the grid's device) is False."""
    return grid.masked_fill(~real.reshape(*real.shape, *[1] * (grid.dim() - 2)), 0)
