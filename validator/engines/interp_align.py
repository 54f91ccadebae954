"""How an interp-engine tensor lines up with ours: one rule per shape difference, the one place.

interp-engine (PyPI `interp-engine`, eager backend) names the same points with the same address
strings ("resid_post.3", "lm_head"), but lays some of them out differently. Each rule below is a
pure re-layout (transpose or reshape, never arithmetic), so a rule can only make equal tensors line
up, never make different ones agree; a point without a rule is compared as it comes. Where the two
engines define a name differently (a different tensor, not a different layout), that is a declared
difference in validator/known_gaps.py, not a rule here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Dims:
    batch: int
    pos: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Rule:
    theirs: str  # their layout
    ours: str  # ours (engine/core/points.py)
    fn: Callable[[torch.Tensor, Dims], torch.Tensor]


def _heads_first(t, d):
    return t.transpose(1, 2) if t.dim() == 4 and t.shape[1] == d.heads and t.shape[2] == d.pos else t


def _per_head(heads_attr: str):
    """Flat [b, pos, n*hd], or grouped [b, pos, g, n*hd/g] (DeepSeek-V4's o_groups), as [b, pos, n, hd]."""
    def fn(t, d):
        n = getattr(d, heads_attr)
        if t.dim() not in (3, 4) or not n or (t.dim() == 4 and t.shape[2] == n):
            return t
        width = t.shape[2:].numel()
        return t.reshape(t.shape[0], t.shape[1], n, width // n) if width % n == 0 else t
    return fn


def _squeeze_last(t, d):
    return t.squeeze(-1) if t.dim() == 4 and t.shape[-1] == 1 else t


RULES: dict[str, Rule] = {
    "attn_probs": Rule("[b, h, q, kpos] (HF output_attentions)", "[b, pos, h, kpos]", _heads_first),
    "attn_scores": Rule("[b, h, q, kpos]", "[b, pos, h, kpos]", _heads_first),
    "z": Rule("[b, pos, h*hd] (flat; [b, pos, groups, h*hd/groups] on DeepSeek-V4)", "[b, pos, h, hd]",
              _per_head("heads")),
    "attn_gate": Rule("[b, pos, h*hd] (flat)", "[b, pos, h, hd]", _per_head("heads")),
    "value": Rule("[b, pos, kvh*hd] (flat)", "[b, pos, kvh, hd]", _per_head("kv_heads")),
    "q_norm_in": Rule("[b, pos, h*hd] on flat-norm families", "[b, pos, h, hd]", _per_head("heads")),
    "q_norm_out": Rule("[b, pos, h*hd] on flat-norm families", "[b, pos, h, hd]", _per_head("heads")),
    "k_norm_in": Rule("[b, pos, kvh*hd] on flat-norm families", "[b, pos, kvh, hd]", _per_head("kv_heads")),
    "k_norm_out": Rule("[b, pos, kvh*hd] on flat-norm families", "[b, pos, kvh, hd]", _per_head("kv_heads")),
    "mlp_stream_write": Rule("[b, pos, s, 1] where the module keeps a trailing axis", "[b, pos, s]",
                             _squeeze_last),
    "attn_stream_write": Rule("[b, pos, s, 1] where the module keeps a trailing axis", "[b, pos, s]",
                              _squeeze_last),
}


def align(point: str, t: torch.Tensor, dims: Dims) -> torch.Tensor:
    """Their capture of `point` in our layout (unchanged when no rule applies)."""
    rule = RULES.get(point)
    return rule.fn(t, dims) if rule else t
