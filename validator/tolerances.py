"""Tolerance tiers: the one place that says how close 'the same tensor' must be.

A row passes when its relative error (the larger of the whole-tensor error and the worst token's)
is at most `pass_rel`, warns up to `warn_rel`, and fails beyond. Structural failures (shape,
NaN/inf, all-zero, attention-mask or padding leak, a steer that changed nothing) fail whatever the
tier. Tiers are chosen per (engine, dtype): every float32 reference here runs the same HF weights
with the same eager kernels, so only operation-order noise (~1e-7) separates them; half precision
rounds every op at ~4e-3 (bf16) / ~5e-4 (fp16) and the errors compound over layers.

Bit-exactness, at every dtype and on every device (bf16 on a GPU included). The references that run
the HF modules themselves (EXACT_ENGINES) and the engine compute the same tensor from the same
weights, inputs, dtype and device with the same kernels, so they agree bit for bit: the expected
max-abs difference is 0, not merely a small one. A tier's tolerance is for the rows where the two
sides compute differently (COMPUTED_DIFFERENTLY: decode-time capture against a whole-sequence
recompute, a padded row against the prompt alone, attention scores a reference recomputes in
float32); a row outside those that is inside its tier but not exact is reported by `inexact` (a
finding: another kernel, another op order), never hidden by the tier. Measured on the CPU in
float32 and bfloat16 (tests/test_validator_devices.py): every such row exact.
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


# References whose tensors come from the HF modules the engine also runs (interp-engine and the vLLM
# columns compute some points with their own code or kernels, so they make no bit-exact claim).
EXACT_ENGINES = ("hf", "transformer_lens", "nnsight", "nnterp")

# (engine or "*", case or point) -> why those rows are computed differently on the two sides
COMPUTED_DIFFERENTLY: dict[tuple[str, str], str] = {
    ("*", "decode"): "our capture at a KV-cache step (one query row) against the reference's whole-sequence "
                     "forward: other matmul shapes, other accumulation order",
    ("*", "leak"): "our left-padded batch row against the reference's prompt run alone: another batch shape, "
                   "for which another kernel may be chosen",
    ("hf", "attn_scores"): "recomputed by the validator from the recorded q and k in float32 "
                           "(validator/engines/base.py scores_from_qk), ours are the model's own in its dtype",
    ("nnsight", "attn_scores"): "recomputed from the saved q and k in float32, as for hf",
}


def exact_expected(engine: str, case: str, point: str) -> bool:
    """Whether a row of this engine, case and point must be bit-exact (see the module docstring)."""
    if engine not in EXACT_ENGINES:
        return False
    return not any((e, k) in COMPUTED_DIFFERENTLY for e in (engine, "*") for k in (case, point))


def inexact(engine: str, rows: list[dict]) -> list[dict]:
    """The compared rows of one cell that should be bit-exact and are not (max-abs difference above 0)."""
    return [r for r in rows if r.get("max_abs") is not None and r["max_abs"] != 0
            and exact_expected(engine, r["case"], r["point"])]


def exactness(engine: str, rows: list[dict]) -> dict:
    """Of one cell's compared rows: how many, how many are bit-exact, how many must be, and the rows
    that must be and are not (`inexact`)."""
    compared = [r for r in rows if r.get("max_abs") is not None]
    return {"compared": len(compared), "exact": sum(r["max_abs"] == 0 for r in compared),
            "expected": sum(exact_expected(engine, r["case"], r["point"]) for r in compared),
            "inexact": inexact(engine, rows)}


def tier_for(engine: str, dtype: str, case: str = "") -> Tier:
    """The tier for one engine and dtype (and case), or a ValueError naming the known pairs."""
    tier = TIERS.get((engine, dtype)) or TIERS.get(("*", dtype))
    if tier is None:
        known = ", ".join(f"{e}/{d}" for e, d in TIERS)
        raise ValueError(f"no tolerance tier for engine {engine!r} at dtype {dtype!r}; add one to "
                         f"validator/tolerances.py (known: {known}).")
    f = CASE_FACTOR.get(case, 1.0)
    return tier if f == 1.0 else Tier(tier.pass_rel * f, tier.warn_rel * f, f"{tier.why}; x{f:g} for {case}")
