"""Logit lens: the model's own unembedding (final norm, lm_head, logit scaling, final softcap)
applied to any residual-stream tensor."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.errors import AddressError
from engine.core.points import RESIDUAL_POINTS
from engine.model.paths import get_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.families.base import Family

LENSABLE = RESIDUAL_POINTS + ("resid_streams",)


def unembed(hf: PreTrainedModel, fam: Family, x: torch.Tensor, apply_norm: bool = True, streams: bool = False) -> torch.Tensor:
    """Map a [.., d_model] residual to logits the way the family's CausalLM head does; with
    `streams`, x is [.., s, d_model] hyper-connection streams, collapsed first by the model's head."""
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    fam = fam.for_config(cfg)
    if streams:
        if fam.streams is None or fam.streams.head is None:
            raise AddressError(f"the {fam.name} family has no hyper-connection streams to collapse; "
                               f"lens resid_post instead.")
        x = get_path(hf, fam.streams.head)(x)
    if apply_norm and fam.final_norm:
        x = get_path(hf, fam.final_norm)(x)
    proj = get_path(hf, fam.final_proj) if fam.final_proj else None
    if proj is not None:  # OPT's project_out back to the embedding width
        x = proj(x)
    logits = get_path(hf, fam.lm_head)(x)
    if getattr(cfg, "logits_scaling", None):  # granite divides
        logits = logits / cfg.logits_scaling
    if getattr(cfg, "lm_head_multiplier", None):  # falcon-h1 multiplies
        logits = logits * cfg.lm_head_multiplier
    if getattr(cfg, "logit_scale", None):  # cohere multiplies
        logits = logits * cfg.logit_scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_lensable(point: str) -> None:
    if point not in LENSABLE:
        raise AddressError(f"logit lens reads the residual stream; {point!r} is not a residual point. "
                           f"Use one of: {', '.join(LENSABLE)}.")
