"""Scoring one pair of tensors: metrics, structural checks, a verdict.

Both tensors are canonical `[batch, pos, ...]`. Metrics: cosine (the worst token's), relative
error (Frobenius, whole tensor) and the worst token's relative error, max-abs, and where the worst
token sits. Structural failures are decided before any tolerance and always fail: a shape
mismatch (with a hint when the sizes are a permutation, e.g. a transposed head axis), NaN/inf,
an all-zero capture, attention masks that differ, a padding leak.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from validator.tolerances import MASKED_SCORE, Tier

VERDICTS = ("pass", "warn", "fail", "gap")
KPOS_POINTS = ("attn_scores", "attn_probs")  # trailing axis indexes key positions
INTEGER_POINTS = ("expert_indices",)


@dataclass
class Score:
    verdict: str
    rel_err: float | None = None  # ||ours - ref|| / ||ref|| over the compared entries
    token_rel_err: float | None = None  # the worst token's relative error
    cosine: float | None = None  # the worst token's cosine similarity
    max_abs: float | None = None
    worst_token: list[int] | None = None  # [batch row, position] of the worst token
    worst: tuple[float, float] | None = None  # (ours, reference) at the largest difference of that token
    structural: list[str] = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("rel_err", "token_rel_err", "cosine", "max_abs"):
            if d[k] is not None:
                d[k] = float(f"{d[k]:.4g}")
        return d


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _shape_problem(ours: torch.Tensor, ref: torch.Tensor) -> str | None:
    if tuple(ours.shape) == tuple(ref.shape):
        return None
    hint = ""
    if sorted(ours.shape) == sorted(ref.shape):
        hint = " (same sizes in another order: transposed or permuted axes)"
    elif ours.numel() == ref.numel():
        hint = " (same number of elements: a reshape or flatten differs)"
    return f"shape mismatch: ours {tuple(ours.shape)} vs reference {tuple(ref.shape)}{hint}"


def _masked(t: torch.Tensor) -> torch.Tensor:
    return ~(t > MASKED_SCORE) & ~torch.isnan(t)  # -inf and very negative both count as masked


def compare(ours: torch.Tensor, ref: torch.Tensor, tier: Tier, point: str = "",
            valid: torch.Tensor | None = None) -> Score:
    """Score `ours` against `ref`. `valid` ([batch, pos] bool) restricts the compared positions
    (padding excluded); attention scores are compared where unmasked and their masks must agree."""
    if not isinstance(ours, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return Score("fail", structural=[f"not a tensor: ours {type(ours).__name__}, reference "
                                         f"{type(ref).__name__}"])
    shape = _shape_problem(ours, ref)
    if shape:
        return Score("fail", structural=[shape])
    if ours.dim() < 2:
        return Score("fail", structural=[f"capture has {ours.dim()} dims; expected [batch, pos, ...]"])
    if point in INTEGER_POINTS or not (ours.is_floating_point() and ref.is_floating_point()):
        return _compare_exact(ours, ref, tier, valid)
    o, r = ours.detach().double(), ref.detach().double()
    keep = torch.ones(o.shape[:2], dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
    if keep.shape != o.shape[:2]:
        return Score("fail", structural=[f"valid mask {tuple(keep.shape)} does not match [batch, pos] "
                                         f"{tuple(o.shape[:2])}"])
    where = torch.nonzero(keep)  # [n_tokens, 2]: (batch row, position) of each compared token
    o, r = o.cpu()[keep], r.cpu()[keep]  # [n_tokens, ...]
    structural = []
    if point == "attn_scores":
        mo, mr = _masked(o), _masked(r)
        if not torch.equal(mo, mr):
            n = int((mo != mr).sum())
            structural.append(f"attention mask differs: {n} entries masked on one side only")
        o = torch.where(mo | mr, torch.zeros_like(o), o)
        r = torch.where(mo | mr, torch.zeros_like(r), r)
    bad_o, bad_r = int((~torch.isfinite(o)).sum()), int((~torch.isfinite(r)).sum())
    if bad_o:
        structural.append(f"NaN/inf in ours: {bad_o} of {o.numel()} entries")
    if bad_r:
        structural.append(f"NaN/inf in the reference: {bad_r} of {r.numel()} entries")
    if o.numel() == 0:
        structural.append("nothing to compare (no valid positions)")
    elif not bad_o and not bad_r and bool((o == 0).all()) and not bool((r == 0).all()):
        structural.append("ours is all zero where the reference is not (hook never wrote?)")
    if bad_o or bad_r or o.numel() == 0:
        return Score("fail", structural=structural)
    score = _metrics(o, r, where)
    score.structural = structural
    score.verdict = verdict(score, tier)
    return score


def _metrics(o: torch.Tensor, r: torch.Tensor, where: torch.Tensor) -> Score:
    """o, r: [n_tokens, ...] float64; where: [n_tokens, 2] (row, position) of each token."""
    d = o - r
    tok_d = d.reshape(d.shape[0], -1).norm(dim=1)
    tok_r = r.reshape(r.shape[0], -1).norm(dim=1)
    tok_o = o.reshape(o.shape[0], -1).norm(dim=1)
    rel = float(d.norm() / r.norm()) if float(r.norm()) > 0 else (0.0 if float(d.norm()) == 0 else math.inf)
    floor = max(float(tok_r.median()) * 1e-3, 1e-12)  # tokens with a near-zero reference norm
    tok_rel = tok_d / tok_r.clamp_min(floor)
    worst = int(tok_rel.argmax())
    dot = (o.reshape(o.shape[0], -1) * r.reshape(r.shape[0], -1)).sum(1)
    both_zero = (tok_o == 0) & (tok_r == 0)
    cos = torch.where(both_zero, torch.ones_like(dot), dot / (tok_o * tok_r).clamp_min(1e-300))
    at = int(d[worst].reshape(-1).abs().argmax())
    return Score("pass", rel_err=_finite_or_none(rel), token_rel_err=float(tok_rel[worst]),
                 cosine=float(cos.min()), max_abs=float(d.abs().max()),
                 worst_token=[int(v) for v in where[worst]],
                 worst=(float(o[worst].reshape(-1)[at]), float(r[worst].reshape(-1)[at])))


def _compare_exact(ours, ref, tier, valid) -> Score:
    """Integer captures (expert indices): the fraction of differing entries is the error."""
    keep = torch.ones(ours.shape[:2], dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
    where = torch.nonzero(keep)
    o, r = ours.cpu()[keep], ref.cpu()[keep]
    if o.numel() == 0:
        return Score("fail", structural=["nothing to compare (no valid positions)"])
    diff = (o != r)
    frac = float(diff.float().mean())
    tok = diff.reshape(diff.shape[0], -1).float().mean(1)
    s = Score("pass", rel_err=frac, token_rel_err=float(tok.max()), cosine=1.0 - frac,
              max_abs=float((o.double() - r.double()).abs().max()),
              worst_token=[int(v) for v in where[int(tok.argmax())]])
    s.verdict = "pass" if frac == 0 else "fail"
    if frac:
        s.structural.append(f"{int(diff.sum())} of {diff.numel()} integer entries differ")
    return s


def verdict(score: Score, tier: Tier) -> str:
    """pass / warn / fail from the metrics; any structural problem fails; an exact tier passes only a
    max-abs difference of 0."""
    if score.structural:
        return "fail"
    if tier.exact:
        return "pass" if score.max_abs == 0 else "fail"
    err = max(score.rel_err if score.rel_err is not None else math.inf, score.token_rel_err or 0.0)
    if err <= tier.pass_rel:
        return "pass"
    return "warn" if err <= tier.warn_rel else "fail"


def real_part(t: torch.Tensor, row: int, n_real: int, point: str) -> torch.Tensor:
    """Row `row` of a left-padded capture, restricted to its last `n_real` (real) positions, and
    for attention patterns to its real key positions: shaped like the same prompt run alone."""
    x = t[row:row + 1, t.shape[1] - n_real:]
    if point in KPOS_POINTS:
        x = x[..., x.shape[-1] - n_real:]
    return x


def padding_leak(ours_padded: torch.Tensor, solo: torch.Tensor, row: int, n_real: int, tier: Tier,
                 point: str = "") -> Score:
    """Compare the real part of one padded row with the same prompt run alone; any failure is a
    structural padding leak (pad tokens changed what real tokens see)."""
    part = real_part(ours_padded, row, n_real, point)
    s = compare(part, solo, tier, point)
    if s.verdict == "fail":
        why = "; ".join(s.structural) or f"relative error {s.rel_err:.3g} / worst token {s.token_rel_err:.3g}"
        s.structural = [f"padding leak: row {row}'s real tokens differ from the same prompt unpadded ({why})"]
    return s
