"""Attention implementations that expose q, k, value, attn_scores, attn_probs and z.

HF models call `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_fn)`.
We register two kinds of implementation:

    "interp"           the family's own eager attention (looked up in the module's modeling file, so
                       softcaps, sinks and sliding windows stay exactly HF's) with every point read or
                       replaced inside it; what a model loaded with eager attention runs
    "interp_<native>"  the implementation the model was loaded with (`native`: sdpa, or flash
                       attention where installed) with q, k, value and z read or replaced around its
                       call; a layer whose pattern (attn_scores, attn_probs) is read also runs the
                       family's eager attention beside it for the pattern alone, so the forward stays
                       the native one, bit for bit

Callbacks run only when attached to that attention module: with none, each is its underlying
implementation, byte for byte; a callback that only reads (returns None) leaves every tensor of the
call untouched. Families that softcap attention logits (Gemma-2) or add ALiBi biases (Falcon-RW) run
eager in both (`native_of` says why).
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


def additive_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """The mask an eager attention adds to its scores ([b or 1, 1, q, kv], 0 or the dtype's minimum), from
    what the loaded implementation's mask function gave: a bool mask (True: attend), an additive one
    (kept), or None (a plain causal mask, which is when HF's SDPA mask skips building one)."""
    if mask is not None and mask.is_floating_point():
        return mask
    if mask is None:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        mask = (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]
    return torch.zeros((), dtype=dtype, device=device).masked_fill(~mask[..., :kv_len], torch.finfo(dtype).min)


def _fast(native: Any) -> Callable[..., tuple]:
    """`native` attention with q / k / value / z callbacks around its call. A pattern callback (capture of
    attn_scores / attn_probs) gets the family's eager scores and probabilities, computed beside the native
    call, so reading a pattern leaves the forward bit-identical; a written attn_probs recomputes the
    output from the new probabilities, as the eager path does."""
    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        cbs = getattr(module, CALLBACKS_ATTR, None)
        if not cbs:
            return native(module, query, key, value, attention_mask, **kwargs)
        q_len = query.shape[2]
        if "q" in cbs:
            new = _run(cbs, "q", _heads_first_to_pos_first(query))
            query = query if new is None else _heads_first_to_pos_first(new)
        key = _new_tail(module, key, q_len, cbs, "k")
        value = _new_tail(module, value, q_len, cbs, "value")
        out, probs = native(module, query, key, value, attention_mask, **kwargs)
        if "attn_scores" in cbs or "attn_probs" in cbs:
            scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
            mask = additive_mask(attention_mask, q_len, key.shape[2], query.dtype, query.device)
            if "attn_scores" in cbs:
                scores = scores_from(module, query, key, mask, scaling, kwargs.get("softcap"))
                _run(cbs, "attn_scores", scores.transpose(1, 2))  # capture only: [b, q, h, kv]
            if "attn_probs" in cbs:
                eager_kw = {k: v for k, v in kwargs.items() if k != "scaling"}
                _, weights = _eager_fn(module)(module, query, key, value, mask, scaling=scaling, **eager_kw)
                new = _run(cbs, "attn_probs", weights.transpose(1, 2))
                if new is not None:  # steered: the output is recomputed from the new probabilities
                    out = _from_probs(new.transpose(1, 2), value)
        if "z" in cbs:
            new = _run(cbs, "z", out)  # out is [b, q, h, d]
            out = out if new is None else new
        return out, probs
    return attention


def _from_probs(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The attention output [b, q, h, d] of probabilities [b, h, q, kv] over values [b, kv_heads, kv, d]
    (grouped-query heads share their value head)."""
    groups = probs.shape[1] // value.shape[1]
    v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    return torch.matmul(probs.to(v.dtype), v).transpose(1, 2).contiguous()


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
            out = _from_probs(probs, value)
    if "z" in cbs:
        new = _run(cbs, "z", out)  # out is already [b, q, h, d]
        out = out if new is None else new
    return out, probs


def install(native: str = "eager") -> str:
    """Register "interp" and the fast implementation over `native` (idempotent); the fast one's name
    ("interp" itself when native is eager, or unknown to HF's registries)."""
    if NAME not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(NAME, interp_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, eager_mask)
    fn = ALL_ATTENTION_FUNCTIONS._global_mapping.get(native)
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(native)
    if native in ("eager", NAME) or fn is None or mask is None:
        return NAME
    fast = f"{NAME}_{native}"
    if fast not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        ALL_ATTENTION_FUNCTIONS.register(fast, _fast(fn))  # type: ignore[arg-type]
        ALL_MASK_ATTENTION_FUNCTIONS.register(fast, mask)  # type: ignore[arg-type]
    return fast


def configs(model: torch.nn.Module) -> list:
    """Every config of a loaded HF model that names its attention implementation (sub-configs too)."""
    seen: dict = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen[id(cfg)] = cfg
    return list(seen.values())


def native_of(model: torch.nn.Module) -> str:
    """The implementation a model was loaded with, for its fast calls: eager where the family softcaps
    attention logits (SDPA and flash kernels here do not), and where it adds ALiBi biases (Falcon-RW:
    HF's SDPA path gave logits 1.4e-2 away from its eager path on a left-padded batch, measured by
    tests/test_attention_fast.py)."""
    config: Any = model.config
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "alibi", False):
        return "eager"
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def select(cfgs: list, name: str) -> None:
    """Run the model with implementation `name` (each config's choice is set)."""
    for cfg in cfgs:
        if cfg._attn_implementation == name:
            continue
        try:
            cfg._attn_implementation = name
        except Exception:  # some configs guard the setter; the internal field always exists
            cfg._attn_implementation_internal = name


def use_on(model: torch.nn.Module) -> None:
    """Switch a loaded HF model (and its sub-configs) to the interp implementation (every call eager)."""
    install()
    select(configs(model), NAME)
