"""vllm-static's in-graph layer guard, and the one buffer where the graph leaves a step's tallies.

A steer whose own result is finite can still overflow later (two adds of 3e38 at attn_out.0 and
mlp_out.0 make resid_post.0 inf, and layer 1 then writes NaN keys and values into the KV cache).
The hooked backends check every layer's output with Python hooks; vllm-static's forward is compiled
(torch.compile on CPU, CUDA graphs on GPU), where hooks never run, so the loader wraps every decoder
layer with this guard before compilation, whatever taps were declared. Inside the graph, with tensor
ops only: the rows marked in the tally's MARK row (those of requests that steer, marked per step by
StaticTaps.before; 0 elsewhere, so a plain request is never altered) whose stream left the layer
non-finite, or so large that its squared norm overflows (`bounded`), become 0 (both halves of a
(hidden, residual) pair), and the FLAG row keeps, per row, NaN where any layer or write tap did that in
this step (each takes the maximum, which keeps NaN). After the step, StaticTaps.after records the
flagged rows in the worker's ledger with the step's receipts, in one gather (the request fails with
NonFiniteSteer naming its steers when its ledger is read at collect; nothing is read back per step),
and clears both rows; the KV blocks such rows wrote are zeroed before they are handed to another
request (engine/backends/vllm/worker/kv.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.site import row_bounds

if TYPE_CHECKING:
    from engine.backends.vllm.worker.tree import Tree
    from engine.core.step import Rows


def bounded(x: torch.Tensor) -> torch.Tensor:
    """Bool [n, 1]: each row of [n, d] within the guard's bounds (engine.core.site.row_bounds: finite,
    with a finite float32 sum of squares). Tensor ops only."""
    return torch.isfinite(row_bounds(x)).unsqueeze(-1)


class Tally:
    """One float64 buffer [writes + 2, rows] on `holder`: row w, write tap w's change norm at each row
    (the graph writes it every forward: the step's receipts); row MARK, the rows of steering requests
    the guard watches this step; row FLAG, NaN at each such row that a write tap kept unsteered or a
    layer zeroed (0 elsewhere). Between steps MARK and FLAG are 0."""

    NAME = "_interp_tally"

    def __init__(self, holder: torch.nn.Module, writes: int, rows: int, device: torch.device) -> None:
        self.holder, self.writes, self.rows = holder, writes, rows
        self.MARK, self.FLAG = writes, writes + 1
        holder.register_buffer(self.NAME, torch.zeros((writes + 2, rows), device=device, dtype=torch.float64),
                               persistent=False)
        self.dirty: tuple[int, int] | None = None  # columns [lo, hi) marked this step

    @property
    def buf(self) -> torch.Tensor:
        return getattr(self.holder, self.NAME)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    # -- between steps (Python, outside the graph) -------------------------------------------------
    def mark(self, rows: Rows, n_tokens: int) -> None:
        """Mark these rows of the step (engine.core.step.Step.guard_rows: every row of each request
        that steers) for this step: one fill."""
        if not rows.spans:
            return
        if rows.index is None:
            self.buf[self.MARK, :n_tokens].fill_(1.0)
            self.dirty = (0, n_tokens)
        else:
            self.buf[self.MARK].index_fill_(0, rows.index.to(self.buf.device), 1.0)
            self.dirty = (int(rows.flat.min()), int(rows.flat.max()) + 1)

    def clear(self) -> None:
        """No row marked or flagged (the state between steps): one fill of both rows' marked columns."""
        if self.dirty is not None:
            self.buf[self.MARK:, self.dirty[0]:self.dirty[1]].zero_()
            self.dirty = None


def flag(tally: torch.Tensor, row: int, n: int, bad: torch.Tensor) -> None:
    """In the graph: NaN into the FLAG row at each of the first n rows where bad ([n] or [n, 1] bool)."""
    f = tally[row, :n]
    f.copy_(torch.maximum(f, torch.where(bad.reshape(n), _NAN, 0.0)))


_NAN = float("nan")


class LayerGuard:
    """The guard of every decoder layer of one model, on the tally's MARK and FLAG rows."""

    def __init__(self, layers: list[torch.nn.Module], tree: Tree, tally: Tally) -> None:
        self.tally = tally
        for layer in layers:
            self._wrap(layer, tree.pair, tree.batched)

    def _wrap(self, layer: torch.nn.Module, pair: bool, batched: bool) -> None:
        holder, name, mark, flag_row = self.tally.holder, Tally.NAME, self.tally.MARK, self.tally.FLAG
        orig = layer.forward

        def guard(parts: list[torch.Tensor]) -> list[torch.Tensor]:  # tensor ops only: traced into the graph
            flat = [p.reshape(-1, p.shape[-1]) if batched else p for p in parts]
            n = flat[0].shape[0]
            stream = flat[0] if len(flat) == 1 else flat[0] + flat[1]
            tally = getattr(holder, name)
            bad = (tally[mark, :n] > 0).unsqueeze(-1) & ~bounded(stream)
            flag(tally, flag_row, n, bad)
            return [torch.where(bad, torch.zeros_like(p), p).reshape(q.shape) for p, q in zip(flat, parts)]

        def forward(*args, **kwargs):
            out = orig(*args, **kwargs)
            if pair and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
                h, r = guard([out[0], out[1]])
                return h, r
            if isinstance(out, tuple):
                return (guard([out[0]])[0], *out[1:])
            return guard([out])[0]
        layer.forward = forward
