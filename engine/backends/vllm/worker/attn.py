"""attn_scores / attn_probs on the vLLM backend: recomputed from the request's captured q and k.

vLLM's attention kernel never materializes the score matrix. The inputs of its Attention module
are q and k after QK-norm and RoPE, so the scores are recomputed after the request finishes, with
the layer's own scale, logit softcap and causal / sliding-window mask, the way HF's eager
attention forms them (masked entries are the dtype's most negative value). Layers with ALiBi
biases are refused; probabilities are refused where the softmax has sink logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.errors import UnsupportedPointError
from engine.core.points import KEY_AXIS_POINTS

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention import Attention

ATTN_POINTS = KEY_AXIS_POINTS  # recomputed here from q and k: the points with a key-position axis


def params(kernel: Attention) -> dict:
    """Scale, softcap, window and refusals of one vLLM Attention module."""
    impl = kernel.impl
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, (tuple, list)):
        window = window[0] + 1 if window[0] >= 0 else None
    return {"scale": float(impl.scale), "softcap": float(getattr(impl, "logits_soft_cap", 0) or 0) or None,
            "window": window if window and window > 0 else None,
            "alibi": getattr(impl, "alibi_slopes", None) is not None,
            "sinks": getattr(impl, "sinks", None) is not None}


def check(point: str, p: dict, where: str) -> None:
    if p["alibi"]:
        raise UnsupportedPointError(f"{point!r} at {where}: this layer adds ALiBi biases inside the kernel, "
                                    f"which the recompute from q and k does not reproduce; use backend='eager'.")
    if point == "attn_probs" and p["sinks"]:
        raise UnsupportedPointError(f"'attn_probs' at {where}: this layer's softmax includes sink logits that are "
                                    f"not captured; capture attn_scores, or use backend='eager'.")


def scores(q: torch.Tensor, k: torch.Tensor, p: dict) -> torch.Tensor:
    """[pos, heads, kpos] pre-softmax logits from q [pos, heads, hd] and k [kpos, kv_heads, hd]."""
    q, k = q.float(), k.float()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1) if groups > 1 else k
    s = torch.einsum("qhd,khd->qhk", q, k) * p["scale"]
    if p["softcap"]:
        s = torch.tanh(s / p["softcap"]) * p["softcap"]
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    allowed = j <= i
    if p["window"]:
        allowed &= (i - j) < p["window"]
    return s.masked_fill(~allowed[:, None, :], torch.finfo(s.dtype).min)


def probs(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1)
