"""Every comparison of one cell as a `Pair` (a row's keys, the tested value, the expected value, how to
compare them), then one scoring loop for all of them.

Row cases, by kind of check:
    short, long, padded   captures against the reference's (padded: the real tokens of the short row)
    leak                  the tested backend's padded short row against its own short prompt alone (once per
                          backend: in the hf cell for the eager engine, in each vLLM cell for its backend)
    decode                the tested backend's captures during greedy generation, every position
                          (prompt, then each fed-back token), against the reference recomputing the
                          reference's own token sequence; compared up to the first token that differs
    address               another form of an address (negative layer, head coordinate, alias)
    steer                 logits after a steer, against the reference with the validator's own maths
    lens                  the logit lens at each resid_post layer, against the reference's own head
    readout               each readout kind, against the same reduction of the reference's tensor
    generate              greedy tokens and the scores they were chosen from, against HF's `generate`
    steer_generate        the same for a steered generation, at each position spec
The eager configuration's rows (attention patterns from eager attention) carry `config: eager`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from validator import known_gaps, scoring
from validator.engines.base import Missing, split_address
from validator.plan import Plan
from validator.rows import resolve, views
from validator.sides import Side
from validator.subject import Generation
from validator.tolerances import STEER_MIN_EFFECT, Tier, expectation


@dataclass
class Pair:
    row: dict  # case, point, layer and the kind's own keys
    ours: object  # tested value (tensor, (indices, values), Generation) or Missing
    ref: object  # expected value or Missing
    tier: Tier
    how: str = "tensor"  # tensor | topk | leak | tokens
    valid: torch.Tensor | None = None
    compare_point: str = ""  # the point whose structural rules apply (attention masks, integers)
    effect: tuple | None = None  # (ours base, ref base): a steer must move both


def _row(case: str, point: str, layer=None, **extra) -> dict:
    return {"case": case, "point": point, "layer": layer, **{k: v for k, v in extra.items() if v is not None}}


def _addr_row(case: str, address: str, **extra) -> dict:
    point, layer = split_address(address)
    return _row(case, point, layer, **extra)


# -- pairs of each kind ----------------------------------------------------------------------------
def capture_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    out = []
    for view, name, batch, valid in views(plan.cases):
        for a in plan.addresses:
            o, r = ours.captures[name][a], ref.captures[name][a]
            point = split_address(a)[0]
            tier = expectation(engine, dtype, view, point, config)
            o = o[batch] if isinstance(o, torch.Tensor) else o
            r = r[batch] if isinstance(r, torch.Tensor) else r
            out.append(Pair(_addr_row(view, a, config=label), o, r, tier, valid=valid, compare_point=point))
    return out


def leak_pairs(engine, dtype, plan: Plan, side: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    """The tested backend's padded short row against its own short prompt alone."""
    by = {c.name: c for c in plan.cases}
    padded, short = by.get("padded"), by.get("short")
    if padded is None or short is None:
        return []
    row_i, n = padded.meta["short_row"], padded.meta["short_len"]
    out = []
    for a in plan.addresses:
        o, r = side.captures["padded"][a], side.captures["short"][a]
        point = split_address(a)[0]
        if point in scoring.KPOS_POINTS and isinstance(o, torch.Tensor) and o.shape[-1] != o.shape[1]:
            continue  # the key axis is not positions (compressed KV): no per-position leak check
        if isinstance(o, torch.Tensor):
            o = scoring.real_part(o, row_i, n, point)
        out.append(Pair(_addr_row("leak", a, config=label), o, r, expectation(engine, dtype, "leak", point, config),
                        how="leak", compare_point=point))
    return out


def _diverged(gen, reference) -> int | None:
    """The first step at which two generations' new tokens differ (None: they agree)."""
    if not isinstance(gen, Generation) or not isinstance(reference, Generation):
        return None
    a, b = gen.tokens[0], reference.tokens[0]
    if a.shape != b.shape:
        return 0
    diff = torch.nonzero(a != b).flatten()
    return None if diff.numel() == 0 else int(diff[0])


