"""Tolerance tiers: the one place that says how close 'the same tensor' must be.

A row passes when its relative error (the larger of the whole-tensor error and the worst token's)
is at most `pass_rel`, warns up to `warn_rel`, and fails beyond. Structural failures (shape,
NaN/inf, all-zero, attention-mask or padding leak, a steer that changed nothing) fail whatever the
tier. Tiers are chosen per (engine, dtype): every float32 reference here runs the same HF weights
with the same eager kernels, so only operation-order noise (~1e-7) separates them; half precision
rounds every op at ~4e-3 (bf16) / ~5e-4 (fp16) and the errors compound over layers.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    pass_rel: float
    warn_rel: float
    why: str


_F32 = Tier(1e-5, 1e-3, "same weights and eager kernels: operation-order noise only")
_F32_KERNELS = Tier(1e-4, 1e-2, "different attention/matmul kernels (vLLM CPU) on the same weights")
_BF16 = Tier(2e-2, 8e-2, "bfloat16 rounds every op (~4e-3) and the error compounds over layers")
_F16 = Tier(5e-3, 3e-2, "float16 rounds every op (~5e-4) and the error compounds over layers")

# (engine, dtype) -> Tier; "*" matches any engine.
TIERS: dict[tuple[str, str], Tier] = {
    ("hf", "float32"): _F32,
    ("transformer_lens", "float32"): _F32,
    ("nnsight", "float32"): _F32,
    ("nnterp", "float32"): _F32,
    ("interp-engine", "float32"): _F32,
    ("vllm", "float32"): _F32_KERNELS,
    ("vllm-static", "float32"): _F32_KERNELS,
    ("*", "bfloat16"): _BF16,
    ("*", "float16"): _F16,
}

# Cases whose reference takes a different computation path: decode-time capture goes through the
# KV cache one token at a time while the reference recomputes the whole sequence.
CASE_FACTOR: dict[str, float] = {"decode": 10.0}

# A steer must move the logits by at least this relative amount, or the parity check timed a no-op.
STEER_MIN_EFFECT = 1e-3

# Attention scores at or below this are masked entries (causal, sliding window, padding); they are
# compared as a mask, not as numbers.
MASKED_SCORE = -1e4


def tier_for(engine: str, dtype: str, case: str = "") -> Tier:
    """The tier for one engine and dtype (and case), or a ValueError naming the known pairs."""
    tier = TIERS.get((engine, dtype)) or TIERS.get(("*", dtype))
    if tier is None:
        known = ", ".join(f"{e}/{d}" for e, d in TIERS)
        raise ValueError(f"no tolerance tier for engine {engine!r} at dtype {dtype!r}; add one to "
                         f"validator/tolerances.py (known: {known}).")
    f = CASE_FACTOR.get(case, 1.0)
    return tier if f == 1.0 else Tier(tier.pass_rel * f, tier.warn_rel * f, f"{tier.why}; x{f:g} for {case}")
