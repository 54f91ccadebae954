"""capture_attention: the attention of chosen layers in one forward, on any backend.

    att = capture_attention(m, "The quick brown fox", layers=[0, 3])
    att.probs[3]          # [batch, q, heads, k]       softmax over key positions
    att.scores[3]         # [batch, q, heads, k]       pre-softmax (masked entries very negative)
    att.value[3]          # [batch, pos, kv_heads, hd] per-head values of the current positions
    att.z[3]              # [batch, pos, heads, hd]    what the output projection reads
    att.mixed(3)          # probs @ value, per head (GQA groups repeated): equals z
    att.missing           # {"attn_scores.3": why}     what this model / backend cannot serve

Each piece is the catalogue point of the same name (engine/core/points.py), so its definition, its
verdict (model.verdict) and its numbers are the ones run_with_cache gives; a piece the model does
not serve is left out with the reason, never filled in by a different computation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from engine.core.address import Address

PIECES = {"scores": "attn_scores", "probs": "attn_probs", "value": "value", "z": "z"}


@dataclass
class AttentionCapture:
    layers: list[int]
    scores: dict = field(default_factory=dict)
    probs: dict = field(default_factory=dict)
    value: dict = field(default_factory=dict)
    z: dict = field(default_factory=dict)
    missing: dict = field(default_factory=dict)  # address -> reason
    logits: torch.Tensor | None = None

    def mixed(self, layer: int) -> torch.Tensor:
        """probs @ value per head ([batch, q, heads, hd]), key/value heads repeated over their query
        groups: the per-head attention output, equal to z."""
        p, v = self.probs[layer], self.value[layer]
        groups = p.shape[2] // v.shape[2]
        v = v.repeat_interleave(groups, dim=2) if groups > 1 else v
        return torch.einsum("bqhk,bkhd->bqhd", p.to(v.dtype), v)


def capture_attention(model: Any, tokens: Any, layers: Iterable[int] | None = None, pieces: Iterable[str] = tuple(PIECES)) -> AttentionCapture:
    """Scores, probabilities, per-head values and z of `layers` (default: every layer with softmax
    attention) in one forward over `tokens`."""
    unknown = [p for p in pieces if p not in PIECES]
    if unknown:
        raise ValueError(f"unknown attention piece(s) {unknown}; choose from {list(PIECES)}.")
    if layers is None:
        layers = sorted(set().union(*(model.point_layers(PIECES[p]) for p in pieces)))
        if not layers:
            raise ValueError(f"{model.name} has no softmax attention layer this backend serves: "
                             f"{model.refuses('attn_probs.0')}")
    layers = [model.address(Address("resid_post", layer)).layer for layer in layers]  # any integer, checked
    want, out = [], AttentionCapture(layers)
    for layer in layers:
        for piece in pieces:
            addr = f"{PIECES[piece]}.{layer}"
            why = model.refuses(addr)
            if why is None:
                want.append(addr)
            else:
                out.missing[addr] = why
    if not want:
        raise ValueError(f"none of {list(pieces)} is served at layers {layers} of {model.name}: "
                         f"{'; '.join(f'{a}: {w}' for a, w in out.missing.items())}")
    out.logits, cache = model.run_with_cache(tokens, want)
    for addr in want:
        point, at = addr.rsplit(".", 1)
        piece = next(k for k, v in PIECES.items() if v == point)
        getattr(out, piece)[int(at)] = cache[addr]
    return out