def decode_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    """Every position of the tested generation's captures against the recompute of the reference tokens
    (the logits, [1, N, vocab], against the recompute at the last prompt token and each fed-back one)."""
    if not plan.decode_tokens:
        return []
    P = int(plan.short.input_ids.shape[1])
    N = plan.decode_tokens
    first = _diverged(ours.generation, plan.reference)  # a sequence position
    out = []
    for a in plan.addresses:
        o, r = ours.decode.get(a), ref.decode.get(a)
        point = split_address(a)[0]
        note = None
        if isinstance(r, torch.Tensor) and point in ("lm_head", "lm_head_raw") and isinstance(o, torch.Tensor) \
                and o.shape[1] == N:
            r = r[:, P - 1:]  # the scores of each new token: from the last prompt position on
            upto = None if first is None else max(first - P + 1, 0)
        else:
            upto = first
        if upto is not None and isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
            note = f"compared up to position {upto} (the generated tokens differ from the reference's there)"
            o, r = o[:, :upto], r[:, :upto]
            if point in scoring.KPOS_POINTS:
                o, r = o[..., :upto], r[..., :upto]
        out.append(Pair(_addr_row("decode", a, config=label, note=note), o, r,
                        expectation(engine, dtype, "decode", point, config), compare_point=point))
    return out


def form_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    """Each other form of an address, captured by the tested side, against the expected side's capture
    of its absolute form (one head's slice for a head coordinate)."""
    out = []
    for f in plan.forms:
        o = ours.forms.get(f.text, Missing("not captured"))
        r = ref.captures[plan.short.name].get(f.address)
        point = split_address(f.address)[0]
        if isinstance(r, torch.Tensor) and f.index is not None:
            r = r[:, :, f.index]  # one head's (or stream's) slice [b, pos, ...]
        out.append(Pair(_addr_row("address", f.address, form=f.text, kind=f.kind, config=label), o, r,
                        expectation(engine, dtype, "address", split_address(f.address)[0], config),
                        compare_point=point))
    return out


def steer_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    out = []
    for sc in plan.steers:
        o = ours.steers.get(sc.name, Missing("not run"))
        r = ref.steers.get(sc.name, Missing(f"{engine} applies no steering cases (no intervention hooks)"))
        row = _row("steer", "steer", sc.layer, address=sc.address, op=sc.op, positions=repr(sc.positions),
                   steer=sc.name, config=label)
        out.append(Pair(row, o, r, expectation(engine, dtype, "steer", sc.point, config), compare_point="lm_head",
                        effect=(ours.base, ref.base)))
    return out


def lens_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    out = []
    for layer in plan.lens_layers:
        o = ours.lens.get(layer, Missing("not run"))
        r = ref.lens.get(layer, Missing(f"{engine} has no logit lens here (no intervention hooks)"))
        out.append(Pair(_row("lens", "resid_post", layer, config=label), o, r,
                        expectation(engine, dtype, "lens", "lm_head", config), compare_point="lm_head"))
    return out


def readout_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    out = []
    for rc in plan.readouts:
        o = ours.readouts.get(rc.name, Missing("not run"))
        r = ref.readouts.get(rc.name, Missing("not computed"))
        point, layer = split_address(rc.address)
        sparse = rc.kind in ("lens_topk", "sae")
        if not sparse and isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor):
            o, r = o.reshape(1, 1, -1), r.reshape(1, 1, -1).float()  # one vector or one value per position
        if sparse and isinstance(o, tuple) and isinstance(r, tuple) and o[0].dim() == r[0].dim() + 1:
            o = (o[0][0], o[1][0])  # the call's batch of one
        out.append(Pair(_row("readout", point, layer, readout=rc.kind, config=label), o, r,
                        expectation(engine, dtype, "readout", point, config), how="topk" if sparse else "tensor"))
    return out


