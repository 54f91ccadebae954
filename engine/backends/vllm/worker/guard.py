"""vllm-static's in-graph layer guard: no steering request's hidden state leaves a decoder layer
inf or NaN.

A steer whose own result is finite can still overflow later (two adds of 3e38 at attn_out.0 and
mlp_out.0 make resid_post.0 inf, and layer 1 then writes NaN keys and values into the KV cache).
The hooked backends check every layer's output with Python hooks; vllm-static's forward is compiled
(torch.compile on CPU, CUDA graphs on GPU), where hooks never run, so the loader wraps every decoder
layer with this guard before compilation, whatever taps were declared. Inside the graph, with tensor
ops only: the rows marked in `rows` (those of requests that steer, marked per step by
StaticTaps.before; 0 elsewhere, so a plain request is never altered) whose stream left the layer
non-finite, or so large that its squared norm overflows (`bounded`), become 0 (both halves of a
(hidden, residual) pair), and `flag` keeps, per row, whether any layer did that in this step (layer
0 writes it, later layers take the maximum). After the step, StaticTaps.after records the flagged
rows in the worker's ledger (the request fails with NonFiniteSteer naming its steers when its ledger
is read at collect; nothing is read back per step); the KV blocks such rows wrote are zeroed before
they are handed to another request (engine/backends/vllm/worker/kv.py).
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


class LayerGuard:
    """The guard of every decoder layer of one model: two [rows, 1] buffers on the first layer."""

    ROWS, FLAG = "_interp_guard_rows", "_interp_guard_flag"

    def __init__(self, layers: list[torch.nn.Module], tree: Tree, rows: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.holder = layers[0]
        for name in (self.ROWS, self.FLAG):
            self.holder.register_buffer(name, torch.zeros((rows, 1), device=device, dtype=dtype), persistent=False)
        self.dirty: tuple[int, int] | None = None  # rows [lo, hi) marked this step
        for i, layer in enumerate(layers):
            self._wrap(layer, i == 0, tree.pair, tree.batched)

    @property
    def rows(self) -> torch.Tensor:
        return getattr(self.holder, self.ROWS)

    @property
    def flag(self) -> torch.Tensor:
        return getattr(self.holder, self.FLAG)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.flag.nbytes

    def _wrap(self, layer: torch.nn.Module, first: bool, pair: bool, batched: bool) -> None:
        holder, rows_name, flag_name = self.holder, self.ROWS, self.FLAG
        orig = layer.forward

        def guard(parts: list[torch.Tensor]) -> list[torch.Tensor]:  # tensor ops only: traced into the graph
            flat = [p.reshape(-1, p.shape[-1]) if batched else p for p in parts]
            n = flat[0].shape[0]
            stream = flat[0] if len(flat) == 1 else flat[0] + flat[1]
            marked = getattr(holder, rows_name)[:n] > 0
            bad = marked & ~bounded(stream)
            flag = getattr(holder, flag_name)[:n]
            hit = bad.to(flag.dtype)
            flag.copy_(hit if first else torch.maximum(flag, hit))
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

    # -- between steps (Python, outside the graph) -------------------------------------------------
    def mark(self, rows: Rows, n_tokens: int) -> None:
        """Mark these rows of the step (engine.core.step.Step.guard_rows: every row of each request
        that steers) for this step."""
        if not rows.spans:
            return
        if rows.index is None:
            self.rows[:n_tokens] = 1.0
            self.dirty = (0, n_tokens)
        else:
            self.rows.index_fill_(0, rows.index.to(self.rows.device), 1.0)
            self.dirty = (int(rows.flat.min()), int(rows.flat.max()) + 1)

    def clear(self) -> None:
        """No row marked (the state between steps: a plain step's rows are never touched)."""
        if self.dirty is not None:
            self.rows[self.dirty[0]:self.dirty[1]].zero_()
            self.dirty = None
