"""An attention implementation that exposes q, k, value, attn_scores, attn_probs and z.

HF models call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_fn)`.
We register one more implementation, "interp", which runs the family's own eager attention
(looked up in the module's modeling file, so softcaps, sinks and sliding windows stay exactly
HF's) and, only when callbacks are attached to that attention module, lets them read or replace
the tensors that flow through. With no callbacks it is the family's eager path, byte for byte; a
callback that only reads (returns None) leaves every tensor of the call untouched.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "interp"
CALLBACKS_ATTR = "_interp_callbacks"  # dict point -> list of fn(canonical tensor) -> tensor | None


class _Attached:
    """Handle of one callback attached to one attention module; remove() detaches that callback
    (by identity) and leaves the module clean once none is left."""

    def __init__(self, module: torch.nn.Module, point: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        self.module, self.point, self.fn = module, point, fn

    def remove(self) -> None:
        cbs = getattr(self.module, CALLBACKS_ATTR, None)
        if not cbs or self.point not in cbs:
            return
        cbs[self.point] = [f for f in cbs[self.point] if f is not self.fn]
        if not cbs[self.point]:
            del cbs[self.point]
        if not cbs:
            delattr(self.module, CALLBACKS_ATTR)


def attach(module: torch.nn.Module, point: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> _Attached:
    """Attach fn(canonical tensor) -> replacement | None at `point` inside module's attention call."""
    cbs = getattr(module, CALLBACKS_ATTR, None)
    if cbs is None:
        cbs = {}
        setattr(module, CALLBACKS_ATTR, cbs)
    cbs.setdefault(point, []).append(fn)
    return _Attached(module, point, fn)


def _eager_fn(module):
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward in its modeling file")
    return fn


def _run(cbs, point, canon):
    """Run the callbacks of `point`; returns the replacement, or None when every one only read."""
    new = None
    for fn in cbs.get(point, ()):
        out = fn(canon if new is None else new)
        if out is not None:
            new = out
    return new


def _heads_first_to_pos_first(t):  # [b, h, p, d] -> [b, p, h, d]
    return t.transpose(1, 2)


def _new_tail(module, t, q_len, cbs, point):
    """Apply callbacks to the newest q_len positions of a [b, h, kv, d] key/value tensor."""
    if point not in cbs:
        return t
    tail = _heads_first_to_pos_first(t[:, :, -q_len:, :])
    new = _run(cbs, point, tail)
    if new is None:
        return t
    new = _heads_first_to_pos_first(new)
    return torch.cat([t[:, :, :-q_len, :], new], dim=2) if t.shape[2] > q_len else new


def scores_from(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                scaling: float, softcap: float | None = None) -> torch.Tensor:
    """Pre-softmax attention logits [b, h, q, kv] recomputed the way eager attention forms them."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    return scores


def interp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    cbs = getattr(module, CALLBACKS_ATTR, None)
    eager = _eager_fn(module)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if not cbs:
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    q_len = query.shape[2]
    if "q" in cbs:
        new = _run(cbs, "q", _heads_first_to_pos_first(query))
        query = query if new is None else _heads_first_to_pos_first(new)
    key = _new_tail(module, key, q_len, cbs, "k")
    value = _new_tail(module, value, q_len, cbs, "value")
    if "attn_scores" in cbs:
        softcap = kwargs.get("softcap")  # families that softcap pass it to the attention call
        scores = scores_from(module, query, key, attention_mask, scaling, softcap)
        _run(cbs, "attn_scores", scores.transpose(1, 2))  # capture only: [b, q, h, kv]
    out, probs = eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if "attn_probs" in cbs and probs is not None:
        new = _run(cbs, "attn_probs", probs.transpose(1, 2))
        if new is not None:  # steered: the output is recomputed from the new probabilities
            probs = new.transpose(1, 2)
            groups = probs.shape[1] // value.shape[1]
            v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
            out = torch.matmul(probs.to(v.dtype), v).transpose(1, 2).contiguous()
    if "z" in cbs:
        new = _run(cbs, "z", out)  # out is already [b, q, h, d]
        out = out if new is None else new
    return out, probs


def install() -> None:
    """Register the implementation (idempotent)."""
    if NAME not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(NAME, interp_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)


def use_on(model: torch.nn.Module) -> None:
    """Switch a loaded HF model (and its sub-configs) to the interp implementation."""
    install()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            try:
                cfg._attn_implementation = NAME
            except Exception:  # some configs guard the setter; the internal field always exists
                cfg._attn_implementation_internal = NAME