def generation_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
                  label: str | None = None) -> list[Pair]:
    """Greedy tokens and their step scores against HF's own generate, plain and steered at each spec."""
    out = []
    if not plan.decode_tokens or ref.generation is None:
        return out
    runs = [("generate", None, ours.generation, ref.generation)]
    runs += [("steer_generate", sc, ours.gen_steers.get(sc.name), ref.gen_steers.get(sc.name)) for sc in plan.gen_steers]
    for case, sc, o, r in runs:
        extra = {} if sc is None else dict(address=sc.address, op=sc.op, positions=repr(sc.positions), steer=sc.name)
        point = "generate" if sc is None else "steer"
        layer = None if sc is None else sc.layer
        tier = expectation(engine, dtype, case, "lm_head", config)
        out.append(Pair(_row(case, point, layer, check="tokens", config=label, **extra), o, r, tier, how="tokens"))
        lo = o.logits if isinstance(o, Generation) else o
        lr = r.logits if isinstance(r, Generation) else r
        upto = _diverged(o, r)
        note = None
        if upto is not None and isinstance(lo, torch.Tensor) and isinstance(lr, torch.Tensor):
            P = int(plan.short.input_ids.shape[1])
            lo, lr = lo[:, :max(upto - P + 1, 0)], lr[:, :max(upto - P + 1, 0)]
            note = f"steps after {upto - P} not compared: the tokens differ there"
        out.append(Pair(_row(case, point, layer, check="logits", config=label, note=note, **extra), lo, lr, tier,
                        compare_point="lm_head"))
    return out


# -- scoring ---------------------------------------------------------------------------------------
def _tokens(o: Generation, r: Generation, tier: Tier) -> scoring.Score:
    """Tokens must be equal; a step where the reference's best two scores are within the tier's noise
    band of each other is a tie, so another pick there is not a failure."""
    a, b = o.tokens[0], r.tokens[0]
    if a.shape != b.shape:
        return scoring.Score("fail", structural=[f"tokens: ours {a.shape[0]} vs reference {b.shape[0]} long"])
    diff = torch.nonzero(a != b).flatten()
    if diff.numel() == 0:
        return scoring.Score("pass", rel_err=0.0, max_abs=0.0)
    pos = int(diff[0])
    P = a.shape[0] - r.logits.shape[1]
    step = pos - P
    scores = r.logits[0, step].double()
    top2 = scores.topk(2).values
    margin = float(top2[0] - top2[1])
    scale = float(scores.abs().max())
    if margin <= max(tier.pass_rel, 1e-12) * scale * 10:
        return scoring.Score("pass", rel_err=0.0, reason=f"tie at step {step}: the reference's best two scores "
                                                         f"differ by {margin:.3g}, inside the noise band")
    return scoring.Score("fail", structural=[f"tokens differ at generated step {step} (position {pos}): ours "
                                             f"{int(a[pos])}, the reference's {int(b[pos])} (its margin over the "
                                             f"next best {margin:.3g})"])


def _topk(o, r, tier: Tier) -> scoring.Score:
    """Sparse (indices, values) per position: indices equal except where the reference's neighbouring
    values tie within the tier, values within the tier."""
    oi, ov = o
    ri, rv = r
    if tuple(oi.shape) != tuple(ri.shape):
        return scoring.Score("fail", structural=[f"shape mismatch: ours {tuple(oi.shape)} vs reference {tuple(ri.shape)}"])
    rv = rv.double()
    ov = ov.double()
    tol = max(tier.pass_rel, 1e-12) * 10 * float(rv.abs().max().clamp_min(1e-30))
    bad = (oi != ri)
    if bad.any():
        gaps = torch.cat([(rv[..., :-1] - rv[..., 1:]).abs(), torch.full_like(rv[..., :1], float("inf"))], dim=-1)
        near = torch.minimum(gaps, torch.cat([torch.full_like(rv[..., :1], float("inf")), gaps[..., :-1]], dim=-1))
        real = bad & ~(near <= tol)
        if real.any():
            at = torch.nonzero(real)[0].tolist()
            return scoring.Score("fail", structural=[f"top-k indices differ at {at}: ours {int(oi[tuple(at)])}, "
                                                     f"reference {int(ri[tuple(at)])} (not a tie)"])
    s = scoring.compare(ov.sort(dim=-1, descending=True).values.float().reshape(1, -1, ov.shape[-1]),
                        rv.float().reshape(1, -1, rv.shape[-1]), tier)
    return s


