"""The library's result types (engine/core/results.py) from the server's answers: one sequence's
captures, readouts and receipts as an ActivationCache / RequestResult, a call's sequences padded into
[batch, ...] tensors the way the local backends pad them (left, or the layout of a given
attention_mask), and the tensors on the device the caller named.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from engine.core.readouts import Readout, TopK
from engine.core.results import (
    ActivationCache,
    GenerationResult,
    Receipt,
    RequestResult,
    Sequences,
    batch_cache,
    batch_readouts,
    columns,
    columns_of,
    combine,
    pad_rows,
)
from engine.serve import encoding

HEADS = ("lm_head", "lm_head_raw")  # captured while generating from the last prompt token: [new, vocab]


def tensor(obj: dict, device: torch.device | str) -> torch.Tensor:
    t = encoding.decode({k: v for k, v in obj.items() if k != "positions"})
    return t if torch.device(device).type == "cpu" else t.to(device)


def receipts(items: list[dict]) -> list[Receipt]:
    """Receipts from their JSON (a non-finite change_norm travels as null: NaN here)."""
    return [Receipt(**{**r, "change_norm": math.nan if r.get("change_norm") is None else r["change_norm"]})
            for r in items]


def readout_value(obj: dict, device) -> torch.Tensor | TopK:
    if set(obj) == {"indices", "values"}:
        return TopK(tensor(obj["indices"], device), tensor(obj["values"], device))
    return tensor(obj, device)


def captures(item: dict, device) -> dict[str, torch.Tensor]:
    """An answer item's captures as tensors (a reduction over no position, null, left out)."""
    return {k: tensor(obj, device) for k, obj in (item.get("captures") or {}).items() if obj is not None}


def cache(item: dict, caps: dict[str, torch.Tensor], n_layers: int, readouts: list[Readout],
          device) -> ActivationCache:
    """One sequence's ActivationCache ([pos, ...] captures `caps`, the item's readouts by name and
    receipts) of an answer's item (a /v1/capture data entry or a completion's interp block)."""
    out = ActivationCache(n_layers, receipts=receipts(item.get("receipts", [])))
    for key, t in caps.items():
        out[key] = t
    per_position = {r.name: r.kind.per_position for r in readouts}
    for name, obj in (item.get("readouts") or {}).items():
        out.put_readout(name, readout_value(obj, device), per_position[name])
    return out


def layout(lengths: list[int], mask: torch.Tensor | None) -> tuple[list[torch.Tensor], int]:
    """(each sequence's columns, width) of a padded batch: left padding, or a given mask's own layout."""
    if mask is None:
        width = max(lengths)
        return columns(lengths, width, "left"), width
    return columns_of(mask), mask.shape[1]


def forward(items: list[dict], n_layers: int, readouts: list[Readout], mask: torch.Tensor | None, logits: bool,
            device) -> tuple[torch.Tensor | None, ActivationCache]:
    """(logits [b, pos, vocab] or None, cache of [b, pos, ...]) of a /v1/capture answer's items."""
    caches = [cache(it, captures(it, device), n_layers, readouts, device) for it in items]
    cols, width = layout([len(it["prompt_token_ids"]) for it in items], mask)
    out = _batched_cache(caches, cols, width, n_layers, combine([c.receipts for c in caches]))
    lg = None
    if logits:
        rows = [tensor(it["logits"], device) for it in items]
        lg = _on(_padded(rows, cols, width), rows[0])
    return lg, out


def _whole(cols: list[torch.Tensor], width: int) -> bool:
    """One sequence filling every column: its batch is itself with a batch axis (no padding, no copy)."""
    return len(cols) == 1 and len(cols[0]) == width


def _padded(rows: list[torch.Tensor], cols: list[torch.Tensor], width: int, fill: float = 0) -> torch.Tensor:
    """pad_rows, or (one sequence filling the width) the rows themselves as a batch of one: the common
    remote call, spared a copy (and torch's threaded fill, which a busy machine makes slow)."""
    return rows[0][None] if _whole(cols, width) else pad_rows(rows, cols, width, fill)


def _batched_cache(caches: list, cols: list[torch.Tensor], width: int, n_layers: int,
                   receipts: list[Receipt]) -> ActivationCache:
    """batch_cache (readouts included), or for one sequence filling the width its entries with a batch axis."""
    if not _whole(cols, width):
        return batch_cache(caches, cols, width, n_layers, receipts)
    out = ActivationCache(n_layers, [c.cpu() for c in cols], receipts)
    for key, t in caches[0].items():
        out[key] = t[None]
    if isinstance(caches[0], ActivationCache):
        _readouts_of_one(out, caches[0])
    return out


def _readouts_of_one(out: ActivationCache, one: ActivationCache) -> None:
    for name, v in one.readouts.items():
        out.put_readout(name, v.map(lambda t: t[None]) if isinstance(v, TopK) else v[None], name in one.positional)


def request(block: dict, caps: dict[str, torch.Tensor], n_layers: int, readouts: list[Readout], logits: bool,
            device) -> RequestResult:
    """One generated sequence from its completion's interp block and captures `caps`; `logits`: the
    block carries each new token's logits [new, vocab] (interp.logits)."""
    c = cache(block, caps, n_layers, readouts, device)
    kept, c.receipts = c.receipts, []  # a sequence's receipts are the RequestResult's, as in-process
    lg = None
    if logits:
        if block.get("logits") is None:
            from engine.core.errors import EngineError
            raise EngineError("the server sent no logits for a generation that asked for them (interp.logits)")
        lg = tensor(block["logits"], device)
    return RequestResult(torch.tensor(block["prompt_token_ids"], dtype=torch.long),
                         torch.tensor(block["token_ids"], dtype=torch.long), block["text"], c, lg,
                         int(block.get("cached_tokens", 0)), int(block.get("recomputed", 0)), kept)


def generation(res: list[RequestResult], n_layers: int, pad: int) -> GenerationResult:
    """A batch of generated sequences as the local backends return it: tokens and mask [b, P + N]
    padded on the left, new tokens and logits [b, N, ...] on the right (a sequence that stopped early),
    captures [b, P + N - 1, ...] on the left (the heads [b, N, vocab] like the logits), receipts
    combined over the sequences (the result's and its cache's, as eager's)."""
    seqs = Sequences.of(res, pad)
    new_cols, n_new, seen, width = seqs.new_cols, seqs.n_new, seqs.seen, seqs.width
    body = [{k: v for k, v in r.cache.items() if k not in HEADS} for r in res]
    receipts = combine([r.receipts for r in res])
    out = _batched_cache(body, seen, width - 1, n_layers, receipts)
    if _whole(seen, width - 1):
        _readouts_of_one(out, res[0].cache)
    else:
        batch_readouts(out, [r.cache for r in res], seen, width - 1)
    for head in HEADS:
        if head in res[0].cache:
            out[head] = _on(_padded([r.cache[head] for r in res], new_cols, n_new), res[0].cache[head])
    logits = None
    rows = [r.logits for r in res if r.logits is not None]
    if len(rows) == len(res):
        logits = _on(_padded(rows, new_cols, n_new), rows[0])
    return GenerationResult(seqs.tokens, seqs.new, [r.text for r in res], out, logits, seqs.mask, res, receipts)


def _on(t: torch.Tensor, like: Any) -> torch.Tensor:
    """pad_rows builds on the CPU: back onto the device the sequences' tensors are on."""
    return t if t.device == like.device else t.to(like.device)
