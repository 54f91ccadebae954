"""Tolerance tiers: the one place that says how close 'the same tensor' must be.

Two kinds of row. **Exact rows**: the references that run the HF modules themselves (EXACT_ENGINES)
and the engine compute the same tensor from the same weights, inputs, dtype, device and kernels (each
column runs the attention implementation of the engine configuration it compares with), so they agree
bit for bit at every dtype: such a row passes only with a max-abs difference of 0, and any other
difference fails as `inexact` unless a declared, measured reason (validator/known_gaps.py) covers it.
**Rows computed differently** on the two sides (COMPUTED_DIFFERENTLY: decode-time capture against a
whole-sequence recompute, a padded row against the prompt alone, the validator's own maths for steering
and readouts in float64, attention patterns a reference recomputes in float32, other columns' other
kernels) pass within their tier's band, which is the measured noise floor of that comparison
(`NOISE`: measured with `python -m validator run --force` over the 96 twins, float32 on 2 CPU cores,
the largest error seen in any passing row, times MARGIN). Structural failures (shape, NaN/inf,
all-zero, attention mask, padding leak, a steer that changed nothing, tokens that differ) fail at any
tier.

Tiers are chosen per (engine, dtype) and scaled per case. Half precision rounds every op at ~4e-3
(bf16) / ~5e-4 (fp16) and the errors compound over layers: those bands are not measured here (no GPU);
they bound rows computed differently only, the exact rows stay exact.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    pass_rel: float
    warn_rel: float
    why: str

    @property
    def exact(self) -> bool:
        return self.pass_rel == 0.0


EXACT = Tier(0.0, 0.0, "same weights, inputs, kernels and configuration: bit-exact expected")
MARGIN = 10.0  # a band is the measured noise floor times this

# float32 noise floors of the rows computed differently (not bit-exact by construction), per case: the largest
# relative error (whole tensor or worst token) of a passing row over the 96 twins, measured with
# `python -m validator run --force --jobs 2` on 2 CPU cores, and where it was seen. A band is MARGIN x its floor.
NOISE_F32: dict[str, tuple[float, str]] = {
    "": (2.6e-7, "attention patterns the hf and nnsight references recompute from q and k (Gemma-3 attn_probs)"),
    "decode": (3.0e-6, "Jamba and Bamba decode-time captures (the mamba hybrids Zamba2 and Nemotron-H are declared "
                       "apart: known_gaps ssm-decode-recurrence)"),
    "leak": (4.1e-6, "Zamba2's padded row against its prompt alone"),
    "steer": (3.6e-6, "GLM-4.5-Air feature_clamp"),
    "steer_generate": (5.8e-7, "Bamba project_out during generation"),
    "readout": (5.2e-7, "GLM-4.5-Air SAE features"),
}
_F32 = Tier(NOISE_F32[""][0] * MARGIN, NOISE_F32[""][0] * MARGIN, "float32, computed differently on the two sides")
# vLLM's CPU kernels on the same weights: the largest relative error of a row over the vLLM columns, bar the
# families declared apart (known_gaps vllm-activation-kernel, vllm-cohere2-window), was 8.8e-6 (a Gemma-2
# address row), measured with `python -m validator run --engines vllm,vllm-static`; the band is MARGIN x 1e-5
_F32_KERNELS = Tier(1e-4, 1e-4, "vLLM's own attention, matmul and activation kernels on the same weights: "
                                "10 x the measured noise floor")
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

# Cases whose two sides take different computation paths, with the factor over the base band (half precision and
# the vLLM kernels; float32 reference columns take the measured floor of the case itself, NOISE_F32).
CASE_FACTOR: dict[str, float] = {"decode": 10.0}

# A steer must move the logits by at least this relative amount, or the parity check timed a no-op.
STEER_MIN_EFFECT = 1e-3

# Attention scores at or below this are masked entries (causal, sliding window, padding); they are
# compared as a mask, not as numbers.
MASKED_SCORE = -1e4

# References whose tensors come from the HF modules the engine also runs (interp-engine and the vLLM
# columns compute some points with their own code or kernels, so they make no bit-exact claim).
EXACT_ENGINES = ("hf", "transformer_lens", "nnsight", "nnterp")

# (engine or "*" [@config], case or point) -> why those rows are computed differently on the two sides
COMPUTED_DIFFERENTLY: dict[tuple[str, str], str] = {
    ("*", "decode"): "our capture at a KV-cache step (one query row) against the reference's whole-sequence "
                     "forward: other matmul shapes, other accumulation order",
    ("*", "leak"): "our left-padded batch row against our own prompt run alone: another batch shape, for which "
                   "another kernel may be chosen",
    ("*", "steer"): "the steer's maths computed by the validator (validator/maths.py, float64) in the reference's "
                    "hook against the engine's op table in the model's dtype",
    ("*", "steer_generate"): "as steer, in every step of a generation",
    ("*", "readout"): "the reduction computed by the validator in float64 from the reference's tensor against "
                      "the engine's, computed in the forward",
    ("hf", "attn_scores"): "recomputed by the validator from the recorded q and k in float32 "
                           "(validator/engines/base.py scores_from_qk), ours are the model's own in its dtype",
    ("nnsight", "attn_scores"): "recomputed from the saved q and k in float32, as for hf",
    ("hf@auto", "attn_probs"): "the loaded attention (sdpa) returns no probabilities: recomputed by the validator "
                               "from the recorded q and k in float32, ours are the family's eager function's",
    ("nnsight@auto", "attn_probs"): "recomputed from the saved q and k in float32, as for hf",
}


def exact_expected(engine: str, case: str, point: str, config: str | None = None) -> bool:
    """Whether a row of this engine, case and point (in this configuration) must be bit-exact."""
    if engine not in EXACT_ENGINES:
        return False
    names = (engine, "*") + ((f"{engine}@{config}",) if config else ())
    return not any((e, k) in COMPUTED_DIFFERENTLY for e in names for k in (case, point))


def expectation(engine: str, dtype: str, case: str, point: str, config: str | None = None) -> Tier:
    """EXACT where the row must be bit-exact, else the band of its (engine, dtype, case)."""
    return EXACT if exact_expected(engine, case, point, config) else tier_for(engine, dtype, case)


def _must_be_exact(engine: str, row: dict, config: str) -> bool:
    """A row of a cell in `config` (the row's own `config` when it records one) that must be bit-exact; a
    declared measured reason (known_gaps kind "inexact") excuses it."""
    return not row.get("inexact_known") and exact_expected(engine, row["case"], row["point"], row.get("config") or config)


def inexact(engine: str, rows: list[dict], config: str = "auto") -> list[dict]:
    """The compared rows of one cell that should be bit-exact and are not (max-abs difference above 0)."""
    return [r for r in rows if r.get("max_abs") is not None and r["max_abs"] != 0 and _must_be_exact(engine, r, config)]


def exactness(engine: str, rows: list[dict], config: str = "auto") -> dict:
    """Of one cell's compared rows: how many, how many are bit-exact, how many must be, and the rows
    that must be and are not (`inexact`). `config`: the cell's configuration (cell["configuration"])."""
    compared = [r for r in rows if r.get("max_abs") is not None]
    return {"compared": len(compared), "exact": sum(r["max_abs"] == 0 for r in compared),
            "expected": sum(_must_be_exact(engine, r, config) for r in compared),
            "inexact": inexact(engine, rows, config)}


def tier_for(engine: str, dtype: str, case: str = "") -> Tier:
    """The band of rows computed differently for one engine and dtype (and case), or a ValueError naming
    the known pairs."""
    tier = TIERS.get((engine, dtype)) or TIERS.get(("*", dtype))
    if tier is _F32:
        floor, where = NOISE_F32.get(case, NOISE_F32[""])
        return Tier(floor * MARGIN, floor * MARGIN, f"float32, computed differently: {MARGIN:g} x the measured noise "
                                                    f"floor {floor:.2g} ({where})")
    if tier is None:
        known = ", ".join(f"{e}/{d}" for e, d in TIERS)
        raise ValueError(f"no tolerance tier for engine {engine!r} at dtype {dtype!r}; add one to "
                         f"validator/tolerances.py (known: {known}).")
    f = CASE_FACTOR.get(case, 1.0)
    return tier if f == 1.0 else Tier(tier.pass_rel * f, tier.warn_rel * f, f"{tier.why}; x{f:g} for {case}")