def _effect(pair: Pair, s: scoring.Score) -> None:
    """A steer must change both sides' logits: else the row timed or compared a no-op."""
    ob, rb = pair.effect
    for who, val, base in (("ours", pair.ours, ob), ("the reference's", pair.ref, rb)):
        if isinstance(val, torch.Tensor) and isinstance(base, torch.Tensor) and val.shape == base.shape:
            e = float((val.double() - base.double()).norm() / base.double().norm().clamp_min(1e-30))
            if who == "ours":
                pair.row["effect"] = float(f"{e:.4g}")
            if e < STEER_MIN_EFFECT:
                s.structural.append(f"the steer changed {who} logits by only {e:.2g} (a no-op?)")
                s.verdict = "fail"


def score_pair(pair: Pair) -> scoring.Score | None:
    o, r = pair.ours, pair.ref
    if isinstance(o, Missing) or isinstance(r, Missing) or o is None or r is None:
        return None
    if pair.how == "tokens":
        return _tokens(o, r, pair.tier)
    if pair.how == "topk":
        return _topk(o, r, pair.tier)
    s = scoring.compare(o, r, pair.tier, pair.compare_point, pair.valid)
    if pair.how == "leak" and s.verdict == "fail":
        why = "; ".join(s.structural) or f"relative error {s.rel_err:.3g} / worst token {s.token_rel_err:.3g}"
        s.structural = [f"padding leak: the padded row's real tokens differ from the same prompt alone ({why})"]
    if pair.effect is not None:
        _effect(pair, s)
    return s


def _declared_band(engine: str, model_type: str, p: Pair, s: scoring.Score | None) -> Tier:
    """The tier a row is held to: its own, or the band of a declared, measured reason when it failed on
    numbers alone (validator/known_gaps.py kind "inexact"; the row records the entry)."""
    if s is None or s.verdict != "fail" or s.structural:
        return p.tier
    k = known_gaps.explain_band(engine, model_type, p.row["point"], p.row["case"])
    if k is None:
        return p.tier
    p.row["inexact_known"] = k.id
    tier = Tier(k.band, k.band, f"declared {k.id}: {k.reason}")
    s.verdict = scoring.verdict(s, tier)
    return tier


def score(engine: str, model_type: str, model: str, pairs: list[Pair]) -> list[dict]:
    rows = []
    for p in pairs:
        o = p.ours if p.ours is not None else Missing("not computed")
        r = p.ref if p.ref is not None else Missing("not computed")
        s = score_pair(p)
        tier = _declared_band(engine, model_type, p, s)
        rows.append(resolve(p.row, engine, model_type, model, o, r, s, tier))
    return rows


def all_pairs(engine, dtype, plan: Plan, ours: Side, ref: Side, config: str | None,
              label: str | None = None) -> list[Pair]:
    """Every pair of one cell: `ours` the tested side, `ref` the expected one; `config` the engine
    configuration the column compares with (it decides which rows must be exact), `label` what rows record
    of it (None: the cell's own)."""
    kinds = (capture_pairs, decode_pairs, form_pairs, steer_pairs, lens_pairs, readout_pairs, generation_pairs)
    out = [p for kind in kinds for p in kind(engine, dtype, plan, ours, ref, config, label)]
    if engine == "hf" or engine.startswith("vllm"):  # the tested engine against itself: once, not per reference
        out += leak_pairs(engine, dtype, plan, ours, config, label)
    return out


__all__ = ["Pair", "all_pairs", "score", "known_gaps"]
