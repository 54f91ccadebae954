"""vllm-static's in-graph layer guard: no steering request's hidden state leaves a decoder layer
inf or NaN.

A steer whose own result is finite can still overflow later (two adds of 3e38 at attn_out.0 and
mlp_out.0 make resid_post.0 inf, and layer 1 then writes NaN keys and values into the KV cache).
The hooked backends check every layer's output with Python hooks; vllm-static's forward is compiled
(torch.compile on CPU, CUDA graphs on GPU), where hooks never run, so the loader wraps every decoder
layer with this guard before compilation, whatever taps were declared. Inside the graph, with tensor
ops only: the rows marked in `Marks` (those of requests that steer, marked per step by
StaticTaps.before; 0 elsewhere, so a plain request is never altered) whose stream left the layer
non-finite, or so large that its squared norm overflows (`bounded`), become 0 (both halves of a
(hidden, residual) pair), and the layer's own `flag` buffer holds, per row, NaN where it did that in
this forward (0 elsewhere; every forward writes it whole, so nothing is reset). After the step,
StaticTaps.after takes every layer's and write tap's flags with the step's receipts in one stack and
records them in the worker's ledger (the request fails with NonFiniteSteer naming its steers when its
ledger is read at collect; nothing is read back per step); the KV blocks such rows wrote are zeroed
before they are handed to another request (engine/backends/vllm/worker/kv.py). Each buffer the graph
writes is its own module's: a compiled piece that wrote a slice of a buffer shared with other pieces
would copy the whole buffer back after it (measured: 11x slower decode with stacked capture buffers).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.core.site import row_bounds

if TYPE_CHECKING:
    from engine.backends.vllm.worker.tree import Tree
    from engine.core.step import Rows


def bounded(x: torch.Tensor) -> torch.Tensor:
    """Bool [n, 1]: each row of [n, d] within the guard's bounds (engine.core.site.row_bounds: finite,
    with a finite float32 sum of squares). Tensor ops only."""
    return torch.isfinite(row_bounds(x)).unsqueeze(-1)


FLAG = "_interp_flag"  # a write tap's or a decoder layer's flags [rows] (float64: 0, or NaN where it failed a row)
_NAN = float("nan")


def nan_where(bad: torch.Tensor, n: int) -> torch.Tensor:
    """In the graph: float64 [n], NaN where bad ([n] or [n, 1] bool), 0 elsewhere."""
    return torch.where(bad.reshape(n), _NAN, 0.0).to(torch.float64)


class Marks:
    """The rows of the steering requests of a step, [rows] on `holder`: written between steps (one fill
    to mark, one to clear), read by every layer's guard inside the graph."""

    NAME = "_interp_guard_rows"

    def __init__(self, holder: torch.nn.Module, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        self.holder, self.rows = holder, rows
        holder.register_buffer(self.NAME, torch.zeros((rows, 1), device=device, dtype=dtype), persistent=False)
        self.dirty: tuple[int, int] | None = None  # rows [lo, hi) marked this step
        self.flat: Any = None  # the host rows of the last mark by index (None: a range, or nothing marked)

    @property
    def buf(self) -> torch.Tensor:
        return getattr(self.holder, self.NAME)

    def mark(self, rows: Rows, n_tokens: int) -> None:
        """Mark exactly these rows of the step (engine.core.step.Step.guard_rows: every row of each request
        that steers): one fill, none when they are the rows marked already (a carried decode step's)."""
        if not rows.spans:
            self.clear()
            return
        if rows.index is None:
            if self.dirty == (0, n_tokens) and self.flat is None:
                return
            self.clear()
            self.buf[:n_tokens].fill_(1.0)
            self.dirty = (0, n_tokens)
        else:
            if self.flat is rows.flat:
                return
            self.clear()
            self.buf.index_fill_(0, rows.index.to(self.buf.device), 1.0)
            self.dirty, self.flat = (int(rows.flat.min()), int(rows.flat.max()) + 1), rows.flat

    def clear(self) -> None:
        """No row marked (the state for a forward without a step of ours: a plain step's rows are never
        touched): one fill."""
        if self.dirty is not None:
            self.buf[self.dirty[0]:self.dirty[1]].zero_()
            self.dirty, self.flat = None, None


class LayerGuard:
    """The guard of every decoder layer of one model: `marks` read, each layer's own flags written."""

    def __init__(self, layers: list[torch.nn.Module], tree: Tree, marks: Marks) -> None:
        self.marks, self.layers = marks, layers
        for layer in layers:
            layer.register_buffer(FLAG, torch.zeros(marks.rows, device=marks.buf.device, dtype=torch.float64),
                                  persistent=False)
            self._wrap(layer, tree.pair, tree.batched)

    @property
    def flags(self) -> list[torch.Tensor]:
        """Each layer's flags of the last forward, [rows]."""
        return [getattr(layer, FLAG) for layer in self.layers]

    @property
    def nbytes(self) -> int:
        return self.marks.buf.nbytes + sum(f.nbytes for f in self.flags)

    def _wrap(self, layer: torch.nn.Module, pair: bool, batched: bool) -> None:
        holder, name = self.marks.holder, Marks.NAME
        orig = layer.forward

        def guard(parts: list[torch.Tensor]) -> list[torch.Tensor]:  # tensor ops only: traced into the graph
            flat = [p.reshape(-1, p.shape[-1]) if batched else p for p in parts]
            n = flat[0].shape[0]
            stream = flat[0] if len(flat) == 1 else flat[0] + flat[1]
            bad = (getattr(holder, name)[:n] > 0) & ~bounded(stream)
            getattr(layer, FLAG)[:n].copy_(nan_where(bad, n))
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
